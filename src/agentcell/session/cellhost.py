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
    try:
        sup = Supervised.start(spec_from_dict(req["spec"]), req["argv"], monitor="terminate",
                               callback=lambda ev: out.send({"event": ev.as_dict()}), stdio=(0, 1, 2))
    except (AgentcellError, OSError) as e:
        out.send({"error": e.line() if isinstance(e, AgentcellError) else f"{type(e).__name__}: {e}"})
        return 1
    out.send({"started": {"cell_id": sup.cell_id, "pid1": sup.pid1}})
    last_stats = 0.0
    while True:
        result = sup.poll()
        if result is not None:
            out.send({"result": result})
            return 0
        if time.monotonic() - last_stats >= 1.0:
            last_stats = time.monotonic()
            out.send({"stats": sup.stats()})
        if select.select([ctl], [], [], 0.05)[0]:
            chunk = os.read(ctl, 1 << 16)
            if not chunk:  # the session's supervisor is gone: fail closed
                sup.terminate("the session's supervisor is gone")
                out.send({"result": sup.wait()})
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if "terminate" in msg:
                    sup.terminate(str(msg["terminate"]))
