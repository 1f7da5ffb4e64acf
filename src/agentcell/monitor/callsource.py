"""The ``calls`` source: the cell's failed calls (:class:`agentcell.monitor.calls.FailedCalls`, eBPF by
its cgroup), each read against the cell's view (:class:`agentcell.monitor.attempts.Classifier`), as
events; its successful execs name the cell's processes in the monitor's table."""
from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import Any

from .attempts import Classifier
from .event import CellEvent

DROPPED_S = 1.0  # how often the kernel's count of the cell's dropped calls is read


class AttemptSource:
    """``exe_of(pid)`` names a process (the monitor's table of the cell's processes, which outlives
    them); ``ignore(pid)``: agentcell's own processes in the cell; ``execed(pid, comm, path)``: an exec
    that succeeded.

    The monitor reads it on every pass, its pace's too (at least every ``monitor.PASS_S``), and waits on
    the calls' ring alone: the task ring is read with it, before the calls are told apart, and never
    wakes the loop. A task's end reaches the task ring as its exit begins and the connector as it ends
    (after its memory is gone): waited on, every process's end took two passes. At the loop's slowest
    pace the task ring still has room for 87,000 events (``calls.TASK_RING_SIZE``), and a flood of
    threads wakes the loop through the connector, which reports threads too."""

    name = "calls"

    def __init__(self, calls: Any, classifier: Classifier, cell: str, exe_of: Callable[[int], str],
                 ignore: Callable[[int], bool], execed: Callable[[int, str, str], None]) -> None:
        self.calls, self.classifier, self.cell = calls, classifier, cell
        self.exe_of, self.ignore, self.execed = exe_of, ignore, execed
        classifier.catch_up = self._tasks
        self._dropped = 0
        self._checked = time.monotonic()

    def fileno(self) -> int:
        return int(self.calls.fileno())

    def read(self) -> list[CellEvent]:
        out: list[CellEvent] = []
        calls = self.calls.read()
        # The tasks after the calls: every task that started or ended before one of these calls did so
        # before the call's event was handed over (a call finds a number gone only once its task ended).
        numbers = self.classifier.numbers
        self._tasks()
        for call in calls:
            if call.errno == 0:  # an exec that succeeded: the process's new name, for the monitor's table
                numbers.exec_by(call.args[0] & 0xFFFFFFFF, call.pid, call.ktime)
                self.execed(call.pid, call.comm, call.path)
                continue
            if self.ignore(call.pid):
                continue
            try:
                verdict = self.classifier.classify(call)
            except Exception as e:  # noqa: BLE001 - a call we cannot read is one we cannot clear: it acts
                verdict = ("telemetry", call.name, f"a failed call could not be told apart ({type(e).__name__}: "
                           f"{e}); held against the cell", True, "")
            if verdict is None:
                continue
            op, target, reason, acts, allow = verdict
            out.append(CellEvent(op, target, f"{reason}; refused by the kernel ({call.name}: "
                                 f"{errno.errorcode.get(call.errno, call.errno)})", source="calls", cell=self.cell,
                                 pid=call.pid, exe=self.exe_of(call.pid) or call.comm, allow=allow, acts=acts))
        if time.monotonic() - self._checked >= DROPPED_S:
            self._checked = time.monotonic()
            out += self.dropped()
        return out

    def _tasks(self) -> None:
        numbers = self.classifier.numbers
        for t in self.calls.read_tasks():
            numbers.task(t.kind, t.number, t.tid, t.ktime)

    def dropped(self) -> list[CellEvent]:
        """Failed calls the kernel could not hand over: its ring was full. Only this cell's calls go into
        it, so the cell made them, faster than the monitor reads (about 7,000 in flight): one attempt may
        hide among them. That acts like any attempt."""
        try:
            dropped = int(self.calls.dropped())
        except OSError:
            return []
        if dropped <= self._dropped:
            return []
        self._dropped = dropped
        return [CellEvent("telemetry", "calls", f"the kernel dropped {dropped} of the cell's failed calls (the cell "
                          "made them faster than the monitor reads): one may be missing from this report",
                          source="telemetry", cell=self.cell)]

    def close(self) -> None:
        self.calls.close()

