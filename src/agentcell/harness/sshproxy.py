"""ssh's way out of a proxied cell: ``ProxyCommand python3 -I -S ssh-connect.py %h %p``.

The cell's only way out is its proxy (127.0.0.1:3128 inside the cell), which speaks HTTP CONNECT and
decides by name; ssh has no proxy client of its own. This opens ``CONNECT host:port`` there, and then
relays ssh's stdin and stdout to the tunnel until either side ends. A refused destination ends it with
the proxy's reason on stderr (ssh shows it). It runs in the cell with the system's Python and the
standard library only: the session's seed directory holds a copy (see :mod:`agentcell.harness.profiles`).
"""
from __future__ import annotations

import os
import select
import socket
import sys

PROXY = ("127.0.0.1", 3128)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        sys.stderr.write("ssh-connect: usage: ssh-connect.py HOST PORT\n")
        return 2
    host, port = argv[0], argv[1]
    try:
        s = socket.create_connection(PROXY, timeout=30)
    except OSError as e:
        sys.stderr.write(f"ssh-connect: the cell's proxy does not answer ({e.strerror})\n")
        return 1
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk or len(head) > 65536:
            sys.stderr.write("ssh-connect: the proxy closed the connection\n")
            return 1
        head += chunk
    status, _, rest = head.partition(b"\r\n\r\n")
    first = status.split(b"\r\n", 1)[0].decode("latin-1")
    if first.split(" ")[1:2] != ["200"]:
        why = rest.decode("utf-8", "replace").strip() or first
        sys.stderr.write(f"ssh-connect: {target}: {why}\n")
        return 1
    s.settimeout(None)
    _write_all(1, rest)
    fds = [0, s.fileno()]
    while fds:
        for fd in select.select(fds, [], [])[0]:
            data = os.read(fd, 65536)
            if fd == 0:
                if not data:
                    s.shutdown(socket.SHUT_WR)
                    fds.remove(0)
                else:
                    s.sendall(data)
            else:
                if not data:
                    return 0
                _write_all(1, data)
    return 0


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
