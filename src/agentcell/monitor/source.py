"""The interface of a monitor source: something to wait on, and what it saw as events.

``fileno()`` is polled by the monitor's loop; ``read()`` returns the new events, each already said in
the cell's terms (operation, target, reason, whether it acts, the process by pid and executable; the
monitor adds the process's parents); ``close()`` lets go of what the source holds in the kernel.
``name`` is what ``monitor_sources`` and ``agentcell doctor`` call it.
"""
from __future__ import annotations

from typing import Protocol

from .event import CellEvent


class Source(Protocol):
    name: str

    def fileno(self) -> int: ...

    def read(self) -> list[CellEvent]: ...

    def close(self) -> None: ...
