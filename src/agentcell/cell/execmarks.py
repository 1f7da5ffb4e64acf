"""Under the monitor, as root: fanotify exec marks on the cell's own mounts where a program could come
from that is not the host's system — the declared paths, the home, /tmp, /dev/shm, /scratch — made by
PID 1 before the command exists and handed out over the hand-off channel (tag ``X``). Each exec from
there is then reported with the executed file itself, however soon the process exits, so the monitor
can say when a binary with privilege of its own (setuid, setgid, file capabilities) ran in the cell,
powerless on its nosuid mount. The system's trees are not marked: their setuid binaries are the host's,
and the privilege tools among them have marks of their own (:mod:`agentcell.monitor.execwatch`).

Mount marks see the cell's execs only (the mounts are the cell's), but they are not free: with one on a
mount, every open, read and close there goes through fsnotify's slower path (about 1.3 % of a file-heavy
workload on the project, bench/monitor.py). The failed-call source's exec program names every exec from
the kernel too, but a file capability is seen only through the file, which a process that exits at once
takes with it: the marks stay.
"""
from __future__ import annotations

import os

from . import fanotify
from .spec import CACHE_PATH, SCRATCH_PATH, CellSpec

FAN_MARK_MOUNT = 0x10


def planned(spec: CellSpec) -> tuple[str, ...]:
    """The mounts (paths in the cell) to mark; none unless the cell is watched, as root."""
    if not spec.watch or spec.identity.userns:
        return ()
    system = set(spec.system_paths)
    return tuple(dict.fromkeys((*spec.rw_paths, *(p for p in spec.ro_paths if p not in system),
                                spec.identity.home, "/tmp", "/dev/shm", SCRATCH_PATH,
                                *((CACHE_PATH,) if spec.cache_dir else ()))))


def mark_and_send(spec: CellSpec, ctl: object) -> None:
    """PID 1 (root in the cell, after pivot_root): mark, send the group to the supervisor. A failure
    fails the launch: the monitor would claim a watch it does not have."""
    from . import handoff

    paths = planned(spec)
    if not paths:
        return
    fd = fanotify.init(fanotify.FAN_CLASS_NOTIF)
    try:
        for p in paths:
            fanotify.mark(fd, fanotify.FAN_OPEN_EXEC, p, FAN_MARK_MOUNT)
        handoff.send_fd(ctl, fd, b"X")  # type: ignore[arg-type]
    finally:
        os.close(fd)
