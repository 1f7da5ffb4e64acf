"""The cell's processes, followed by descent from its PID 1, and what each of them is.

Forks, exits and execs come from the proc connector (:mod:`.execsource`), the failed-call source's exec
program (:mod:`.attempts`) and the exec marks (:mod:`.execwatch`). The table outlives the processes a
while: a failed call or a denial is often read after its process is gone, and every event still names
its process and its parents up to the cell's PID 1.
"""
from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

from ..cell.cgroups import CellCgroup
from ..hostfs import proc_stat, read_proc

FORGET_S = 5.0  # an exited process stays in the table this long (a tool's fanotify event may come later)


class CellProcs:
    """``members``: the cell's processes by descent; ``table``: pid -> [parent, executable, command line,
    (the name its last exec gave it)], the executable None until the process execs (then it is what its
    parent is); ``trusted``: agentcell's own processes in the cell's cgroup (its proxy). ``refresh()``
    reads the forks the connector has not yet handed over (the monitor sets it)."""

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.table: dict[int, list[int | str | None]] = {}
        self.trusted: set[int] = set()
        self.seed = 0  # the cell's PID 1
        self.command: int | None = None  # its child: the command
        self.exited: collections.deque[tuple[float, int]] = collections.deque()  # members gone, by when
        self.leftover: list[tuple[int, str]] = []  # what ran on when the command ended (named later)
        self.refresh: Callable[[], None] = lambda: None

    def is_member(self, pid: int) -> bool:
        """One of the cell's processes (not agentcell's own), looked up again if it forked just now."""
        if pid not in self.members:
            self.refresh()
        return pid in self.members and pid not in self.trusted

    def forked(self, parent: int, pid: int) -> None:
        if parent in self.members:
            self.members.add(pid)
            self.table[pid] = [parent, None, None]  # what its parent is, until it execs
            if parent == self.seed and self.command is None:
                self.command = pid  # PID 1 forks once: the command (a live cell's exec server)
        elif pid != self.seed:  # (PID 1 itself was forked by the launcher, outside)
            self.members.discard(pid)  # a pid the cell used before, now someone else's
            self.table.pop(pid, None)

    def exited_now(self, pid: int, status: int) -> None:
        """Kept a while: the fanotify event of a tool that exited at once may come later."""
        if pid in self.members and pid == self.command and status & 0x7F != 9:
            # (not when it was killed: then the whole cell was, at once). Named at the end of this
            # drain: the exec marks of what it left may not have been read yet.
            gone = {p for _, p in self.exited}
            self.leftover = [(p, _readlink(f"/proc/{p}/exe"))  # (read now: PID 1 is about to kill it)
                             for p in sorted(self.members - gone - {self.seed, self.command or 0, pid})]
        if pid in self.members:
            now = time.monotonic()
            self.exited.append((now, pid))
            while self.exited and self.exited[0][0] < now - FORGET_S:
                _, old = self.exited.popleft()
                if not _thread_group_alive(old):  # a leader that exited before its threads still counts
                    self.members.discard(old)
                    self.table.pop(old, None)

    def reread(self, cg: CellCgroup | None) -> None:
        """The connector overflowed: who is in the cell is read again from its cgroup."""
        self.members = _pids_in(cg) | ({self.seed} if self.seed else set())

    def execed_now(self, pid: int, exe: str) -> None:
        """An exec the connector reported (of one of the cell's processes, ``exe`` read at once)."""
        entry = self.table.setdefault(pid, [0, None, None])  # (gone already: what an exec mark named it stays)
        entry[:3] = [entry[0] or _ppid(pid), exe or entry[1] or "", _cmdline(pid) or entry[2] or ""]

    def execed(self, pid: int, comm: str, path: str) -> None:
        """An exec of the cell's that succeeded (the failed-call source's exec program), with the new
        program's name and the file as execve was given it (the kernel's copy): what the process is,
        though it exited before /proc could be read. A relative name is not a name: then it is the one
        the kernel gave the process."""
        exe = _readlink(f"/proc/{pid}/exe")  # (the file it resolves to, while the process lives: sh is dash)
        entry = self.table.get(pid)
        if entry is not None:
            del entry[3:]
            entry.append(comm)
            if exe or path.startswith("/"):
                entry[1] = exe or os.path.normpath(path)
                if entry[2] is None:
                    entry[2] = _cmdline(pid) or entry[1]

    def named(self, pid: int, path: str) -> None:
        """An exec's file, from a mark: the process is that program now (read before it can be gone)."""
        entry = self.table.get(pid)
        if entry is not None:
            entry[1] = path
            if entry[2] is None:
                entry[2] = _cmdline(pid) or path

    def known(self, pid: int) -> tuple[str, str] | None:
        """(exe, command line) from the table: a process that has not exec'd is what its parent is."""
        for _ in range(64):
            entry = self.table.get(pid)
            if entry is None:
                return None
            if entry[1] is not None:
                return str(entry[1]), str(entry[2])
            pid = int(entry[0] or 0)
        return None

    def exe_of(self, pid: int) -> str:
        """The process's executable: from the table, from /proc, else the name its last exec gave it."""
        known = self.known(pid)
        if known and known[0]:
            return known[0]
        exe = _readlink(f"/proc/{pid}/exe")
        if exe:
            return exe
        entry = self.table.get(pid)
        return str(entry[3]) if entry is not None and len(entry) > 3 else ""

    def last_comm(self, pid: int) -> str:
        """The name the kernel gave the last exec of the process, or of the parent it forked from (the
        failed-call source hears every exec): for one that exited before its file could be read."""
        for _ in range(64):
            entry = self.table.get(pid)
            if entry is None:
                return ""
            if len(entry) > 3:
                return str(entry[3])
            pid = int(entry[0] or 0)
        return ""

    def ancestry(self, pid: int) -> list[list[int | str]]:
        """The parents of ``pid`` ([pid, exe, command line]), nearest first, up to the cell's PID 1 (not
        listed): from the table (forks and execs as they came, so a process that has exited is still
        placed), else as far as /proc still has them."""
        if pid not in self.table:
            return ancestry(pid, self.seed, self.members)
        out: list[list[int | str]] = []
        seen = {pid}
        for _ in range(32):
            ppid = int(self.table[pid][0] or 0) if pid in self.table else _ppid(pid)
            if ppid <= 1 or ppid == self.seed or ppid in seen or ppid not in self.members:
                break
            known = self.known(ppid)
            if known is not None and known[0]:
                out.append([ppid, *known])
            else:
                out.append([ppid, self.exe_of(ppid), _cmdline(ppid)])
            seen.add(ppid)
            pid = ppid
        return out


