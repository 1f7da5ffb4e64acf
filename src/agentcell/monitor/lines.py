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
