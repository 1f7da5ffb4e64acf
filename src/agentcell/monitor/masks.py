"""Masks that the host undoes: a mount over a file is detached, in every other mount namespace, when
that file is replaced on the host by a rename (useradd rewriting /etc/shadow; an editor saving the
.env that ``--mask`` hides by writing a new file and renaming it over). The cell would then see the
new file. The kernel allows this; nothing stops it. What the monitor can do is notice at once:

* inotify on the host directories that hold masked files (create, rename, delete of those names);
* on such an event (and every 0.1 s anyway), the name is looked up again *inside* the cell
  (``/proc/<PID 1>/root/...``): if it no longer leads to the cell's own mask device (every mask is
  a bind of the cell's empty file or directory), the mask is gone. That is an event that ends the
  cell (it is no longer confined as declared), whoever caused it. The cell's mount table is no
  witness: a detached mount can linger in it while the name already leads past it.
"""
from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Callable

from .event import CellEvent

IN_CREATE, IN_DELETE, IN_MOVED_FROM, IN_MOVED_TO = 0x100, 0x200, 0x40, 0x80
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
_EV = struct.Struct("=iIII")
CLOSE_S = 0.02  # the loop's pace while a touched mask is looked at again


class MaskWatch:
    """``candidates``: every path the cell was built with a mask on. All masks are binds of the cell's
    own empty file or directory, on the cell's staging tmpfs: a name that leads to another device
    is not masked any more. The device is the one most masks are on when the watch starts (the
    command may already run by then, and a host rename may already have undone one of them)."""

    def __init__(self, pid1: int, candidates: tuple[str, ...], uid: int, groups: tuple[int, ...]) -> None:
        self.pid1, self.uid, self.groups = pid1, uid, set(groups)
        devs: dict[str, int] = {}
        for p in candidates:
            try:
                devs[p] = os.stat(f"/proc/{pid1}/root{p}", follow_symlinks=False).st_dev
            except OSError:
                continue
        if not devs:
            raise OSError(2, "no masked path is in the cell")
        counts: dict[int, int] = {}
        for d in devs.values():
            counts[d] = counts.get(d, 0) + 1
        self.dev = max(counts, key=lambda d: counts[d])
        if counts[self.dev] < 2 and len(devs) > 1:
            raise OSError(22, "the cell's masks could not be told apart")
        self.masks = tuple(devs)
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._names: dict[int, set[str]] = {}
        for p in self.masks:
            parent, name = os.path.split(p)
            events = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
            wd = libc.inotify_add_watch(self.fd, os.fsencode(parent), events)
            if wd >= 0:
                self._names.setdefault(wd, set()).add(name)

    def fileno(self) -> int:
        return int(self.fd)

    def touched(self) -> bool:
        """The host created, renamed or removed a masked name since the last look (never blocks)."""
        touched = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return touched
            off = 0
            while off + _EV.size <= len(data):
                wd, _mask, _c, length = _EV.unpack_from(data, off)
                name = data[off + _EV.size:off + _EV.size + length].rstrip(b"\0").decode(errors="replace")
                off += _EV.size + length
                touched = touched or name in self._names.get(wd, ())

    def check(self) -> list[tuple[str, bool]]:
        """Masks the cell's names no longer lead to: (path, whether the cell's account can read what
        the name leads to now). /etc/shadow, replaced by every useradd on the host, stays unreadable
        to an ordinary account by its permissions; a --mask'ed .env saved by an editor usually not."""
        gone = []
        for p in self.masks:
            try:
                st = os.stat(f"/proc/{self.pid1}/root{p}", follow_symlinks=False)
            except FileNotFoundError:
                if not os.path.exists(f"/proc/{self.pid1}/root/"):
                    return []  # the cell is gone
                gone.append((p, False))
                continue
            except OSError:  # this name cannot be looked up now (a parent made a file): the others still are
                if not os.path.exists(f"/proc/{self.pid1}/root/"):
                    return []  # the cell is gone
                continue
            if st.st_dev != self.dev:
                gone.append((p, self._readable(st)))
        return gone

    def _readable(self, st: os.stat_result) -> bool:
        if st.st_uid == self.uid:
            return bool(st.st_mode & 0o400)
        if st.st_gid in self.groups:
            return bool(st.st_mode & 0o040)
        return bool(st.st_mode & 0o004)

    def close(self) -> None:
        os.close(self.fd)


class MaskSource:
    """The ``masks`` source. The kernel reports the host's rename a moment before it detaches the mount:
    after such an event the names are looked up at once, then again every CLOSE_S for half a second
    (:meth:`pace` quickens the monitor's loop to that), and every 0.1 s anyway. Not on every pass: a
    live cell's commands make thousands a second, and the host's useradd (another cell's account) a
    look at every masked name on each of them."""

    name = "masks"

    def __init__(self, watch: MaskWatch, cell: str, news: Callable[[int], bool] = lambda fd: True) -> None:
        self.watch, self.cell, self.news = watch, cell, news  # news(fd): whether the pass found its queue readable
        self._checked = self._until = 0.0

    def fileno(self) -> int:
        return self.watch.fileno()

    def pace(self) -> float | None:
        """How soon the loop should come round without news, while a touched name is watched closely: when
        the next look is due (at least a millisecond: the loop reads none as its own pace)."""
        now = time.monotonic()
        return max(0.001, self._checked + CLOSE_S - now) if now < self._until else None

    def read(self) -> list[CellEvent]:
        now = time.monotonic()
        if self.news(self.watch.fileno()) and self.watch.touched():
            self._until, self._checked = now + 0.5, 0.0
        if now - self._checked < (CLOSE_S if now < self._until else 0.1):
            return []
        self._checked = now
        return [CellEvent("read", path, "the mask over it is gone: the file was replaced on the host (a rename over "
                          "a masked file detaches the mask in every cell), and the cell's account can read the new "
                          "one", source="masks", cell=self.cell, allow="keep masked files from being replaced while a "
                          "cell runs")
                # useradd on the host replacing /etc/shadow: root's 0600 again, nothing to see (looked at again
                # on every pass: a chmod later would be seen)
                for path, readable in self.watch.check() if readable]

    def close(self) -> None:
        self.watch.close()
