"""``agentcell warm``: a per-user warm launcher that ``agentcell run`` hands its cells to.

A cold ``agentcell run`` pays for a Python start, its imports and a full cell build every time. With
``agentcell warm start`` a long-lived launcher (the same single-threaded server :class:`agentcell.Cell`
uses, :mod:`agentcell.host.zygote`) listens on a unix socket and keeps the next cell prepared, so
the CLI only compiles the policy, hands over argv and its stdio fds, and waits.

Trust: the socket lives in a directory only its owner can enter (``/run/agentcell`` for root,
``$XDG_RUNTIME_DIR/agentcell`` or ``$XDG_STATE_HOME/agentcell`` otherwise), and both ends check the
other is the same uid (SO_PEERCRED). The launcher can do nothing its client could not do itself.
Interactive runs (stdin a terminal we hold) stay on the cold path: job control needs the cell in the
terminal's session. The launcher exits after ``--idle`` seconds without work.
"""
from __future__ import annotations

import os
import time

from .. import hostfs
from ..cell.spec import TYPE_CHECKING, CellSpec
from .remote import WARM_SOCKET, HostUnavailable, RemoteHost, ask, connect_warm, serve_detached

if TYPE_CHECKING:
    import signal
    from typing import Any
else:  # see launch.py
    import _signal as signal

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


socket_dir = hostfs.socket_dir


def run(spec: CellSpec, argv: list[str], timeout: float | None, monitor: str | None = None) -> dict[str, Any] | None:
    """Run through the warm launcher, on our stdio, forwarding our signals. None means it is not
    running (or went away before anything ran): launch cold instead. Once it has started the command,
    its result is final. A supervised cell (proxy, host-firewall table, ``monitor``) runs in a cell host
    the launcher forks, whose result is as complete as the cold path's (the protected-path step stays
    with the caller)."""

    try:
        cell = RemoteHost("warm").start(spec, argv, stdio=(0, 1, 2), monitor=monitor)
    except HostUnavailable:
        return None
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: cell.signal(sig))
    result = cell.wait(timeout)
    if cell.was_lost:  # its cell died with it (PID 1's parent-death signal); the caller's checks still run
        result.update(exit_status=125, timed_out=cell.timed_out, cell_id=cell.cell_id,
                      error="warm launcher: it went away while the command ran (see 'agentcell warm status'; "
                            "--no-warm launches cold)")
    return result


# ---- managing the launcher (not on the hot path) --------------------------------------------------


def _ask(*ops: str) -> list[dict[str, Any] | None] | None:
    """Send each op to our launcher and collect the replies; None if no launcher runs."""
    s = connect_warm()
    if s is None:
        return None
    try:
        return [ask(s, op) for op in ops]
    finally:
        s.close()


def status() -> dict[str, Any] | None:
    replies = _ask("status")
    return None if replies is None else replies[0]


def start(idle_s: float) -> tuple[int, bool]:
    """Start the launcher unless one runs; (pid, started_now)."""
    from . import interp

    running = status()
    if running is not None:
        return int(running["pid"]), False

    path = os.path.join(hostfs.private_dir(socket_dir(), "warm"), WARM_SOCKET)
    proc = serve_detached(path, lambda fd: interp.launcher("--listen", str(fd), "--path", path, "--idle",
                                                                    str(idle_s)), 64)
    for _ in range(200):  # until it answers as itself (its own listen(): see peer.peer_is_ours)
        if status() is not None:
            break
        time.sleep(0.01)
    return proc.pid, True


def stop(wait_s: float = 10.0) -> int | None:
    """Ask the launcher to stop (the cells it runs itself are killed; a supervised cell's host, which
    it forked, serves that cell to its end, tied to its client); the pid it had, or None. Returns once
    it has exited (with the cells it ran, its prepared cell and a front's CLI forked ahead), or after
    ``wait_s``."""
    import select

    first = status()
    if first is None:
        return None
    pid = int(first["pid"])
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = None
    try:
        replies = _ask("stop")
        if pidfd is not None and replies and replies[0] is not None:
            select.select([pidfd], [], [], wait_s)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return pid
