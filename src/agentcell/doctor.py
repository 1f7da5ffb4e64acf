"""What this machine supports, probed for real: the data behind ``agentcell doctor``.

Every probe returns plain data (:class:`Check`, :class:`Report`) and prints nothing. Probes that need
the kernel's answer rather than a config file's (user namespaces, the cell's namespaces) fork a child
that tries the real thing and reports through its exit status. Forking is only safe from a
single-threaded process, so those probes refuse to run when this process has more than one thread.

Nothing here changes the machine: no sysctl, no audit state, no cgroup, no nftables table is written.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import platform
import pwd
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .cell import namespaces
from .cell import syscalls as sc
from .cell.spec import NETWORK_MODES

Status = Literal["ok", "warn", "missing"]

IDENTITY_MODES = ("self", "agent", "uid")
NEEDABLE_MODES = IDENTITY_MODES + NETWORK_MODES

NOBODY_UID = 65534
NOBODY_GID = 65534

# Landlock (see KERNEL_NOTES.md).
SYS_landlock_create_ruleset = 444  # x86_64 and every other arch using the generic table
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_FEATURES = {
    1: "fs rules",
    2: "refer",
    3: "truncate",
    4: "TCP rules",
    5: "ioctl on devices",
    6: "scopes",
    7: "audit log flags",
}
LANDLOCK_BEST_ABI = 7

PR_GET_SECCOMP = 21

# Audit netlink (read-only: only AUDIT_GET is ever sent).
NETLINK_AUDIT = 9
AUDIT_GET = 1000
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 1
NLM_F_ACK = 4
AUDIT_STATUS_FIELDS = (
    "mask", "enabled", "failure", "pid", "rate_limit", "backlog_limit", "lost", "backlog",
    "feature_bitmap", "backlog_wait_time", "backlog_wait_time_actual",
)

V1_CONTROLLERS = frozenset({
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "net_cls", "net_prio", "blkio",
    "perf_event", "hugetlb", "pids", "rdma", "misc",
})
CELL_CONTROLLERS = ("memory", "cpu", "pids", "freezer")

# Exit codes of the forked probe children (an errno otherwise, 0 on success).
_CHILD_DROP_FAILED = 250
_CHILD_MAP_FAILED = 251
_CHILD_LOOPBACK_FAILED = 252
_CHILD_MOUNT_API_FAILED = 253
_CHILD_UNEXPECTED = 255
_CHILD_CODES = {
    _CHILD_MOUNT_API_FAILED: "the new mount API (open_tree + mount_setattr, Linux 5.12+) does not work; "
                             "agentcell sets bind flags with it before attaching",
    _CHILD_DROP_FAILED: "could not switch to uid 65534 (nobody) for the probe",
    _CHILD_MAP_FAILED: "could not write uid_map/gid_map in the new user namespace",
    _CHILD_LOOPBACK_FAILED: "could not bring lo up in the new network namespace",
    _CHILD_UNEXPECTED: "the probe child failed unexpectedly",
}


@dataclass
class Check:
    """One line of the report. ``fix`` is set whenever ``status`` is not ``ok``."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


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


@dataclass
class ProbeResult:
    """The outcome of a forked probe: ``ok`` or the errno / reason it failed with."""

    ok: bool
    reason: str = ""
    errno: int | None = None
    probed: bool = True


# ---------------------------------------------------------------------------------------------------
# Forked probes


