"""The one event every source of the monitor yields: what was tried (operation, target), why it was
refused (reason), by which process (pid, exe, and its parents up to the cell's PID 1), which source saw
it, what would allow it, and whether it acts on the verdict or is only recorded (a note)."""
from __future__ import annotations

import time
from typing import Any

from .lines import event_line

FS_OR_NET = ("read", "write", "execute", "network")


class CellEvent:
    __slots__ = ("operation", "target", "reason", "pid", "exe", "cell", "source", "ts", "allow", "count", "acts",
                 "ancestry")

    def __init__(self, operation: str, target: str, reason: str, *, source: str, cell: str, pid: int | None = None,
                 exe: str = "", allow: str = "", ts: float | None = None, acts: bool = True,
                 ancestry: list[list[Any]] | None = None) -> None:
        self.operation, self.target, self.reason, self.pid, self.exe = operation, target, reason, pid, exe
        self.cell, self.source, self.allow, self.ts, self.count = cell, source, allow, ts or time.time(), 1
        # False: recorded, never a reason to end the cell (it cannot be pinned on the cell, or it is
        # harmless in any cell: a TCP bind where nothing can connect).
        self.acts = acts
        # [pid, exe, command line] of each parent, nearest first, up to the cell's PID 1 (not included)
        self.ancestry = ancestry

    def key(self) -> tuple[str, str, str, bool]:
        """Duplicates share it. An attempt on a path or an address is one event whichever sources saw it
        (the failed call and Landlock's record of the same open); acts is part of it: a refusal first
        noted as not the cell's must not mask a later one that is."""
        return (self.operation, self.target, "" if self.operation in FS_OR_NET else self.source, self.acts)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def line(self) -> str:
        return event_line(self.as_dict())
