"""The cell's host: a fresh single-threaded process that runs one :class:`agentcell.supervise.Supervised`.

Why a process of its own: the session graph runs inside LangGraph, which keeps a pool of worker
threads, and the launcher must never fork from a multi-threaded process (a lock another thread holds
stays locked in the child; ARCHITECTURE.md, "Child side"). This process is started with fork+exec
(``subprocess``, safe from threads), so its only thread forks the cell; the monitor's thread starts
after that, inside Supervised.

Protocol (one JSON object per line): the session writes ``{"spec": …, "argv": […]}`` and later
``{"terminate": REASON}`` on fd CTL; the host writes ``{"started": {"cell_id", "pid1"}}`` (or
``{"error": LINE}``), then ``{"event": …}`` as the monitor sees them, ``{"stats": …}`` about once a
second, and ``{"result": …}`` last, on fd REPORT. Its stdio are the agent's. When CTL reaches EOF (the
session's supervisor died) the cell is terminated: no agent runs unwatched.
"""
from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from typing import Any


def command(ctl: int, report: int) -> list[str]:
    """Like the warm launcher's (cell/zygote.py): nothing is imported from the caller's working
    directory or PYTHONPATH; the package is found where the caller found it."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from agentcell.session.cellhost import main; "
            "sys.exit(main(sys.argv[2:]))")
    return [sys.executable, "-I", "-c", code, pkg_parent, str(ctl), str(report)]


class _Out:
    def __init__(self, fd: int) -> None:
        self.fd, self.lock = fd, threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, default=str) + "\n").encode()
        with self.lock:  # the monitor's thread reports events too
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except BrokenPipeError:
                pass  # the session is gone; CTL's EOF ends the cell


def main(argv: list[str]) -> int:
    import signal

    from ..cell import terminal
    from ..cell.spec import spec_from_dict
    from ..errors import AgentcellError
    from ..supervise import Supervised

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the session's to act on ('stopped')
    ctl, out = int(argv[0]), _Out(int(argv[1]))
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(ctl, 1 << 20)
        if not chunk:
            return 1
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    req = json.loads(line)
    # Where our 0, 1, 2 are terminals the cell gets a pty of its own, relayed (as agentcell run does): it
    # never holds the human's terminal (TIOCSTI). stdin only when the session runs in the foreground.
    ttys, interactive = terminal.tty_fds(), terminal.is_ours()
    stdio = [0, 1, 2]
    if 0 in ttys and not interactive:
        stdio[0] = os.open(os.devnull, os.O_RDONLY)
        ttys = tuple(fd for fd in ttys if fd != 0)
    try:
        # A session's account (its own, or a persistent agent's) runs nothing outside its cells.
        sup = Supervised.start(spec_from_dict(req["spec"]), req["argv"], monitor="terminate",
                               callback=lambda ev: out.send({"event": ev.as_dict()}), stdio=stdio, tty_fds=ttys,
                               dedicated=True, guard=False)  # the session's cleanup checks its paths
    except (AgentcellError, OSError) as e:
        out.send({"error": e.line() if isinstance(e, AgentcellError) else f"{type(e).__name__}: {e}"})
        return 1
    out.send({"started": {"cell_id": sup.cell_id, "pid1": sup.pid1}})
    control = _Control(sup, ctl, buf, out)
    master = sup.running.pty_master
    if master is None:
        control.run(until_end=True)
        return 0
    # The relay needs this (main) thread for SIGWINCH; the session's requests are served beside it.
    threading.Thread(target=control.run, kwargs={"until_end": False}, name="agentcell-cellhost", daemon=True).start()
    terminal.Relay(master, interactive).pump(sup.running, None)
    control.finish(sup.wait())
    return 0


class _Control:
    """The session's side of the protocol: its requests (and its EOF), stats, the result."""

    def __init__(self, sup: Any, ctl: int, buf: bytes, out: _Out) -> None:
        self.sup, self.ctl, self.buf, self.out = sup, ctl, buf, out
        self.done = threading.Event()

    def finish(self, result: dict[str, Any]) -> None:
        if not self.done.is_set():
            self.done.set()
            self.out.send({"result": result})

    def run(self, until_end: bool) -> None:
        last_stats = 0.0
        while not self.done.is_set():
            if until_end:
                result = self.sup.poll()
                if result is not None:
                    self.finish(result)
                    return
            if time.monotonic() - last_stats >= 1.0:
                last_stats = time.monotonic()
                self.out.send({"stats": self.sup.stats()})
            if select.select([self.ctl], [], [], 0.05)[0]:
                chunk = os.read(self.ctl, 1 << 16)
                if not chunk:  # the session's supervisor is gone: fail closed
                    self.sup.terminate("the session's supervisor is gone")
                    if until_end:
                        self.finish(self.sup.wait())
                    return
                self.buf += chunk
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "terminate" in msg:
                        self.sup.terminate(str(msg["terminate"]))
