"""The modes (identity and network) a user can run cells in here, judged from the checks, and the
whole report behind ``agentcell doctor``."""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..cell.spec import NETWORK_MODES
from . import cgroupfs, checks
from .checks import Check, Status, user_name
from .namespaces import ProbeResult, check_ns, check_userns, probe_cell_namespaces, probe_userns

IDENTITY_MODES = ("self", "agent", "uid")
NEEDABLE_MODES = IDENTITY_MODES + NETWORK_MODES


@dataclass
class Mode:
    """Whether an identity or network mode can work here for the current user."""

    name: str
    kind: Literal["identity", "network"]
    works: bool
    status: Status
    detail: str
    fix: str = ""


@dataclass
class Report:
    uid: int
    user: str
    root: bool
    checks: list[Check]
    modes: list[Mode]
    default_needs: list[str]

    def mode(self, name: str) -> Mode:
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(name)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def satisfies(self, needs: Iterable[str]) -> bool:
        return all(self.mode(n).works for n in needs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



def evaluate_modes(*, root: bool, userns_ok: bool, userns_fix: str, ns_root: ProbeResult | None,
                   ns_rootless: ProbeResult | None, nft_ok: bool = False) -> list[Mode]:
    modes: list[Mode] = []
    # Identity modes.
    if userns_ok and ns_rootless is not None and ns_rootless.ok:
        detail = "a user namespace maps the invoking uid"
        if root:
            detail += "; as root, --as self means the sudo caller (SUDO_UID) and needs no user namespace"
        modes.append(Mode("self", "identity", True, "ok", detail))
    else:
        why = "unprivileged user namespaces do not work" if not userns_ok else (
            "the cell's namespaces fail inside a user namespace: "
            + (ns_rootless.reason if ns_rootless else "not probed"))
        modes.append(Mode("self", "identity", False, "missing", why,
                          userns_fix or "allow unprivileged user namespaces"))
    for name, what in (("agent", "a persistent agent account"), ("uid", "a numeric non-root uid")):
        if not root:
            modes.append(Mode(name, "identity", False, "missing", f"needs root: runs the cell as {what}",
                              "run agentcell through sudo (or use --as self)"))
        elif ns_root is not None and ns_root.ok:
            modes.append(Mode(name, "identity", True, "ok", f"root: runs the cell as {what}"))
        else:
            reason = ns_root.reason if ns_root else "not probed"
            modes.append(Mode(name, "identity", False, "missing",
                              f"root, but the cell's namespaces fail: {reason}",
                              "see the 'namespaces' check"))
    # Network modes: both need the cell's net namespace (lo brought up by the same probe).
    net = ns_root if root else ns_rootless
    for name, what in (("none", "a new network namespace, no interface up"),
                       ("loopback", "a new network namespace with lo up"),
                       ("proxy", "a new network namespace with lo up, whose only way out is agentcell's proxy "
                                 "(a listener made inside it, served from outside)")):
        if net is not None and net.ok:
            modes.append(Mode(name, "network", True, "ok", what))
        else:
            reason = net.reason if net else "not probed"
            fix = "see the 'namespaces' check" if root else "allow user namespaces, or run as root"
            modes.append(Mode(name, "network", False, "missing", f"{what}: fails ({reason})", fix))
    what = "the host's network, an nftables table on the agent's uid"
    if root and nft_ok:
        modes.append(Mode("host-firewall", "network", True, "ok", what))
    elif not root:
        modes.append(Mode("host-firewall", "network", False, "missing", f"{what}: needs root",
                          "run through sudo with --as, or use --net proxy"))
    else:
        modes.append(Mode("host-firewall", "network", False, "missing", f"{what}: nft does not work here",
                          "see the 'nftables' check"))
    return modes


def default_needs(root: bool) -> list[str]:
    return ["agent", "uid", "none"] if root else ["self", "none"]


def run() -> Report:
    """Probe everything and return the report (forks short-lived children; changes nothing)."""
    euid = os.geteuid()
    root = euid == 0
    lines: list[Check] = [checks.check_kernel(), checks.check_landlock(), *checks.check_seccomp()]
    userns_probe = probe_userns()
    userns = check_userns(userns_probe, root=root)
    lines.append(userns)
    ns_root: ProbeResult | None = None
    if root:
        ns_root = probe_cell_namespaces(rootless=False)
        lines.append(check_ns(ns_root, rootless=False, who="root"))
    ns_rootless = probe_cell_namespaces(rootless=True, as_nobody=root)
    lines.append(check_ns(ns_rootless, rootless=True, who="uid 65534" if root else user_name(euid)))
    lines += cgroupfs.check_cgroups(root=root)
    lines.append(checks.check_audit(root=root))
    lines.append(checks.check_monitor(root=root))
    nft = checks.check_nft(root=root)
    lines.append(nft)
    lines += checks.check_tools()
    lines += checks.check_extras()
    lines += checks.check_harnesses()
    modes = evaluate_modes(root=root, userns_ok=userns.status == "ok", userns_fix=userns.fix,
                           ns_root=ns_root, ns_rootless=ns_rootless, nft_ok=nft.data.get("listed") is True)
    return Report(uid=euid, user=user_name(euid), root=root, checks=lines, modes=modes,
                  default_needs=default_needs(root))
