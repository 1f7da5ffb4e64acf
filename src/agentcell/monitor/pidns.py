"""What the cell's PID namespace did with its numbers, from the kernel's own events (the task ring of
:mod:`.calls`: each task of the cell that starts or ends, threads too, with its number in the cell's
namespace and the kernel's clock; and each exec by a thread other than the leader, which gives that
thread's number up with no exit of its own).

A call in the cell that names a number its namespace does not have (``/proc/N``, ``kill(N)``, a pidfd)
while a host process has that number is either a look at one of the cell's own tasks that ended, or a
reach for the host process. Which, is told from what the cell's namespace did with N, never from how the
host's pids compare with the cell's counter (a freshly booted host's pids are as low as a cell's, a
host past pid_max starts low again, a cell that forked past its pid_max has had every number):

* ``alive``: a task of the cell had N when the call was made (the ENOENT was about a deeper name);
* ``ended``: the cell gave N up at most RECENT_NS before the call (ps listing /proc, a parent looking
  at its child, a watcher polling the pid it started);
* ``had``: N was the cell's before the call, longer ago (a pidfile; any look at it is the cell's
  business, a reach for what is behind it is not);
* ``never``: no task of the cell had N before the call: a host process's, whatever its number.

Memory is bounded: tasks alive (the cell's task ceiling), numbers given up in the last 2 × RECENT_NS (a
cell making threads as fast as it can gives up some 20,000 a second, and it has a few million numbers at
most), GONE_TIDS host tids, and one bit per number ever had.
"""
from __future__ import annotations

from collections import deque

RECENT_NS = 10 * 10**9  # by the kernel's clock
GONE_TIDS = 1 << 16  # tasks ended lately, by host tid, at most (only a thread's exec needs one: its leader's)
FORK, EXIT = 1, 2  # the kinds of a task event (:mod:`.callprog` writes them; here, the classifier needs no BPF)


class Numbers:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # number -> when its task started (0: before anything was heard)
        self.ended: dict[int, tuple[int, int]] = {}  # number -> when its task started and ended (pruned)
        self.first: dict[int, int] = {}  # number -> when it was first the cell's, within RECENT_NS (pruned)
        self.old = bytearray()  # a bit per number the cell had longer ago than that
        self.tids: dict[int, int] = {}  # host tid -> number, of the tasks alive
        self.gone_tids: dict[int, int] = {}  # host tid -> number, of the tasks that ended lately
        # (when, number or tid) in the order they came, to prune the three tables above by (a dict's
        # oldest entry is slow to find once many before it were deleted)
        self._ends: deque[tuple[int, int]] = deque()
        self._firsts: deque[tuple[int, int]] = deque()
        self._gone: deque[tuple[int, int]] = deque()
        self.unknown = False  # a task came without its number: the kernel's layout is not known
        self.latest = 0

    # ---- what the kernel said ----------------------------------------------------------------------

    def task(self, kind: int, number: int, tid: int, ktime: int) -> None:
        """A task of the cell started (FORK) or ended (EXIT)."""
        if not number:
            self.unknown = True
            return
        self._had(number, ktime)
        if kind == FORK:
            self.live[number] = ktime
            self.tids[tid] = number
        elif kind == EXIT:
            self.tids.pop(tid, None)
            self._end(number, tid, self.live.pop(number, 0), ktime)
        self._prune(ktime)

    def exec_by(self, old_tid: int, tgid: int, ktime: int) -> None:
        """A thread (host tid ``old_tid``) other than its process's leader called exec: it took the leader's
        number (which the kernel reported ended a moment ago, as the leader went) and gave its own up."""
        if old_tid == tgid or not old_tid:
            return
        mine = self.tids.pop(old_tid, None)
        if mine is not None:
            self._end(mine, old_tid, self.live.pop(mine, 0), ktime)
        leader = self.gone_tids.pop(tgid, None)
        if leader is not None:  # the process lives on under its leader's number
            self.ended.pop(leader, None)
            self.live[leader] = 0
            self.tids[tgid] = leader

    def _end(self, number: int, tid: int, born: int, ktime: int) -> None:
        self.ended[number] = (born, ktime)
        self._ends.append((ktime, number))
        self.gone_tids[tid] = number
        self._gone.append((ktime, tid))

    def _had(self, number: int, ktime: int) -> None:
        if not self._bit(number) and number not in self.first:
            self.first[number] = ktime
            self._firsts.append((ktime, number))

    def _bit(self, number: int) -> bool:
        byte = number >> 3
        return byte < len(self.old) and bool(self.old[byte] & (1 << (number & 7)))

    def _prune(self, now: int) -> None:
        self.latest = max(self.latest, now)
        horizon = self.latest - RECENT_NS
        # (ends kept twice as long: a call is read a while after it was made, on a busy host)
        while self._ends and self._ends[0][0] < horizon - RECENT_NS:
            when, number = self._ends.popleft()
            if self.ended.get(number, (0, -1))[1] == when:
                del self.ended[number]
        while self._gone and (self._gone[0][0] < horizon - RECENT_NS or len(self._gone) > GONE_TIDS):
            self.gone_tids.pop(self._gone.popleft()[1], None)
        if len(self._ends) > 2 * len(self.ended) + 1024:  # (a number ended again and again: one entry each)
            self._ends = deque(sorted((gone, number) for number, (_, gone) in self.ended.items()))
        while self._firsts and self._firsts[0][0] < horizon:
            _, number = self._firsts.popleft()
            del self.first[number]
            if number >> 3 >= len(self.old):
                self.old.extend(bytes((number >> 3) + 1 - len(self.old)))
            self.old[number >> 3] |= 1 << (number & 7)

    # ---- what a number was, when a call named it ------------------------------------------------------

    def known(self, number: int) -> bool:
        """Whether any event named ``number`` (else a task alive now with it started before they came)."""
        return number in self.live or number in self.ended or number in self.first or self._bit(number)

    def state(self, number: int, ktime: int) -> str:
        """``alive``, ``ended``, ``had`` or ``never`` (see the module): what ``number`` was to the cell when
        a call made at ``ktime`` named it."""
        born = self.live.get(number)
        if born is not None and born <= ktime:
            return "alive"
        if number in self.ended:
            born, gone = self.ended[number]
            if born <= ktime < gone:
                return "alive"  # (it ended after the call)
            if gone <= ktime:
                return "ended" if ktime - gone <= RECENT_NS else "had"
        first = self.first.get(number)
        if first is not None and first <= ktime or first is None and self._bit(number):
            return "had"  # (a number first had more than RECENT_NS before the newest event: before the call)
        return "never"
