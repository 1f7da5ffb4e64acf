"""fanotify through ctypes (no maintained binding exists): init, mark, and the event layout.

Used for the canary credentials (permission events on the decoys, :mod:`.canary`), by the monitor's
exec watch (notification events on the privilege tools' binaries) and by its watch on the directories
where a protected entry could be created (directory events that name the entry: FAN_REPORT_DFID_NAME).
"""
from __future__ import annotations

import ctypes
import os
import struct

FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_NOTIF, FAN_CLASS_CONTENT = 0x1, 0x2, 0x0, 0x4
FAN_MARK_ADD, FAN_MARK_DONT_FOLLOW, FAN_MARK_ONLYDIR = 0x1, 0x4, 0x8
FAN_OPEN_PERM, FAN_OPEN_EXEC, FAN_Q_OVERFLOW, FAN_ALLOW = 0x10000, 0x1000, 0x4000, 0x1
FAN_MOVED_TO, FAN_CREATE, FAN_ONDIR = 0x80, 0x100, 0x40000000
FAN_REPORT_DFID_NAME = 0x400 | 0x800  # the directory's file handle and the entry's name (Linux 5.9)
INFO_DFID_NAME = 2
AT_FDCWD = -100
EVENT = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_INFO = struct.Struct("=BBH8sIi")  # info type, pad, len, fsid, handle_bytes, handle_type


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


def mark(fd: int, mask: int, path: str, flags: int = 0) -> None:
    """An inode mark on ``path`` (its file, whoever reaches it by any name)."""
    if _libc().fanotify_mark(fd, FAN_MARK_ADD | flags, mask, AT_FDCWD, os.fsencode(path)) != 0:
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


def handle_of(path: str) -> bytes:
    """The file handle of ``path`` (type and bytes, as an event's directory record carries them), not
    following a final symlink."""
    buf = ctypes.create_string_buffer(8 + 128)  # struct file_handle with MAX_HANDLE_SZ
    struct.pack_into("=I", buf, 0, 128)
    mount_id = ctypes.c_int()
    if _libc().name_to_handle_at(AT_FDCWD, os.fsencode(path), buf, ctypes.byref(mount_id), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"name_to_handle_at {path}: {os.strerror(err)}")
    size, kind = struct.unpack_from("=Ii", buf, 0)
    return struct.pack("=i", kind) + buf.raw[8:8 + size]


def named_events(data: bytes) -> list[tuple[int, int, bytes, str]]:
    """(mask, pid, directory handle, entry name) of each event of a FAN_REPORT_DFID_NAME group."""
    out = []
    off = 0
    while off + EVENT.size <= len(data):
        length, _v, _r, meta, mask, _fd, pid = EVENT.unpack_from(data, off)
        at, end = off + meta, off + max(length, EVENT.size)
        off = end
        while at + _INFO.size <= end:
            kind, _pad, size, _fsid, hbytes, htype = _INFO.unpack_from(data, at)
            if size == 0:
                break
            if kind == INFO_DFID_NAME:
                start = at + _INFO.size
                handle = struct.pack("=i", htype) + data[start:start + hbytes]
                name = data[start + hbytes:at + size].split(b"\0")[0]
                out.append((mask, pid, handle, os.fsdecode(name)))
            at += size
        if mask & FAN_Q_OVERFLOW:
            out.append((mask, pid, b"", ""))
    return out


def allow(group: int, fd: int) -> None:
    """Answer a permission event: let the operation go on."""
    os.write(group, struct.pack("=iI", fd, FAN_ALLOW))
