"""Protected entries created while the cell runs, as it happens. One that exists is bound read-only in
the cell (a write fails, and :mod:`.attempts` reports it); one that does not exist cannot be bound: the
command may create it (``.claude/settings.json`` where there was no ``.claude``, a hook where a
repository had no ``hooks`` directory), and it is moved aside when the cell ends (:mod:`agentcell.protect.check`).
This source says so at once: fanotify directory events (create, moved-to) on the directories where such
an entry could appear, each naming the entry and the process; those of the cell's processes count.

Needs root (fanotify with CAP_SYS_ADMIN); Linux 5.9 for events that name the entry.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from ..cell import fanotify
from .attempts import INSTRUCTIONS
from .event import CellEvent
from .source import close_later


class CreatedWatch:
    """A :class:`agentcell.monitor.source.Source` over ``entries`` (protected paths that do not exist
    yet); ``ours(pid)`` says whether a process is the cell's."""

    name = "created"

    def __init__(self, entries: tuple[str, ...], cell: str, ours: Callable[[int], bool]) -> None:
        self.cell, self.ours = cell, ours
        self.entries = set(entries)
        self.fd = fanotify.init(fanotify.FAN_CLASS_NOTIF | fanotify.FAN_REPORT_DFID_NAME)
        self.dirs: dict[bytes, str] = {}
        try:
            for d in sorted({os.path.dirname(p) for p in entries}):
                try:
                    handle = fanotify.handle_of(d)
                    fanotify.mark(self.fd, fanotify.FAN_CREATE | fanotify.FAN_MOVED_TO | fanotify.FAN_ONDIR, d,
                                  fanotify.FAN_MARK_DONT_FOLLOW | fanotify.FAN_MARK_ONLYDIR)
                except OSError:
                    continue  # gone or replaced since the scan: nothing can be created in it by that name
                self.dirs[handle] = d
        except BaseException:
            os.close(self.fd)
            raise

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[CellEvent]:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out = []
        for mask, pid, handle, name in fanotify.named_events(data):
            if mask & fanotify.FAN_Q_OVERFLOW:
                out.append(CellEvent("telemetry", "created", "the kernel dropped events of created protected "
                                     "entries (they are still moved aside when the cell ends)", source="telemetry",
                                     cell=self.cell, acts=False))
                continue
            d = self.dirs.get(handle)
            path = os.path.join(d, name) if d is not None else ""
            if path not in self.entries or not self.ours(pid):
                continue
            what = ("the instructions a harness reads" if name in INSTRUCTIONS else
                    "what the human's tools run or obey: git hooks and config, harness settings, shell rc files")
            # inside the declared paths: noted as it happens, made harmless when the cell ends
            out.append(CellEvent("write", path, f"a protected entry was created in the project ({what}); it is "
                                 "moved aside when the cell ends", source="created", cell=self.cell, pid=pid,
                                 allow=f"--allow-write {path}", acts=False))
        return out

    def close(self) -> None:
        close_later(self.fd)
