"""Landlock: the second wall. The mount tree says what exists in the cell; Landlock says, again and
independently, what the command may do with it (ctypes: the PyPI binding is buggy, see KERNEL_NOTES).

Rules mirror the mount tree: read and execute on the system dirs and --ro paths, everything on the
writable ones, device files usable as devices; in network mode ``none`` every TCP bind and connect
is denied (the namespace already has no route; this is the second wall); with ABI >= 6 the command
may not signal, or reach abstract unix sockets of, processes outside its domain (PID 1 included);
with ABI >= 7 denials after exec are logged to the audit stream (for the escape monitor).
"""
from __future__ import annotations

import ctypes
import os
import stat
import struct

from ..errors import LaunchError
from .spec import CACHE_PATH, SCRATCH_PATH, CellSpec

SYS_create_ruleset, SYS_add_rule, SYS_restrict_self = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH, RULE_NET_PORT = 1, 2
LOG_NEW_EXEC_ON = 2

# Filesystem rights (bit numbers from the kernel ABI) and the ABI that brought each.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # all a rule on a non-directory may carry
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

READ_EXEC = EXECUTE | READ_FILE | READ_DIR
WRITE_ALL = (1 << 16) - 1 & ~(MAKE_CHAR | MAKE_BLOCK)  # no device nodes, even where writes are allowed
DEVICES = READ_FILE | WRITE_FILE | READ_DIR | IOCTL_DEV | TRUNCATE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_L = ctypes.c_long


def version() -> int | OSError:
    """The kernel's Landlock ABI version, or why there is none: ENOSYS when the kernel lacks Landlock,
    EOPNOTSUPP when it has it but not among its active LSMs (``agentcell doctor`` tells the two apart)."""
    ctypes.set_errno(0)
    n = _libc.syscall(_L(SYS_create_ruleset), None, _L(0), _L(CREATE_RULESET_VERSION))
    if n < 0:
        err = ctypes.get_errno()
        return OSError(err, os.strerror(err))
    return int(n)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    found = version()
    return 0 if isinstance(found, OSError) else found


def fs_rights(version: int) -> int:
    return FS_BY_ABI[max(v for v in FS_BY_ABI if v <= version)] if version else 0


def rules_for(spec: CellSpec) -> list[tuple[str, int]]:
    """(path in the cell, rights) — the mount tree again, as Landlock rules. Also what --explain shows."""
    rules: list[tuple[str, int]] = [(p, READ_EXEC) for p in spec.system_paths if os.path.isdir(p)
                                    and not os.path.islink(p)]
    rules += [("/", READ_DIR), ("/proc", READ_FILE | READ_DIR), ("/dev", DEVICES)]  # /proc: read only
    rules += [(p, READ_EXEC) for p in spec.ro_paths]
    rules += [(p, WRITE_ALL) for p in ("/tmp", "/dev/shm", SCRATCH_PATH, spec.identity.home, *spec.rw_paths,
                                       *((CACHE_PATH,) if spec.cache_dir else ()))]
    return rules


def describe(spec: CellSpec) -> list[str]:
    names = {EXECUTE: "execute", READ_FILE: "read", READ_DIR: "readdir", WRITE_FILE: "write", IOCTL_DEV: "ioctl"}
    out = []
    for path, rights in rules_for(spec):
        if rights == WRITE_ALL:
            label = "all but device nodes"
        else:
            label = ",".join(n for bit, n in names.items() if rights & bit)
        out.append(f"{path}: {label}")
    if spec.network == "none":
        out.append("tcp: no bind, no connect")
    out.append("scope: no signals or abstract unix sockets outside the cell (ABI >= 6)")
    return out


def describe_abi(spec: CellSpec) -> str:
    """What :func:`prepare` and :meth:`Ruleset.enforce` do for ``spec`` on this kernel."""
    version = abi()
    if version >= max(spec.landlock_min_abi, 1):
        return f"ABI {version}" + (", LOG_NEW_EXEC_ON" if version >= 7 else "") + ", rules:"
    if spec.landlock == "best-effort":
        return f"ABI {version} here; SKIPPED (--landlock best-effort)"
    return f"ABI {version} here; refused (required)"


class Ruleset:
    """A built ruleset, enforced later (a prepared cell builds it before its command arrives)."""

    def __init__(self, fd: int, version: int) -> None:
        self.fd, self.version = fd, version

    def enforce(self) -> None:
        """Restrict this process, and all it execs, to the rules for good."""
        flags = LOG_NEW_EXEC_ON if self.version >= 7 else 0
        try:
            if _libc.syscall(_L(SYS_restrict_self), _L(self.fd), _L(flags)) < 0:
                raise LaunchError("landlock", f"restrict_self: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(self.fd)


def prepare(spec: CellSpec) -> Ruleset | None:
    """Step 14 (enforced at 19): the cell's ruleset; None only when the policy accepts running without
    (``--landlock best-effort``) on a kernel below its minimum ABI, else fail closed."""
    version = abi()
    if version >= max(spec.landlock_min_abi, 1):
        return build(spec, version)
    if spec.landlock == "best-effort":
        return None
    raise LaunchError("landlock", f"this kernel's Landlock ABI is {version}, the policy needs "
                      f"{max(spec.landlock_min_abi, 1)}", "see 'agentcell doctor'; --landlock best-effort runs "
                      "without this second wall")


def build(spec: CellSpec, version: int) -> Ruleset:
    """The ruleset for ``spec`` (not yet enforced)."""
    fs = fs_rights(version)
    net = NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 and spec.network == "none" else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0
    attr = struct.pack("QQQ", fs, net, scoped)  # older kernels accept the longer struct: its tail is 0
    ruleset = _libc.syscall(_L(SYS_create_ruleset), attr, _L(len(attr)), _L(0))
    if ruleset < 0:
        raise LaunchError("landlock", f"create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path, rights in rules_for(spec):
            _add_path(int(ruleset), path, rights & fs)
    except BaseException:
        os.close(int(ruleset))
        raise
    return Ruleset(int(ruleset), version)


def _add_path(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # not in this cell (a system dir the host lacks)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_ONLY
        rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr is packed: 12 bytes
        if _libc.syscall(_L(SYS_add_rule), _L(ruleset), _L(RULE_PATH_BENEATH), rule, _L(0)) < 0:
            raise LaunchError("landlock", f"add_rule {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
