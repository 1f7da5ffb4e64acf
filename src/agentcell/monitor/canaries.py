"""Canary credentials, watched (planted by :mod:`agentcell.cell.canary`): the watch PID 1 made —
fanotify as root (the event names the process), inotify rootless (the cell as a whole) — read here.
Any open is an escape attempt: nothing a cell legitimately runs reads another person's keys.
"""
from __future__ import annotations

import os
import struct
from typing import Any

from .event import CellEvent
from .procs import CellProcs
from .source import close_later

_INO = struct.Struct("=iIII")  # wd, mask, cookie, len
FAN_Q_OVERFLOW, IN_Q_OVERFLOW, IN_OPEN, FAN_OPEN_PERM = 0x4000, 0x4000, 0x20, 0x10000


class CanaryWatch:
    def __init__(self, fd: int, paths: tuple[str, ...], home: str) -> None:
        self.fd, self.paths, self.home = fd, paths, home.rstrip("/")
        self.kind = "fanotify" if "fanotify" in os.readlink(f"/proc/self/fd/{fd}") else "inotify"

    def fileno(self) -> int:
        return self.fd

    def read(self) -> list[dict[str, Any]]:
        """Opens seen since the last read: {"path", "pid" (None with inotify), "exe", "answer"}; {"lost":
        True} if the kernel's queue overflowed. Each must be given to :meth:`answer` once recorded."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        return self._fanotify(data) if self.kind == "fanotify" else self._inotify(data)

    def _fanotify(self, data: bytes) -> list[dict[str, Any]]:
        from ..cell import fanotify

        out: list[dict[str, Any]] = []
        for mask, fd, pid in fanotify.events(data):
            if mask & FAN_Q_OVERFLOW:
                out.append({"lost": True})
                continue
            path = "?"
            if fd >= 0:
                try:  # the path within the home's own mount (another mount namespace's)
                    rel = os.readlink(f"/proc/self/fd/{fd}")
                    path = next((p for p in self.paths if p.endswith(rel)),
                                rel if rel.startswith(self.home + "/") else self.home + rel)
                except OSError:
                    pass
            exe = ""
            try:  # the opener waits for our answer: it is still there to be named
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                pass
            out.append({"path": path, "pid": pid, "exe": exe, "answer": fd if mask & FAN_OPEN_PERM else None})
        return out

    def answer(self, event: dict[str, Any]) -> None:
        """Let a waiting open go ahead (after it was recorded: the decoy is fake) and drop its fd."""
        fd = event.get("answer")
        if fd is None:
            return
        from ..cell import fanotify

        try:
            fanotify.allow(self.fd, fd)
        except OSError:
            pass  # the opener was killed meanwhile
        finally:
            os.close(fd)

    def _inotify(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        off = 0
        while off + _INO.size <= len(data):
            wd, mask, _c, length = _INO.unpack_from(data, off)
            off += _INO.size + length
            if mask & IN_Q_OVERFLOW:
                out.append({"lost": True})
            elif mask & IN_OPEN and 1 <= wd <= len(self.paths):
                out.append({"path": self.paths[wd - 1], "pid": None, "exe": ""})
        return out

    def close(self) -> None:
        os.close(self.fd)


class CanarySource:
    """The ``canary`` source: each open of a decoy as an escape attempt. The opener waits (fanotify's
    permission event) until :meth:`release`, after the event is recorded: then the open may go on."""

    name = "canary"

    def __init__(self, watch: CanaryWatch, procs: CellProcs, cell: str) -> None:
        self.watch, self.procs, self.cell = watch, procs, cell
        self._held: list[dict[str, Any]] = []

    def fileno(self) -> int:
        return self.watch.fileno()

    def read(self) -> list[CellEvent]:
        out = []
        for c in self.watch.read():
            if c.get("lost"):
                out.append(CellEvent("telemetry", "canary", "the kernel dropped canary events", source="telemetry",
                                     cell=self.cell))
                continue
            pid = c.get("pid")
            if pid in self.procs.trusted:
                self.watch.answer(c)
                continue
            self.procs.refresh()  # the opener's parents may have forked since the connector was read
            out.append(CellEvent("read", c["path"], "a canary credential was opened (a decoy agentcell planted in "
                                 "the cell's home: nothing legitimate reads it)", source="canary", cell=self.cell,
                                 pid=pid, exe=c.get("exe", ""),
                                 ancestry=self.procs.ancestry(pid) if pid else None,  # it waits
                                 allow="nothing: it is a decoy; give real credentials with --ro PATH if a tool "
                                 "needs them"))
            self._held.append(c)
        return out

    def release(self) -> None:
        held, self._held = self._held, []
        for c in held:
            self.watch.answer(c)

    def close(self) -> None:
        close_later(self.watch.fd)
