"""The cell's failed system calls, from the kernel: an eBPF program on the ``sys_exit`` raw tracepoint
(every call's return, host-wide) keeps only calls that failed, in the cell's own cgroup, of the calls
that reach for something (open, exec, connect, send, mkdir, unlink, rename, link, chmod, chdir, kill, …)
with an errno that can mean "not yours" (ENOENT, EACCES, EPERM, EROFS, EXDEV, EBUSY, ESRCH, and the
network's), and hands each to the monitor through a ring buffer with the process, its name and the
path or address it named. What it means is decided in :mod:`.attempts`. A second program, on the
``sched_process_exec`` raw tracepoint, hands over each exec of the cell (as errno 0), with the new
program's name and file (its place in the kernel's structure read from the kernel's BTF,
:mod:`.btf`): a process that exits at once is still named. Two more, on ``sched_process_fork`` and
``sched_process_exit``, hand over each task of the cell that starts or ends (threads too), with the
number it has in the cell's pid namespace, into a second ring of the cell's (:class:`TaskEvent`): a
/proc entry or a pid the cell names is then told to be one of the cell's own, or a host process's,
whatever the host's pids and the cell's pid counter are (:mod:`.pidns`). A flood of threads fills
that ring, never the calls'. Every event carries the kernel's clock (CLOCK_MONOTONIC). The programs and
the layout of their events are :mod:`.callprog`; this module loads them (one copy for the host,
:mod:`.hostprog`) and decodes what they hand over.

Why this source: most of what a cell refuses, the kernel refuses without a record. A host file the cell
does not contain is ENOENT, a write to the read-only system EROFS (the mount refuses before Landlock is
asked), a datagram to the network ENETUNREACH (the cell's network namespace has no route), a host pid
ESRCH. Landlock's audit records cover only what exists in the cell and is not allowed.

Cost: the program runs at every system call's return on the host; one that succeeded costs two
instructions, one that failed in another cgroup a helper call more. Reading the path takes place at the call's
return: a thread of the same process could rewrite the buffer in between, so a path may be shown other
than it was asked for (the call failed all the same). x86_64 only (its call numbers and registers).
"""
from __future__ import annotations

import functools
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from . import bpf, hostprog
from .callprog import (
    CALLS,
    EVENT_SIZE,
    EXEC_NAME,
    HEAD,
    MSGHDR,
    NAMES,
    O_CREAT,
    O_TRUNC,
    PATH,
    PATH_MAX,
    SOCKADDR,
    TASK,
    TASK_DROPS,
    TASK_RING_SIZE,
    WORD,
    A,
    B,
    exec_program,
    program,
    spec,
    task_program,
)
from .pidns import EXIT, FORK

RING_SIZE = 4 << 20  # tens of thousands of events in flight (an event takes its head and its path)


def supported() -> str:
    """Empty if this source can run here, else why not."""
    if os.uname().machine != "x86_64":
        return f"its call table knows x86_64 only (this is {os.uname().machine})"
    if os.geteuid() != 0:
        return "eBPF needs root (CAP_BPF, CAP_PERFMON)"
    return ""


# its mode; an ending task's number in its innermost pid namespace.
EXEC_FIELDS = {"filename": ("linux_binprm", "filename"), "file": ("linux_binprm", "file"),
               "f_inode": ("file", "f_inode"), "i_mode": ("inode", "i_mode")}
TASK_FIELDS = {"pid": ("task_struct", "pid"), "tgid": ("task_struct", "tgid"),
               "thread_pid": ("task_struct", "thread_pid"), "level": ("pid", "level"), "numbers": ("pid", "numbers"),
               "upid_nr": ("upid", "nr"), "upid_ns": ("upid", "ns")}


def part(layout: dict[str, int], fields: dict[str, tuple[str, str]]) -> dict[str, int] | None:
    """The offsets ``fields`` names, if the layout has them all."""
    return layout if all(k in layout for k in fields) else None


