"""monitor ⟲: one watch of the running cell per step, until an escape, its end, the wall clock or a stop."""
from __future__ import annotations

import os
import time
from typing import Any

from ...audit.trail import AuditLog, AuditWriteError
from ..records import Result, plain
from ..state import Runtime, SessionState, config_of, policy_of
from .kit import TelemetryLost, audit, crash, escape_record, inject

AUDIT_MIN_FREE = 1 << 20  # bytes left where the trail is, below which a running session stops


def monitor(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """One watch of up to ``tick_s``: the first escape, the cell's end, the wall clock, a stop."""
    from ...monitor.monitor import ESCAPES

    sid = state["session_id"]
    inject(rt, "telemetry", TelemetryLost)
    cell = rt.cells.get(sid)
    if cell is None:
        raise TelemetryLost("monitor", "the supervisor holds no handle on the cell")
    crash(rt, "monitor")
    until = min(time.monotonic() + rt.tick_s, time.monotonic() + max(0.0, state["deadline"] - time.time()))
    next_line = time.monotonic()
    while True:
        # What the monitor acts on (an event it only notes, acts false, is not held against the cell).
        escape = next((e for e in cell.events() if e["operation"] in ESCAPES and e.get("acts", True)), None)
        result = cell.poll()
        if result is not None and escape is None and result.get("terminated_by_monitor"):
            # Ended by its monitor whatever the report kept: never a normal exit.
            escape = next((e for e in result.get("events", []) if e["operation"] in ESCAPES
                           and e.get("acts", True)), None) or {
                "operation": "telemetry", "target": "monitor", "source": "telemetry",
                "reason": result.get("monitor_reason") or "the monitor ended the cell"}
        if result is None and escape is None and cell.lost:
            raise TelemetryLost("monitor", "the cell's host ended without a word")
        if result is not None and escape is None and result.get("host_ended"):
            # its host ended it (stopped, or its proxy or monitor failed once the agent ran): not the agent's
            # own exit, nor an escape of its
            why = f"the cell's host ended it: {result.get('error') or 'no reason given'}"
            audit(rt, state, "monitor", "session.stop", reason=why)
            return {"status": "terminated", "reason": why}
        if escape is not None:
            ev = escape_record(state, escape["operation"], escape["target"], escape["reason"],
                               source=escape["source"], pid=escape.get("pid"), exe=escape.get("exe"),
                               ts=escape.get("ts"), ancestry=escape.get("ancestry"))
            try:
                audit(rt, state, "monitor", "session.escape", allow=escape.get("allow", ""),
                      **{k: v for k, v in plain(ev).items() if k != "session_id"})
                unrecorded: dict[str, Any] = {}
            except AuditWriteError as e:  # the escape is still the session's verdict, and says so
                unrecorded = {"audit_error": e.line()}
            who = f" by {os.path.basename(ev.exe or '?')} (pid {ev.pid})" if ev.pid else ""
            return {"status": "terminated", "reason": f"escape: {ev.operation} {ev.target}{who}: "
                    f"{ev.reason}" + (" (not in the audit log: it cannot be written)" if unrecorded else ""),
                    "escape": ev, **unrecorded}
        if result is not None:
            audit(rt, state, "monitor", "session.exit", exit_status=result["exit_status"],
                  signal=result["signal"])
            return {"status": "completed", "reason": f"exit {result['exit_status']}",
                    "result": Result.of(result)}
        if sid in rt.stop_requested:
            why = rt.stop_requested[sid]
            audit(rt, state, "monitor", "session.stop", reason=why)
            return {"status": "terminated", "reason": f"stopped: {why}"}
        if time.time() >= state["deadline"]:
            audit(rt, state, "monitor", "session.timeout",
                  wall_clock_limit_s=getattr(policy_of(state), "wall_clock_limit_s", None))
            return {"status": "completed", "reason": "timeout"}
        if time.monotonic() >= until:
            break
        if time.monotonic() >= next_line:  # once a second
            _audit_room(state)
            if rt.status_line:
                _status_line(state, cell)
            next_line = time.monotonic() + 1.0
        cell.settle(0.05)  # (at once when the host says something: the cell's end is seen as it comes)
    # A record per tick: what the cell has used so far, and the proof the trail still takes records
    # (one that cannot ends the session now, not at its end).
    stats = cell.stats()
    audit(rt, state, "monitor", "session.tick", cpu_s=stats.get("cpu_s"), memory_bytes=stats.get("memory_bytes"),
          events=len(cell.events()))
    return {}


def _audit_room(state: SessionState) -> None:
    """The trail's file system still has room: a session stops before its records are lost."""
    path = AuditLog(config_of(state).audit_log_path).path
    try:
        st = os.statvfs(os.path.dirname(path))
    except OSError as e:
        raise AuditWriteError("audit", f"cannot reach {path}: {e.strerror}", "the session stops: fix the log") \
            from None
    free, inodes = st.f_bavail * st.f_frsize, st.f_favail
    if free < AUDIT_MIN_FREE or inodes < 16:
        raise AuditWriteError("audit", f"the file system of {path} is full ({free:,} bytes, {inodes:,} inodes "
                              "left)", "the session stops before its records are lost: make room, then "
                              "'agentcell audit verify'")


def _status_line(state: SessionState, cell: Any) -> None:
    import sys

    s = cell.stats()
    mem = f"{s['memory_bytes'] / 2**20:.0f} MiB" if s.get("memory_bytes") else "-"
    cpu = f"{s['cpu_s']:.1f} s" if s.get("cpu_s") is not None else "-"
    sys.stderr.write(f"\r\033[Ksession {state['session_id']}: {time.time() - state['started_at']:.0f} s, "
                     f"cpu {cpu}, memory {mem}, events {len(cell.events())}")
    sys.stderr.flush()
