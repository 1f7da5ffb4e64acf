"""cgroups: every cell gets its own cgroup, so it can be limited, frozen and killed as a whole.

Two layouts, detected at the standard places: cgroup v2 (one tree; controllers enabled in the
parent's ``cgroup.subtree_control``; processes only in leaves) and hybrid/v1 hosts (memory, cpu,
pids and freezer hierarchies, plus a cgroup2 mounted at /sys/fs/cgroup/unified whose
``cgroup.kill`` and ``cgroup.freeze`` work). A cell's groups are ``agentcell/<cell id>`` in each.

As root the groups live under ``agentcell/`` at the top of each hierarchy. An unprivileged caller has
groups only where some were delegated to it (:func:`delegated`: its own cgroup in each hierarchy, owned
by its uid: what systemd's ``Delegate=yes`` gives a user's manager or a ``systemd-run --user --scope``,
or root's ``chown`` of a group): the cell's groups are made below those, and its records kept in the
caller's own runtime directory.

Defaults protect the host without breaking builds: at most 4096 tasks (a fork bomb stops there, a
parallel build does not) and 75 % of RAM (the host keeps a quarter); CPU is not capped unless asked.
OPS-1's profile (``--limits ops1``): 2 GiB, 50 % of one core, 64 tasks.
"""
from __future__ import annotations

import os
import time

from .. import hostfs
from ..errors import LaunchError

ROOT = "/sys/fs/cgroup"
PARENT = "agentcell"
RECORDS = f"{hostfs.RUN}/cgroups"  # one file per live cell cgroup (root's state; see ARCHITECTURE)
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer")
STALE_S = 30  # a record this old whose groups hold no process was left by a supervisor that died
CPU_PERIOD_US = 100_000
DEFAULT_PIDS = 4096


def default_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 * 3 // 4
    return 0


def layout() -> str:
    """v2, hybrid, v1 or none, from the standard mount points."""
    if os.path.exists(f"{ROOT}/cgroup.controllers"):
        return "v2"
    if any(os.path.exists(f"{ROOT}/{c}/tasks") for c in ("memory", "pids", "cpu")):
        return "hybrid" if os.path.exists(f"{ROOT}/unified/cgroup.controllers") else "v1"
    return "none"