def thread_count() -> int:
    """Kernel threads of this process (counts native threads Python's ``threading`` cannot see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 1


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setresgid(NOBODY_GID, NOBODY_GID, NOBODY_GID)
    os.setresuid(NOBODY_UID, NOBODY_UID, NOBODY_UID)
    # A uid change makes the process non-dumpable, which makes /proc/self/* root-owned and
    # uid_map unwritable; the launcher's rootless path runs dumpable, so the probe does too.
    sc.prctl(sc.PR_SET_DUMPABLE, 1)


def run_in_child(body: Callable[[], int], *, as_nobody: bool = False) -> ProbeResult:
    """Run ``body`` in a forked child (first as uid 65534 if ``as_nobody``); its return value
    (0 = success, else an errno) is the exit code."""
    if thread_count() > 1:
        return ProbeResult(False, "not probed: this process is multi-threaded and must not fork",
                           probed=False)
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's code
        code = _CHILD_UNEXPECTED
        try:
            if as_nobody:
                try:
                    _drop_to_nobody()
                except OSError:
                    os._exit(_CHILD_DROP_FAILED)
            code = body()
        except OSError as e:
            code = e.errno if e.errno and 0 < e.errno < 200 else _CHILD_UNEXPECTED
        except BaseException:
            code = _CHILD_UNEXPECTED
        finally:
            os._exit(code)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return ProbeResult(False, "the probe child vanished", probed=False)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return ProbeResult(False, f"the probe child was killed by signal {os.WTERMSIG(status)}")
    code = os.WEXITSTATUS(status)
    if code == 0:
        return ProbeResult(True)
    if code in _CHILD_CODES:
        probed = code not in (_CHILD_DROP_FAILED, _CHILD_UNEXPECTED)
        return ProbeResult(False, _CHILD_CODES[code], probed=probed)
    return ProbeResult(False, f"{errno.errorcode.get(code, str(code))}: {os.strerror(code)}", errno=code)


def _userns_body() -> int:
    sc.unshare(sc.CLONE_NEWUSER)
    return 0


def probe_userns() -> ProbeResult:
    """Can a non-root user create a user namespace? As root the child first becomes uid 65534."""
    return run_in_child(_userns_body, as_nobody=os.geteuid() == 0)


CELL_NS_FLAGS = sc.CLONE_NEWNS | sc.CLONE_NEWPID | sc.CLONE_NEWIPC | sc.CLONE_NEWUTS | sc.CLONE_NEWNET


def _cell_ns_body(rootless: bool) -> Callable[[], int]:
    def body() -> int:
        uid, gid = os.geteuid(), os.getegid()
        sc.unshare(CELL_NS_FLAGS | (sc.CLONE_NEWUSER if rootless else 0))
        if rootless:
            try:
                namespaces.map_ids(uid, gid, uid, gid)
            except OSError:
                return _CHILD_MAP_FAILED
        try:
            namespaces.loopback_up()
        except OSError:
            return _CHILD_LOOPBACK_FAILED
        try:  # the launcher's bind: a detached recursive clone made read-only before it is attached
            tree = sc.open_tree(sc.AT_FDCWD, "/usr", sc.OPEN_TREE_CLONE | sc.AT_RECURSIVE)
            try:
                sc.mount_setattr(tree, sc.AT_RECURSIVE, sc.MOUNT_ATTR_RDONLY | sc.MOUNT_ATTR_NOSUID)
            finally:
                os.close(tree)
        except OSError:
            return _CHILD_MOUNT_API_FAILED
        return 0

    return body


def probe_cell_namespaces(*, rootless: bool, as_nobody: bool = False) -> ProbeResult:
    """Unshare the cell's namespaces (mount, PID, IPC, UTS, net [+ user]) and bring ``lo`` up, in a child."""
    return run_in_child(_cell_ns_body(rootless), as_nobody=as_nobody)


# ---------------------------------------------------------------------------------------------------
# Small readers


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_int(path: str) -> int | None:
    text = read_text(path)
    try:
        return None if text is None else int(text.split()[0])
    except (ValueError, IndexError):
        return None


