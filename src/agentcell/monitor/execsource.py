"""The ``exec`` source: the proc connector's forks, exits, execs and uid changes and the privilege tools'
execs (fanotify), both of :mod:`.execwatch`, said in the cell's terms. The forks and exits keep the
table of the cell's processes (:mod:`.procs`); what is an event: a privilege tool run in the cell, a
process that changed its uid, and the processes left behind when the command ends (notes, from
:class:`Outlived`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..cell.cgroups import CellCgroup
from .event import CellEvent
from .execwatch import PRIVILEGE_TOOLS, ExecWatch, ToolExecs, identify
from .procs import CellProcs
from .source import Fileno, close_later


class ExecSource:
    """``uid``: the cell's account (the launcher's own drop to it is not an event); ``cgroup()``: the
    cell's cgroup, to re-read who is in it after an overflow; ``progress()``: the watchdog's, for each
    message (a flood read is not a spin); ``news(fd)``: whether the tools' queue may have something
    (the source is read on every pass with news, the connector's or another's)."""

    name = "exec"

    def __init__(self, execs: ExecWatch, tools: ToolExecs | None, procs: CellProcs, cell: str, uid: int | None,
                 cgroup: Callable[[], CellCgroup | None], progress: Callable[[], None],
                 news: Callable[[int], bool] = lambda fd: True) -> None:
        self.execs, self.tools, self.procs, self.cell, self.uid = execs, tools, procs, cell, uid
        self.cgroup, self.progress, self.news = cgroup, progress, news
        execs.on_read = progress

    def fileno(self) -> int:
        return self.execs.fileno()

    def wakers(self) -> list[Fileno]:
        return [self.tools] if self.tools is not None else []

    def read(self) -> list[CellEvent]:
        """Who belongs to the cell first (forks, from the connector), then the tools' execs (fanotify,
        in the order they happened), then the connector's own exec and uid events."""
        tools = self.tools
        return self.connector(tools.read() if tools is not None and self.news(tools.fd) else [])

    def connector(self, tools: list[dict[str, Any]] | None = None) -> list[CellEvent]:
        execs = self.execs.read()
        out: list[CellEvent] = []
        for ex in execs:
            if ex["kind"] in ("fork", "exit", "lost"):
                self.progress()
                out += self._one(ex)
        for ex in (*(tools or ()), *(e for e in execs if e["kind"] not in ("fork", "exit", "lost"))):
            self.progress()
            out += self._one(ex)
        return out

    def _one(self, ex: dict[str, Any]) -> list[CellEvent]:
        procs = self.procs
        if ex["kind"] == "lost":
            if ex.get("tools"):  # the tools' own queue: an exec may be missed
                return [CellEvent("telemetry", "exec", "the kernel dropped exec events", source="telemetry",
                                  cell=self.cell)]
            # The connector carries the whole host's forks: a busy host can overflow it. Who is in the
            # cell is read again from its cgroup (a tool's exec is still named by fanotify).
            procs.reread(self.cgroup())
            return [CellEvent("telemetry", "exec", "the proc connector overflowed (a busy host); the cell's "
                              "processes were re-read from its cgroup", source="telemetry", cell=self.cell,
                              acts=False)]
        kind, pid = ex["kind"], int(ex.get("pid") or 0)
        if kind == "fork":
            procs.forked(ex["parent"], pid)
            return []
        if kind == "exit":
            procs.exited_now(pid, ex.get("status", 0))
            return []
        if pid not in procs.members or pid in procs.trusted:
            return []  # another process of the host (or ours)
        if kind in ("exec", "uid"):  # read now, for the cell's processes only (the host's are many)
            ex = {**identify(pid), **ex}
            if kind == "exec":
                procs.execed_now(pid, ex.get("exe", ""))
        name = ex.get("tool") or os.path.basename(ex.get("exe", "")) or ex.get("comm", "")
        if kind in ("tool", "exec") and name in PRIVILEGE_TOOLS:  # a copy under the same name too (exec)
            return [CellEvent("execute", name, f"a privilege tool was run in the cell ({name}: mounts are nosuid, "
                              "so it can only be an attempt)", source="exec", cell=self.cell, pid=ex["pid"],
                              exe=ex.get("exe", ""), allow="nothing: a cell never gains privilege")]
        if ex["kind"] == "uid" and not (ex.get("ruid") == ex.get("euid") == self.uid):
            return [CellEvent("execute", f"uid {ex.get('ruid')}/{ex.get('euid')}", "a process of the cell changed "
                              "its uid", source="exec", cell=self.cell, pid=ex["pid"], exe=ex.get("exe", ""))]
        return []

    def close(self) -> None:
        self.execs.close()
        if self.tools is not None:
            close_later(self.tools.fd)


class Outlived:
    """The command has ended: what of the cell still ran then is noted (PID 1 kills it now; nothing
    outlives a cell, but a process that tried to is worth knowing). Read after the exec marks and the
    failed calls: they may name what the connector saw only as a number."""

    name = "outlived"

    def __init__(self, procs: CellProcs, cell: str) -> None:
        self.procs, self.cell = procs, cell

    def fileno(self) -> int:
        return -1

    def read(self) -> list[CellEvent]:
        procs = self.procs
        leftover, procs.leftover = procs.leftover, []
        out = []
        for pid, seen in leftover:
            exe = procs.exe_of(pid) or seen or procs.last_comm(pid)
            out.append(CellEvent("execute", exe or f"pid {pid}", "a process still ran when the command ended "
                                 "(detached or left behind; it was killed with the cell)", source="exec",
                                 cell=self.cell, pid=pid, exe=exe, acts=False))
        return out

    def close(self) -> None:
        pass
