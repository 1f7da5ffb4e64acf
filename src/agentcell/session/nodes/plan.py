"""plan → policy → preflight, and abort: the request made a plan, the plan a policy, the backup taken
before anything exists."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..planning import compile_policy, ids, make_plan, session_human
from ..records import plain, record
from ..state import Runtime, SessionState, config_of, plan_of, policy_of
from .kit import audit, audit_quietly, crash, inject, seal_now, written_paths

if TYPE_CHECKING:
    from ...policy.models import SandboxPolicy


def plan(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The request, from the configuration and the harness profile (pure). ``session start`` planned
    already, to refuse bad input before anything exists: it hands its plan in."""
    cfg, given = config_of(state), plan_of(state)
    if given is not None:
        plan, marks = given, dict(state.get("config_marks") or {})
    else:
        plan, marks = make_plan(cfg.as_dict(), state["session_id"], plain(state.get("launch")))
    crash(rt, "plan")
    audit(rt, state, "plan", "session.plan", harness=plan.harness, declared_paths=plan.declared_paths,
          network=plan.network, allow_presets=plan.allow_presets, allow_domains=plan.allow_domains,
          deny_domains=plan.deny_domains, wall_clock_limit_s=plan.wall_clock_limit_s, identity=plan.identity,
          sources=cfg.sources)
    seal_now(state)
    # Who gets what the agent makes is decided now, by whoever starts the session: not by whoever
    # later runs 'session recover' (their SUDO_UID is not the session's human).
    return {"plan": plan, "status": "running", "reason": "", "cell_id": f"agentcell-{plan.session_id}",
            "config_marks": marks, "root_ids": ids([cfg.project_root, *plan.declared_paths]),
            "human": session_human(cfg.project_root) if plan.identity.isdigit() else None}


def compile_state(rt: Runtime, state: SessionState, identity: str | None = None) -> SandboxPolicy:
    from ...policy.models import SandboxPolicy  # noqa: F811 - (the class, not only its name)

    plan = plan_of(state)
    assert plan is not None  # (the plan node ran)
    return record(SandboxPolicy, compile_policy(plan, rt.environ, config_of(state).project_root, identity))


def policy(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The policy the plan compiles to; the one ``session start`` compiled, when it hands one in."""
    policy, plan, cfg = policy_of(state) or compile_state(rt, state), plan_of(state), config_of(state)
    crash(rt, "policy")
    audit(rt, state, "policy", "session.policy", os_user=policy.os_user, write_paths=policy.write_paths,
          read_paths=policy.read_paths, env_allowlist=policy.env_allowlist,
          firewall_rule=policy.firewall_rule, risk=plan.risk if plan else None, limits=policy.limits.model_dump(),
          limits_from=cfg.sources.get("limits"), home=policy.home_dir or "tmpfs",
          ceilings="on" if cfg.ceilings else "off")
    return {"policy": policy}


def preflight(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The backup: no backup, no agent."""
    from ...snapshot.store import SnapshotError, Store

    inject(rt, "preflight", SnapshotError)
    store = Store(config_of(state).backup_dir)
    paths = written_paths(state)
    # A copy-on-write workspace is never written: its change set is on disk from the start, so
    # the project needs no backup (the other declared paths still get theirs).
    backup = store.take(paths) if paths else None
    crash(rt, "preflight")
    audit(rt, state, "preflight", "session.preflight", backup_id=backup, store=store.path, paths=paths,
          workspace=config_of(state).workspace)
    return {"backup_id": backup}


def abort(rt: Runtime, state: SessionState) -> dict[str, Any]:
    reason = state.get("reason") or "aborted"
    if state.get("backup_id"):
        reason += f"; the backup {state['backup_id']} is kept"
    crash(rt, "abort")
    update: dict[str, Any] = {"status": "aborted", "reason": reason}
    update.update(audit_quietly(rt, state, "abort", "session.abort", reason=update["reason"],
                                backup_id=state.get("backup_id")))
    return update
