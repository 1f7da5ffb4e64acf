"""A layer's tree read entry by entry: never through a link nor across a mount; whiteouts, digests."""
from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator

WHITEOUT = os.makedev(0, 0)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == WHITEOUT


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _walk(top: str, start: str = "", skip: Callable[[str, os.DirEntry[str]], bool] | None = None,
          strict: bool = False) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry below ``top/start``: (its path relative to ``top``, its entry), iteratively, never
    following a link nor entering a directory on another file system (the view does not cross mounts
    either). ``skip``: entries left out, and not entered. A directory that cannot be read is passed
    over, or with ``strict`` its error raised."""
    try:
        dev = os.lstat(top).st_dev
    except OSError:
        if strict:
            raise
        return
    stack = [start]
    while stack:
        r = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(top, r) if r else top))
        except OSError:
            if strict:
                raise
            continue
        for e in entries:
            rel = f"{r}/{e.name}" if r else e.name
            if skip is not None and skip(rel, e):
                continue
            yield rel, e
            if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_dev == dev:
                stack.append(rel)


def _walk_files(top: str, rel: str = "") -> Iterator[str]:
    """Every non-directory below ``top/rel`` (paths relative to ``top``)."""
    return (r for r, e in _walk(top, rel) if not e.is_dir(follow_symlinks=False))


def _digest(path: str, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "link:" + os.readlink(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _kind(st: os.stat_result) -> str:
    return "symlink" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
