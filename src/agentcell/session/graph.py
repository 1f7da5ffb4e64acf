"""The session as a LangGraph ``StateGraph``; :func:`build_graph` reads like ARCHITECTURE.md's diagram::

    plan → policy → preflight ─fail→ abort ─────────────────────────┐
                        └ok→ account → firewall → spawn → monitor ⟲ │
                                                     └escape/exit/timeout→ terminate → cleanup → audit → END

Retry rules, declared on the nodes (a node raises; its ``RetryPolicy`` retries; its error handler routes):

* preflight backup: 2 retries (after 1 s, then 3 s), then abort — no backup, no agent;
* account switch: 1 retry, then terminate (which tears down whatever was made);
* firewall: 1 retry, then abort before spawn;
* spawn: 1 retry on a process-level crash (:class:`~.nodes.kit.SpawnCrash`), then abort, keeping the backup;
* telemetry (the monitor losing sight of its cell): 3 reconnects with backoff, then a violation: terminate;
* audit writes: the trail retries each record 3 times itself (``audit.trail.RETRY_DELAYS``); a record that
  still cannot be written terminates the session (every node's error handler routes it so).

``abort`` goes through ``cleanup`` too: a firewall failure leaves an account and ACL grants to undo.
The wall clock ends a session normally: status ``completed``, reason ``timeout``.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import RetryPolicy

from ..audit.trail import AuditWriteError
from ..errors import AgentcellError
from .nodes import account, firewall, monitor, plan, spawn, teardown
from .nodes.kit import SpawnCrash, TelemetryLost, on_error
from .records import Supervisor
from .request import new_session_id as new_session_id  # (where callers found it)
from .state import FINAL, Runtime, SessionState, config_of, start_time, supervisor_alive

Graph = CompiledStateGraph[SessionState, Any, SessionState, SessionState]


def _on(*kinds: type[BaseException]) -> Callable[[Exception], bool]:
    """Retry these failures, never an unwritable audit log (the trail has retried it already)."""
    return lambda e: isinstance(e, kinds) and not isinstance(e, AuditWriteError)


PREFLIGHT_RETRY = RetryPolicy(max_attempts=3, initial_interval=1.0, backoff_factor=3.0, jitter=False,
                              retry_on=_on(AgentcellError, OSError))
ACCOUNT_RETRY = RetryPolicy(max_attempts=2, initial_interval=0.5, jitter=False, retry_on=_on(AgentcellError, OSError))
FIREWALL_RETRY = RetryPolicy(max_attempts=2, initial_interval=0.5, jitter=False, retry_on=_on(AgentcellError, OSError))
SPAWN_RETRY = RetryPolicy(max_attempts=2, initial_interval=0.5, jitter=False, retry_on=_on(SpawnCrash))
TELEMETRY_RETRY = RetryPolicy(max_attempts=4, initial_interval=0.5, backoff_factor=2.0, jitter=False,
                              retry_on=_on(TelemetryLost))


def _after_monitor(state: SessionState) -> str:
    return "monitor" if state.get("status") == "running" else "terminate"


def build_graph(runtime: Runtime | None = None, *, checkpointer: Any = None) -> Graph:
    rt = runtime or Runtime()
    g = StateGraph(SessionState)

    def add(name: str, node: Callable[[Runtime, SessionState], dict[str, Any]], **how: Any) -> None:
        g.add_node(name, partial(node, rt), **how)  # (a node's name is the graph's: checkpoints name it)

    add("plan", plan.plan, error_handler=on_error("plan", "abort"))
    add("policy", plan.policy, error_handler=on_error("policy", "abort"))
    add("preflight", plan.preflight, retry_policy=PREFLIGHT_RETRY, error_handler=on_error("preflight", "abort"))
    add("abort", plan.abort)
    add("account", account.account, retry_policy=ACCOUNT_RETRY, error_handler=on_error("account", "terminate"))
    add("firewall", firewall.firewall, retry_policy=FIREWALL_RETRY, error_handler=on_error("firewall", "abort"))
    add("spawn", spawn.spawn, retry_policy=SPAWN_RETRY, error_handler=on_error("spawn", "abort"))
    add("monitor", monitor.monitor, retry_policy=TELEMETRY_RETRY, error_handler=on_error("monitor", "terminate"))
    add("terminate", teardown.terminate)
    add("cleanup", teardown.cleanup)
    add("audit", teardown.audit)

    g.add_edge(START, "plan")
    g.add_edge("plan", "policy")
    g.add_edge("policy", "preflight")
    g.add_edge("preflight", "account")
    g.add_edge("abort", "cleanup")
    g.add_edge("account", "firewall")
    g.add_edge("firewall", "spawn")
    g.add_edge("spawn", "monitor")
    g.add_conditional_edges("monitor", _after_monitor, ["monitor", "terminate"])
    g.add_edge("terminate", "cleanup")
    g.add_edge("cleanup", "audit")
    g.add_edge("audit", END)
    return g.compile(checkpointer=checkpointer)


# ---- running, listing and recovering sessions ---------------------------------------------------

def open_graph(runtime: Runtime | None = None) -> tuple[Graph, Any]:
    """The graph over the checkpoint database, and the database's connection."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from .state import Serde, connect, sessions_dir

    try:
        conn = connect()
    except OSError as e:
        raise AgentcellError("state", f"cannot open {sessions_dir()}: {e.strerror}",
                             "run through sudo (sessions are root's), or set AGENTCELL_STATE_DIR") from None
    return build_graph(runtime, checkpointer=SqliteSaver(conn, serde=Serde())), conn


