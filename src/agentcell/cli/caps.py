"""The operator's caps on what a session plan may ask for, as options: ``agentcell fleet run`` and
``agentcell k8s render`` both take them (:class:`agentcell.fleet.plan.Caps` holds the plans to them)."""
from __future__ import annotations

from typing import Any

TYPE_CHECKING = False  # see cell/spec.py
if TYPE_CHECKING:
    from ..fleet.plan import Caps

def cap_args(sp: Any) -> None:
    """The options, on ``sp`` (a parser or subparser)."""
    for flag, metavar, help_ in (
            ("--max-memory", "SIZE", "the most memory a plan may ask for (default: each node's most generous "
             "default ceiling, that of --risk low)"),
            ("--max-cpu", "PERCENT", "the most CPU a plan may ask for, in percent of one CPU (default: likewise)"),
            ("--max-pids", "N", "the most tasks a plan may ask for (default: likewise)"),
            ("--max-wall-clock", "S", "the longest wall clock a plan may ask for (default 86400)")):
        sp.add_argument(flag, metavar=metavar, help=help_)
    sp.add_argument("--trust-plan-network", action="store_true", help="let plans set allow_ranges, resolver and "
                    "network host-firewall, and clone from non-public addresses: ways to other nodes, the Ray head, "
                    "the cloud's metadata, and past the name allow-list. Only when the plans' authors may reach those")
    sp.add_argument("--allow-api-base", action="append", default=[], metavar="URL", help="an api_base a plan may "
                    "give (repeatable): the harness's key goes to its host")
    sp.add_argument("--allow-keep-env", action="append", default=[], metavar="NAME", help="a variable of the "
                    "nodes' keys a plan may pass into its cell with keep_env (repeatable)")


def caps(ns: Any, keys: bool) -> Caps:
    """The caps the options of :func:`cap_args` give; ``keys``: the nodes hold harness keys."""
    from ..fleet.plan import Caps

    return Caps.from_flags(memory=ns.max_memory, cpu=ns.max_cpu, pids=ns.max_pids, wall_clock=ns.max_wall_clock,
                           plan_network=ns.trust_plan_network, api_bases=ns.allow_api_base,
                           keep_env=ns.allow_keep_env, keys=keys)
