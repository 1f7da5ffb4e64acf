"""A node's session starter: a process with ``agentcell session start``'s modules imported once, which
forks a child for each session the node runs. A fresh interpreter spends most of a short session importing
them (LangGraph, pydantic, the session's graph: about half a second of CPU on a small machine); a fork
starts with them in place. Each session is still a process of its own, with the environment, working
directory and stdio its caller gives the server, and runs the CLI's own entry with its argv (by name: the
fleet does not import the CLI).

Servers belong to the process that started them (:func:`run`: an idle one of the same environment, or a
new one); one session at a time per server. The server is single-threaded when it forks (it refuses
otherwise). Who ends with whom: the server exits when its caller's end of the connection closes, as it does
when the caller dies, even mid-session (not a parent-death signal: that follows the thread that started the
server, and a caller's thread may end first); a session gets SIGTERM when the server dies, and tears itself
down, as ``setpriv --pdeathsig TERM agentcell session start`` did.

The wire (a SOCK_SEQPACKET socketpair, the server's end on the fd given): the caller sends
``{"argv": [...]}`` with the session's stdin, stdout and stderr as SCM_RIGHTS; the server answers
``{"pid": N}`` once the child exists, then ``{"exit": STATUS}`` when it has ended (``subprocess``'s
returncode: negative for a signal).
"""
from __future__ import annotations

import importlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from ..cell import syscalls
from ..errors import AgentcellError
from ..host.starter import PRELOAD, preload  # one list and one way for the warm launcher's starter and this

ENTRY = "agentcell.cli.main"  # the console script's entry: main(argv) -> exit status
MAX_REQUEST = 1 << 20


def command(conn_fd: int) -> list[str]:
    """argv that starts a server on ``conn_fd`` (:func:`agentcell.host.interp.isolated`)."""
    from ..host import interp

    return interp.isolated("agentcell.fleet.forkserver", str(conn_fd), *PRELOAD)


def main(argv: Sequence[str]) -> int:
    conn = socket.socket(fileno=int(argv[0]))
    threads = preload(argv[1:])  # (the warm launcher's starter's: imported, then out of the collector's sight)
    if threads != 1:  # a fork keeps only the forking thread: a lock another held stays held
        sys.stderr.write(f"agentcell fleet: the session starter has {threads} threads after its imports; it "
                         "forks only from one\n")
        return 1
    me = os.getpid()
    try:
        while True:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            if not msg:
                return 0  # the caller closed its end
            args = [str(a) for a in json.loads(msg)["argv"]]
            pid = os.fork()
            if pid == 0:
                _session(conn, fds, args, me)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            ended = os.pidfd_open(pid)
            if conn.fileno() in select.select([conn.fileno(), ended], [], [])[0]:
                return 0  # the caller is gone (or speaks out of turn): the session gets SIGTERM as we exit
            os.close(ended)
            _, status = os.waitpid(pid, 0)
            conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
    except OSError:  # the caller is gone
        return 0


def _session(conn: socket.socket, fds: list[int], argv: list[str], server: int) -> None:
    """In the child: its stdio, a parent-death signal, then the CLI; never returns."""
    code = 1
    try:
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, 15)  # SIGTERM: the session tears itself down
        if os.getppid() != server:  # the server died before the signal was set
            os._exit(1)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.argv = ["agentcell", *argv]
        code = int(importlib.import_module(ENTRY).main(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # the child never returns into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # a closed pipe: the exit status still goes back
                pass
        os._exit(code)


class Server:
    """The caller's end of one server (started here, as a child of this process)."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.key = _key(env, cwd)
        self.fresh = True  # never used yet
        self.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(command(theirs.fileno()), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except BaseException:
            self.conn.close()
            raise
        finally:
            theirs.close()

    def start(self, argv: Sequence[str], stdio: tuple[int, int, int]) -> int:
        """Fork ``agentcell ARGV`` on ``stdio``; its pid."""
        socket.send_fds(self.conn, [json.dumps({"argv": list(argv)}).encode()], list(stdio))
        return self._reply("pid")

    def wait(self) -> int:
        """The session's exit status, once it has ended."""
        return self._reply("exit")

    def _reply(self, key: str) -> int:
        msg = self.conn.recv(4096)
        if not msg:
            code = self.proc.poll()
            raise AgentcellError("fleet", f"the node's session starter ended ({'running' if code is None else code})",
                                 "see the Ray worker's log on this node")
        return int(json.loads(msg)[key])

    def close(self) -> None:
        """End the server: it sees its connection's end and exits (a session it runs gets SIGTERM and tears
        itself down)."""
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_idle: list[Server] = []
_lock = threading.Lock()


def _key(env: dict[str, str], cwd: str) -> tuple[object, ...]:
    return (tuple(sorted(env.items())), cwd)


def _take(env: dict[str, str], cwd: str) -> Server:
    with _lock:
        server = next((s for s in _idle if s.key == _key(env, cwd)), None)
        if server is not None:
            _idle.remove(server)
            server.fresh = False
            return server
    return Server(env, cwd)


def run(argv: Sequence[str], env: dict[str, str], cwd: str, stdio: tuple[int, int, int]) -> int | None:
    """``agentcell ARGV`` forked by a server of this process for ``env`` and ``cwd`` (an idle one, or a new
    one), on ``stdio``: its exit status once it has ended; None if the server died first (the session got
    SIGTERM then)."""
    server = _take(env, cwd)
    try:
        server.start(argv, stdio)
    except (AgentcellError, OSError):
        server.close()
        if server.fresh:
            raise
        server = Server(env, cwd)  # the idle one had died
        try:
            server.start(argv, stdio)
        except (AgentcellError, OSError):
            server.close()
            raise
    try:
        code = server.wait()
    except (AgentcellError, OSError):
        server.close()
        return None
    except BaseException:  # a cancelled task: its session ends too
        server.close()
        raise
    with _lock:
        _idle.append(server)
    return code


def stop_idle() -> None:
    """End this process's idle servers (a busy one ends when its caller is done with it)."""
    with _lock:
        idle = list(_idle)
        _idle.clear()
    for server in idle:
        server.close()