def v2_exists(cgroup_id: int) -> bool | None:
    """Whether a cgroup v2 directory with this id (its inode number, as eBPF sees it) exists now: the
    kernel opens it by its file handle (kernfs: the id itself), or says it is stale. None if that
    cannot be asked (no cgroup2 mounted, no CAP_DAC_READ_SEARCH)."""
    import ctypes
    import struct

    v2 = ROOT if layout() == "v2" else f"{ROOT}/unified"
    try:
        root = os.open(v2, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        handle = ctypes.create_string_buffer(struct.pack("<IiQ", 8, 0xFE, cgroup_id))  # FILEID_KERNFS
        fd = libc.open_by_handle_at(root, handle, os.O_RDONLY | os.O_PATH | os.O_CLOEXEC)
        if fd >= 0:
            os.close(fd)
            return True
        return False if ctypes.get_errno() in (116, 2) else None  # ESTALE, ENOENT: gone
    finally:
        os.close(root)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _write_new(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    """A control file's text ("" if it cannot be read). Not open(): its text layer costs more than the read
    (four of these end every cell's result)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _count(text: str, key: str) -> int:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def records_dir() -> str:
    """Where the records of live cell groups are: root's runtime directory, or the caller's own."""
    return RECORDS if os.geteuid() == 0 else os.path.join(hostfs.socket_dir(), "cgroups")


def _own_cgroups() -> dict[str, str]:
    """The caller's own cgroup in each hierarchy (``/proc/self/cgroup``): a v1 controller, or
    ``unified`` (cgroup v2), to its directory."""
    out: dict[str, str] = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            out["unified"] = (ROOT if layout() == "v2" else f"{ROOT}/unified") + path.rstrip("/")
        for c in controllers.split(","):
            if c in V1_CONTROLLERS:
                out[c] = f"{ROOT}/{c}" + path.rstrip("/")
    return out


def _ours(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.geteuid() and os.access(path, os.W_OK) and \
            os.access(f"{path}/cgroup.procs", os.W_OK)
    except OSError:
        return False


def delegated() -> dict[str, str] | None:
    """For an unprivileged caller: the groups delegated to it, by hierarchy (its own cgroup in each, when
    its uid owns it and may write its ``cgroup.procs``), or None when one that ceilings need is not: on
    cgroup v2 the unified one; on v1 and hybrid hosts memory, cpu and pids (the freezer, cpuacct and the
    unified tree of a hybrid host are used when they are delegated too)."""
    kind = layout()
    own = _own_cgroups()
    needed = ("unified",) if kind == "v2" else ("memory", "cpu", "pids") if kind in ("v1", "hybrid") else ()
    if not needed or not all(k in own and _ours(own[k]) for k in needed):
        return None
    return {k: d for k, d in own.items() if _ours(d)}


def how_to_delegate() -> str:
    """What gives an unprivileged user cgroups of their own here (for ``doctor`` and refusals)."""
    if layout() == "v2":
        return ("run it in a delegated scope: systemd-run --user --scope -p Delegate=yes agentcell ... (the user's "
                "systemd manager, with memory, cpu and pids delegated: systemctl edit user@.service, Delegate=yes)")
    return ("ask root to delegate a group in each of the memory, cpu and pids hierarchies: mkdir "
            f"{ROOT}/{{memory,cpu,pids}}/USER, chown it to you, and start your shell inside it")


def sweep() -> list[str]:
    """Remove the groups of cells whose supervisor died (SIGKILL) before it could: a record older
    than STALE_S whose groups hold no process. Returns the records removed."""
    removed: list[str] = []
    records = records_dir()
    try:
        names = os.listdir(records)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        record = os.path.join(records, name)
        try:
            if now - os.lstat(record).st_mtime < STALE_S:
                continue
            dirs = [d for d in _read(record).split("\n") if d.startswith(ROOT + "/")]
        except OSError:
            continue
        if any(_read(f"{d}/cgroup.procs").strip() for d in dirs):
            continue  # still running
        stale = CellCgroup("", {})
        stale.created, stale.record = [d for d in dirs if os.path.isdir(d)], record
        stale.remove()
        removed.append(record)
    return removed


def _leave_room(top: str, wanted: set[str]) -> set[str]:
    """cgroup v2 lets a group enable controllers for its children only while it holds no process itself;
    a delegated group holds the caller (and its shell, maybe). Those of its processes that are the
    caller's own move to a leaf of it, ``agentcell-here``; then the controllers it can enable are
    returned (none if another's process stays: then the cell gets no ceilings from this tree)."""
    procs = [p for p in _read(f"{top}/cgroup.procs").split() if p.isdigit()]
    if procs:
        here = f"{top}/agentcell-here"
        os.makedirs(here, exist_ok=True)
        for p in procs:
            try:
                _write(f"{here}/cgroup.procs", p)
            except OSError:
                return set()
    return wanted & set(_read(f"{top}/cgroup.controllers").split())


def _top_of(d: str) -> str:
    """The group a cell's group ``d`` (``TOP/agentcell/<cell id>``) was made below: its hierarchy's root,
    or the group delegated to the caller."""
    return d.rsplit("/" + PARENT + "/", 1)[0]


def _thread_file(d: str) -> str:
    """A v1 group's ``tasks`` (a thread's own move), or its ``cgroup.procs`` where only that one was given
    to the caller (a group delegated by chown of the directory and cgroup.procs alone)."""
    tasks = f"{d}/tasks"
    return tasks if os.geteuid() == 0 or os.access(tasks, os.W_OK) else f"{d}/cgroup.procs"


class Limits:
    def __init__(self, memory: int | None, cpu_percent: int | None, pids: int | None) -> None:
        self.memory, self.cpu_percent, self.pids = memory, cpu_percent, pids


class CellCgroup:
    """The cell's groups: ``dirs`` maps a controller (or "unified") to its directory."""

    def __init__(self, kind: str, dirs: dict[str, str]) -> None:
        self.kind, self.dirs = kind, dirs
        self.created: list[str] = []
        self.controllers: set[str] = {"memory", "cpu", "pids"}  # v2: those the tree really has
        self.record = ""

    @classmethod
    def create(cls, cell_id: str, limits: Limits, delegated_to_us: dict[str, str] | None = None) -> CellCgroup:
        """The cell's groups, as root at the top of each hierarchy, or below the groups delegated to an
        unprivileged caller (:func:`delegated`)."""
        kind = layout()
        if kind == "none":
            raise LaunchError("cgroup", "no cgroup filesystem is mounted", "see 'agentcell doctor'")
        dirs: dict[str, str] = {}
        cg = cls(kind, dirs)
        cg.record = os.path.join(records_dir(), cell_id)
        sweep()
        if delegated_to_us is not None:
            tops = dict(delegated_to_us)
        elif kind == "v2":
            tops = {"unified": ROOT}
        else:
            tops = {c: f"{ROOT}/{c}" for c in (*V1_CONTROLLERS, "unified")}
        planned = [f"{top}/{PARENT}/{cell_id}" for top in tops.values()]
        try:
            # Recorded before it exists, so a crash's leftovers can always be found and removed.
            if delegated_to_us is None:
                hostfs.run_dir("cgroups")
            else:
                hostfs.private_dir(records_dir())
            _write_new(cg.record, "\n".join(planned) + "\n")
            if kind == "v2":
                top = tops["unified"]
                # Only controllers this tree has (on a hybrid host a v2 tree may have none of them).
                have = set(_read(f"{top}/cgroup.controllers").split()) & {"memory", "cpu", "pids"}
                if have and delegated_to_us is not None:
                    have &= _leave_room(top, have)
                cg.controllers = have
                os.makedirs(f"{top}/{PARENT}", exist_ok=True)
                for d in (top, f"{top}/{PARENT}"):
                    if have:
                        _write(f"{d}/cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(have)))
                d = dirs["unified"] = cg._mkdir(f"{top}/{PARENT}/{cell_id}")
                if limits.memory and "memory" in have:
                    _write(f"{d}/memory.max", str(limits.memory))
                    if os.path.exists(f"{d}/memory.swap.max"):
                        _write(f"{d}/memory.swap.max", "0")
                if limits.cpu_percent and "cpu" in have:
                    _write(f"{d}/cpu.max", f"{limits.cpu_percent * CPU_PERIOD_US // 100} {CPU_PERIOD_US}")
                if limits.pids and "pids" in have:
                    _write(f"{d}/pids.max", str(limits.pids))
                return cg._held(limits, have) if delegated_to_us is not None else cg
            for ctrl in V1_CONTROLLERS:
                if ctrl in tops and os.path.exists(f"{ROOT}/{ctrl}/tasks"):
                    dirs[ctrl] = cg._mkdir(f"{tops[ctrl]}/{PARENT}/{cell_id}")
            if kind == "hybrid" and "unified" in tops:
                dirs["unified"] = cg._mkdir(f"{tops['unified']}/{PARENT}/{cell_id}")
            if limits.memory and "memory" in dirs:
                _write(f"{dirs['memory']}/memory.limit_in_bytes", str(limits.memory))
            if limits.cpu_percent and "cpu" in dirs:
                _write(f"{dirs['cpu']}/cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(f"{dirs['cpu']}/cpu.cfs_quota_us", str(limits.cpu_percent * CPU_PERIOD_US // 100))
            if limits.pids and "pids" in dirs:
                _write(f"{dirs['pids']}/pids.max", str(limits.pids))
            return cg._held(limits, set(dirs)) if delegated_to_us is not None else cg
        except OSError as e:
            cg.remove()
            raise LaunchError("cgroup", f"{e.filename or ''}: {e.strerror}", "see 'agentcell doctor'") from None
        except BaseException:  # (a SIGTERM, say, while the groups are being made): none of them is left
            cg.created = [*cg.created, *(d for d in planned if d not in cg.created and os.path.isdir(d))]
            cg.remove()
            raise

    def _held(self, limits: Limits, have: set[str]) -> CellCgroup:
        """Fail closed, below a group delegated to the caller: a ceiling asked for whose controller it
        does not give (a v2 group with only pids delegated, one that still holds another's process) is a
        launch refused, never a cell run without it while the summary names it. (Root's own trees give
        every controller the host has; a hybrid host's v2 tree gives none, and v1 holds them.)"""
        missing = [c for c, want in (("memory", limits.memory), ("cpu", limits.cpu_percent),
                                     ("pids", limits.pids)) if want and c not in have]
        if missing:
            self.remove()
            raise LaunchError("cgroup", f"the ceilings need the {', '.join(missing)} controller"
                              f"{'s' if len(missing) > 1 else ''}, and the cgroup tree here does not give "
                              f"{'them' if len(missing) > 1 else 'it'}",
                              "delegate them (systemd's Delegate=yes), or run without ceilings (--ceilings off)")
        return self

    def _mkdir(self, path: str) -> str:
        for attempt in range(3):  # another cell's cleanup may remove the shared parent in between
            try:
                os.mkdir(path, 0o755)  # (the shared parent is usually there: made only when it is not)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.created.append(path)  # at once, so a failure further on still removes it
        return path

    def v2_id(self) -> int | None:
        """The id of the cell's cgroup v2 directory (its inode number: what eBPF's
        bpf_get_current_cgroup_id gives for the cell's processes), or None without one."""
        d = self.dirs.get("unified")
        try:
            return os.stat(d).st_ino if d else None
        except OSError:
            return None

    def join_v1(self) -> None:
        """Move the calling process (and so all it forks) into the cell's v1 groups (hybrid and v1 hosts).

        Only for a single-threaded caller (C1, or a PID 1 cloned straight into its namespaces): a group is
        joined through its ``tasks`` file, which moves the one thread, so the whole process. A
        ``cgroup.procs`` write (or a thread's move of another) takes the host-wide cgroup_threadgroup_rwsem,
        whose first taker after a quiet spell waits out an RCU grace period (5-15 ms here); a thread's move
        of itself does not."""
        for kind, d in self.dirs.items():
            if kind != "unified":
                _write(_thread_file(d), "0")

    def open_v2(self) -> int:
        """An fd of the cell's cgroup v2 group, for a child to be born in (:func:`agentcell.cell.syscalls.clone3`),
        or -1 without one (:meth:`join_v2` where the kernel will not)."""
        d = self.dirs.get("unified")
        return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if d else -1

    def join_v2(self) -> int:
        """Move the calling process into the cell's cgroup v2 group, where the kernel will not let a child
        be born there (lock and wait included); the fd of the way back out (see :meth:`way_out`)."""
        d = self.dirs["unified"]
        out = os.open(f"{_top_of(d)}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        try:
            _write(f"{d}/cgroup.procs", "0")
        except BaseException:
            os.close(out)
            raise
        return out

    def adopt(self, pid: int) -> None:
        """Move another process into every group of the cell: one that serves the cell alone (its
        egress proxy) and so counts against the cell's ceilings, and goes when the cell is killed."""
        for d in self.dirs.values():
            _write(f"{d}/cgroup.procs", str(pid))

    def way_out(self) -> list[int]:
        """fds of the ``tasks`` files (:func:`_thread_file`) of the groups the cell's v1 groups were made in,
        opened now: C1 leaves through them after it forked PID 1, when PID 1's pivot_root may already
        have replaced the root of their shared mount namespace (and /sys with it)."""
        return [os.open(_thread_file(_top_of(d)), os.O_WRONLY | os.O_CLOEXEC)
                for kind, d in self.dirs.items() if kind != "unified"]

    @staticmethod
    def leave(way_out: list[int]) -> None:
        """Move the calling process back to the groups it came from (C1: only the cell proper stays inside)."""
        for fd in way_out:
            os.write(fd, b"0")
            os.close(fd)

    def freeze(self) -> None:
        """Stop every process of the cell where it stands (cgroup v2 ``cgroup.freeze``; the v1 freezer on
        hosts without a unified hierarchy). A frozen cell can still be killed."""
        if "unified" in self.dirs and os.path.exists(f"{self.dirs['unified']}/cgroup.freeze"):
            _write(f"{self.dirs['unified']}/cgroup.freeze", "1")
        elif "freezer" in self.dirs:
            _write(f"{self.dirs['freezer']}/freezer.state", "FROZEN")
        else:
            raise OSError("no freezer for this cell")

    def frozen(self) -> bool:
        if "unified" in self.dirs:
            return "frozen 1" in _read(f"{self.dirs['unified']}/cgroup.events")
        return _read(f"{self.dirs.get('freezer', '')}/freezer.state").strip() == "FROZEN"

    def kill(self) -> bool:
        """Kill every process of the cell at once, if the kernel has cgroup.kill."""
        if "unified" not in self.dirs or not os.path.exists(f"{self.dirs['unified']}/cgroup.kill"):
            return False
        try:
            _write(f"{self.dirs['unified']}/cgroup.kill", "1")
            return True
        except OSError:
            return False

    def events(self) -> dict[str, int]:
        """OOM kills, how often the task limit refused a fork, and how many periods the CPU ceiling held
        the cell back, from the cell's own accounting."""
        if self.kind == "v2":
            d = self.dirs["unified"]
            return {"oom_kills": _count(_read(f"{d}/memory.events"), "oom_kill"),
                    "pids_limit_hits": _count(_read(f"{d}/pids.events"), "max"),
                    "cpu_throttled": _count(_read(f"{d}/cpu.stat"), "nr_throttled")}
        mem, pids, cpu = self.dirs.get("memory"), self.dirs.get("pids"), self.dirs.get("cpu")
        return {"oom_kills": _count(_read(f"{mem}/memory.oom_control"), "oom_kill") if mem else 0,
                "pids_limit_hits": _count(_read(f"{pids}/pids.events"), "max") if pids else 0,
                "cpu_throttled": _count(_read(f"{cpu}/cpu.stat"), "nr_throttled") if cpu else 0}

    def cpu_usage_s(self) -> float:
        if self.kind == "v2":
            return _count(_read(f"{self.dirs['unified']}/cpu.stat"), "usage_usec") / 1e6
        acct = self.dirs.get("cpuacct") or self.dirs.get("cpu")
        text = _read(f"{acct}/cpuacct.usage").strip() if acct else ""
        return int(text) / 1e9 if text.isdigit() else 0.0

    def memory_current(self) -> int:
        """Bytes of memory the cell uses now (0 where the tree has no memory controller)."""
        if self.kind == "v2":
            path = f"{self.dirs['unified']}/memory.current"
        elif "memory" in self.dirs:
            path = f"{self.dirs['memory']}/memory.usage_in_bytes"
        else:
            return 0
        text = _read(path).strip()
        return int(text) if text.isdigit() else 0

    def remove(self, wait_s: float = 5.0) -> None:
        """Remove the cell's groups (empty by now, or soon: PID 1 reports just before it exits, and a cell
        killed whole leaves zombies that the host's init reaps when it gets to them). A group still busy
        after ``wait_s`` keeps the cell's record, so that :func:`sweep` removes it later."""
        deadline, left = time.monotonic() + wait_s, False
        for d in self.created:
            tries = 0
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left = True
                        break
                    tries += 1
                    time.sleep(0.0005 if tries < 400 else 0.01)
            try:
                os.rmdir(os.path.dirname(d))  # the shared agentcell/ parent, when no other cell uses it
            except OSError:
                pass
        if self.record and not left:
            try:
                os.unlink(self.record)
            except FileNotFoundError:
                pass


# ---- teardown by a cell's name alone (session recover, a lost host) ---------------------------------


def groups_of(cell_id: str) -> list[str]:
    """Every group of a cell on this host, v2 or hybrid/v1 (one per controller), whether or not its
    record (``RECORDS``) survived."""
    import glob

    return sorted({*glob.glob(f"{ROOT}/{PARENT}/{glob.escape(cell_id)}"),
                   *glob.glob(f"{ROOT}/*/{PARENT}/{glob.escape(cell_id)}")})


def _procs(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def kill_by_name(cell_id: str) -> None:
    """Kill every process of a cell whose handle is gone, through its groups: frozen first, then
    ``cgroup.kill`` where the kernel has it, else each member (a frozen member cannot fork or exit, so
    its pid names it until it is killed)."""
    dirs = groups_of(cell_id)
    for d in dirs:
        _poke(d, "cgroup.freeze", "1")
        _poke(d, "freezer.state", "FROZEN")
    for _ in range(200):
        members = {p for d in dirs for p in _procs(d)}
        if not members:
            break
        for d in dirs:
            _poke(d, "cgroup.kill", "1")
        for pid in members:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for d in dirs:  # a killed process of a frozen v1 group dies only once thawed
            _poke(d, "freezer.state", "THAWED")
        time.sleep(0.01)


def _poke(group: str, name: str, value: str) -> None:
    """Write one of a group's control files, where the kernel (or the group's hierarchy) has it."""
    try:
        _write(os.path.join(group, name), value)
    except OSError:  # not in this hierarchy, or the group is gone already
        pass


def remove_by_name(cell_id: str) -> list[str]:
    """Kill and remove a cell's groups by its name alone (no handle: its supervisor may be gone);
    each group that would not go is a problem line."""
    kill_by_name(cell_id)
    problems = []
    for d in groups_of(cell_id):
        for _ in range(200):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                err = e
                time.sleep(0.01)
        else:
            problems.append(f"cgroup {d}: {err.strerror}")
            continue
        try:
            os.rmdir(os.path.dirname(d))  # the shared agentcell/ parent, when no other cell uses it
        except OSError:
            pass
    try:
        os.unlink(os.path.join(RECORDS, cell_id))
    except OSError:
        pass
    return problems
