"""Reading a tree and writing files for snapshots, without following a link: the walk, a file below a
root opened by descriptor, text, whole writes, one syncfs for many files, small JSON files."""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from .. import hostfs

CHUNK = 1 << 20


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _free_bytes(path: str) -> int:
    sv = os.statvfs(path)
    return sv.f_bavail * sv.f_frsize


def _walk(root: str) -> Iterator[tuple[str, os.stat_result, str | None]]:
    """(relative path, lstat, symlink target) for root and all below it, never through a symlink,
    on root's file system only; iterative (any depth)."""
    from ..accounts.acl import Walk

    for n in Walk(root, links=True):
        link = None
        if stat.S_ISLNK(n.st.st_mode) and n.parent is not None:
            link = os.readlink(n.name or "", dir_fd=n.parent)
        yield n.rel, n.st, link


def _open_below(root: str, rel: str, flags: int) -> int:
    from ..cell.paths import open_nofollow

    parent, name = os.path.split(rel)
    dfd = open_nofollow(os.path.join(root, parent) if parent else root)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)


def _read_text(path: str, limit: int) -> str | None:
    with open(path, "rb") as f:
        return _text(f.read(limit + 1), limit)


def _read_text_nofollow(root: str, rel: str, limit: int) -> str | None:
    fd = _open_below(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return _text(os.read(fd, limit + 1), limit)
    finally:
        os.close(fd)


def _text(data: bytes, limit: int) -> str | None:
    """The data as text, or None if it is binary (a NUL, not UTF-8) or longer than ``limit``."""
    if len(data) > limit or b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _syncfs(path: str) -> None:
    """Flush the file system holding ``path`` once (syncfs(2)), instead of an fsync per file."""
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _load_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: object) -> None:
    hostfs.replace_file(path, json.dumps(data, separators=(",", ":")).encode())
