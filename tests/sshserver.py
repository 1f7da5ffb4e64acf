"""A git host for tests, on a fake internet: an SSH server (paramiko) that lets one public key in and
runs ``git-upload-pack`` / ``git-receive-pack`` for repositories under one directory.

    python tests/sshserver.py ADDR PORT AUTHORIZED_KEY_FILE REPO_ROOT LOG

prints ``ready`` once it listens; each authentication attempt is a line in LOG.
"""
from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import threading

import paramiko

GIT_COMMANDS = ("git-upload-pack", "git-receive-pack")


class Server(paramiko.ServerInterface):
    def __init__(self, allowed: paramiko.PKey, root: str, log: str) -> None:
        self.allowed, self.root, self.log = allowed, root, log
        self.command: bytes | None = None
        self.event = threading.Event()

    def _note(self, **what: object) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps(what) + "\n")

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        ok = key.get_fingerprint() == self.allowed.get_fingerprint()
        self._note(user=username, method="publickey", ok=ok)
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def check_auth_none(self, username: str) -> int:
        self._note(user=username, method="none", ok=False)
        return paramiko.AUTH_FAILED

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self.command = command
        self.event.set()
        return True


def serve(conn: socket.socket, host_key: paramiko.PKey, allowed: paramiko.PKey, root: str, log: str) -> None:
    t = paramiko.Transport(conn)
    t.add_server_key(host_key)
    server = Server(allowed, root, log)
    try:
        t.start_server(server=server)
    except (paramiko.SSHException, EOFError):
        return
    chan = t.accept(30)
    if chan is None or not server.event.wait(30) or server.command is None:
        t.close()
        return
    words = shlex.split(server.command.decode())
    if len(words) != 2 or words[0] not in GIT_COMMANDS or ".." in words[1]:
        chan.send_exit_status(127)
        chan.close()
        return
    repo = root + "/" + words[1].lstrip("/")
    proc = subprocess.Popen([words[0], repo], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def pump_in() -> None:
        assert proc.stdin is not None
        while data := chan.recv(65536):
            proc.stdin.write(data)
            proc.stdin.flush()
        proc.stdin.close()

    threading.Thread(target=pump_in, daemon=True).start()
    while data := proc.stdout.read1(65536):
        chan.sendall(data)
    chan.send_exit_status(proc.wait())
    chan.close()
    t.close()


def main(argv: list[str]) -> None:
    addr, port, key_file, root, log = argv
    host_key = paramiko.ECDSAKey.generate()
    with open(key_file) as f:
        kind, blob = f.read().split()[:2]
    allowed = paramiko.PKey.from_type_string(kind, __import__("base64").b64decode(blob))
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, int(port)))
    s.listen(8)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve, args=(conn, host_key, allowed, root, log), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
