"""``agentcell run`` for the compiled front (``front/agentcell.c``): the warm launcher forks a process
that becomes the front's CLI (its argv, environment, working directory, umask and stdio) and runs the
code a Python ``agentcell run`` runs (:func:`agentcell.cli.main.main`), with the interpreter started and
the imports done. That process asks the launcher for its cell like any client (over a connection made
as it was forked: a socketpair, which needs no peer check), so everything the policy, the monitor and
the protected-path step do is unchanged: only the start is saved.

  front  -> {"op": "cli", "argv": [b"run", ...], "env": [b"K=V", ...], "umask": N}
            + fds [working directory, stdin, stdout, stderr]
  front  -> {"op": "signal", "sig": N}                  forwarded to that process
  server -> {"event": "refused", "why": "..."}           nothing ran: the front runs Python itself
          | {"event": "started"}                         from here on the front never runs it again
          | {"event": "exit", "code": N}                 that process's status (128+N for signal N)

Trust. The launcher is its owner's, listening in a directory only they may enter, and each end checks
that the other is itself in all but its pid (:mod:`.peer`: the same uid, namespaces, cgroup, audit
session, groups, capabilities, no_new_privs, seccomp state and hard limits). A caller with less (a root
shell that dropped capabilities, a sandboxed process) is refused, and starts Python as before; so is a
"launcher" with less (a weaker process of the user's that took the socket's place). What a process
forked here has that a Python ``agentcell run`` would not: no controlling terminal (the front hands
over no run that has one), and the launcher's ``ulimit`` soft limits.
"""
from __future__ import annotations

import _socket
import os

from ..cell import syscalls as sc
from ..cell.spec import TYPE_CHECKING
from . import wire

if TYPE_CHECKING:
    import signal
    import threading
    from collections.abc import Callable
    from typing import Any
else:  # (signal.py imports enum; see cell/launch.py)
    import _signal as signal


def refusal(msg: dict[str, Any], fds: list[int]) -> str:
    """Why this request is not served here ('' if it is). Its peer was checked as it connected
    (:func:`agentcell.host.peer.accept_ours`): our uid, outside any cell, with all our powers."""
    argv, env, umask = msg.get("argv"), msg.get("env"), msg.get("umask")
    if not (set(msg) == {"op", "argv", "env", "umask"}
            and isinstance(argv, list) and argv and all(isinstance(a, bytes) for a in argv)
            and isinstance(env, list) and all(isinstance(e, bytes) for e in env)
            and isinstance(umask, int) and 0 <= umask <= 0o777 and len(fds) == 4):
        return "malformed request"
    if not served(argv):
        return f"not served here: {argv[0]!r}"
    return ""


def served(argv: list[bytes]) -> str:
    """What a front may hand over: 'run', 'session' (a ``session start``, forked by :mod:`.starter`), or ''."""
    if argv[:1] == [b"run"]:
        return "run"
    return "session" if argv[:2] == [b"session", b"start"] else ""


