"""Open paths without following symlinks, so later steps work on fds, never on names again."""
from __future__ import annotations

import os
import stat

from ..errors import LaunchError

_O_PATH_NOFOLLOW = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def open_nofollow(path: str, *, dir_fd: int | None = None) -> int:
    """Open ``path`` (absolute, or relative to ``dir_fd``) with O_PATH, refusing any symlink component.

    The policy already resolved ``path`` with realpath; a symlink found now means something was
    swapped since, so the launch is refused rather than followed.
    """
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", _O_PATH_NOFOLLOW | os.O_DIRECTORY) if dir_fd is None else os.dup(dir_fd)
    try:
        for i, part in enumerate(parts):
            if part == "..":
                raise LaunchError("resolve", f"{path}: '..' is not allowed in a cell path")
            nfd = os.open(part, _O_PATH_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                where = "/" + "/".join(parts[: i + 1])
                raise LaunchError(
                    "resolve", f"{path}: {where} is a symlink (it changed after the policy was compiled)"
                )
        return fd
    except OSError as e:
        os.close(fd)
        raise LaunchError("resolve", f"{path}: {e.strerror}") from None
    except LaunchError:
        os.close(fd)
        raise


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"
