"""Thin ctypes wrappers for the syscalls Python 3.11's ``os`` lacks (unshare, mount, pivot_root, prctl).

Each wrapper raises ``OSError`` with errno set, so the launcher can name the step that failed.
"""
from __future__ import annotations

import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

MNT_DETACH = 2

# The new mount API (open_tree/move_mount: Linux 5.2, mount_setattr: 5.12): a bind is cloned,
# made read-only/nosuid/nodev while still detached, then attached to a directory fd.
SYS_open_tree = 428
SYS_move_mount = 429
SYS_mount_setattr = 442
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_IDMAP = 0x00100000

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

SYS_pivot_root = 155  # x86_64
# clone3 (Linux 5.3) has one number on every architecture; CLONE_INTO_CGROUP (5.7) puts the child in a
# cgroup v2 group as it is born: no migration, so none of the host-wide lock a cgroup.procs write takes.
SYS_clone3 = 435
CLONE_INTO_CGROUP = 0x200000000
SIGCHLD = 17

_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


_L = ctypes.c_long  # syscall() is variadic: pass every integer as a full register


def open_tree(dirfd: int, path: str, flags: int) -> int:
    return _check(_libc.syscall(_L(SYS_open_tree), _L(dirfd), _b(path), _L(flags | os.O_CLOEXEC)), f"open_tree {path}")


def mount_setattr(fd: int, flags: int, attr_set: int, userns_fd: int = 0) -> None:
    attr = struct.pack("QQQQ", attr_set, 0, 0, userns_fd)  # struct mount_attr, MOUNT_ATTR_SIZE_VER0
    _check(_libc.syscall(_L(SYS_mount_setattr), _L(fd), b"", _L(flags | AT_EMPTY_PATH), attr, _L(len(attr))),
           "mount_setattr")


def move_mount(from_fd: int, to_fd: int) -> None:
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    _check(_libc.syscall(_L(SYS_move_mount), _L(from_fd), b"", _L(to_fd), b"", _L(flags)), "move_mount")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_L(SYS_pivot_root), _b(new_root), _b(put_old)), "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc.prctl(option, arg2, arg3, arg4, arg5), f"prctl({option})")


def clone3(flags: int = 0, cgroup_fd: int = -1) -> int:
    """fork() with clone3's ``flags`` (new namespaces: the child is born in them), the child born in the
    cgroup v2 group ``cgroup_fd`` if one is given (CLONE_INTO_CGROUP): 0 in the child, its pid in the
    parent; OSError where clone3 or a flag is refused (ENOSYS: an older kernel, or a container runtime's
    seccomp profile; EINVAL: a kernel before 5.7 for CLONE_INTO_CGROUP).

    Only for a single-threaded caller that runs Python on in the child: unlike os.fork(), no at-fork
    handler runs (none is needed: no other thread can hold a lock; the call holds the GIL throughout),
    and libc's cached thread id stays the parent's (libc's own fork() sets it right in any process this
    child forks)."""
    if cgroup_fd >= 0:
        flags |= CLONE_INTO_CGROUP
    args = struct.pack("11Q", flags, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, max(cgroup_fd, 0))  # struct clone_args
    return _check(_pysyscall(_L(SYS_clone3), args, _L(len(args))), "clone3")


_pysyscall = ctypes.PyDLL(None, use_errno=True).syscall  # (the GIL is not let go around the clone)
_pysyscall.restype = ctypes.c_long


def sethostname(name: str) -> None:
    b = name.encode()
    _check(_libc.sethostname(b, len(b)), "sethostname")


def inet_dgram_socket() -> int:
    """A bare AF_INET/SOCK_DGRAM fd for interface ioctls (the socket module costs ~2 ms to import)."""
    return _check(_libc.socket(2, 2 | os.O_CLOEXEC, 0), "socket")


def close_fds_except(keep: set[int]) -> None:
    """Close every fd >= 3 not in ``keep`` (close_range over the gaps)."""
    lo = 3
    for fd in sorted(k for k in keep if k >= 3):
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 2**31 - 1)



def fchown_fd(fd: int, uid: int, gid: int) -> None:
    """chown the very file ``fd`` holds (an O_PATH fd too, a symlink's included): fchownat(fd, "",
    AT_EMPTY_PATH) — no name is looked up, so nothing can be swapped in between."""
    _check(_libc.fchownat(fd, b"", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW), "fchownat")