@functools.lru_cache(maxsize=1)
def kernel_layout() -> dict[str, int]:
    """The offsets of EXEC_FIELDS and TASK_FIELDS on this kernel, as far as its BTF has them (none
    without BTF). Read from the BTF once a boot and kept in root's runtime directory: twenty sessions
    starting at once each reading 5 MB slowed the monitors already listening to the host's forks (their
    connector overflowed)."""
    import json

    from .. import hostfs
    from ..errors import AgentcellError
    from .btf import VMLINUX, offsets

    where = {**EXEC_FIELDS, **TASK_FIELDS}
    try:
        st = os.stat(VMLINUX)
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = (f"{f.read().strip()} {os.uname().release} {os.uname().version} {st.st_size} {st.st_mtime_ns} "
                   f"{sorted(where.items())}")
    except OSError:
        return {}
    cache = os.path.join(hostfs.RUN, "btf-layout.json")
    try:
        with open(cache) as f:
            kept = json.load(f)
        if kept.get("key") == key:
            return {k: int(v) for k, v in kept["layout"].items() if k in where}
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        pass
    found = offsets(where.values())
    out = {k: v for k, w in where.items() if (v := found[w]) is not None}
    try:
        hostfs.run_dir()
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "layout": out}, f)
        os.replace(tmp, cache)
    except (OSError, AgentcellError):  # (root's runtime directory unusable: read again next time)
        pass
    return out


def check() -> str:
    """Empty if the program loads here (maps made, the verifier passes: nothing is attached), else why not."""
    why = supported()
    if why:
        return why
    fds: list[int] = []
    try:
        fds.extend(_maps(1 << 16, 1))
        fds.extend(bpf.prog_load(bpf.PROG_RAW_TRACEPOINT, code, name) for _, _, code, name in _programs(*fds))
    except OSError as e:
        return str(e.strerror or e)
    finally:
        for fd in fds:
            os.close(fd)
    return ""


def _programs(table: int, cells: int, tasks: int, drops: int, scratch: int) -> list[tuple[str, str, bytes, str]]:
    """(the link's name, the raw tracepoint, the program, its name) of each program, over these maps."""
    layout = kernel_layout()
    return [("calls_link", "sys_exit", program(table, cells, drops, scratch), "agentcell_calls"),
            ("exec_link", "sched_process_exec", exec_program(cells, drops, part(layout, EXEC_FIELDS)),
             "agentcell_execs"),
            ("fork_link", "sched_process_fork", task_program(FORK, tasks, drops, part(layout, TASK_FIELDS)),
             "agentcell_forks"),
            ("exit_link", "sched_process_exit", task_program(EXIT, tasks, drops, part(layout, TASK_FIELDS)),
             "agentcell_exits")]


def _maps(ring_size: int, cells: int) -> list[int]:
    """The programs' maps: the call table (filled), ``cells`` (cgroup id -> a ring of ``ring_size``),
    ``tasks`` (cgroup id -> a task ring of TASK_RING_SIZE), ``drops`` (cgroup id, and with TASK_DROPS for
    the task ring -> count), the per-CPU buffer an event is built in."""
    fds: list[int] = []
    try:
        fds.append(bpf.map_create(bpf.MAP_ARRAY, 4, 8, 512, "agentcell_calls"))
        for nr, kinds in CALLS.values():
            bpf.map_update(fds[0], struct.pack("<I", nr), struct.pack("<Q", spec(kinds)))
        for size, name in ((ring_size, "agentcell_cells"), (min(ring_size, TASK_RING_SIZE), "agentcell_tasks")):
            like = bpf.map_create(bpf.MAP_RINGBUF, 0, 0, size, "agentcell_ring")
            try:
                fds.append(bpf.map_create(bpf.MAP_HASH_OF_MAPS, 8, 4, cells, name, inner=like))
            finally:
                os.close(like)
        fds.append(bpf.map_create(bpf.MAP_HASH, 8, 8, 2 * cells, "agentcell_drops"))
        fds.append(bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, EVENT_SIZE, 1, "agentcell_event"))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _attached() -> dict[str, int]:
    """The host's programs, loaded and attached (:mod:`.hostprog` shares them): the fds it hands over."""
    fds = _maps(RING_SIZE, hostprog.CELLS)
    out: dict[str, int] = {}
    try:
        _table, cells, tasks, drops, _scratch = fds
        for link, tracepoint, code, name in _programs(*fds):
            prog = bpf.prog_load(bpf.PROG_RAW_TRACEPOINT, code, name)
            try:
                out[link] = bpf.attach_raw_tracepoint(tracepoint, prog)
            finally:
                os.close(prog)
        out["cells"], out["tasks"], out["drops"] = os.dup(cells), os.dup(tasks), os.dup(drops)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    finally:
        for fd in fds:  # (the programs hold the table and the buffer)
            os.close(fd)
    return out