def kernel_tuple(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# ---------------------------------------------------------------------------------------------------
# Checks


def which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin dirs, which a non-root user's PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin")


def check_kernel() -> Check:
    u = platform.uname()
    return Check("kernel", "ok", f"{u.release} {u.machine}",
                 data={"release": u.release, "machine": u.machine})


def landlock_abi() -> int | OSError:
    """The Landlock ABI version, or the OSError the probe syscall failed with."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(SYS_landlock_create_ruleset), ctypes.c_void_p(None), ctypes.c_size_t(0),
                      ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if rc < 0:
        err = ctypes.get_errno()
        return OSError(err, os.strerror(err))
    return int(rc)


def check_landlock() -> Check:
    abi = landlock_abi()
    lsm = read_text("/sys/kernel/security/lsm")
    data: dict[str, Any] = {"lsm": lsm}
    if isinstance(abi, OSError):
        data["abi"] = None
        data["errno"] = abi.errno
        if abi.errno == errno.EOPNOTSUPP:
            return Check("landlock", "missing", "compiled in but not enabled (not in the active LSM list)",
                         "add landlock to the lsm= kernel parameter "
                         "(e.g. lsm=landlock,lockdown,yama,apparmor,bpf) and reboot", data)
        if abi.errno == errno.ENOSYS:
            return Check("landlock", "missing", "not in this kernel (ENOSYS)",
                         "use a kernel >= 5.13 built with CONFIG_SECURITY_LANDLOCK=y (>= 6.15 for ABI 7)",
                         data)
        return Check("landlock", "missing", f"probe failed: {abi.strerror}",
                     "check the kernel's Landlock support (CONFIG_SECURITY_LANDLOCK, lsm=)", data)
    features = [LANDLOCK_FEATURES[v] for v in sorted(LANDLOCK_FEATURES) if v <= abi]
    lacking = [LANDLOCK_FEATURES[v] for v in sorted(LANDLOCK_FEATURES) if v > abi]
    data.update(abi=abi, features=features, lacking=lacking)
    detail = f"ABI {abi}: " + ", ".join(features)
    if abi >= LANDLOCK_BEST_ABI:
        return Check("landlock", "ok", detail, data=data)
    return Check("landlock", "warn", detail + "; lacks " + ", ".join(lacking),
                 "a kernel >= 6.15 gives ABI 7 (TCP rules 6.7, scopes 6.12, audit log flags 6.15)", data)


def check_seccomp() -> list[Check]:
    status = read_text("/proc/self/status") or ""
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in status.splitlines()) if v
    )
    checks: list[Check] = []
    mode: int | None = None
    prctl_error = ""
    try:
        mode = sc.prctl(PR_GET_SECCOMP)
    except OSError as e:
        prctl_error = os.strerror(e.errno) if e.errno else str(e)
    has_filter = "Seccomp_filters" in fields
    data = {"status_field": fields.get("Seccomp"), "prctl_mode": mode, "filter_field": has_filter,
            "actions_avail": read_text("/proc/sys/kernel/seccomp/actions_avail")}
    if "Seccomp" not in fields or mode is None:
        why = ("no Seccomp field in /proc/self/status" if "Seccomp" not in fields
               else f"PR_GET_SECCOMP: {prctl_error}")
        checks.append(Check("seccomp", "missing", why, "use a kernel built with CONFIG_SECCOMP_FILTER=y",
                            data))
    else:
        current = {0: "not filtered", 1: "strict", 2: "already filtered"}.get(mode, str(mode))
        actions = read_text("/proc/sys/kernel/seccomp/actions_avail") or ""
        notif = " (user_notif available)" if "user_notif" in actions.split() else ""
        checks.append(Check("seccomp", "ok", f"available; this process: {current}{notif}", data=data))
    lib = ctypes.util.find_library("seccomp")
    if lib:
        checks.append(Check("libseccomp", "ok", lib, data={"library": lib}))
    else:
        checks.append(Check("libseccomp", "warn", "libseccomp not found",
                            "apt install libseccomp2 (dnf install libseccomp)", {"library": None}))
    return checks


def check_userns(probe: ProbeResult, *, root: bool) -> Check:
    max_ns = read_int("/proc/sys/user/max_user_namespaces")
    clone = read_int("/proc/sys/kernel/unprivileged_userns_clone")
    apparmor = read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
    data: dict[str, Any] = {"max_user_namespaces": max_ns, "unprivileged_userns_clone": clone,
                            "apparmor_restrict_unprivileged_userns": apparmor, "probe_ok": probe.ok,
                            "probe_errno": probe.errno, "probed_as": "nobody (uid 65534)" if root else "self"}
    who = "uid 65534 (as a non-root user)" if root else "this user"
    if probe.ok:
        if apparmor == 1:
            # AppArmor lets the unshare through but strips capabilities inside the namespace.
            return Check("user namespaces", "missing",
                         f"unshare(CLONE_NEWUSER) works for {who} but AppArmor restricts it "
                         "(kernel.apparmor_restrict_unprivileged_userns=1)",
                         "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, "
                         "or install an AppArmor profile for agentcell", data)
        return Check("user namespaces", "ok", f"unshare(CLONE_NEWUSER) works for {who}", data=data)
    if not probe.probed:
        return Check("user namespaces", "warn", f"unknown: {probe.reason}",
                     "run agentcell doctor from a single-threaded process as root or the user in question",
                     data)
    detail = f"unshare(CLONE_NEWUSER) fails for {who}: {probe.reason}"
    if apparmor == 1:
        fix = ("sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, "
               "or install an AppArmor profile for agentcell")
    elif clone == 0:
        fix = "sudo sysctl -w kernel.unprivileged_userns_clone=1"
    elif max_ns == 0:
        fix = "sudo sysctl -w user.max_user_namespaces=15000"
    else:
        fix = "check for a container, seccomp or LSM policy that blocks CLONE_NEWUSER; or run as root"
    return Check("user namespaces", "missing", detail, fix, data)


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
        from .cell import cgroups

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
        checks.append(check_cgroup_migration(cg))
    if cg.unified:
        checks.append(_check_kill_freeze(cg.unified))
    else:
        checks.append(Check("cgroup.kill/freeze", "warn", "no cgroup2 tree: no cgroup.kill / cgroup.freeze",
                            "mount cgroup2 (hybrid or v2); until then the v1 freezer + kill-each-pid is used",
                            {"kill": False, "freeze": False, "how": "no unified tree"}))
    return checks


def check_cgroup_migration(cg: CgroupMounts) -> Check:
    """Speed, not safety: a cold cell's first move into its cgroup waits for an RCU grace period (the
    kernel's cgroup_threadgroup_rwsem), ~10 ms of a cold ``agentcell run`` on this project's machines
    (59.7 -> 49.2 ms with it off). The ``favordynmods`` mount option (kernel >= 6.0) removes the wait
    host-wide, at a small cost to every fork and exit; it is the host owner's choice, so this only says so."""
    data = {"favordynmods": cg.favoured}
    if cg.favoured:
        return Check("cgroup migration", "ok", f"favordynmods on {', '.join(cg.favoured)}: a cell joins its "
                     "cgroup without waiting", data=data)
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


def read_audit_status(timeout: float = 2.0) -> dict[str, int]:
    """AUDIT_GET over NETLINK_AUDIT (read-only). Raises OSError (or TimeoutError) on failure."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT) as s:
        s.settimeout(timeout)
        s.bind((0, 0))
        seq = os.getpid() & 0xFFFF or 1
        s.sendto(struct.pack("=IHHII", 16, AUDIT_GET, NLM_F_REQUEST | NLM_F_ACK, seq, 0), (0, 0))
        status: dict[str, int] | None = None
        acked = False
        while status is None or not acked:
            buf = s.recv(65536)
            off = 0
            while off + 16 <= len(buf):
                length, mtype, _flags, mseq, _pid = struct.unpack_from("=IHHII", buf, off)
                if length < 16:
                    break
                payload = buf[off + 16:off + length]
                off += (length + 3) & ~3
                if mseq != seq:
                    continue
                if mtype == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", payload)[0] if len(payload) >= 4 else 0
                    if err:
                        raise OSError(err, f"AUDIT_GET: {os.strerror(err)}")
                    acked = True
                elif mtype == AUDIT_GET:
                    n = min(len(payload) // 4, len(AUDIT_STATUS_FIELDS))
                    values = struct.unpack_from(f"={n}I", payload)
                    status = dict(zip(AUDIT_STATUS_FIELDS, values, strict=False))
                elif mtype == NLMSG_DONE:
                    acked = True
        return status


def check_monitor(*, root: bool) -> Check:
    """Which of the escape monitor's sources can work here for this user (probes open and close
    kernel handles; nothing is subscribed or changed)."""
    have: dict[str, str] = {}
    actions = (read_text("/proc/sys/kernel/seccomp/actions_avail") or "").split()
    have["seccomp"] = "on" if "user_notif" in actions else "off: the kernel has no seccomp user notification"
    have["canary"] = "on (fanotify: the opener is named)" if root else "on (inotify: the open, not who made it)"
    if root:
        try:
            from .cell import fanotify

            os.close(fanotify.init(fanotify.FAN_CLASS_CONTENT))
        except OSError as e:
            have["canary"] = f"on (inotify; fanotify failed: {e.strerror})"
        try:
            import socket

            with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11) as sk:  # NETLINK_CONNECTOR
                sk.bind((0, 1))  # CN_IDX_PROC
            have["exec"] = "on"
        except OSError as e:
            have["exec"] = f"off: the proc connector: {e.strerror}"
        have["landlock"] = "on (audit stream)"
        have["cgroup"] = "on"
        from .monitor import calls

        why = calls.check()  # loaded and verified, never attached
        layout = calls.kernel_layout()
        names = "" if calls.part(layout, calls.EXEC_FIELDS) is not None else \
            "; no BTF: a process that exits at once is named by its 15-character name, not its file"
        if calls.part(layout, calls.TASK_FIELDS) is None:
            names += ("; the BTF does not say where a task keeps its pid: a /proc entry of a host process is "
                      "only noted (it cannot be told from one of the cell's own that just ended)")
        have["calls"] = (f"on (eBPF: failed calls, so attempts on what the cell does not contain{names})"
                         if not why else
                         f"off: {why}; attempts on what the cell does not contain are not seen (an old kernel, "
                         "lockdown=confidentiality, or no CAP_BPF in a container)")
        try:
            os.close(fanotify.init(fanotify.FAN_CLASS_NOTIF | fanotify.FAN_REPORT_DFID_NAME))
            have["created"] = "on"
        except OSError as e:
            have["created"] = f"off: fanotify directory events: {e.strerror} (Linux 5.9; created protected " \
                              "entries are reported at the end)"
    else:
        have["exec"] = "off: the proc connector needs root"
        have["landlock"] = "off: the audit stream needs root"
        have["cgroup"] = "off: no delegated cgroup for unprivileged users"
        have["calls"] = "off: eBPF needs root"
        have["created"] = "off: fanotify needs root"
    off = sorted(k for k, v in have.items() if not v.startswith("on"))
    detail = "; ".join(f"{k} {v}" for k, v in sorted(have.items()))
    if off:
        return Check("monitor", "warn", f"escape monitor: {detail}",
                     "run through sudo for every source" if not root else "see the sources marked off",
                     data={"sources": have})
    return Check("monitor", "ok", f"escape monitor: every source available ({detail})", data={"sources": have})


def check_audit(*, root: bool) -> Check:
    if not os.path.exists("/proc/self/loginuid"):
        return Check("audit", "warn",
                     "kernel built without audit: no Landlock denial records for the monitor",
                     "use a kernel with CONFIG_AUDIT=y (the escape monitor reads Landlock denials from it)",
                     {"compiled_in": False, "enabled": None})
    if not root:
        return Check("audit", "warn", "compiled in; state unknown: reading it needs root (CAP_AUDIT_CONTROL)",
                     "run agentcell doctor as root to see the audit state",
                     {"compiled_in": True, "enabled": None})
    try:
        st = read_audit_status()
    except (OSError, TimeoutError) as e:
        reason = e.strerror or str(e) if isinstance(e, OSError) else "no reply"
        return Check("audit", "warn", f"compiled in; state unknown: {reason}",
                     "audit netlink only answers in the initial user and network namespace; "
                     "run doctor there as root", {"compiled_in": True, "enabled": None, "error": reason})
    enabled = st.get("enabled")
    words = {0: "disabled (the monitor enables it for a session and restores it)", 1: "enabled",
             2: "enabled and locked (immutable)"}
    detail = f"compiled in, {words.get(enabled or 0, f'enabled={enabled}')}"
    if st.get("pid"):
        detail += f"; audit daemon pid {st['pid']}"
    return Check("audit", "ok", detail, data={"compiled_in": True, "enabled": enabled, "status": st})


def check_nft(*, root: bool) -> Check:
    nft = which("nft")
    later = "needed only by the host-firewall network mode"
    if not nft:
        return Check("nftables", "warn", f"nft not installed; {later}", "apt install nftables", {"nft": None})
    if not root:
        return Check("nftables", "ok", f"{nft} (listing tables needs root)",
                     data={"nft": nft, "listed": None})
    try:
        p = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, timeout=5,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Check("nftables", "warn", f"{nft}: 'nft list tables' did not answer in 5 s",
                     "check the nf_tables kernel module (modprobe nf_tables)", {"nft": nft, "listed": False})
    except OSError as e:
        return Check("nftables", "warn", f"{nft}: {e.strerror}", "reinstall nftables",
                     {"nft": nft, "listed": False})
    if p.returncode != 0:
        first = (p.stderr.strip().splitlines() or ["exit status " + str(p.returncode)])[0]
        return Check("nftables", "warn", f"{nft}: 'nft list tables' failed: {first}",
                     "load nf_tables (modprobe nf_tables) or check the kernel's CONFIG_NF_TABLES",
                     {"nft": nft, "listed": False})
    n = len([ln for ln in p.stdout.splitlines() if ln.startswith("table ")])
    return Check("nftables", "ok", f"{nft}; lists tables ({n} present)",
                 data={"nft": nft, "listed": True, "tables": n})


def check_ns(probe: ProbeResult, *, rootless: bool, who: str) -> Check:
    name = "namespaces (rootless)" if rootless else "namespaces"
    kinds = "mnt, pid, ipc, uts, net" + (" inside a user namespace" if rootless else "")
    data = {"ok": probe.ok, "errno": probe.errno, "rootless": rootless, "as": who}
    if probe.ok:
        return Check(name, "ok", f"{kinds}: unshare, lo up and read-only detached binds work for {who}", data=data)
    if not probe.probed:
        return Check(name, "warn", f"unknown for {who}: {probe.reason}",
                     "run agentcell doctor from a single-threaded process", data)
    fix = ("allow unprivileged user namespaces (see 'user namespaces'), or run as root" if rootless
           else "check for a container or seccomp policy that blocks unshare (CONFIG_*_NS must be enabled)")
    return Check(name, "missing", f"{kinds} fails for {who}: {probe.reason}", fix, data)


def check_tools() -> list[Check]:
    out = []
    bwrap = which("bwrap")
    out.append(Check("bwrap", "ok", bwrap, data={"path": bwrap}) if bwrap else
               Check("bwrap", "warn", "not installed (optional: only the benchmarks compare against it)",
                     "apt install bubblewrap (only to run the benchmarks)", {"path": None}))
    setfacl = which("setfacl")
    out.append(Check("setfacl", "ok", setfacl, data={"path": setfacl}) if setfacl else
               Check("setfacl", "warn", "not installed; agent accounts (agentcell agent) share folders through ACLs",
                     "apt install acl", {"path": None}))
    out.append(check_acl_fs("/home"))
    return out


EXTRAS = (("mcp", "mcp", "agentcell mcp"), ("langchain", "langchain-core", "CellShellTool"),
          ("ray", "ray", "agentcell fleet"))


def check_extras() -> list[Check]:
    """The optional extras: installed or not, read from the package metadata (nothing is imported)."""
    from importlib import metadata

    out = []
    for extra, dist, what in EXTRAS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out.append(Check(f"extra {extra}", "warn", f"{dist} is not installed: {what} is not available",
                             f"pip install 'agentcell[{extra}]' (only for {what})", {"version": None}))
            continue
        out.append(Check(f"extra {extra}", "ok", f"{dist} {version}: {what}", data={"version": version}))
    return out


def check_harnesses() -> list[Check]:
    """Each harness profile: whether its CLI is installed where a cell can run it (resolved as a session
    resolves it), and what it still needs. Nothing is run."""
    from .errors import PolicyError
    from .harness import profiles

    out = []
    for name in profiles.HARNESSES:
        prof = profiles.PROFILES[name]
        label = f"harness {name}"
        untested = "" if prof.tested else "; untested: not in any registry agentcell's tests reach, its profile " \
                                          "follows its documentation"
        try:
            found, cell_path = profiles.locate(prof.binary or name, field_name=label, install=prof.install,
                                               title=prof.title)
        except PolicyError as e:
            out.append(Check(label, "warn", e.problem + untested, e.fix or prof.install,
                             {"path": None, "tested": prof.tested}))
            continue
        missing = [n for n in prof.needs if shutil.which(n, path=cell_path) is None]
        detail = f"{prof.title}: {found}" + (f"; downloads {', '.join(missing)} when missing" if missing else "") + \
            untested
        fix = f"install {', '.join(missing)} system-wide" if missing else \
            "" if prof.tested else f"try it: sudo agentcell check --harness {name}"
        out.append(Check(label, "warn" if fix else "ok", detail, fix, {"path": found, "tested": prof.tested}))
    return out


def check_acl_fs(path: str) -> Check:
    """Whether the file system holding ``path`` keeps POSIX ACLs (agent homes and shares need them)."""
    try:
        os.getxattr(path, "system.posix_acl_access", follow_symlinks=False)
        supported = True
    except OSError as e:
        supported = e.errno == errno.ENODATA
    if supported:
        return Check("acl-fs", "ok", f"{path} keeps POSIX ACLs", data={"path": path, "supported": True})
    return Check("acl-fs", "warn", f"the file system of {path} has no POSIX ACLs: agent accounts cannot share "
                 "folders", "mount it with ACL support (ext4, xfs and btrfs have it by default)",
                 {"path": path, "supported": False})


# ---------------------------------------------------------------------------------------------------
# Modes and the whole report


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
    checks: list[Check] = [check_kernel(), check_landlock(), *check_seccomp()]
    userns_probe = probe_userns()
    userns = check_userns(userns_probe, root=root)
    checks.append(userns)
    ns_root: ProbeResult | None = None
    if root:
        ns_root = probe_cell_namespaces(rootless=False)
        checks.append(check_ns(ns_root, rootless=False, who="root"))
    ns_rootless = probe_cell_namespaces(rootless=True, as_nobody=root)
    checks.append(check_ns(ns_rootless, rootless=True, who="uid 65534" if root else user_name(euid)))
    checks += check_cgroups(root=root)
    checks.append(check_audit(root=root))
    checks.append(check_monitor(root=root))
    nft = check_nft(root=root)
    checks.append(nft)
    checks += check_tools()
    checks += check_extras()
    checks += check_harnesses()
    modes = evaluate_modes(root=root, userns_ok=userns.status == "ok", userns_fix=userns.fix,
                           ns_root=ns_root, ns_rootless=ns_rootless, nft_ok=nft.data.get("listed") is True)
    return Report(uid=euid, user=user_name(euid), root=root, checks=checks, modes=modes,
                  default_needs=default_needs(root))
