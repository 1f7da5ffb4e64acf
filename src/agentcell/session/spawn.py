"""The one place the session starts a cell and watches it: the seam to ``agentcell.supervise``.

:class:`Supervised` here has the interface of ``agentcell.supervise.Supervised`` (being written on main);
until that lands it is built from the launcher (:func:`agentcell.cell.launch.start`), the escape monitor
(:class:`agentcell.monitor.monitor.Monitor`) and the egress proxy, as ``agentcell run`` does. When it
lands, :func:`start` returns the real one and this module shrinks to that import.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cell.cgroups import CellCgroup
    from ..cell.launch import Running
    from ..cell.spec import CellSpec
    from ..monitor.monitor import CellEvent, Monitor
    from ..network.egress import ProxyProcess

EventSource = Callable[[], list[dict[str, Any]]]


class Supervised:
    """A cell with its monitor. ``poll`` and ``terminate`` are safe to call from the session's loop."""

    def __init__(self, running: Running, watch: Monitor | None, proxy: ProxyProcess | None) -> None:
        self._running, self._watch, self._proxy = running, watch, proxy
        self.cell_id = running.cell_id
        self.cg: CellCgroup | None = running.cg
        self._result: dict[str, Any] | None = None
        self._terminated_by: str = ""

    @property
    def pid1(self) -> int:
        while not self._running.pid1 and not self._running.finished_reading():
            self._running.poll_messages(0.05)
        return self._running.pid1

    @classmethod
    def start(cls, spec: CellSpec, argv: list[str], *, monitor: str | None = "terminate",
              callback: Callable[[CellEvent], None] | None = None, stdio: Sequence[int] = (0, 1, 2),
              sources: Sequence[EventSource] = ()) -> Supervised:
        from ..cell import launch

        watch = None
        if monitor is not None:  # its sources open before the command can run: nothing is missed
            from ..monitor.monitor import Monitor

            watch = Monitor(spec.cell_id, None, monitor, callback=callback, uid=spec.identity.uid)
            for source in sources:
                watch.add_source(source)
        try:
            running = launch.start(spec, argv, stdio=stdio)
        except BaseException:
            if watch is not None:
                watch.stop()
            raise
        proxy = None
        if running.egress_fd is not None:
            from ..network.egress import ProxyProcess

            proxy = ProxyProcess(running.egress_fd, spec.egress)
            if running.cg is not None:
                try:
                    running.cg.adopt(proxy.proc.pid)
                except OSError:
                    pass
        if watch is not None:
            watch.cg = running.cg
            if proxy is not None:
                watch.add_source(proxy.new_events)
                watch.trusted.add(proxy.proc.pid)
            watch.start()  # a thread, started after the cell's processes were forked
        return cls(running, watch, proxy)

    def events(self) -> list[CellEvent]:
        return list(self._watch.events) if self._watch is not None else []

    def poll(self) -> dict[str, Any] | None:
        if self._result is None:
            self._running.poll_messages(0)
            if self._running.reported() or self._running.finished_reading():
                return self.wait()
        return self._result

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._running.reported() or self._running.finished_reading()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.terminate("timeout")
                deadline = None
                continue
            self._running.poll_messages(left if left is None else min(left, 0.5))
        result = self._running.wait(clean_up=False).as_dict()
        events = self._watch.stop() if self._watch is not None else []
        if self._proxy is not None:
            result["egress_blocked"] = self._proxy.stop()
        self._running.clean_up()
        result["events"] = [e.as_dict() for e in events]
        result["terminated_by_monitor"] = bool(self._watch is not None and self._watch.terminated)
        result["terminated_by"] = self._terminated_by
        self._result = result
        return result

    def terminate(self, reason: str) -> None:
        """Freeze the cell's cgroup (nothing of it runs on), then kill it."""
        self._terminated_by = self._terminated_by or reason
        if self.cg is not None:
            try:
                self.cg.freeze()
            except OSError:
                pass
        self._running.kill()

    def stats(self) -> dict[str, Any]:
        if self.cg is None:
            return {"cpu_s": None, "memory_bytes": None}
        memory = None
        try:
            with open(f"{self.cg.dirs.get('unified') or self.cg.dirs.get('memory', '')}/memory.current") as f:
                memory = int(f.read().strip())
        except (OSError, ValueError):
            pass
        try:
            cpu: float | None = self.cg.cpu_usage_s()
        except OSError:
            cpu = None
        return {"cpu_s": cpu, "memory_bytes": memory}


def start(spec: CellSpec, argv: list[str], *, stdio: Sequence[int] = (0, 1, 2),
          callback: Callable[[CellEvent], None] | None = None, sources: Sequence[EventSource] = ()) -> Supervised:
    return Supervised.start(spec, argv, monitor="terminate", callback=callback, stdio=stdio, sources=sources)
