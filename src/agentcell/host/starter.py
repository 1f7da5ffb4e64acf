"""The warm launcher's session starter: ``agentcell session start`` from the compiled front, forked from a
process that has the session's modules imported already.

A fresh interpreter spends most of a short session importing LangGraph, its SQLite checkpointer and
pydantic (about half a second of CPU on a small machine) before its first audit record. The launcher
cannot hold them itself: it forks every cell, and a fork copies its parent's page tables (a process
with them loaded forks about four times slower). So on the first ``session start`` a front hands
over, the launcher forks this process, which imports them once and then forks a child for each
session that comes: that child becomes the front's CLI (:func:`.clihost.run_request`: its argv,
environment, working directory, umask and stdio) and runs the CLI's own entry. Everything a session
does from there is what a Python ``agentcell session start`` does: the same code, asking the launcher
for its cell like any client.

  launcher -> {"rid": N, "argv": [...], "env": [...], "umask": N}
              + fds [working directory, stdin, stdout, stderr, the front's connection]
  starter  -> {"event": "pid", "rid": N, "pid": P} + fds [a pidfd of P]
            | {"event": "exit", "pid": P, "code": N}     (128+N for signal N)

The launcher forwards the front's signals through the pidfd and answers the front with the status.
The session's child tells its front its status itself too, so a session outlives a launcher stopped
under it, as a ``run``'s CLI does. The starter is single-threaded when it forks (it checks), and it
exits when the launcher's end of its socket closes; the sessions it started go on.

Trust: the starter is the launcher's child, with nothing of it but this socket, and the session's
child is the launcher's grandchild: the same uid, namespaces, cgroup and powers as the front
(checked when the front connected, :mod:`.peer`).
"""
from __future__ import annotations

import _socket
import gc
import importlib
import os
import select
import sys

from ..cell import pid1
from ..cell import syscalls as sc
from ..cell.spec import TYPE_CHECKING
from . import clihost, wire

if TYPE_CHECKING:
    import signal
    from collections.abc import Callable
    from typing import Any

    Sock = _socket.socket
else:  # (signal.py imports enum; see cell/launch.py)
    import _signal as signal

# What a session's CLI imports on its way (as a session of the shell harness on a small project showed:
# sys.modules after one, less before); imported once, in the starter. One left out is imported by each
# session that needs it, as a Python `session start` does.
PRELOAD = ("agentcell.cli.main", "agentcell.cli.session", "agentcell.session.start", "agentcell.session.graph",
           "agentcell.session.config", "agentcell.session.planning", "agentcell.session.spawn",
           "agentcell.harness.profiles", "agentcell.harness.seed", "agentcell.policy.models",
           "agentcell.policy.compile", "agentcell.policy.plan", "agentcell.policy.resolve", "agentcell.limits",
           "agentcell.snapshot.store", "agentcell.accounts.acl", "agentcell.accounts.accounts",
           "agentcell.accounts.ephemeral", "agentcell.accounts.registry", "agentcell.cell.paths",
           "agentcell.audit.trail", "agentcell.host.remote", "agentcell.monitor.monitor", "agentcell.monitor.procs",
           "agentcell.monitor.refusals", "agentcell.monitor.resources", "agentcell.protect.check",
           "agentcell.protect.surface", "langgraph.checkpoint.sqlite", "langchain_core.tracers.context",
           "langchain_core.tracers.run_collector", "langchain_core.tracers.stdout", "glob")


