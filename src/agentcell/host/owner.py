"""A session's cell host and ``session recover`` never work on one session at once.

A session's cell host is a process of its own: when the session's supervisor is killed while its host is
starting the cell, the host goes on, and ``session recover`` (which runs once the supervisor is gone) could
tear the session down (its firewall table, its account, its cgroup) just before the host starts the agent,
which would then run without its rule after the session's last record. The lifecycle model found that order
(model/lifecycle.pml, ``REVERT_HOST_UNLOCKED``). So:

* the cell host takes the cell's lock (``<socket dir>/hosts/CELL_ID.lock``, flock) before anything of the
  cell exists, and keeps it until it exits; holding it, it refuses to start when its client (the
  supervisor) is gone already;
* ``session recover`` takes the same lock before it kills the cell by its name: it waits for a host that
  has it to end the cell (a host ends its cell when its supervisor is gone), and a host that comes later
  finds its supervisor gone and refuses.

A flock is let go when its holder dies: a killed host or recover leaves nothing held.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from .. import hostfs
from ..errors import AgentcellError

WAIT_S = 60.0  # how long recover waits for a host that holds the lock to end its cell


def _path(cell_id: str) -> str:
    if not cell_id or not all(c.isalnum() or c in "-_" for c in cell_id):
        raise ValueError(f"not a cell id: {cell_id!r}")
    d = hostfs.private_dir(os.path.join(hostfs.private_dir(hostfs.socket_dir()), "hosts"))
    return os.path.join(d, f"{cell_id}.lock")


def _open(cell_id: str) -> int:
    return os.open(_path(cell_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def hold(cell_id: str, gone: Callable[[], bool]) -> int:
    """For the cell host, before it makes anything of the cell: the lock, held until this process ends (the
    fd returned is never closed). ``gone`` says whether the client is gone; it is asked once the lock is
    held, and if it is, the lock is let go and the start refused."""
    import fcntl

    fd = _open(cell_id)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (only a recover holds it against us, and only for a moment)
        if gone():
            raise AgentcellError("cell", "the session's supervisor is gone", "'agentcell session recover' "
                                 "finishes the session")
    except BaseException:
        os.close(fd)
        raise
    return fd


def wait_ended(cell_id: str, timeout: float = WAIT_S) -> bool:
    """For recover, before it kills the cell by its name: wait until no cell host of the cell holds the
    lock (it ends its cell once its supervisor is gone, then exits); False if one still held it after
    ``timeout`` seconds. The lock file is removed: a host still to come refuses (its supervisor is gone)."""
    import fcntl

    try:
        fd = _open(cell_id)
    except OSError:
        return True
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        forget(cell_id)
        return True
    finally:
        os.close(fd)


def forget(cell_id: str) -> None:
    """Remove the cell's lock file: by recover once it holds the lock, and by cleanup once the cell has
    ended. Never by a host: a later host of the cell would lock a new file that recover does not wait on."""
    try:
        os.unlink(_path(cell_id))
    except (OSError, ValueError):
        pass
