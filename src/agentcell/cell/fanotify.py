"""fanotify through ctypes (no maintained binding exists): init, mark, and the event layout.

Used for the canary credentials (permission events on the decoys, :mod:`.canary`) and by the
monitor's exec watch (notification events on the privilege tools' binaries).
"""
from __future__ import annotations

import ctypes
import os
import struct

FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_NOTIF, FAN_CLASS_CONTENT = 0x1, 0x2, 0x0, 0x4
FAN_MARK_ADD = 0x1
FAN_OPEN_PERM, FAN_OPEN_EXEC, FAN_Q_OVERFLOW, FAN_ALLOW = 0x10000, 0x1000, 0x4000, 0x1
AT_FDCWD = -100
EVENT = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    return libc


def init(flags: int) -> int:
    """A new group (close-on-exec, non-blocking); OSError without CAP_SYS_ADMIN."""
    fd = _libc().fanotify_init(flags | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_init: {os.strerror(err)}")
    return int(fd)


def mark(fd: int, mask: int, path: str) -> None:
    """An inode mark on ``path`` (its file, whoever reaches it by any name)."""
    if _libc().fanotify_mark(fd, FAN_MARK_ADD, mask, AT_FDCWD, os.fsencode(path)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")


def events(data: bytes) -> list[tuple[int, int, int]]:
    """(mask, fd, pid) of each event in a read's worth of data."""
    out = []
    off = 0
    while off + EVENT.size <= len(data):
        length, _v, _r, _m, mask, fd, pid = EVENT.unpack_from(data, off)
        off += max(length, EVENT.size)
        out.append((mask, fd, pid))
    return out


def allow(group: int, fd: int) -> None:
    """Answer a permission event: let the operation go on."""
    os.write(group, struct.pack("=iI", fd, FAN_ALLOW))