class Starter:
    """The launcher's side: the starter process, the requests it has taken and the sessions it runs."""

    def __init__(self, detach: Callable[[], None]) -> None:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                detach()
                ours.detach()
                sc.close_fds_except({theirs.fileno(), 2})  # (stderr: the launcher's, where it says why it quit)
                code = serve(theirs)
            finally:
                os._exit(code)
        theirs.close()
        self.pid, self.sock = pid, ours
        self.next_rid = 0
        # request id -> [its front (None: it left before the pid came), the signals it sent meanwhile]
        self.waiting: dict[int, tuple[Sock | None, list[int]]] = {}
        self.running: dict[int, tuple[int, Sock | None]] = {}  # session pid -> (its pidfd, its front)

    def fileno(self) -> int:
        return self.sock.fileno()

    def take(self, msg: dict[str, Any], fds: list[int], front: Sock) -> bool:
        """Hand a front's ``session start`` over; False if the starter cannot take it (it has gone)."""
        self.next_rid += 1
        try:
            wire.send(self.sock, {"rid": self.next_rid, "argv": msg["argv"], "env": msg["env"],
                                  "umask": msg["umask"]}, [*fds, front.fileno()])
        except (OSError, wire.WireError):
            return False
        self.waiting[self.next_rid] = (front, [])
        return True

    def waits(self, front: Sock) -> bool:
        """Whether this front's session has been handed over and its pid has not come yet."""
        return any(f is front for f, _ in self.waiting.values())

    def hold(self, front: Sock, sig: int) -> bool:
        """A signal from a front whose session's pid has not come yet: kept, and sent as it comes."""
        for f, held in self.waiting.values():
            if f is front:
                held.append(sig)
                return True
        return False

    def says(self) -> tuple[int, Sock | None, int | None] | None:
        """Read one message: (pidfd, its front, None) as a session starts (the signals its front sent
        before are sent to it now; SIGTERM if its front has left), (pidfd, front, status) as it ends;
        None when the starter has gone (its sessions tell their fronts themselves)."""
        msg, fds = wire.recv_or_gone(self.sock)
        if msg is None:
            for fd in fds:
                os.close(fd)
            return None
        if msg.get("event") == "pid" and len(fds) == 1:
            front, held = self.waiting.pop(int(msg["rid"]), (None, []))
            self.running[int(msg["pid"])] = (fds[0], front)
            for sig in held if front is not None else (signal.SIGTERM,):  # (a front that left: its session ends)
                try:
                    signal.pidfd_send_signal(fds[0], sig)
                except ProcessLookupError:
                    pass
            return fds[0], front, None
        for fd in fds:
            os.close(fd)
        if msg.get("event") == "exit" and int(msg.get("pid", 0)) in self.running:
            pidfd, front = self.running.pop(int(msg["pid"]))
            return pidfd, front, int(msg["code"])
        return -1, None, None  # (nothing the starter sends)

    def left(self, front: Sock) -> int | None:
        """The front has gone: the pidfd of its session (to be told), or None if its pid has not come yet
        (the session is told as it comes; see :meth:`says`)."""
        for rid, (f, held) in self.waiting.items():
            if f is front:
                self.waiting[rid] = (None, held)
        for pid, (pidfd, f) in self.running.items():
            if f is front:
                self.running[pid] = (pidfd, None)
                return pidfd
        return None

    def discard(self) -> None:
        """The launcher stops: the starter sees its socket close and exits; its sessions go on."""
        self.sock.close()
        for pidfd, _ in self.running.values():
            os.close(pidfd)
        self.running.clear()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def serve(sock: Sock) -> int:
    """The starter: import, then fork a session's CLI for each request until the launcher goes."""
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    # What is here now stays shared with the sessions forked from it: out of the collector's sight, which
    # would otherwise write to every object as it looks (a full collection in a session copied the whole
    # heap's pages, some 60 ms on a small machine).
    gc.collect()
    gc.freeze()
    if threading.active_count() != 1:  # a fork keeps only the forking thread: a lock another held stays held
        sys.stderr.write(f"agentcell warm: the session starter has {threading.active_count()} threads after its "
                         "imports; it forks only from one, and stops\n")
        return 1
    sessions: dict[int, int] = {}  # pidfd -> pid
    try:
        _loop(sock, sessions)
    except OSError:  # the launcher has gone
        pass
    return 0


def _loop(sock: Sock, sessions: dict[int, int]) -> None:
    while True:
        ready, _, _ = select.select([sock.fileno(), *sessions], [], [])
        for r in ready:
            if r == sock.fileno():
                msg, fds = wire.recv(sock, 5)
                if msg is None:
                    return  # the launcher has gone
                if len(fds) != 5:
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        sock.detach()  # (closed by become: nothing of the starter's stays open)
                        code = clihost.run_request({k: msg[k] for k in ("argv", "env", "umask")}, fds[:4], fds[4])
                    finally:
                        clihost.settle()
                        os._exit(code)
                pidfd = os.pidfd_open(pid)
                for fd in fds:
                    os.close(fd)
                sessions[pidfd] = pid
                wire.send(sock, {"event": "pid", "rid": msg["rid"], "pid": pid}, [pidfd])
            else:
                pid = sessions.pop(r)
                os.close(r)
                _, wstatus = os.waitpid(pid, 0)
                wire.send(sock, {"event": "exit", "pid": pid, "code": pid1.status_of(wstatus)[0]})
