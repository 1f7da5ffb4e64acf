"""User namespaces and the cell's namespaces, probed for real: a forked child tries the thing and reports
through its exit status. Forking is only safe from a single-threaded process, so these probes refuse to
run when this process has more than one thread.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cell import namespaces
from ..cell import syscalls as sc
from ..errors import forked
from .checks import Check, read_int

NOBODY_UID = 65534
NOBODY_GID = 65534

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
class ProbeResult:
    """The outcome of a forked probe: ``ok`` or the errno / reason it failed with."""

    ok: bool
    reason: str = ""
    errno: int | None = None
    probed: bool = True




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
    with forked() as pid:
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