def _config(session_id: str, limit_s: int = 0) -> RunnableConfig:
    # Every monitor tick is a step: allow the wall clock's worth of them, and the fixed nodes.
    return {"configurable": {"thread_id": session_id}, "recursion_limit": 2 * limit_s + 100}


def run(graph: Graph, state: SessionState) -> SessionState:
    """Run a new session to its end; the final state."""
    sid = state["session_id"]
    initial: SessionState = {**state, "supervisor": Supervisor(os.getpid(), start_time(os.getpid()))}
    limit = int(config_of(state).wall_clock_limit_s or 3600)
    out: SessionState = graph.invoke(initial, _config(sid, limit), durability="sync")  # type: ignore[assignment]
    return out


def session_ids(conn: Any) -> list[str]:
    try:
        rows = conn.execute("SELECT DISTINCT thread_id FROM checkpoints").fetchall()
    except Exception:  # noqa: BLE001 - no table yet: no sessions
        return []
    return sorted(str(r[0]) for r in rows)


def load(graph: Graph, session_id: str) -> SessionState | None:
    snap = graph.get_state(_config(session_id))
    values: SessionState = snap.values  # type: ignore[assignment]
    return values or None


def unfinished(state: SessionState) -> bool:
    """A session whose teardown did not run to its end, and whose supervisor is gone."""
    return not state.get("finished") and not supervisor_alive(state)


def recover(graph: Graph, session_id: str) -> SessionState:
    """Finish a session whose supervisor died: mark it terminated as if its monitor had decided so, and let
    the graph run terminate → cleanup → audit from the checkpointed state."""
    state = load(graph, session_id)
    if state is None:
        raise AgentcellError("ID", f"no session {session_id}", "see 'agentcell session list'")
    from .state import check_recorded

    check_recorded(state, session_id)
    cfg = _config(session_id)
    update: dict[str, Any] = {"supervisor": Supervisor(os.getpid(), start_time(os.getpid())), "recovered": True}
    if state.get("status") not in FINAL:
        update.update(status="terminated", reason="the supervisor died; recovered by 'agentcell session recover'")
    graph.update_state(cfg, update, as_node="monitor")
    out: SessionState = graph.invoke(None, cfg, durability="sync")  # type: ignore[assignment]
    return out