class Ahead:
    """A CLI process forked before it is needed, as the next cell is prepared: it has closed all of the
    launcher's fds, run the CLI's code once on a request of its own that creates nothing (so the pages
    it touches are copied before a caller waits on them), and waits for one front's request. Used once."""

    def __init__(self, detach: Callable[[], None], warm_up: bool = True) -> None:
        """``warm_up``: False when a request waits for it already (the request's own run does the same).
        ``conn``: the launcher's end of the CLI's connection to it, made now (the launcher serves it as any
        client's; a fork of the launcher needs no peer check, and connects to nothing)."""
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        conn, its_conn = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                detach()
                ours.detach()
                conn.detach()
                sc.close_fds_except({theirs.fileno(), its_conn.fileno()})
                from . import remote

                remote.given_warm(its_conn)
                if warm_up:
                    _warm_up()
                msg, fds = wire.recv(theirs, 5)
                code = 0
                if msg is not None and len(fds) == 5:  # (else the launcher has stopped: nothing to do)
                    code = run_request(msg, fds[:4], fds[4], keep=(its_conn.fileno(),))
            finally:
                settle()
                os._exit(code)
        theirs.close()
        its_conn.close()
        self.pid, self.pidfd, self.sock, self.conn = pid, os.pidfd_open(pid), ours, conn

    def hand(self, msg: dict[str, Any], fds: list[int], front: int) -> bool:
        """Give it the request; False if it could not take it (it has died)."""
        try:
            wire.send(self.sock, msg, [*fds, front])
            return True
        except (OSError, wire.WireError):
            return False
        finally:
            self.sock.close()

    def discard(self) -> None:
        self.sock.close()  # it sees the end and exits
        os.close(self.pidfd)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def watch_front(conn: _socket.socket) -> threading.Event:
    """Read the front's connection in a thread of this process: a signal the front forwards is raised
    here; the front gone (killed, or the connection lost) is a SIGTERM, as a session's supervisor takes
    it (it tears the session down). Set the event returned once the command has ended: the front's
    hang-up after its answer is no signal."""
    import threading

    done = threading.Event()

    def read() -> None:  # (the connection stays open: the process's last act is its answer on it)
        while not done.is_set():
            msg, fds = wire.recv_or_gone(conn)
            for fd in fds:
                os.close(fd)
            sig = msg.get("sig") if msg is not None else signal.SIGTERM
            if msg is not None and (msg.get("op") != "signal" or not isinstance(sig, int) or not 0 < sig <= 64):
                continue  # (nothing else comes from a front)
            if not done.is_set():
                os.kill(os.getpid(), int(sig))  # type: ignore[arg-type]
            if msg is None:
                return

    threading.Thread(target=read, name="agentcell-front", daemon=True).start()
    return done


def settle() -> None:
    """Before a process forked here ends (``os._exit``): what its monitors still do after a cell's end
    (:func:`agentcell.monitor.calls.settle`), if it ran any."""
    import sys

    calls = sys.modules.get("agentcell.monitor.calls")
    if calls is not None:
        calls.settle()


def _warm_up() -> None:
    from ..cli.run import build_spec
    from ..cli.runargs import parse
    from ..errors import AgentcellError
    from ..protect.check import SurfaceCheck, human

    try:
        spec = build_spec(parse(["--as", "65534", "--", "true"] if os.geteuid() == 0 else ["--", "true"]))
        SurfaceCheck(spec, human())
    except AgentcellError:
        pass


def run_request(msg: dict[str, Any], fds: list[int], front: int, *, watch: bool = False,
                keep: tuple[int, ...] = ()) -> int:
    """In a process of the launcher's: become the front's CLI, run its command line, and tell the front
    its status (its parent tells it too, as it reaps this process: it may have been killed). ``watch``:
    the front's connection is this process's alone (a session's, :mod:`.starter`): what the front sends
    is read here (:func:`watch_front`). ``keep``: what else stays open (its connection to the launcher)."""
    os.set_inheritable(front, False)
    become(msg, fds, keep={front, *keep})
    conn = _socket.socket(fileno=front)
    done = watch_front(conn) if watch else None
    code = 1
    try:
        code = serve(msg)
    finally:
        if done is not None:
            done.set()
        try:
            wire.send(conn, {"event": "exit", "code": code})
        except OSError:
            pass
    return code


def become(msg: dict[str, Any], fds: list[int], keep: set[int]) -> None:
    """Take on the caller's working directory, stdio, umask and environment, and the signal
    dispositions a fresh interpreter has; nothing of the launcher's stays open (but ``keep``)."""
    cwd, stdio = fds[0], fds[1:]
    os.fchdir(cwd)
    for i, fd in enumerate(stdio):
        os.dup2(fd, i)
    sc.close_fds_except(keep)
    os.umask(int(msg["umask"]))
    os.environ.clear()
    for item in msg["env"]:
        key, eq, value = item.partition(b"=")
        if eq and key:
            os.environb[key] = value
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as the interpreter sets it)


def serve(msg: dict[str, Any]) -> int:
    """Run the front's command line as ``agentcell`` would; its exit status."""
    import sys

    from ..cli.main import main

    argv = [os.fsdecode(a) for a in msg["argv"]]
    sys.argv = ["agentcell", *argv]
    try:
        code = main(argv)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def preload() -> None:
    """What a forked ``agentcell run`` imports, imported once here."""
    from ..cli import main, run  # noqa: F401
    from . import warm  # noqa: F401
