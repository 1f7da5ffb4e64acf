"""The egress part of a cell's spec, from CLI flags or plan fields alike: checked, as rule text.

``names`` maps each setting to what the user typed it as (``--allow-domain`` on the command line,
``allow_domains`` in a plan), so every error names the field and the fix in the user's own terms.
"""
from __future__ import annotations

from ..errors import PolicyError

FLAGS = {"network": "--net", "allow_domains": "--allow-domain", "deny_domains": "--deny-domain",
         "allow_presets": "--allow-preset", "allow_ranges": "--allow-range", "resolver": "--resolver",
         "allow_egress": "--allow-egress", "allow_loopback": "--allow-loopback"}
PLAN = {k: k for k in FLAGS}


def egress(network: str, *, allow_domains: list[str], deny_domains: list[str], allow_presets: list[str],
           allow_ranges: list[str], resolver: str | None, allow_egress: list[str], allow_loopback: bool,
           names: dict[str, str]) -> tuple[str, ...]:
    domain_rules = allow_domains or deny_domains or allow_presets or allow_ranges or resolver
    net = names["network"]
    if network == "host-firewall" or allow_egress or allow_loopback:
        if network != "host-firewall":
            raise PolicyError(net, f"{names['allow_egress']} and {names['allow_loopback']} apply to the host "
                              "firewall", f"set {net} host-firewall")
        if domain_rules:
            raise PolicyError(net, "the host firewall sees addresses, not names",
                              f"use {names['allow_egress']}, or {net} proxy for domains")
        from . import firewall

        for text in allow_egress:
            try:
                firewall.parse_egress(text)
            except PolicyError as e:
                raise PolicyError(names["allow_egress"], e.problem, e.fix) from None
        return (*(f"egress:{t}" for t in allow_egress), *(["loopback"] if allow_loopback else []))
    if network != "proxy":
        if domain_rules:
            raise PolicyError(net, f"{names['allow_domains']}, {names['deny_domains']}, {names['allow_presets']}, "
                              f"{names['allow_ranges']} and {names['resolver']} apply to the proxy",
                              f"set {net} proxy")
        return ()
    from . import presets, rules

    by_flag = {FLAGS[k]: names[k] for k in FLAGS}
    try:
        return rules.compile_rules([*presets.expand(allow_presets), *allow_domains], deny_domains, allow_ranges,
                                   resolver)
    except PolicyError as e:
        raise PolicyError(by_flag.get(e.field, e.field), e.problem, e.fix) from None
