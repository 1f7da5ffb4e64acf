"""The ``cgroup`` source: the cell's cgroup counters as events. An OOM kill and a fork refused at the
task limit are recorded (the kernel has acted already: the event only says so); the CPU ceiling holding
the cell back is a note. Nothing to wait on: the counters are read every RESOURCES_S."""
from __future__ import annotations

import time
from collections.abc import Callable

from ..cell.cgroups import CellCgroup
from .event import CellEvent

RESOURCES_S = 0.25
CPU_NOTE = 10  # periods the CPU ceiling held the cell back before that is noted (a second at 0.1 s each)
_WHAT = (("oom_kills", "a process was killed for memory (OOM) at the cell's --memory"),
         ("pids_limit_hits", "a fork was refused at the cell's --pids"),
         ("cpu_throttled", f"the cell was held at its CPU ceiling (--cpu) for {CPU_NOTE} periods of 0.1 s or more: "
                           "it wanted more"))


class ResourceSource:
    """``cgroup()``: the cell's cgroup (None until it is launched, or if it has none)."""

    name = "cgroup"

    def __init__(self, cgroup: Callable[[], CellCgroup | None], cell: str) -> None:
        self.cgroup, self.cell = cgroup, cell
        self._seen = {"oom_kills": 0, "pids_limit_hits": 0}
        self._last = time.monotonic()

    def fileno(self) -> int:
        return -1

    def read(self) -> list[CellEvent]:
        if time.monotonic() - self._last < RESOURCES_S:
            return []
        self._last = time.monotonic()
        return self.counts()

    def counts(self) -> list[CellEvent]:
        """What the counters say now (also the last look, when the cell has ended)."""
        cg = self.cgroup()
        if cg is None:
            return []
        try:
            now = cg.events() or {}
        except OSError:
            return []
        out = []
        for key, what in _WHAT:
            n = int(now.get(key, 0))
            # (a start-up's burst past the ceiling, its proxy's and its own, says nothing: held back a while)
            if n > self._seen.get(key, 0) and (key != "cpu_throttled" or n >= CPU_NOTE):
                self._seen[key] = n
                out.append(CellEvent("resource", key, what, source="cgroup", cell=self.cell,
                                     acts=key != "cpu_throttled"))
        return out

    def close(self) -> None:
        pass
