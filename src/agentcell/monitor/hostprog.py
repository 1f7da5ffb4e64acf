"""One copy of the failed-call programs for the whole host, shared by every monitor that runs.

A program on the ``sys_exit`` raw tracepoint runs at every system call's return on the host, whoever
makes it. Measured here (a ``getppid`` loop, retpolines): 97 ns a call with none attached, 121 ns with
one, 271 ns with five — each program attached costs every call on the host about 35 ns more. One
program per cell made twenty sessions cost every process on the host some 700 ns a call. So there is
one: it finds the cell a call belongs to by its cgroup (a map of the watched cgroups' ids to their
own rings, which each monitor adds itself to and takes itself out of), and each cell's events go into
its own ring only.

Shared within a process by a count, and between processes without a daemon and without pinning
anything in a bpf filesystem: a monitor that finds another agentcell process holding the programs
(``/run/agentcell/calls.json``, root's alone, read and written under ``calls.lock``) takes copies of
its file descriptors with ``pidfd_getfd(2)``, each checked to be the very object the holder recorded
(the kernel's id for it, given once a boot: a pid reused since by another process cannot hand over
something else). The kernel counts the holders: the programs stay attached while any monitor holds
their links, and go when the last one closes them, however it ends (a killed supervisor's fds are
closed by the kernel). Nothing is left behind.

Holders with another build of the programs (another agentcell version) are not joined: each build
runs its own.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import hostfs
from . import bpf

SYS_PIDFD_GETFD = 438  # x86_64 (the programs' call table knows x86_64 only)
CELLS = 4096  # cells watched at once on a host, at most
SHARED = ("cells", "tasks", "drops", "calls_link", "exec_link", "fork_link", "exit_link")  # what a holder hands over

_lock = threading.Lock()
_host: HostPrograms | None = None
_users = 0


class HostPrograms:
    """The attached programs and the three maps each monitor writes: ``cells`` (cgroup id -> its ring),
    ``tasks`` (cgroup id -> its task ring) and ``drops`` (cgroup id -> events its rings had no room for)."""

    def __init__(self, fds: dict[str, int]) -> None:
        self.fds = fds
        self.cells, self.tasks, self.drops = fds["cells"], fds["tasks"], fds["drops"]

    def ids(self) -> dict[str, str]:
        return {name: bpf.object_id(fd) for name, fd in self.fds.items()}

    def close(self) -> None:
        for name in reversed(SHARED):  # the links first: the programs stop before their maps go
            fd = self.fds.get(name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fds = {}


def _forget() -> None:
    """In a child forked without exec: the parent's holding is not the child's (its copies of the fds
    are closed by its exec, or with it)."""
    global _host, _users
    _host, _users = None, 0


os.register_at_fork(after_in_child=_forget)


def acquire(version: str, create: Callable[[], dict[str, int]]) -> HostPrograms:
    """The host's programs of this ``version`` (a digest of their build), joined or made (``create``
    loads and attaches them and returns SHARED's fds); :func:`release` when done."""
    global _host, _users
    with _lock:
        if _host is None:
            _host = _join_or_create(version, create)
        _users += 1
        return _host


def release(host: HostPrograms) -> None:
    """One user fewer; the process's last lets go of its fds (the kernel detaches the programs when no
    process holds them any more) and takes itself off the list of holders."""
    global _host, _users
    with _lock:
        if host is not _host:
            return
        _users -= 1
        if _users > 0:
            return
        _host = None
        try:
            with _registry() as holders:
                holders[:] = [h for h in holders if h.get("pid") != os.getpid()]
        except OSError:  # an entry left behind is checked before use by whoever reads it
            pass
        host.close()


def _join_or_create(version: str, create: Callable[[], dict[str, int]]) -> HostPrograms:
    host = None
    try:
        with _registry() as holders:
            live, mine = [], None
            for h in holders:
                if h.get("pid") == os.getpid() or not _alive(h.get("pid")):
                    continue  # (our own: a fork's leftover, or a crash we survived; none are open here)
                if mine is None and h.get("version") == version:
                    mine = _take(h)
                    if mine is None:  # alive, but not holding them any more (or another process by that pid)
                        continue
                live.append(h)
            host = HostPrograms(mine if mine is not None else create())
            ids = host.ids()
            if not all(ids.values()):
                raise OSError(5, "the failed-call programs' objects have no id in fdinfo")
            live.append({"pid": os.getpid(), "start": _started(os.getpid()), "version": version,
                         "fds": {name: [fd, ids[name]] for name, fd in host.fds.items()}})
            holders[:] = live
    except BaseException:  # (the list not written: nobody could find these, so nobody keeps them)
        if host is not None:
            host.close()
        raise
    return host


def _take(holder: dict[str, Any]) -> dict[str, int] | None:
    """Copies of a live holder's fds, each the object it recorded; None if any is not (it has gone,
    closed them, or its pid is another process's now)."""
    got: dict[str, int] = {}
    try:
        pidfd = os.pidfd_open(int(holder["pid"]))
    except (OSError, KeyError, TypeError, ValueError):
        return None
    try:
        # The process the pidfd holds (its number cannot be given again while it is held) is the one
        # listed: started when it was. Another process by that number is never asked for its fds.
        if holder.get("start") is None or _started(int(holder["pid"])) != holder["start"]:
            return None
        for name in SHARED:
            fd, oid = holder["fds"][name]
            new = _pidfd_getfd(pidfd, int(fd))
            got[name] = new
            if bpf.object_id(new) != oid:
                raise OSError(3, f"{name} is another object now")
    except (OSError, KeyError, TypeError, ValueError):
        for fd in got.values():
            os.close(fd)
        return None
    finally:
        os.close(pidfd)
    return got


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    new = libc.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd), ctypes.c_long(0))
    if new < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(new)  # (close-on-exec, as the kernel makes it)


def _started(pid: int) -> int | None:
    """When the process started (clock ticks since boot: /proc/PID/stat's 22nd field), or None."""
    try:
        return hostfs.start_time(pid)
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and os.path.exists(f"/proc/{pid}")


@contextlib.contextmanager
def _registry() -> Iterator[list[dict[str, Any]]]:
    """The list of holders, under the host's lock (flock: let go when the holder dies); written back
    whole (a rename) when the block ends without an error."""
    run = hostfs.run_dir()
    path = os.path.join(run, "calls.json")
    fd = os.open(os.path.join(run, "calls.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                kept = json.load(f)
            holders = [h for h in kept.get("holders", []) if isinstance(h, dict)] \
                if kept.get("boot") == _boot() else []
        except (OSError, ValueError, AttributeError):
            holders = []
        yield holders
        tmp = f"{path}.{os.getpid()}"
        for name in os.listdir(run):  # (under the lock no one else is writing: a copy there is a dead writer's)
            if name.startswith("calls.json.") and name[len("calls.json."):].isdigit():
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(run, name))
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600),
                      "w") as f:
                json.dump({"boot": _boot(), "holders": holders}, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    finally:
        os.close(fd)  # (the lock goes with it)


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def version(*parts: bytes | int) -> str:
    """A digest of a build of the programs (their instructions, sizes): holders of another are not joined."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else struct.pack("<q", p))
    return h.hexdigest()[:16]
