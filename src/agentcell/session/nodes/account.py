"""account: the least-privilege account the agent runs as (per session, a persistent agent's, or, without
root, the user's own) and the declared paths shared with it by ACL; what cleanup needs to undo them."""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from ...errors import AgentcellError
from ..planning import session_human
from ..records import Account, Grant
from ..state import Runtime, SessionState, config_of, policy_of
from .kit import InjectedFault, audit, crash, inject, line, written_paths
from .plan import compile_state


def account(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The least-privilege account the agent runs as, and the declared paths shared with it (ACLs)."""
    from ...accounts.commands import Commands

    inject(rt, "account", InjectedFault)
    cmds = Commands()
    cfg, policy = config_of(state), policy_of(state)
    assert policy is not None  # (the policy node ran)
    update: dict[str, Any] = {}
    if os.geteuid() != 0:
        account = Account("self", policy.os_user, os.geteuid(), os.getegid(), "")
        grants: list[Grant] = []
    elif cfg.agent:
        account, human, wanted = persistent(cfg.agent, written_paths(state))
        update["human"] = human
        changes: Changes = {}
        grants = grant(cmds, account, wanted, changes)
        rt.granted[state["session_id"]] = changes
    else:
        from ...accounts import ephemeral

        made = ephemeral.create_ephemeral(state["session_id"], cmds)
        account = Account("ephemeral", made.name, made.uid, made.gid, made.name)
        grants = []
        try:
            update["human"] = state.get("human") or session_human(cfg.project_root)
            changes = {}
            grants = grant(cmds, account, written_paths(state), changes)
            rt.granted[state["session_id"]] = changes
            update["policy"] = compile_state(rt, state, identity=str(made.uid))
        except BaseException:  # undone here, so that the retry starts clean
            revoke(cmds, account, grants)
            ephemeral.delete(made, cmds)
            raise
    update.update(account=account, grants=grants)
    crash(rt, "account")
    audit(rt, state, "account", "session.account", account=asdict(account),
          grants=[g.path for g in grants])
    return update


def persistent(name: str, paths: list[str]) -> tuple[Account, list[int] | None, list[str]]:
    import pwd

    from ...accounts.registry import open_registry

    with open_registry() as reg:
        rec = reg.get(name)
    if rec.state != "ready":
        raise AgentcellError("AGENT_OS_USER", f"agent '{name}' is {rec.state}, not ready",
                             f"'agentcell agent delete {name} --yes' removes what was made")
    account = Account("agent", name, rec.uid, rec.gid, rec.group)
    try:
        pw = pwd.getpwnam(rec.human)
        human: list[int] | None = [pw.pw_uid, pw.pw_gid]
    except KeyError:
        human = None
    # A path the agent already shares read-write keeps its share: granting and revoking it here would
    # take that share away at the end of the session.
    wanted = [p for p in paths if not any(s.mode == "rw" and (p == s.source or p.startswith(s.source + "/"))
                                          for s in rec.shares)]
    return account, human, wanted


# Per granted path, the files whose ACL the session wrote: (path below it, stat before, stat after).
Changes = dict[str, list[tuple[str, os.stat_result, os.stat_result]]]


def grant(cmds: Any, account: Account, paths: list[str], changes: Changes | None = None) -> list[Grant]:
    from ...accounts import acl

    grants: list[Grant] = []
    try:
        for p in paths:
            prior: list[str] = []  # (recorded as the walk goes: a grant cut short is revoked too)
            try:
                acl.grant(cmds, account.group, account.gid, p, "rw", prior=prior,
                          changed=None if changes is None else _collect(changes, p))
            finally:
                grants.append(Grant(p, tuple(prior)))
    except BaseException:
        revoke(cmds, account, grants)
        raise
    return grants


def revoke(cmds: Any, account: Account, grants: list[Grant], changes: Changes | None = None,
           give_to: tuple[int, int] | None = None, others: list[str] | None = None) -> list[str]:
    """Remove the session's ACL entries from each granted path (and with ``give_to``, give what the
    account owns there to them, in the same walk: :func:`agentcell.accounts.acl.revoke`); what could not
    be removed or given. ``others``: what other users put in the agent's directories (acl.revoke's)."""
    from ...accounts import acl

    problems: list[str] = []
    for g in grants:
        try:
            problems += acl.revoke(cmds, account.uid, account.gid, g.path, list(g.prior),
                                   changed=None if changes is None else _collect(changes, g.path), give_to=give_to,
                                   others=others)
        except (OSError, AgentcellError) as e:
            problems.append(f"revoke {g.path}: {line(e)}")
    return problems


def _collect(changes: Changes, path: str) -> Any:
    kept = changes.setdefault(path, [])
    return lambda rel, before, after: kept.append((rel, before, after))


def carry(state: SessionState, changes: Changes, human: list[int] | None) -> None:
    """Our ACL writes moved the ctime of every file the session shares: the backup store keeps what it
    knows of those whose content cannot have changed (:meth:`agentcell.snapshot.store.Store.carry`), so
    that the next session's backup reads only what changed. ``changes``: the grant's, then the revoke's,
    in that order (one rewrite of the store's cache, at cleanup; a cleanup in another process, ``session
    recover``, has no grant's and carries nothing). Best effort: a file not carried is read again."""
    if not changes or not human:
        return
    from ...snapshot.store import Store

    store = Store(config_of(state).backup_dir)
    for path, changed in changes.items():
        try:
            store.carry(path, changed, {0, int(human[0])})
        except (OSError, AgentcellError, ValueError, TypeError):  # (a cache we did not write: not carried)
            continue


def ephemeral_left(session_id: str) -> Account | None:
    from ...accounts import ephemeral

    for a in ephemeral.leftovers():
        if a.session_id == session_id:
            return Account("ephemeral", a.name, a.uid, a.gid, a.name)
    return None
