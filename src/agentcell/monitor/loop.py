"""The monitor's loop thread and the watchdog beside it, which tells a stuck loop from a starved host,
and the record of what the monitor saw (events kept, duplicates counted, the stream)."""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

from ..hostfs import proc_stat
from .event import CellEvent

HEARTBEAT_S = 1.0  # a loop without progress for this long of the watchdog's own time has stopped
TICK_S = HEARTBEAT_S / 4
LATE_S = 2 * TICK_S  # a watchdog tick that took longer than this: the process was not getting the CPU
MAX_EVENTS = 1000  # distinct events kept per cell, of each kind (acting, notes); duplicates are counted


class Loop:
    """``progress()`` is called for each pass of the loop and each message a source reads (whoever's it
    was: reading the host's messages to drop them is work, not a spin)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()
        self.wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # stop() wakes the loop's select
        self.heartbeat = time.monotonic()
        self.stalled = 0.0  # the loop's time without progress while the host gave it time (the watchdog's)
        self.ready: set[int] | None = None  # the files this pass's wait found readable (None: not waited on)

    def news(self, fd: int) -> bool:
        """Whether ``fd`` may have something to read in this pass: its wait said so, or the pass did not wait
        (the last look reads everything). A source read for another file's news skips an empty read of its
        own (a call and an exception, and the GIL let go to the host's loop and taken back)."""
        return self.ready is None or fd in self.ready

    def start(self, run: Callable[[], None], check: Callable[[], None]) -> None:
        self.heartbeat = time.monotonic()
        self.thread = threading.Thread(target=run, name="agentcell-monitor", daemon=True)
        self.thread.start()
        threading.Thread(target=self._watchdog, args=(check,), name="agentcell-monitor-watchdog",
                         daemon=True).start()

    def progress(self) -> None:
        self.heartbeat = time.monotonic()

    def alive(self) -> bool:
        """The loop is running and has not stalled for HEARTBEAT_S of the watchdog's own time. When not,
        the caller records a telemetry event."""
        return self.thread is not None and self.thread.is_alive() and self.stalled < HEARTBEAT_S

    def stop(self) -> bool:
        """Ends the loop; whether it hangs (it did not end within 5 s)."""
        self.stopped.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self.thread is not None:
            self.thread.join(5)
        for fd in (self.wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.wake_r = self._wake_w = -1
        return self.thread is not None and self.thread.is_alive()

    def _watchdog(self, check: Callable[[], None]) -> None:
        """Without progress (a pass of the loop, or an event read), the loop's stalled time is what the
        host gave it and it did not use: each tick that came on time (the process is getting the CPU)
        while the loop's thread was not itself waiting for a CPU (not runnable: blocked in a call, a
        lock, a source), plus the CPU time the loop's thread spent since its last progress (it ran, and
        went nowhere: a spin). A late tick, or the loop's thread on the run queue without being given
        the CPU, is the host's. Progress resets it."""
        last, beat = time.monotonic(), self.heartbeat
        blocked, spun_from = 0.0, self._loop_cpu()
        while not self.stopped.wait(TICK_S):
            now, cpu = time.monotonic(), self._loop_cpu()
            tick, last = now - last, now
            if self.heartbeat != beat:
                beat, blocked, spun_from = self.heartbeat, 0.0, cpu
            elif tick <= LATE_S and not self._loop_runnable():
                blocked += tick
            self.stalled = blocked + max(0.0, cpu - spun_from)
            check()

    def _loop_cpu(self) -> float:
        """The CPU time the loop's thread has used, from the kernel by its thread id (0 once it is
        gone: then :meth:`alive` says so; never through a pthread handle that may be freed)."""
        tid = getattr(self.thread, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _loop_runnable(self) -> bool:
        """Whether the loop's thread is waiting for a CPU (state R), not blocked."""
        tid = getattr(self.thread, "native_id", None)
        try:
            return proc_stat(f"self/task/{tid}")[0] == b"R"
        except (OSError, IndexError):
            return False


class Record:
    """The events kept, each once: a duplicate is counted on the first. Notes and acting events are
    capped apart (MAX_EVENTS each): a flood of notes never pushes an attempt out. ``queue`` streams
    them (None: the monitor has stopped)."""

    def __init__(self) -> None:
        self.events: list[CellEvent] = []
        self.lock = threading.RLock()
        self.queue: queue.Queue[CellEvent | None] = queue.Queue()
        self._index: dict[tuple[str, str, str, bool], CellEvent] = {}
        self._kept = {True: 0, False: 0}  # events kept, by whether they act

    def seen(self, ev: CellEvent) -> bool:
        """A duplicate (then counted)."""
        first = self._index.get(ev.key())
        if first is not None:
            first.count += 1
        return first is not None

    def keep(self, ev: CellEvent, cell: str) -> CellEvent | None:
        """What is kept: ``ev``, or past the cap the event that counts the rest (None once it is kept)."""
        if self._kept[ev.acts] >= MAX_EVENTS:
            kind = "events" if ev.acts else "notes"
            ev = CellEvent("telemetry", kind, f"more than {MAX_EVENTS} distinct {kind}: the rest are counted here",
                           source="telemetry", cell=cell, acts=False)
            if self.seen(ev):
                return None
        self._index[ev.key()] = ev
        self.events.append(ev)
        self._kept[ev.acts] += 1
        self.queue.put(ev)
        return ev
