"""``FakeHost``: a :class:`~agentcell.host.base.CellHost` with no kernel behind it, for tests of what is
built on cells (the Python API, the session's workflow), as httpx's ``MockTransport`` is for a client.

Nothing is contained here: a *script* says what each command does (its output, status and the monitor
events it causes) and nothing runs. Each start or exec is recorded in :attr:`FakeHost.calls`. A cell
whose script holds it (``hold=True``) runs until it is terminated, as an agent would until the
monitor or the session ends it. An event that acts, under the verdict ``terminate``, ends the cell
the way the monitor does: status 137, ``terminated_by_monitor``.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cell.spec import CellSpec
from .base import CellEnded, StartOptions

EXIT_KILLED = 137


@dataclass(frozen=True)
class FakeRun:
    """What a command does on a fake host."""

    exit_status: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    events: tuple[dict[str, Any], ...] = ()
    hold: bool = False  # it runs until terminated (a harness that is still working)


@dataclass(frozen=True)
class FakeCall:
    spec: CellSpec
    argv: list[str]
    monitor: str | None
    options: StartOptions | None = None
    live: bool = False


Script = Callable[[CellSpec, list[str]], FakeRun]


def _ok(_spec: CellSpec, _argv: list[str]) -> FakeRun:
    return FakeRun()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _acting(run: FakeRun, monitor: str | None) -> dict[str, Any] | None:
    if monitor != "terminate":
        return None
    return next((e for e in run.events if e.get("acts", True)), None)


@dataclass
class FakeCell:
    """One command's cell on a fake host (a :class:`~agentcell.host.base.CellHandle`)."""

    cell_id: str
    pid1: int
    run: FakeRun
    monitor: str | None
    _result: dict[str, Any] | None = None
    _reason: str = ""
    lost: bool = False
    terminations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        escape = _acting(self.run, self.monitor)
        if escape is not None:
            self._end(EXIT_KILLED, 9, f"{escape.get('operation')} {escape.get('target')}")
        elif not self.run.hold:
            self._end(self.run.exit_status, 0, "")

    def _end(self, status: int, sig: int, reason: str) -> None:
        self._result = {"exit_status": status, "signal": sig, "timed_out": False, "duration_s": 0.0,
                        "cell_id": self.cell_id, "error": None, "events": list(self.run.events),
                        "terminated_by_monitor": bool(reason), "monitor_reason": reason or None}

    def events(self) -> list[dict[str, Any]]:
        return list(self.run.events)

    def stats(self) -> dict[str, Any]:
        return {"cpu_s": 0.0, "memory_bytes": 0.0}

    def poll(self) -> dict[str, Any] | None:
        return self._result

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        if self._result is None:  # held: at its timeout (or at once, with none) it is killed
            self._end(124 if timeout is not None else EXIT_KILLED, 9, "")
            if timeout is not None:
                assert self._result is not None
                self._result["timed_out"] = True
        assert self._result is not None
        return self._result

    def settle(self, timeout: float) -> None:
        time.sleep(timeout)

    def signal(self, sig: int) -> None:
        if self._result is None and sig in (9, 15):
            self._end(128 + sig, sig, "")

    def terminate(self, reason: str) -> None:
        self.terminations.append(reason)
        if self._result is None:
            self._end(EXIT_KILLED, 9, reason)


class FakeLive:
    """A live cell on a fake host (a :class:`~agentcell.host.base.LiveHandle`)."""

    def __init__(self, host: FakeHost, spec: CellSpec, cell_id: str, monitor: str | None) -> None:
        self.host, self.spec, self.cell_id, self.pid1, self.monitor = host, spec, cell_id, 0, monitor
        self.ended: str | None = None
        self.result: dict[str, Any] | None = None
        self._events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def events(self) -> list[dict[str, Any]]:
        return list(self._events)

    def exec(self, argv: list[str], fds: Sequence[int], *, env: dict[str, str], cwd: str | None,
             timeout: float | None) -> tuple[int, queue.SimpleQueue[dict[str, Any]]]:
        with self._lock:
            if self.ended is not None:
                raise CellEnded(self.ended)
            cid = next(self._ids)
            self.host.calls.append(FakeCall(self.spec, list(argv), self.monitor, live=True))
            run = self.host.script(self.spec, list(argv))
            _write(fds[1], run.stdout)
            _write(fds[2], run.stderr)
            self._events += run.events
            done: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
            escape = _acting(run, self.monitor)
            if escape is not None:
                self._end(f"terminated at an escape attempt: {escape.get('operation')} {escape.get('target')}")
                done.put({"event": "exit", "exit_status": EXIT_KILLED, "signal": 9, "timed_out": False,
                          "duration_s": 0.0, "ended": self.ended})
            else:
                done.put({"event": "exit", "exit_status": run.exit_status, "signal": 0, "timed_out": False,
                          "duration_s": 0.0, "ended": None})
            return cid, done

    def _end(self, reason: str) -> None:
        self.ended = reason
        self.result = {"exit_status": 0, "events": list(self._events),
                       "terminated_by_monitor": reason.startswith("terminated"), "monitor_reason": reason}

    def signal(self, cid: int, sig: int) -> None:
        pass  # every fake command has ended by the time exec returns

    def forget(self, cid: int) -> None:
        pass

    def close(self, timeout: float | None = 30.0) -> dict[str, Any] | None:
        if self.ended is None:
            self._end("stopped (asked to stop)")
        return self.result


class FakeHost:
    """Cells that are only a script's say-so (see the module). ``script(spec, argv)`` gives each
    command's :class:`FakeRun`; the default: status 0, no output, no events."""

    def __init__(self, script: Script | None = None) -> None:
        self.script: Script = script or _ok
        self.calls: list[FakeCall] = []
        self.cells: list[FakeCell] = []
        self._ids = itertools.count(1)

    def start(self, spec: CellSpec, argv: Sequence[str], *, stdio: Sequence[int] = (0, 1, 2),
              monitor: str | None = None, options: StartOptions | None = None) -> FakeCell:
        args = [os.fspath(a) for a in argv]
        self.calls.append(FakeCall(spec, args, monitor, options))
        run = self.script(spec, args)
        _write(stdio[1], run.stdout)
        _write(stdio[2], run.stderr)
        n = next(self._ids)
        cell = FakeCell(f"fake-{n}", 0, run, monitor)  # pid 0: no process exists
        self.cells.append(cell)
        return cell

    def open(self, spec: CellSpec, *, monitor: str | None = "terminate") -> FakeLive:
        return FakeLive(self, spec, f"fake-live-{next(self._ids)}", monitor)

    def close(self) -> None:
        pass
