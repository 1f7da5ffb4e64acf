"""terminate → cleanup → audit: the cell ended, everything made for the session undone, the last record.
They never raise, and work from the checkpointed state alone when the supervisor's handles are gone
(``session recover``)."""
from __future__ import annotations

import os
import time
from typing import Any

from ... import caches
from ...cell import cgroups
from ...errors import AgentcellError
from .. import envfiles
from ..planning import session_human
from ..records import Account, Grant, Result, Surface, of, plain
from ..state import FINAL, MAX_EVENTS, Runtime, SessionState, config_of, policy_of
from .account import Changes, carry, ephemeral_left, persistent, revoke
from .kit import audit_quietly, crash, line, witnessed, written_paths


def terminate(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """End the cell (freeze, then kill) whatever brought us here, and collect its result."""
    sid = state["session_id"]
    cell = rt.cells.pop(sid, None)
    update: dict[str, Any] = {}
    if state.get("status") not in FINAL:
        update["status"] = "terminated"
    if rt.status_line:
        import sys

        sys.stderr.write("\r\033[K")
    result = of(Result, state.get("result"))
    if cell is not None:
        if cell.poll() is None:
            cell.terminate(state.get("reason") or "terminated")
        result = Result.of(cell.wait())
    elif state.get("cell_id"):
        from ...host import owner

        owner.wait_ended(state["cell_id"])  # a cell host still starting or ending the cell finishes first
        cgroups.kill_by_name(state["cell_id"])
    if result is not None:
        update["result"] = result.without_events()  # the state's events hold them
        update["events"] = [dict(e) for e in result.events or ()][:MAX_EVENTS]
    crash(rt, "terminate")
    update.update(audit_quietly(rt, state, "terminate", "session.terminate",
                                status=update.get("status", state.get("status")),
                                reason=state.get("reason"),
                                exit_status=result.exit_status if result else None,
                                events=len(update.get("events", []))))
    return update


def cleanup(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """Undo everything made for the session: firewall table, ACL grants, the per-session account.
    Works from the state alone; each problem is reported, none stops the rest."""
    from ...accounts import acl, ephemeral
    from ...accounts.commands import Commands

    cmds = Commands()
    sid = state["session_id"]
    problems: list[str] = []
    fw = rt.firewalls.pop(sid, None)
    try:
        if fw is not None:
            fw[0].remove()
            fw[1].close()
        elif table := state.get("firewall_table") or _table_left(state):
            from ...network import firewall

            firewall.HostFirewall(table, os.path.join(firewall.RECORDS, table)).remove()
    except OSError as e:
        problems.append(f"firewall: {e}")
    account = of(Account, state.get("account"))
    warnings = _quarantine(state, account)
    cfg, policy = config_of(state), policy_of(state)
    agent, rw = cfg.agent, list(policy.rw_paths if policy else [])
    recorded, human = state.get("grants"), state.get("human")
    grants = None if recorded is None else [g for g in (of(Grant, r) for r in recorded) if g is not None]
    if account is None and os.geteuid() == 0 and policy:  # the account node did not finish
        try:
            if agent:
                account, human, rw = persistent(agent, rw)  # never its own shares
            else:
                account = ephemeral_left(sid)
        except (OSError, AgentcellError) as e:
            problems.append(f"account: {line(e)}")
    if human is None and account is not None and account.kind == "ephemeral":
        try:  # recorded at plan time; a session that predates that: found again now
            human = session_human(cfg.project_root)
        except (OSError, AgentcellError) as e:
            problems.append(f"the agent's files are left to root: {line(e)}")
    cache = state.get("cache_dir") or _cache_left(state)
    if cache and state.get("escape"):  # nothing an agent ended at an escape wrote is built with next time
        try:
            caches.discard(cache)
            warnings.append("the project's toolchain cache was emptied: the session ended at an escape, and "
                            "what it wrote there would be the next session's build tools")
            cache = None
        except (OSError, AgentcellError) as e:
            problems.append(f"toolchain cache: not emptied after the escape ({line(e)}): "
                            "'agentcell cache clear --project' removes it")
    if account is not None and account.kind in ("ephemeral", "agent"):
        if grants is None:  # crashed while granting: revoke wherever it may have granted
            grants = [Grant(p, ()) for p in rw]
        changes: Changes = rt.granted.pop(sid, {})  # (the grant's, which the revoke's follow)
        give_to = (human[0], human[1]) if human else None
        # A session's own account, vouched for and with none of its processes left: what it made in the
        # granted paths is given back in the revoke's walk (else by the delete's, below).
        given = _given_in_revoke(cmds, account, sid, give_to or (0, 0))
        others: list[str] = []  # what another user put in a directory the agent opened to others
        revoked = revoke(cmds, account, grants, changes, give_to=given, others=others)
        problems += revoked
        carry(state, changes, human)
        paths = [g.path for g in grants]
        if cfg.workspace == "copy":
            try:  # the change set becomes the project owner's, as the agent's work in the project would
                from ... import workspace

                problems += workspace.give_back(sid, account.uid, account.gid)
            except (OSError, AgentcellError) as e:
                problems.append(f"workspace: {line(e)}")
        if account.kind == "ephemeral" and cache:
            try:  # what it made in the cache goes back to root before its number is freed
                problems += acl.reassign(cmds, account.uid, account.gid, 0, 0, cache)
            except (OSError, AgentcellError) as e:  # (the account is deleted all the same)
                problems.append(f"toolchain cache: {line(e)}")
        try:
            if account.kind == "ephemeral":
                ephemeral.delete(ephemeral.Account(account.name, account.uid, account.gid, sid), cmds,
                                 paths=paths, give_to=give_to or (0, 0), given=bool(given) and not revoked)
            else:
                from ...accounts.accounts import defuse_home

                home = policy.home_dir if policy else None
                if home:
                    warnings += defuse_home(home, account.uid, account.gid)
                if give_to is not None:
                    for p in paths:
                        problems += acl.reassign(cmds, account.uid, account.gid, give_to[0], give_to[1],
                                                 p, others=others)
        except (OSError, AgentcellError) as e:
            problems.append(line(e))
        problems += dict.fromkeys(others)  # (each once: a persistent agent's paths are walked twice)
        from ...accounts.accounts import group_holders

        try:  # (a persistent agent keeps its group: such a process would have the next session's grant too)
            problems += group_holders(account.uid, account.gid)
        except OSError as e:
            problems.append(f"processes holding the agent's group: not looked for ({e.strerror})")
    if state.get("cell_id"):
        from ...host import owner

        problems += cgroups.remove_by_name(state["cell_id"])
        owner.forget(state["cell_id"])
    from ...harness import seed

    problems += seed.remove(sid)
    warnings += state.get("seed_notes") or []
    crash(rt, "cleanup")
    warnings += [f"{f} was {'created' if was is None else 'changed'} during the session: the next session "
                 "reads it; review it first" for f, was in (state.get("config_marks") or {}).items()
                 if envfiles.fingerprint(f) != was]
    update: dict[str, Any] = {"problems": problems, "warnings": list(dict.fromkeys(warnings))}
    update.update(audit_quietly(rt, state, "cleanup", "session.cleanup", problems=problems,
                                account=account.name if account else None))
    return update


def _given_in_revoke(cmds: Any, account: Account, sid: str, give_to: tuple[int, int]) -> tuple[int, int] | None:
    """``give_to`` if the revoke may give the account's files back as it walks (a per-session account,
    this session's, none of whose processes is left), else None (the delete walks for them, and says why
    it cannot)."""
    from ...accounts import ephemeral
    from ...accounts.accounts import kill_all

    if account.kind != "ephemeral":
        return None
    try:
        ephemeral.vouch(ephemeral.Account(account.name, account.uid, account.gid, sid))
    except AgentcellError:
        return None
    return None if kill_all(cmds, account.uid, account.gid) else give_to


def _quarantine(state: SessionState, account: Account | None) -> list[str]:
    """Move aside what the agent created on the control surface (the run protocol's step,
    :func:`agentcell.protect.check.compare`, from the scan spawn checkpointed); say what it changed there.
    Before the account is deleted: what moves must be the account's."""
    from ...protect.check import compare, lines
    from .spawn import kept_surface

    try:
        guard, policy = of(Surface, state.get("protect")), policy_of(state)
        if guard is None:  # a supervisor killed after the agent went, before spawn's checkpoint: the scan it kept
            guard = kept_surface(state["session_id"])
    except Exception as e:  # noqa: BLE001 - damaged: said, and teardown goes on
        return [f"the protected paths could not be checked (the scan taken before the agent went is damaged: "
                f"{line(e)}): review repositories and agent config in the declared paths before you use them"]
    if guard is None:
        return []
    human = state.get("human")
    give_to = (human[0], human[1]) if human else None
    try:  # whatever the agent left for the scan to read, teardown goes on
        found = compare(
            {k: tuple(v) for k, v in guard.before.items()}, guard.truncated, guard.since_ns,
            state.get("cell_id", ""), tuple(written_paths(state)), policy.allow_write if policy else (),
            (*policy.ro_paths, *policy.masked_paths) if policy else (),
            _owner(account), give_to, guard.meanings, owner_only=bool(state.get("recovered")))
        out = lines(found, "the agent", lift_hint=False)
        out += _set_aside_config(state, guard, account, give_to)
    except Exception as e:  # noqa: BLE001 - a teardown that stops here leaves the account behind
        return [f"the protected paths could not be checked ({type(e).__name__}: {line(e)}): review "
                "repositories and agent config in the declared paths before you use them"]
    if found["scan_truncated"]:
        out.append("the declared paths hold more than the protected-path scan covers: review repositories and "
                   "agent config in them before you use them")
    return out


def audit(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The session's last record: how it ended, and what it tried beyond its policy."""
    escape, result = state.get("escape"), of(Result, state.get("result"))
    crash(rt, "audit")
    from .spawn import forget_surface

    forget_surface(state["session_id"])  # (cleanup, checkpointed, compared with it)
    update: dict[str, Any] = {"finished": True, "ended_at": time.time()}
    update.update(audit_quietly(rt, state, "audit", "session.end", status=state.get("status"),
                                reason=state.get("reason"), escape=plain(escape),
                                backup_id=state.get("backup_id"),
                                exit_status=result.exit_status if result else None,
                                problems=state.get("problems", [])))
    if "audit_error" not in update:  # (the end is recorded: a sealed trail is sealed up to it)
        update.update(witnessed(state))
    return update


def _table_left(state: SessionState) -> str | None:
    """The host-firewall table of a session whose supervisor was killed between making it and checkpointing
    it (the lifecycle model found it: model/lifecycle.pml, REVERT_TABLE_BY_STATE_ONLY): it is named after
    the cell, and its record was written before it was made."""
    policy = policy_of(state)
    if policy is None or policy.network != "host-firewall" or not state.get("cell_id"):
        return None
    from ...network import firewall

    table = firewall.table_name(state["cell_id"])
    return table if os.path.lexists(os.path.join(firewall.RECORDS, table)) else None


def _cache_left(state: SessionState) -> str | None:
    """The cache a session that crashed before its spawn returned may have handed to its account."""
    cfg = config_of(state)
    if not cfg.cache or not cfg.project_root:
        return None
    tree = caches.tree_of(cfg.project_root, cfg.agent)
    return tree if os.path.isdir(tree) and not os.path.islink(tree) else None


def _set_aside_config(state: SessionState, guard: Surface, account: Account | None,
                      give_to: tuple[int, int] | None) -> list[str]:
    """Env files and session configuration the agent created in the declared paths: the next session and
    the human's tools load them (a ``.env`` setting ``CODEX_HOME=./.codex`` runs the project's config the
    next time the human starts Codex; ``WALL_CLOCK_LIMIT_S``), so they are the human's to accept: moved
    into the quarantine box, as created git hooks and harness config are. The ones that existed were
    hidden (env files) or read-only (``agentcell.toml``) in the cell."""
    from ...protect import check, surface

    policy = policy_of(state)
    rw = policy.rw_paths if policy else ()
    before = set(guard.env_files or ())
    now, _ = envfiles.dotenv_files(list(rw))
    # (an example file documents the variables: no tool loads it)
    created = [f for f in now if f not in before and not f.endswith((".example", ".sample", ".template", ".dist"))
               and f"/{surface.QUARANTINE_DIR}" not in f]  # (nor what was just moved aside)
    created += [f for f, was in (state.get("config_marks") or {}).items()
                if was is None and os.path.basename(f) == "agentcell.toml" and os.path.lexists(f)]
    if not created:
        return []
    created = sorted(set(created))
    moved: list[tuple[str, str]]
    if state.get("recovered") and _owner(account) is None:  # (the human may have made them since: said, not moved)
        moved, failed = [], created
    else:
        moved, failed = check.set_aside(created, state.get("cell_id", ""), rw, owner_uid=_owner(account),
                                        since_ns=guard.since_ns, give_to=give_to)
    out = [f"the agent created {old}, which the next session or your tools load (an env file, the session's "
           f"configuration); it was moved to {new}: move it back if you accept it" for old, new in moved]
    out += [f"the agent created {f}, which the next session or your tools load, and it could not be moved aside: "
            "review it before you use the project" for f in failed]
    gone = {old for old, _new in moved} | set(failed)
    out += [f"{f} is new since the session began but not the agent's account's, so it was left where it is: the "
            "next session or your tools load it; review it before you use the project" for f in created
            if f not in gone]
    return out


def _owner(account: Account | None) -> int | None:
    """Whose files the cell's were: the agent's account (none when the user ran it as themself)."""
    return account.uid if account is not None and account.kind != "self" else None