@functools.lru_cache(maxsize=1)
def _version() -> str:
    """This build of the programs (fds as placeholders)."""
    return hostprog.version(*(code for _, _, code, _ in _programs(1, 2, 3, 4, 5)), RING_SIZE, EVENT_SIZE,
                            TASK_RING_SIZE, hostprog.CELLS, repr(sorted(CALLS.items())).encode())


def hold() -> hostprog.HostPrograms:
    """The host's programs, joined or loaded and attached, held until ``hostprog.release``: a process that
    starts watched cells one after another (the warm launcher) keeps them, so that each cell's monitor
    joins them (copies of their fds) instead of loading, verifying and attaching them anew."""
    why = supported()
    if why:
        raise OSError(95, why)
    return hostprog.acquire(_version(), _attached)


class Call:
    """One failed call: ``name``, ``errno``, ``pid`` (the process, host pid), ``tid``, ``comm``, ``args``
    (raw), ``path`` and ``path2`` (as given, maybe relative), ``addr`` (("inet"|"inet6", ip, port),
    ("unix", path), ("abstract", name) or None), ``flags`` (an open's; for an exec that succeeded, its
    file's mode, with MODE_KNOWN set if it was read, and ``args[0]`` the host tid that called exec),
    ``ktime`` (the kernel's CLOCK_MONOTONIC, ns)."""

    __slots__ = ("name", "errno", "pid", "tid", "comm", "args", "path", "path2", "addr", "flags", "ktime")

    def __init__(self, name: str, errno: int, pid: int, tid: int, comm: str, args: tuple[int, ...], path: str = "",
                 path2: str = "", addr: tuple[Any, ...] | None = None, flags: int = 0, ktime: int = 0) -> None:
        self.name, self.errno, self.pid, self.tid, self.comm, self.args = name, errno, pid, tid, comm, args
        self.path, self.path2, self.addr, self.ktime = path, path2, addr, ktime
        self.flags = flags or {"open": args[1], "openat": args[2], "creat": O_CREAT | O_TRUNC | 1}.get(name, 0)

    def __repr__(self) -> str:
        return f"Call({self.name} -> {self.errno} pid {self.pid} {self.comm!r} {self.path!r} {self.path2!r} " \
               f"{self.addr!r})"


def _text(raw: bytes, at: int) -> str:
    end = raw.find(b"\0", at, at + PATH_MAX)
    return os.fsdecode(raw[at:end if end >= 0 else at + PATH_MAX])


def decode(raw: bytes) -> Call | None:
    if len(raw) < A:
        return None
    raw = raw.ljust(EVENT_SIZE, b"\0")  # (the ring holds an event as long as its paths are)
    nr, second, ret, pid_tgid, *rest = HEAD.unpack_from(raw, 0)
    args, comm, ktime = tuple(rest[:6]), rest[6].split(b"\0")[0].decode(errors="replace"), rest[7]
    name = NAMES.get(nr)
    if name is None:
        return None
    kinds = CALLS[name][1]
    call = Call(name, -ret, pid_tgid >> 32, pid_tgid & 0xFFFFFFFF, comm, args, ktime=ktime)
    first = kinds[0][0] if kinds else 0
    if first == PATH:
        call.path = _text(raw, A)
    elif first == SOCKADDR:
        length = args[5] if name == "sendto" else args[2]
        call.addr = sockaddr(raw[A:A + 110], length)
    elif first == MSGHDR:
        length = struct.unpack_from("<I", raw, B + 8)[0] if struct.unpack_from("<Q", raw, B)[0] else 0
        call.addr = sockaddr(raw[A:A + 110], length) if length else None
    if ret == 0 and name == "execve":  # an exec that succeeded (the exec program): its file's mode
        call.flags = second
        if len(os.fsencode(call.path)) >= EXEC_NAME - 1:  # cut: not a name
            call.path = ""
        return call
    if len(kinds) > 1 and kinds[1][0] == PATH:
        call.path2 = _text(raw, B)
    elif len(kinds) > 1 and kinds[1][0] == WORD:
        call.flags = struct.unpack_from("<Q", raw, B)[0]
    return call