def _ppid(pid: int) -> int:
    try:
        return int(proc_stat(pid)[1])
    except (OSError, ValueError, IndexError):
        return 0


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    """The start of a process's command line (its own words, at most four, 300 characters)."""
    try:
        return " ".join(a.decode("utf-8", "replace") for a in read_proc(f"/proc/{pid}/cmdline").split(b"\0")[:4]
                        if a)[:300]
    except OSError:
        return ""


def ancestry(pid: int, pid1: int | None, members: set[int] | None = None, limit: int = 32) -> list[list[int | str]]:
    """The parents of ``pid`` ([pid, exe, the start of its command line: the process's own word]),
    nearest first, up to the cell's PID 1 (agentcell's reaper, not listed), the first one gone, or the
    first that is not among ``members`` (the cell's processes by descent: a number the host reused is
    never named)."""
    out: list[list[int | str]] = []
    for _ in range(limit):
        ppid = _ppid(pid)
        if ppid <= 1 or ppid == pid1 or (members and ppid not in members):
            break
        try:
            exe = os.readlink(f"/proc/{ppid}/exe")
        except OSError:
            exe = ""
        out.append([ppid, exe, _cmdline(ppid)])
        pid = ppid
    return out


def _pids_in(cg: CellCgroup | None) -> set[int]:
    out: set[int] = set()
    for d in (cg.dirs.values() if cg is not None else ()):
        try:
            with open(f"{d}/cgroup.procs") as f:
                out |= {int(x) for x in f.read().split() if x.isdigit()}
        except OSError:
            pass
    return out


def _thread_group_alive(pid: int) -> bool:
    """Some thread of ``pid``'s group still runs (its leader may have exited before the others)."""
    try:
        status = read_proc(f"/proc/{pid}/status", 1 << 16).decode(errors="replace")
    except OSError:
        return False
    threads = next((line.split()[1] for line in status.splitlines() if line.startswith("Threads:")), "0")
    return threads.isdigit() and int(threads) > 0 and "\nState:\tX" not in status
