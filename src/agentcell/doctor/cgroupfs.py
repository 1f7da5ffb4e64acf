"""The cgroup checks: the layout /proc/self/mountinfo shows, the controllers a cell's ceilings need,
delegation to an unprivileged user, cgroup.kill and cgroup.freeze, and how fast a cell joins its group."""
from __future__ import annotations

import contextlib
import os
import platform
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .checks import Check, kernel_tuple, read_text

V1_CONTROLLERS = frozenset({
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio",
    "perf_event", "hugetlb", "pids", "rdma", "misc",
})
CELL_CONTROLLERS = ("memory", "cpu", "pids", "freezer")


@dataclass
class CgroupMounts:
    """What /proc/self/mountinfo says about cgroups (pure data, no file reads)."""

    layout: Literal["v2", "hybrid", "v1", "none"]
    unified: str | None  # the cgroup2 mount point, if any
    v1: dict[str, str]  # controller -> its v1 hierarchy's mount point
    favoured: list[str] = field(default_factory=list)  # cgroup mounts with favordynmods in their super options


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def parse_cgroup_mounts(mountinfo: str) -> CgroupMounts:
    """Classify the cgroup layout from mountinfo text: v2-only, hybrid (v1 + cgroup2 beside), or v1."""
    unified: str | None = None
    v1: dict[str, str] = {}
    favoured: list[str] = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields = pre.split()
        tail = post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, mountpoint = tail[0], _unescape(fields[4])
        if fstype in ("cgroup", "cgroup2") and "favordynmods" in tail[2].split(","):
            favoured.append(mountpoint)
        if fstype == "cgroup2":
            # Prefer the canonical places if several cgroup2 mounts are visible.
            if unified is None or mountpoint in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                unified = mountpoint
        elif fstype == "cgroup":
            for opt in tail[2].split(","):
                if opt in V1_CONTROLLERS:
                    v1.setdefault(opt, mountpoint)
    if v1:
        layout: Literal["v2", "hybrid", "v1", "none"] = "hybrid" if unified else "v1"
    else:
        layout = "v2" if unified else "none"
    return CgroupMounts(layout, unified, v1, favoured)


