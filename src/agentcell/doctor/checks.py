"""The machine's checks behind ``agentcell doctor``, each one line of the report: the kernel, Landlock,
seccomp, audit, the escape monitor's sources, nftables, tools, extras and harnesses. Each asks the
mechanism's own probe (cell/landlock.py, monitor/audit.py, monitor/calls.py, ...) and returns plain data.
"""
from __future__ import annotations

import ctypes.util
import errno
import os
import platform
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Literal

from ..cell import landlock
from ..cell import syscalls as sc

Status = Literal["ok", "warn", "missing"]

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


@dataclass
class Check:
    """One line of the report. ``fix`` is set whenever ``status`` is not ``ok``."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)



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



def which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin dirs, which a non-root user's PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin")


def check_kernel() -> Check:
    u = platform.uname()
    return Check("kernel", "ok", f"{u.release} {u.machine}",
                 data={"release": u.release, "machine": u.machine})



def check_landlock() -> Check:
    abi = landlock.version()
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



def check_monitor(*, root: bool) -> Check:
    """Which of the escape monitor's sources can work here for this user (probes open and close
    kernel handles; nothing is subscribed or changed)."""
    have: dict[str, str] = {}
    actions = (read_text("/proc/sys/kernel/seccomp/actions_avail") or "").split()
    have["seccomp"] = "on" if "user_notif" in actions else "off: the kernel has no seccomp user notification"
    have["canary"] = "on (fanotify: the opener is named)" if root else "on (inotify: the open, not who made it)"
    if root:
        try:
            from ..cell import fanotify

            os.close(fanotify.init(fanotify.FAN_CLASS_CONTENT))
        except OSError as e:
            have["canary"] = f"on (inotify; fanotify failed: {e.strerror})"
        from ..monitor import calls, execwatch

        why = execwatch.connector_problem()
        have["exec"] = f"off: the proc connector: {why}" if why else "on"
        have["landlock"] = "on (audit stream)"
        have["cgroup"] = "on"

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
    from ..monitor import kaudit as audit

    try:
        st = dict(zip(audit.STATUS_FIELDS, audit.audit_status(timeout=2.0), strict=False))
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
    from ..errors import PolicyError
    from ..harness import profiles

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