def sockaddr(data: bytes, length: int) -> tuple[Any, ...] | None:
    """An address as the call gave it (``length`` bytes of it)."""
    if len(data) < 2:
        return None
    family = struct.unpack_from("<H", data, 0)[0]
    if family == socket.AF_INET and len(data) >= 8:
        return ("inet", socket.inet_ntop(socket.AF_INET, data[4:8]), struct.unpack_from(">H", data, 2)[0])
    if family == socket.AF_INET6 and len(data) >= 24:
        return ("inet6", socket.inet_ntop(socket.AF_INET6, data[8:24]), struct.unpack_from(">H", data, 2)[0])
    if family == socket.AF_UNIX:
        body = data[2:max(2, min(length, len(data)))]
        if body[:1] == b"\0":
            return ("abstract", body[1:].decode(errors="replace"))
        return ("unix", os.fsdecode(body.split(b"\0")[0])) if body else None
    return None


class TaskEvent(NamedTuple):
    """A task of the cell started (FORK) or ended (EXIT): its number in the cell's pid namespace (0: not
    known), its host tid and tgid, when (the kernel's CLOCK_MONOTONIC, ns)."""

    kind: int
    number: int
    tid: int
    tgid: int
    ktime: int


def decode_task(raw: bytes) -> TaskEvent | None:
    return TaskEvent(*TASK.unpack_from(raw, 0)) if len(raw) >= TASK.size else None


