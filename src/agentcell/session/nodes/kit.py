"""What every node shares: its audit record, the fault-injection points, the error handler that routes
a node whose retries are spent, and the failures the graph's retry rules name."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from langgraph.errors import NodeError
from langgraph.types import Command

from ... import hostfs
from ...audit.trail import AuditLog, AuditWriteError
from ...errors import AgentcellError
from ..records import Escape, Surface
from ..state import Runtime, SessionState, config_of, policy_of

UNWRITABLE_AUDIT = "/proc/agentcell-fault/audit.jsonl"  # /proc takes no new files: a real write failure


class InjectedFault(AgentcellError):
    """A failure made on purpose by the fault-injection hook."""


class SpawnCrash(AgentcellError):
    """The cell's process failed before its command ran (a launch step, fork): retried once."""


class TelemetryLost(AgentcellError):
    """The session lost sight of its cell (the handle or the monitor's stream): retried, then a violation."""


def line(e: BaseException) -> str:
    return e.line() if isinstance(e, AgentcellError) else f"{type(e).__name__}: {e}"


def audit(rt: Runtime, state: SessionState, node: str, event: str, **details: Any) -> None:
    """One record. On a sealed trail, a record that makes a seal due sends a head to the witness: with
    ``--audit-witness-required`` a head it did not take stops the session here, as an unwritable record does."""
    cfg = config_of(state)
    path = cfg.audit_log_path
    if rt.fault(f"audit@{node}"):
        path = UNWRITABLE_AUDIT
    log = AuditLog(path)
    log.append(event, session=state["session_id"], **details)
    if log.witness_problem and cfg.audit_witness_required:
        raise AuditWriteError("--audit-witness-required", log.witness_problem, "the session stops: start the "
                              "witness; the heads wait on this host and go first at the next seal")


def seal_now(state: SessionState) -> None:
    """With ``--audit-witness-required``, at the session's first record: the witness must take the head
    that covers it, before anything exists for the session (an account, a cell)."""
    cfg = config_of(state)
    if not cfg.audit_witness_required:
        return
    log = AuditLog(cfg.audit_log_path)
    problem = log.seal() if os.path.isdir(log.path + ".seal") else f"{log.path} is not sealed to a witness"
    if problem:
        raise AuditWriteError("--audit-witness-required", problem, "the session stops before its agent runs: "
                              "start the witness; the heads wait on this host and go first at the next seal")


def witnessed(state: SessionState) -> dict[str, Any]:
    """At a session's end: its trail sealed up to its last record, and every head the witness lacks sent.
    What the witness did not take is a warning (an audit error with ``--audit-witness-required``)."""
    cfg = config_of(state)
    log = AuditLog(cfg.audit_log_path)
    try:
        problem = log.seal()
    except AuditWriteError as e:
        return {"audit_error": e.line()}
    if not problem:
        return {}
    text = (f"the audit trail's witness did not take every head ({problem}); they wait on this host and go first "
            "at the next seal ('agentcell audit seal' retries): until then a root could rewrite the records they "
            "cover unseen")
    if cfg.audit_witness_required:
        return {"audit_error": text}
    return {"warnings": [*(state.get("warnings") or []), text]}


def audit_quietly(rt: Runtime, state: SessionState, node: str, event: str, **details: Any) -> dict[str, Any]:
    """For teardown nodes: a failed record is kept in the state, never raised."""
    try:
        audit(rt, state, node, event, **details)
        return {}
    except AuditWriteError as e:
        return {"audit_error": e.line()}


def crash(rt: Runtime, node: str, *, always: bool = False) -> None:
    """``kill@NODE``: the supervisor dies by SIGKILL here — after the node's work, before its
    checkpoint, the hardest place for ``session recover`` (``always``: a hook of the node's own chose to)."""
    if always or rt.fault(f"kill@{node}"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def inject(rt: Runtime, point: str, exc: type[AgentcellError]) -> None:
    if rt.fault(point):
        raise exc(point, "injected fault", f"unset {point} in the fault-injection hook")


def on_error(node: str, route: str) -> Callable[[SessionState, NodeError], Command[str]]:
    """The node's error handler: where the session goes once the node's retries are spent."""
    def handler(state: SessionState, error: NodeError) -> Command[str]:
        err = error.error
        if isinstance(err, AuditWriteError):  # nothing runs unrecorded: the session stops
            goto, reason = "terminate", f"the audit log cannot be written ({err.line()})"
        else:
            goto, reason = route, f"{node} failed: {line(err)}"
        status = "aborted" if goto == "abort" else "terminated"
        update: dict[str, Any] = {"status": status, "reason": reason}
        scan = getattr(err, "protect", None)
        if node == "spawn" and isinstance(scan, Surface):  # it failed once the agent was let go: the scan its
            update["protect"] = scan  # cleanup compares against
        if node == "monitor" and isinstance(err, TelemetryLost):
            update["reason"] = f"lost sight of the cell, after 3 reconnects: {err.problem}"
            update["escape"] = escape_record(state, "telemetry", "monitor", update["reason"], source="telemetry")
        return Command(goto=goto, update=update)
    handler.__name__ = f"on_{node}_error"
    return handler


def escape_record(state: SessionState, operation: str, target: str, reason: str, *, source: str,
                  pid: int | None = None, exe: str | None = None, ts: float | None = None,
                  ancestry: list[Any] | None = None) -> Escape:
    from ...policy.models import EscapeEvent

    ev = EscapeEvent(session_id=state["session_id"], operation=operation,  # type: ignore[arg-type]
                     target=target, reason=reason, pid=pid, exe=exe or None, source=source,
                     ts=ts or time.time(), ancestry=[tuple(a) for a in ancestry or []])
    return Escape(**ev.model_dump())


def written_paths(state: SessionState) -> list[str]:
    """The declared paths the agent writes on the host: all of them, but the project in a copy-on-write
    workspace (its writes go to the change set)."""
    policy, cfg = policy_of(state), config_of(state)
    rw = list(policy.rw_paths if policy else [])
    if cfg.workspace == "copy":
        project = os.path.realpath(cfg.project_root)
        return [p for p in rw if not hostfs.within(os.path.realpath(p), project)]
    return rw
