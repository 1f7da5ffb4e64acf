"""The interface of a monitor source: something to wait on, and what it saw as events.

``fileno()`` is polled by the monitor's loop (-1: nothing to wait on; it is read on every pass and
paces itself); ``read()`` returns the new events without blocking, each already said in the cell's
terms (operation, target, reason, whether it acts, the process by pid and executable; the monitor adds
the process's parents); ``close()`` lets go of what the source holds in the kernel. ``name`` is what
``monitor_sources`` and ``agentcell doctor`` call it.

A source with more files to wait on is also :class:`Wakes`. A source whose events keep a process
waiting (a decoy's open, a call handed to us by seccomp) is also :class:`Holds`: the monitor calls
``release()`` once it has recorded them (and, under terminate, frozen the cell), so nothing the cell
does runs on before the verdict.
"""
from __future__ import annotations

import os
import threading
from typing import Protocol, runtime_checkable

from .event import CellEvent


class Source(Protocol):
    name: str

    def fileno(self) -> int: ...

    def read(self) -> list[CellEvent]: ...

    def close(self) -> None: ...


@runtime_checkable
class Holds(Protocol):
    def release(self) -> None: ...


class Fileno(Protocol):
    def fileno(self) -> int: ...


class Fd:
    """A bare file descriptor, to wait on."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


@runtime_checkable
class Wakes(Protocol):
    """A source with more than one file to wait on (its other rings and queues, read with it)."""

    def wakers(self) -> list[Fileno]: ...


def close_later(fd: int) -> None:
    """Close a fanotify group off the caller's path: that waits for an SRCU grace period (10-30 ms
    here). The cell is gone by then; a decoy's waiting open (there is none left) would be let go."""
    threading.Thread(target=_close, args=(fd,), name="agentcell-monitor-close", daemon=True).start()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
