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

  launcher -> {"argv": [...], "env": [...], "umask": N}
              + fds [working directory, stdin, stdout, stderr, the front's connection]

The front's connection goes with the request, and the launcher lets go of it: from then on it is the
session's. The session reads it itself (:func:`.clihost.watch_front`: a signal the front forwards is
raised in the session; the front hanging up, killed, is a SIGTERM: the session tears itself down), and
tells the front its status; the starter, its parent, tells it too as it reaps the session (one killed
outright says nothing itself). So a session needs neither the launcher nor the starter once it runs:
``agentcell warm stop``, or a starter that dies, leaves it its front. A request the starter cannot
serve (it cannot fork) is answered at once (125, and why, on the front's stderr); one queued when the
starter dies has its front's connection closed with it: the front says the launcher went away. The
starter is single-threaded when it forks (it checks); once the launcher has gone it takes no more
requests, and exits when its last session has ended.

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
    from collections.abc import Callable, Iterable
    from typing import Any

    Sock = _socket.socket

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
    """The launcher's side: the starter process and the socket requests go to."""

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

    def take(self, msg: dict[str, Any], fds: list[int], front: Sock) -> bool:
        """Hand a front's ``session start`` over, its connection with it; False if the starter cannot take
        it (it has gone)."""
        try:
            wire.send(self.sock, {"argv": msg["argv"], "env": msg["env"], "umask": msg["umask"]},
                      [*fds, front.fileno()])
            return True
        except (OSError, wire.WireError):
            return False

    def discard(self) -> None:
        """The launcher stops, or the starter has ended: it sees its socket close and takes no more
        requests; its sessions go on (it exits after the last, and the launcher does not wait for that)."""
        self.sock.close()
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def preload(names: Iterable[str]) -> int:
    """Import ``names`` into a process that will fork sessions; the number of its threads after (it forks
    only from one). What is here then stays shared with the sessions forked from it: out of the collector's
    sight, which would otherwise write to every object as it looks (a full collection in a session copied
    the whole heap's pages, some 60 ms on a small machine)."""
    import threading

    for name in names:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return threading.active_count()


def serve(sock: Sock) -> int:
    """The starter: import, then fork a session's CLI for each request until the launcher goes and the
    last session has ended."""
    threads = preload(PRELOAD)
    if threads != 1:  # a fork keeps only the forking thread: a lock another held stays held
        sys.stderr.write(f"agentcell warm: the session starter has {threads} threads after its imports; it forks "
                         "only from one, and stops\n")
        return 1
    sessions: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, the front's connection)
    taking = True
    while taking or sessions:
        ready, _, _ = select.select([*([sock.fileno()] if taking else []), *sessions], [], [])
        for r in ready:
            if r == sock.fileno():
                taking = _take(sock, sessions)
            else:
                pid, front = sessions.pop(r)
                os.close(r)
                _, wstatus = os.waitpid(pid, 0)
                _answer(front, pid1.status_of(wstatus)[0])
    return 0


def _take(sock: Sock, sessions: dict[int, tuple[int, int]]) -> bool:
    """One request: its session forked (or the front answered why not); False once the launcher has gone."""
    try:
        msg, fds = wire.recv(sock, 5)
    except (OSError, wire.WireError, ValueError, EOFError, TypeError):
        msg, fds = None, []
    if msg is None or len(fds) != 5:
        for fd in fds:
            os.close(fd)
        return msg is not None
    try:
        pid = os.fork()
    except OSError as e:
        os.write(fds[3], f"agentcell: warm launcher: cannot start the session: {e.strerror}\n".encode())
        _answer(fds[4], 125)
        for fd in fds[:4]:
            os.close(fd)
        return True
    if pid == 0:
        code = 1
        try:
            sock.detach()  # (closed by become: nothing of the starter's stays open)
            code = clihost.run_request({k: msg[k] for k in ("argv", "env", "umask")}, fds[:4], fds[4], watch=True)
        finally:
            clihost.settle()
            os._exit(code)
    for fd in fds[:4]:
        os.close(fd)
    try:
        sessions[os.pidfd_open(pid)] = (pid, fds[4])
    except OSError:  # (no fd for it: the session answers its front itself; reaped as the starter exits)
        os.close(fds[4])
    return True


def _answer(front: int, code: int) -> None:
    """The session's status to its front (which takes the first it gets: the session's own, or this)."""
    conn = _socket.socket(fileno=front)
    try:
        wire.send(conn, {"event": "exit", "code": code})
    except OSError:
        pass
    finally:
        conn.close()
