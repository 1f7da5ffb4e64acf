"""firewall: the host's egress rule, made before the agent exists."""
from __future__ import annotations

from typing import Any

from ..state import Runtime, SessionState, policy_of
from .kit import InjectedFault, audit, crash, inject


def firewall(rt: Runtime, state: SessionState) -> dict[str, Any]:
    """The egress rule before the agent exists. Namespaced modes need none on the host: the cell's
    own network namespace (none, loopback) or its proxy (made with the cell) is the rule. For
    host-firewall the table is made here, so that a host that cannot have it fails (retried once,
    then aborted) before anything runs; spawn hands it (and its log's socket) over to the cell's
    host, whose Supervised adopts it and removes it with the cell."""
    inject(rt, "firewall", InjectedFault)
    policy = policy_of(state)
    assert policy is not None  # (the policy node ran)
    table = None
    if policy.network == "host-firewall":
        from ...network import firewall, nflog

        rules = [r for e in policy.egress if e.startswith("egress:") for r in firewall.parse_egress(e[7:])]
        log = nflog.open_group()
        try:
            fw = firewall.HostFirewall.create(state["cell_id"], policy.identity.uid, rules,
                                              "loopback" in policy.egress, log.group)
        except BaseException:
            log.close()
            raise
        rt.firewalls[state["session_id"]] = (fw, log)
        table = fw.table
    crash(rt, "firewall")
    audit(rt, state, "firewall", "session.firewall", network=policy.network, rule=policy.firewall_rule,
          table=table, egress=list(policy.egress))
    return {"firewall_table": table}