class FailedCalls:
    """One cell's failed calls and its tasks: two rings of its own (calls, :class:`TaskEvent`), which the
    host's programs (:mod:`.hostprog`: one copy for every cell) fill from the moment its cgroup is added
    to them; :meth:`read` and :meth:`read_tasks` what they saw. Close it when the cell has ended."""

    name = "calls"

    def __init__(self, cgroup_id: int) -> None:
        why = supported()
        if why:
            raise OSError(95, why)
        self.ring: bpf.RingBuffer | None = None
        self.tasks: bpf.RingBuffer | None = None
        self._key = struct.pack("<Q", cgroup_id)
        self._task_key = struct.pack("<Q", cgroup_id | TASK_DROPS)
        self._added: list[tuple[int, bytes]] = []  # the host's maps this cell is in, by key
        self.host: hostprog.HostPrograms | None = hostprog.acquire(_version(), _attached)
        try:
            self.ring = _ring(RING_SIZE)
            self.tasks = _ring(TASK_RING_SIZE)
            host, zero = self.host, struct.pack("<Q", 0)
            for fd, key, value in ((host.drops, self._key, zero), (host.drops, self._task_key, zero)):
                self._add(fd, key, value, cgroup_id)
            # The rings go into maps of maps, whose every update waits out an RCU grace period: the two at once.
            failed = _together([functools.partial(self._add, fd, self._key, struct.pack("<I", ring.fd), cgroup_id)
                                for fd, ring in ((host.tasks, self.tasks), (host.cells, self.ring))])
            if failed is not None:
                raise failed
        except BaseException:
            self.close()
            raise
        self._sweep()

    def _add(self, fd: int, key: bytes, value: bytes, cgroup_id: int) -> None:
        try:
            bpf.map_update(fd, key, value, bpf.NOEXIST)
        except OSError as e:
            if e.errno == 17:
                raise OSError(17, f"cgroup {cgroup_id} is watched by another monitor already") from None
            raise
        self._added.append((fd, key))

    def _sweep(self) -> None:
        """Cells whose monitor was killed before it could take them out: their cgroups are gone (an id
        is never given again), and each keeps two rings alive while the programs run."""
        from ..cell.cgroups import v2_exists

        assert self.host is not None
        try:
            for key in bpf.map_keys(self.host.cells, 8):
                group = struct.unpack("<Q", key)[0]
                if key != self._key and v2_exists(group) is False:
                    for fd, k in ((self.host.cells, key), (self.host.tasks, key), (self.host.drops, key),
                                  (self.host.drops, struct.pack("<Q", group | TASK_DROPS))):
                        try:
                            bpf.map_delete(fd, k)
                        except OSError:
                            pass
        except OSError:  # (what is not swept now is swept by the next cell)
            pass

    def fileno(self) -> int:
        assert self.ring is not None
        return self.ring.fileno()

    def read(self, limit: int = 4096) -> list[Call]:
        """The failed calls recorded since the last read (at most ``limit``); never blocks."""
        assert self.ring is not None
        return [c for c in map(decode, self.ring.records(limit)) if c is not None]

    def read_tasks(self, limit: int = 1 << 16) -> list[TaskEvent]:
        """The cell's tasks started and ended since the last read (at most ``limit``); never blocks."""
        assert self.tasks is not None
        return [t for t in map(decode_task, self.tasks.records(limit)) if t is not None]

    def dropped(self) -> int:
        """Failed calls the kernel could not hand over (the ring was full), since the start."""
        assert self.host is not None
        return int(struct.unpack("<Q", bpf.map_lookup(self.host.drops, self._key, 8))[0])

    def tasks_dropped(self) -> int:
        """Task events the kernel could not hand over (a flood of threads filled the task ring)."""
        assert self.host is not None
        return int(struct.unpack("<Q", bpf.map_lookup(self.host.drops, self._task_key, 8))[0])

    def close(self) -> None:
        """Let go of the rings (read to their end by now) at once; take them out of the host's maps and
        release the programs in a thread of its own (:func:`settle` waits for it): an update of a map of
        maps waits out an RCU grace period, which the cell's end need not wait for. Until then the
        programs may still write to them: what they write there is read by no one, and an entry whose
        cgroup is gone is swept by the next cell (:meth:`_sweep`) should this process not finish."""
        added, self._added = self._added, []
        for ring in (self.ring, self.tasks):
            if ring is not None:
                ring.close()
                os.close(ring.fd)
        self.ring = self.tasks = None
        host, self.host = self.host, None
        if host is None:
            return

        def out() -> None:  # (out of the maps of maps first, at once; then the counters)
            nested = {host.cells, host.tasks}
            _together([functools.partial(_delete, fd, key) for fd, key in added if fd in nested])
            for fd, key in added:
                if fd not in nested:
                    _delete(fd, key)
            hostprog.release(host)

        t = threading.Thread(target=out, name="agentcell-bpf-close")
        t.start()
        _closing.append(t)


_closing: list[threading.Thread] = []


def settle() -> None:
    """Wait until every cell this process watched is out of the host's maps (:meth:`FailedCalls.close`).
    A process that ends with ``os._exit`` calls this first; one that returns from its main, at exit,
    waits for those threads anyway."""
    while _closing:
        _closing.pop().join()


def _delete(fd: int, key: bytes) -> None:
    try:
        bpf.map_delete(fd, key)
    except OSError:
        pass


def _together(jobs: list[Callable[[], None]]) -> BaseException | None:
    """Run the jobs side by side (the first here, each other in a thread of its own, joined before this
    returns); the first exception one raised, or None. For updates of maps of maps: the kernel makes each
    wait for an RCU grace period (synchronize_rcu, 15-20 ms on a small machine), and waits side by side
    share one."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,), name="agentcell-bpf") for job in jobs[1:]]
    for t in threads:
        t.start()
    if jobs:
        run(jobs[0])
    for t in threads:
        t.join()
    return errors[0] if errors else None


def _ring(size: int) -> bpf.RingBuffer:
    fd = bpf.map_create(bpf.MAP_RINGBUF, 0, 0, size, "agentcell_ring")
    try:
        return bpf.RingBuffer(fd, size)
    except BaseException:
        os.close(fd)
        raise
