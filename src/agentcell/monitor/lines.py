"""How an event reads, in one line: written once, for :class:`agentcell.monitor.monitor.CellEvent` and
for a result's events as plain data (what ``agentcell run`` prints from a warm launcher's cell host,
without importing the monitor: its threads, queues and sources cost a cold CLI ~30 ms)."""
from __future__ import annotations

import os

from ..cell.spec import TYPE_CHECKING
from ..errors import printable

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


def event_line(ev: Mapping[str, Any]) -> str:
    pid, count = ev.get("pid"), int(ev.get("count") or 1)
    who = f"{os.path.basename(str(ev.get('exe') or '')) or '?'} (pid {pid})" if pid else "the cell"
    more = f" ({count}x)" if count > 1 else ""
    hint = f"; to allow it: {ev['allow']}" if ev.get("allow") else ""
    return printable(f"{ev.get('operation')} {ev.get('target')} by {who}{more}: {ev.get('reason')}{hint}")


def event_kind(ev: Mapping[str, Any]) -> str:
    """resource (a ceiling reached), escape (acts on the verdict) or note (recorded only)."""
    return "resource" if ev.get("operation") == "resource" else "escape" if ev.get("acts", True) else "note"


def chain(ev: Mapping[str, Any]) -> str:
    """Who did it, from the cell's PID 1 down: ``PID 1 → claude (pid 40) → bash (pid 52) → cat (pid 60)``."""
    if not ev.get("pid"):
        return ""
    steps = ["PID 1"]
    for pid, exe, cmd in reversed(ev.get("ancestry") or []):
        word = os.path.basename(str(exe)) or str(cmd).split(" ", 1)[0] or "?"
        steps.append(f"{word} (pid {pid})")
    steps.append(f"{os.path.basename(str(ev.get('exe') or '')) or '?'} (pid {ev['pid']})")
    return printable(" → ".join(steps))
