"""An ID mapping for an idmapped mount: a user namespace that exists only to carry the mapping.

A mount made idmapped (``mount_setattr`` with ``MOUNT_ATTR_IDMAP``) shows a file whose owner on disk is
``inside`` as owned by ``outside``, and writes back the other way. The namespace is made by a child
that unshares it and waits while we write its maps (the only way the kernel takes them), then goes;
its file descriptor is all that is kept. No other id is mapped: a file owned by anyone else shows as
the overflow id (nobody) and keeps only what its mode gives others.
"""
from __future__ import annotations

import os

from ..errors import forked
from . import syscalls as sc


def userns_fd(uid: tuple[int, int], gid: tuple[int, int]) -> int:
    """A user namespace mapping ``uid[0]`` to ``uid[1]`` and ``gid[0]`` to ``gid[1]`` (only those)."""
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    with forked() as pid:
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(ready_r)
                os.close(go_w)
                sc.unshare(sc.CLONE_NEWUSER)
                os.write(ready_w, b"u")
                os.read(go_r, 1)  # until the maps are written and the namespace is held
                code = 0
            finally:
                os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    try:
        if os.read(ready_r, 1) != b"u":
            raise OSError("the id-mapping namespace could not be made (unshare of a user namespace failed)")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"{uid[0]} {uid[1]} 1\n")
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{gid[0]} {gid[1]} 1\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(go_w)  # the child reads end-of-file and goes
        os.waitpid(pid, 0)