def _own_unified_cgroup(unified: str) -> str:
    for line in (read_text("/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            return os.path.join(unified, line[3:].lstrip("/"))
    return unified


def check_cgroups(mountinfo: str | None = None, *, root: bool) -> list[Check]:
    if mountinfo is None:
        mountinfo = read_text("/proc/self/mountinfo") or ""
    cg = parse_cgroup_mounts(mountinfo)
    v2_controllers: list[str] = []
    if cg.unified:
        v2_controllers = (read_text(os.path.join(cg.unified, "cgroup.controllers")) or "").split()
    available = {c: ("v1" if c in cg.v1 else "v2" if c in v2_controllers else None) for c in CELL_CONTROLLERS}
    data: dict[str, Any] = {"layout": cg.layout, "unified": cg.unified, "v1": cg.v1,
                            "v2_controllers": v2_controllers, "cell_controllers": available}
    checks: list[Check] = []
    if cg.layout == "none":
        checks.append(Check("cgroups", "missing", "no cgroup filesystem mounted",
                            "mount cgroup2 at /sys/fs/cgroup (mount -t cgroup2 none /sys/fs/cgroup)", data))
        return checks
    where = {"v2": f"cgroup2 at {cg.unified}", "v1": "v1 only",
             "hybrid": f"v1 controllers + cgroup2 at {cg.unified}"}[cg.layout]
    have = [f"{c}({v})" for c, v in available.items() if v]
    lacking = [c for c, v in available.items() if not v]
    # v2 has no freezer controller: freezing is cgroup.freeze (checked below).
    if cg.layout == "v2" and "freezer" in lacking:
        lacking.remove("freezer")
    detail = f"{cg.layout}: {where}; " + (", ".join(have) if have else "no cell controllers")
    if lacking:
        checks.append(Check("cgroups", "warn", detail + "; lacks " + ", ".join(lacking),
                            "enable the controllers (v2: add them to the parent's cgroup.subtree_control; "
                            "v1: mount their hierarchies) — cell ceilings need memory, cpu, pids", data))
    else:
        checks.append(Check("cgroups", "ok", detail, data=data))
    if not root:
        from ..cell import cgroups

        given = cgroups.delegated()
        if given is None:
            checks.append(Check("cgroup delegation", "warn", "no cgroup is delegated to this user: a session "
                                "without root needs --ceilings off (said in its trail and summary), and agentcell "
                                "run takes no --memory/--cpu/--pids", cgroups.how_to_delegate(),
                                {"delegated": None}))
        else:
            checks.append(Check("cgroup delegation", "ok", "delegated to this user: " + ", ".join(
                f"{k} {v}" for k, v in sorted(given.items())) + "; cells get their ceilings below them",
                data={"delegated": given}))
    if root:
        checks.append(check_cgroup_migration(cg, clone_into_cgroup_usable()))
    if cg.unified:
        checks.append(_check_kill_freeze(cg.unified))
    else:
        checks.append(Check("cgroup.kill/freeze", "warn", "no cgroup2 tree: no cgroup.kill / cgroup.freeze",
                            "mount cgroup2 (hybrid or v2); until then the v1 freezer + kill-each-pid is used",
                            {"kill": False, "freeze": False, "how": "no unified tree"}))
    return checks


def clone_into_cgroup_usable() -> bool:
    """Whether this process may fork a child into a cgroup v2 group (clone3 with CLONE_INTO_CGROUP, Linux
    5.7), as the launcher forks a cell's PID 1. clone3 with no arguments is refused with EINVAL where the
    call exists, with ENOSYS where it does not or a seccomp filter (a container runtime's) refuses it."""
    if kernel_tuple(platform.release()) < (5, 7):
        return False
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(435), None, ctypes.c_long(0)) < 0 and ctypes.get_errno() == errno.EINVAL


def check_cgroup_migration(cg: CgroupMounts, born_in: bool = False) -> Check:
    """Speed, not safety: a move into a cgroup through ``cgroup.procs`` takes the kernel's
    cgroup_threadgroup_rwsem, whose first taker after a quiet spell waits out an RCU grace period (~10 ms
    of a cold ``agentcell run`` on this project's machines). A cell's PID 1 is born in its v2 group
    (``born_in``: clone3's CLONE_INTO_CGROUP works here) and C1 joins the v1 groups as a thread, neither
    of which takes that lock; without clone3, the ``favordynmods`` mount option (kernel >= 6.0) removes
    the wait host-wide, at a small cost to every fork and exit: the host owner's choice, so this only
    says so."""
    data: dict[str, Any] = {"favordynmods": cg.favoured, "clone_into_cgroup": born_in}
    if cg.favoured:
        return Check("cgroup migration", "ok", f"favordynmods on {', '.join(cg.favoured)}: a cell joins its "
                     "cgroup without waiting", data=data)
    if born_in and cg.unified:
        return Check("cgroup migration", "ok", "a cell's PID 1 is born in its cgroup v2 group (clone3 "
                     "CLONE_INTO_CGROUP)" + (" and joins its v1 groups as a thread" if cg.v1 else "")
                     + ": no wait for an RCU grace period", data=data)
    where = cg.unified or next(iter(cg.v1.values()), "/sys/fs/cgroup")
    if kernel_tuple(platform.release()) < (6, 0):
        return Check("cgroup migration", "warn", "each cold cell waits ~10 ms to join its cgroup (an RCU grace "
                     "period)", "a kernel >= 6.0 has the favordynmods mount option that removes the wait", data)
    return Check("cgroup migration", "warn", "each cold cell waits ~10 ms to join its cgroup (an RCU grace period)",
                 f"for a faster cold agentcell run: mount -o remount,favordynmods {where} (host-wide; forks and "
                 "exits cost a little more; agentcell warm start avoids the wait without it)", data)


def _check_kill_freeze(unified: str) -> Check:
    """cgroup.kill / cgroup.freeze exist only in non-root cgroups: look at ours, or any existing child."""
    candidates = [_own_unified_cgroup(unified)]
    with contextlib.suppress(OSError):
        candidates += [e.path for e in os.scandir(unified) if e.is_dir(follow_symlinks=False)]
    for d in candidates:
        if os.path.realpath(d) == os.path.realpath(unified):
            continue
        kill = os.path.exists(os.path.join(d, "cgroup.kill"))
        freeze = os.path.exists(os.path.join(d, "cgroup.freeze"))
        data = {"kill": kill, "freeze": freeze, "how": f"seen in {d}"}
        if kill and freeze:
            return Check("cgroup.kill/freeze", "ok", f"both present in the cgroup2 tree (seen in {d})",
                         data=data)
        gone = " and ".join(n for n, ok in (("cgroup.kill", kill), ("cgroup.freeze", freeze)) if not ok)
        return Check("cgroup.kill/freeze", "warn", f"{gone} missing in the cgroup2 tree (seen in {d})",
                     "a kernel >= 5.14 has cgroup.kill and cgroup.freeze", data)
    # Only the root cgroup exists and it has neither file; judge by kernel version (kill 5.14, freeze 5.2).
    k = kernel_tuple(platform.release())
    kill, freeze = k >= (5, 14), k >= (5, 2)
    data = {"kill": kill, "freeze": freeze,
            "how": "inferred from the kernel version (no child cgroup to look at)"}
    if kill and freeze:
        return Check("cgroup.kill/freeze", "ok",
                     f"kernel {k[0]}.{k[1]} provides both in child cgroups "
                     "(inferred: only the root cgroup exists to look at)",
                     data=data)
    return Check("cgroup.kill/freeze", "warn", f"kernel {k[0]}.{k[1]} lacks cgroup.kill (needs >= 5.14)",
                 "a kernel >= 5.14 has cgroup.kill; until then the cell is killed pid by pid", data)
