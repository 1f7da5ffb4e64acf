"""The launcher: the ordered steps that turn a :class:`CellSpec` into a confined process tree.

Read top to bottom, :func:`prepare` (supervisor side, steps 1-4), :func:`_cell` (C1 and PID 1, steps
5-12) and :func:`_command` (the command's process, steps 13-23) are the security argument, numbered
as in docs/ARCHITECTURE.md ("The launcher's order of operations", which says why each step is where
it is); each step names itself so a failure says where it happened. A cell is built before it knows
its command (:class:`Prepared`); ``go`` hands argv and stdio over, at once (``agentcell run``) or later
(the warm launcher), or makes it a live cell that serves many (step 23, :mod:`.execd`).

Process tree::

    supervisor (caller) ── C1: unshare(...), waits ── PID 1 of the cell (pid1.run) ── the command

or, from a single-threaded supervisor (a warm launcher), without C1: PID 1 is cloned straight into its
PID namespace and makes the others itself (:func:`_born`).
"""
from __future__ import annotations

import os
import select
import stat
import sys
import time

from ..errors import (
    EXIT_CANNOT_EXEC,
    EXIT_NOT_FOUND,
    EXIT_SETUP,
    EXIT_TIMEOUT,
    LaunchError,
    PolicyError,
    forked,
    mark_after_go,
)
from . import (
    canary,
    cgroups,
    execd,
    execmarks,
    handoff,
    identity,
    landlock,
    mounts,
    namespaces,
    pid1,
    seccomp,
    terminal,
)
from . import syscalls as sc
from .spec import TYPE_CHECKING, CellSpec, new_cell_id

if TYPE_CHECKING:
    import signal
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn, TypeVar

    T = TypeVar("T")
    Guards = tuple[Sequence[tuple[str, bool]], Sequence[str]]  # mounts.plan's guarded, hidden
else:  # signal.py only wraps _signal in IntEnums, whose import costs ~6 ms per agentcell run here
    import _signal as signal


class CellResult:
    """How a cell ended. ``error`` is set when agentcell (not the command) failed: "step: message"."""

    def __init__(self, exit_status: int, signal: int, duration_s: float, cell_id: str, timed_out: bool = False,
                 error: str = "") -> None:
        self.exit_status, self.signal, self.duration_s = exit_status, signal, duration_s
        self.cell_id, self.timed_out, self.error = cell_id, timed_out, error or ""
        self.limits_hit: dict[str, int] | None = None  # oom_kills, pids_limit_hits (when it had a cgroup)
        self.cpu_s: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "exit_status": self.exit_status,
            "signal": self.signal,
            "duration_s": round(self.duration_s, 6),
            "cell_id": self.cell_id,
            "timed_out": self.timed_out,
            "error": self.error or None,
            "limits_hit": self.limits_hit,
            "cpu_s": None if self.cpu_s is None else round(self.cpu_s, 6),
        }


class Running:
    """A launched cell, seen from the supervisor: wait for it, signal it, kill it."""

    def __init__(self, spec: CellSpec, c1: int, status_r: int, started: float, cell_id: str,
                 cg: cgroups.CellCgroup | None = None) -> None:
        self.spec, self.c1, self._r, self.started, self.cell_id = spec, c1, status_r, started, cell_id
        self.cg = cg
        self.pid1 = 0  # host pid of the cell's PID 1, known once C1 reports it
        self.pty_master: int | None = None  # an interactive cell's own pty, for the caller to relay
        self.egress_fd: int | None = None  # network "proxy": the listener for the caller to serve
        self.canary_fd: int | None = None  # spec.watch: the watch on the canary credentials (monitor)
        self.exec_fd: int | None = None  # spec.watch as root: exec marks on the cell's own mounts (monitor)
        self.seccomp_fd: int | None = None  # spec.watch: the seccomp listener (monitor)
        self.root_fds: list[int] | None = None  # spec.watch: the cell's root and mount namespace (monitor)
        self.live: execd.Channel | None = None  # a live cell: its exec server's channel
        self._buf = b""
        self._msgs: list[list[str]] = []
        self._eof = False
        self._result: CellResult | None = None

    def fileno(self) -> int:
        return self._r

    def poll_messages(self, timeout: float | None) -> None:
        """Read status messages for up to ``timeout`` seconds (None: until EOF)."""
        if self._eof:
            return
        ready, _, _ = select.select([self._r], [], [], timeout)
        if not ready:
            return
        chunk = os.read(self._r, 65536)
        if not chunk:
            self._eof = True
            return
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            msg = line.decode(errors="replace").split("\t")
            if msg[0] == "pid1":
                self.pid1 = int(msg[1])
            self._msgs.append(msg)

    def finished_reading(self) -> bool:
        return self._eof

    @property
    def ended(self) -> bool:
        """Its end is taken (:meth:`wait` returned): PID 1 is reaped, its number may be another's."""
        return self._result is not None

    def signal(self, sig: int) -> None:
        """Deliver ``sig`` to PID 1, which forwards it to the command (SIGKILL ends the whole cell); nothing
        once the cell's end is taken."""
        if self._result is not None:
            return
        while not self.pid1 and not self._eof:
            self.poll_messages(0.05)
        target = self.pid1 or self.c1
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass

    def forward(self, sig: int) -> None:
        """Signal-handler safe: deliver ``sig`` without reading the status pipe."""
        if self._result is not None:
            return
        try:
            os.kill(self.pid1 or self.c1, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Kill the whole cell: at once through its cgroup where the kernel can, and through PID 1
        (whose death ends its PID namespace) in any case: early on, the cgroup may still be empty."""
        if self.cg is not None:
            self.cg.kill()
        self.signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None, *, clean_up: bool = True) -> CellResult:
        """Wait until PID 1 reports (it has killed and reaped the whole cell by then) or the cell is gone.
        ``clean_up=False`` leaves removing the cell's cgroup to :meth:`clean_up`, for a caller that
        answers its client first (the warm launcher)."""
        if self._result is not None:
            if clean_up:
                self.clean_up()
            return self._result
        deadline = None if timeout is None else self.started + timeout
        timed_out = False
        while not self._eof and not self.reported():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.poll_messages(left)
            if deadline is not None and not self._eof and time.monotonic() >= deadline:
                timed_out = True
                self.kill()
                deadline = None
        if self._eof:
            _, wstatus = _waitpid_eintr(self.c1)
        else:
            wstatus = 0  # PID 1's report is the status; C1 only has namespaces left to tear down
            _reap_later(self.c1)
        os.close(self._r)
        self._result = self._finish(wstatus, timed_out)
        if self.cg is not None:
            self._result.limits_hit = self.cg.events()
            self._result.cpu_s = self.cg.cpu_usage_s()
        if clean_up:
            self.clean_up()
        return self._result

    def clean_up(self) -> None:
        """Remove the cell's cgroup (once its result is known); close watches no monitor took."""
        if self.live is not None:
            self.live.close()
        for fd in (self.canary_fd, self.seccomp_fd, self.exec_fd, *(self.root_fds or ())):
            if fd is not None:
                os.close(fd)
        self.canary_fd = self.seccomp_fd = self.exec_fd = None
        self.root_fds = None
        if self.cg is not None:
            if self.c1 in _unreaped:
                _reaped(self.c1)
            cg, self.cg = self.cg, None
            cg.remove()

    def retire(self) -> int | None:
        """:meth:`clean_up` without waiting, once the result is known (a launcher that serves the next
        request meanwhile): what can go goes now; the cell's cgroup waits for C1, which reaps PID 1 (or
        for PID 1 itself, when the supervisor cloned it), which killed and reaped the rest before it
        reported, so once that child has exited the groups are empty and :meth:`clean_up` removes them
        at once. Returns an fd that becomes readable then (the child's pidfd: the caller closes it, then
        calls :meth:`clean_up`), or None when all is done."""
        if self.cg is not None and self.c1 in _unreaped and not _reaped(self.c1):
            return os.pidfd_open(self.c1)  # (an unreaped child: its pid cannot have been reused)
        self.clean_up()
        return None

    def reported(self) -> bool:
        """PID 1 has reported the command's end (and emptied the cell)."""
        return bool(self._msgs) and self._msgs[-1][0] == "exit"

    def _finish(self, wstatus: int, timed_out: bool) -> CellResult:
        duration = time.monotonic() - self.started
        code, sig = pid1.status_of(wstatus)
        error = ""
        for m in self._msgs:
            if m[0] == "exit":
                code, sig = int(m[1]), int(m[2])
        for m in self._msgs:
            if m[0] == "error":
                code, error = int(m[1]), f"{m[2]}: {m[3]}"
        if timed_out:
            code, sig = EXIT_TIMEOUT, signal.SIGKILL
        return CellResult(code, sig, duration, self.cell_id, timed_out, error)


_unreaped: list[int] = []


def _reap_later(pid: int) -> None:
    """C1 exits just after PID 1's report; reap it now if it has, else on a later call."""
    _unreaped.append(pid)
    for p in list(_unreaped):
        _reaped(p)


def _reaped(pid: int) -> bool:
    """Reap ``pid`` (of :data:`_unreaped`) if it has exited; whether it is gone."""
    try:
        if not os.waitpid(pid, os.WNOHANG)[0]:
            return False
    except ChildProcessError:
        pass
    _unreaped.remove(pid)
    return True


def _waitpid_eintr(pid: int) -> tuple[int, int]:
    while True:
        try:
            return os.waitpid(pid, 0)
        except InterruptedError:
            continue


class Prepared:
    """A cell whose namespaces and mount tree are built, waiting for its command (PID 1 blocks on
    the hand-off channel). Used at once by :func:`start`, or ahead of time by the warm launcher."""

    def __init__(self, spec: CellSpec, c1: int, status_r: int, ctl: object, cell_id: str,
                 cg: cgroups.CellCgroup | None) -> None:
        self.spec, self.c1, self._r, self._ctl, self.cell_id, self.cg = spec, c1, status_r, ctl, cell_id, cg
        self.pid1 = 0  # known here when the supervisor cloned PID 1 itself (then c1 is PID 1)
        self.egress_fd: int | None = None  # the proxy's listening socket, made in the cell's netns
        self.canary_fd: int | None = None  # spec.watch: the canaries' watch, made by PID 1
        self.exec_fd: int | None = None  # spec.watch as root: exec marks on its own mounts, made by PID 1
        self.root_fds: list[int] | None = None  # spec.watch: its root and mount namespace, from PID 1
        self.sent = False  # its command handed over (from then on it may have run)

    def go(self, argv: Sequence[str], *, stdio: Sequence[int] = (0, 1, 2), pass_fds: Sequence[int] = (),
           tty_fds: Sequence[int] = (), live: bool = False) -> Running:
        """Hand over the command. ``tty_fds`` (of 0-2) get the cell's own new pty instead of ours; its
        master comes back as ``Running.pty_master`` for the caller to relay. ``live``: no command; the
        cell serves many through ``Running.live`` (:mod:`.execd`) until that channel is closed."""
        if not argv and not live:
            raise LaunchError("command", "no command given", "put it after --")
        if live and (tty_fds or pass_fds):  # each of its commands brings its own stdio (cell/execd.py)
            raise LaunchError("command", "a live cell takes no terminal and no fds of its own")
        fds = {} if live else {i: fd for i, fd in enumerate(stdio) if i not in tty_fds}
        fds.update({fd: fd for fd in pass_fds})
        started = time.monotonic()
        master = listener = None
        # From its send on, the command may run (it does not wait for what comes back below): said before
        # the send, as an error in it may come after the cell has it.
        self.sent = True
        try:
            handoff.send(self._ctl, list(argv), fds, tuple(tty_fds), live)  # type: ignore[arg-type]
            if tty_fds and not live:
                master = handoff.recv_fd(self._ctl)  # type: ignore[arg-type]
            if self.spec.watch:  # the command process loads its filter, then hands out the listener
                listener = handoff.recv_fd(self._ctl, b"S")  # type: ignore[arg-type]
        except (BrokenPipeError, ConnectionResetError):
            pass  # the cell failed while being prepared; its status pipe says where (see wait())
        except BaseException as e:  # (a SIGTERM, say, while the command is handed over): nothing of it is left
            mark_after_go(e)
            for fd in (master, listener):
                if fd is not None:
                    os.close(fd)
            self.kill_and_discard()
            raise
        finally:
            if not live:
                self._ctl.close()  # type: ignore[attr-defined]
        running = Running(self.spec, self.c1, self._r, started, self.cell_id, self.cg)
        running.pid1 = self.pid1
        if live:
            running.live = execd.Channel(self._ctl)  # type: ignore[arg-type]
        running.pty_master = master
        running.egress_fd, self.egress_fd = self.egress_fd, None
        running.canary_fd, self.canary_fd = self.canary_fd, None
        running.exec_fd, self.exec_fd = self.exec_fd, None
        running.root_fds, self.root_fds = self.root_fds, None
        running.seccomp_fd = listener
        return running

    @property
    def control(self) -> Any:
        """The hand-off channel's socket (the warm launcher's forked hosts let go of it)."""
        return self._ctl

    def kill_and_discard(self) -> None:
        """Kill the cell (C1, and all in its groups: PID 1 and what it forked already), then :meth:`discard`."""
        os.kill(self.c1, signal.SIGKILL)
        if self.cg is not None:
            self.cg.kill()
        self.discard()

    def discard(self) -> None:
        """Throw away a cell that never got a command: with its channel closed, its command process
        exits without exec'ing anything, and PID 1 tears the cell down."""
        self._ctl.close()  # type: ignore[attr-defined]
        for fd in (self.egress_fd, self.canary_fd, self.exec_fd, *(self.root_fds or ())):
            if fd is not None:
                os.close(fd)
        self.root_fds = None
        os.close(self._r)
        _waitpid_eintr(self.c1)
        if self.cg is not None:
            self.cg.remove()


def prepare(spec: CellSpec, guards: Guards) -> Prepared:
    """Build a cell for ``spec`` up to the point where it needs its command. Supervisor-side steps.
    ``guards``: what the policy adds to the mount plan (:func:`agentcell.protect.binds.for_cell`)."""
    cell_id = spec.cell_id or new_cell_id()
    # 1. Plan the mounts: resolve every path once without following symlinks and record its identity
    #    (dev, ino); the child re-opens each in its mount namespace the same way and refuses one that
    #    changed.
    plan = mounts.plan(spec, *guards)
    # 2. The seccomp filter, compiled (or read from root's cache) here, once, not in every cell.
    seccomp.program(spec.watch)
    # 3. The cell's own cgroup (limits; freeze and kill as a whole). An unprivileged caller has one only
    #    where groups were delegated to it (doctor says how); without, a cell with ceilings is refused.
    delegated = cgroups.delegated() if os.geteuid() != 0 else None
    if os.geteuid() == 0 or delegated is not None:
        cg = cgroups.CellCgroup.create(cell_id, cell_limits(spec), delegated)
    elif spec.memory_max or spec.cpu_percent or spec.pids_max:
        raise PolicyError("--memory/--cpu/--pids", "ceilings need a cgroup, and none is delegated to you here",
                          f"run through sudo with --as, drop the ceilings, or {cgroups.how_to_delegate()}")
    else:
        cg = None
    prepared = None
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
        ours, theirs = handoff.channel()
        outer_uid, outer_gid = os.getuid(), os.getgid()
        # 4. Fork C1. Nothing of the supervisor's but stdio, the status pipe and the hand-off channel
        #    crosses into the cell (a warm launcher holds other cells' channels and its caller's sockets).
        #    A SIGTERM meanwhile is raised once C1 is recorded, so that it is taken down. A single-threaded
        #    supervisor (a warm launcher) clones PID 1 itself instead, straight into a PID namespace and
        #    the cell's cgroup v2 group: one Python process less a cell (:func:`_born` does C1's 5-7).
        keep = {w, theirs.fileno(), *plan.kept_fds()}
        with _clone_pid1(spec, cg) as (c1, command_mask):
            if c1 == 0 and command_mask is not None:
                try:  # (never back into the supervisor's code with its fds: a failure here ends the child)
                    sc.close_fds_except(keep)
                    _after_clone()
                except BaseException:
                    os._exit(EXIT_SETUP)
                _run_child(w, lambda: _born(spec, plan, w, theirs, cg, command_mask))
            if c1 < 0:
                with forked() as c1:
                    if c1 == 0:
                        sc.close_fds_except(keep)
                        _run_child(w, lambda: _cell(spec, plan, w, theirs, outer_uid, outer_gid, cg))
            plan.release()
            os.close(w)
            theirs.close()
            prepared = Prepared(spec, c1, r, ours, cell_id, cg)
            if command_mask is not None:
                prepared.pid1 = c1  # (C1 reports PID 1's pid; this one is PID 1)
        if spec.network == "proxy":  # None if the cell failed first: its status pipe says why
            prepared.egress_fd = handoff.recv_fd(ours, b"L")
        if canary.planned(spec):  # None if the cell failed first
            prepared.canary_fd = handoff.recv_fd(ours, b"C")
        if execmarks.planned(spec):
            prepared.exec_fd = handoff.recv_fd(ours, b"X")
        if spec.watch:
            prepared.root_fds = handoff.recv_fds(ours, b"R", 2)
    except BaseException:  # (a SIGTERM, say, while the cell is being built): nothing of it is left
        plan.release()
        if prepared is not None:
            prepared.kill_and_discard()
        elif cg is not None:
            cg.remove()
        raise
    return prepared


class _clone_pid1:  # noqa: N801 - used as a function: `with _clone_pid1(spec, cg) as (pid, mask):`
    """PID 1 cloned here, straight into a PID namespace of its own and the cell's cgroup v2 group (it makes
    its other namespaces itself, in :func:`_born`), where this process may
    (:func:`agentcell.cell.syscalls.clone3`: single-threaded, and a kernel and seccomp that allow it; a
    rootless cell's uid map is C1's to write): (0, the mask the command gets back) in the child, (its pid,
    that mask) here, or (-1, None) to go through C1. The forwarded signals, SIGTERM and SIGHUP among them,
    are blocked across the clone and until the block ends (as :class:`agentcell.errors.forked`); PID 1
    keeps them blocked."""

    def __init__(self, spec: CellSpec, cg: cgroups.CellCgroup | None) -> None:
        self.spec, self.cg = spec, cg
        self.mask: set[int] | None = None

    def __enter__(self) -> tuple[int, set[int] | None]:
        if self.spec.identity.userns or not _single_threaded():
            return -1, None
        born_in = self.cg.open_v2() if self.cg is not None else -1
        self.mask = pid1.block_signals()
        try:
            pid = sc.clone3(sc.CLONE_NEWPID, born_in)
        except OSError:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            self.mask = None
            return -1, None
        finally:
            if born_in >= 0:
                os.close(born_in)
        return pid, self.mask

    def __exit__(self, *_exc: object) -> None:
        if self.mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def cell_limits(spec: CellSpec) -> cgroups.Limits:
    return cgroups.Limits(spec.memory_max or cgroups.default_memory(), spec.cpu_percent,
                          spec.pids_max or cgroups.DEFAULT_PIDS)


def start(spec: CellSpec, argv: Sequence[str], *, guards: Guards, stdio: Sequence[int] = (0, 1, 2),
          pass_fds: Sequence[int] = (), tty_fds: Sequence[int] = (), live: bool = False) -> Running:
    """Launch ``argv`` in a new cell and return at once (``live``: no argv; see :meth:`Prepared.go`)."""
    if not argv and not live:
        raise LaunchError("command", "no command given", "put it after --")
    return prepare(spec, guards).go(argv, stdio=stdio, pass_fds=pass_fds, tty_fds=tty_fds, live=live)


def launch(spec: CellSpec, argv: Sequence[str], *, timeout: float | None = None, **kw: object) -> CellResult:
    return start(spec, argv, **kw).wait(timeout)  # type: ignore[arg-type]


def describe(spec: CellSpec, plan: mounts.MountPlan, argv: Sequence[str]) -> list[str]:
    """The steps :func:`prepare`, :func:`_cell` and :func:`_command` take to run ``argv`` for ``spec``
    (``plan``: its :func:`mounts.plan`), by their numbers and in each mechanism's own words (``agentcell
    run --explain``). A step changed above is changed here, beside its number."""
    ident, ns_flags = spec.identity, namespaces.flags_for(spec)
    if os.geteuid() == 0 or cgroups.delegated() is not None:
        lim = cell_limits(spec)
        where = f"{cgroups.PARENT}/{spec.cell_id}" if os.geteuid() == 0 else f"{spec.cell_id}, in the one delegated"
        cgroup = (f"cgroup {where} ({cgroups.layout()}): memory {lim.memory} bytes, cpu "
                  f"{f'{lim.cpu_percent}% of a core' if lim.cpu_percent else 'not capped'}, pids {lim.pids}")
    else:
        cgroup = "cgroup: none is delegated to you here (see agentcell doctor)" + (
            "; a cell with ceilings is refused" if spec.memory_max or spec.cpu_percent or spec.pids_max else "")
    ns_names = [n for n in ("NS", "PID", "IPC", "UTS", "NET", "USER") if ns_flags & getattr(sc, f"CLONE_NEW{n}")]
    marks = [f"{what} {', '.join(paths)}" for what, paths in (("plant canaries:", canary.planned(spec)),
                                                             ("mark for execs:", execmarks.planned(spec))) if paths]
    return [
        "1. plan the mounts: every path resolved once, no symlink followed, its (dev, ino) recorded",
        "2. compile the seccomp filter", f"3. {cgroup}",
        *(["4. clone3(CLONE_NEWPID|CLONE_INTO_CGROUP): PID 1 of the cell (reaper), born in a PID namespace and "
           "the cgroup's v2 group, forwarded signals blocked (stdio, the status pipe, the hand-off only; a "
           "supervisor with threads forks C1, which does 5-7)",
           "5. prctl(PR_SET_PDEATHSIG, SIGKILL); non-dumpable (7); join the cgroup's v1 groups (tasks)",
           f"6. unshare({'|'.join('CLONE_NEW' + n for n in ns_names if n != 'PID')})"] if not ident.userns else [
           "4. fork C1 (stdio, the status pipe, the hand-off only)",
           "5. prctl(PR_SET_PDEATHSIG, SIGKILL); join the cgroup's v1 groups (tasks), open its v2 group",
           f"6. unshare({'|'.join('CLONE_NEW' + n for n in ns_names)})  # 0x{ns_flags:x}",
           f"   write uid_map '{ident.uid} {ident.uid} 1', setgroups deny, gid_map '{ident.gid} {ident.gid} 1'",
           "7. non-dumpable; clone3(CLONE_INTO_CGROUP) -> PID 1 of the cell (reaper), born in the v2 group"]),
        "8. mount --make-rprivate /; tmpfs new root", *(f"   {d}" for d in plan.describe()),
        "   remount new root read-only; pivot_root; detach old root",
        *(["9. ip link set lo up"] if spec.network in ("loopback", "proxy") else []),
        *(["   the proxy's listening socket, made here and handed out"] if spec.network == "proxy" else []),
        f"10. sethostname {spec.hostname}", *(f"11. {m}" for m in marks),
        *(["11. hand out the cell's root and mount namespace: the monitor holds them to its last look"]
          if spec.watch else []),
        "12. stdio -> /dev/null; fork -> the command's process; PID 1 reaps",
        "13. default signal dispositions; setsid (a session of its own, no controlling terminal)",
        f"14. landlock: {landlock.describe_abi(spec)}", *(f"   {rule}" for rule in landlock.describe(spec)),
        "   the seccomp filter made ready (21); pin the audit login uid; drop capability bounding set; clear "
        "ambient capabilities",
        "15. receive argv and stdio fds",
        f"16. {f'setgroups {list(ident.groups)}; setresgid {ident.gid}; ' if not ident.userns else ''}"
        f"setresuid {ident.uid}; prctl(PR_SET_PDEATHSIG, SIGKILL); prctl(PR_SET_NO_NEW_PRIVS, 1)",
        f"17. chdir {spec.cwd or ident.home}", "18. the fds onto their numbers (no directory on 0-2)",
        "19. landlock restrict_self", "20. refuse any terminal but the cell's own; the scrubbed environment",
        "21. seccomp filter (libseccomp), loaded last:", *(f"   {rule}" for rule in seccomp.describe()),
        "22. close every other fd", f"23. execve {argv[0] if argv else '?'} with the environment listed above",
    ]


# ---- child side: single-threaded, forked from the supervisor ---------------------------------------


def _report(w: int, *fields: object) -> None:
    """One status line to the supervisor: tab-separated fields (pid1 N | exit CODE SIG | error CODE STEP MSG)."""
    line = "\t".join(str(f).replace("\t", " ").replace("\n", " ") for f in fields) + "\n"
    try:
        os.write(w, line.encode())
    except OSError:
        pass


def _after_clone() -> None:
    """In PID 1 cloned by raw clone3: what ``os.fork`` runs in a child and clone3 does not, of ours (the
    at-fork hooks of :mod:`agentcell.monitor.hostprog`: its holding is the supervisor's, not PID 1's)."""
    hostprog = sys.modules.get("agentcell.monitor.hostprog")
    if hostprog is not None:
        hostprog._forget()


def _run_child(w: int, body: Callable[[], object]) -> NoReturn:
    """Run ``body`` in a forked child; any failure is reported on the status pipe, never raised."""
    code = EXIT_SETUP
    try:
        body()
    except LaunchError as e:
        code = e.exit_code
        _report(w, "error", e.exit_code, e.field, e.line()[len(e.field) + 2:])
    except OSError as e:
        _report(w, "error", EXIT_SETUP, "launch", e)
    except BaseException as e:  # a bug in the launcher must still not run the command unconfined
        _report(w, "error", EXIT_SETUP, "launch", f"internal error: {e!r}")
    os._exit(code)


def _step(name: str, fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except OSError as e:
        raise LaunchError(name, e.strerror or str(e)) from None


def _cell(spec: CellSpec, plan: mounts.MountPlan, w: int, ctl: object, outer_uid: int, outer_gid: int,
          cg: cgroups.CellCgroup | None) -> NoReturn:
    # 5. The cell dies with its supervisor; and before anything else, C1 joins the cell's v1 groups and
    #    opens its v2 group, which PID 1 is born in (7): every process of the cell is born inside them.
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    way_out: list[int] = []
    born_in = -1
    if cg is not None:
        born_in = _step("cgroup", cg.open_v2)
        _step("cgroup", cg.join_v1)
        way_out = _step("cgroup", cg.way_out)
    # 6. New namespaces; the next fork is PID 1 of the cell.
    _step("namespaces", namespaces.enter, spec, outer_uid, outer_gid)
    # 7. Non-dumpable: our memory holds the supervisor's environment, not for /proc readers (only now:
    #    a non-dumpable process cannot write its own uid_map). PID 1 is born with forwarded signals
    #    blocked: the kernel drops a signal that reaches a namespace's init before it has a handler,
    #    and the supervisor may signal as soon as it knows us. C1 then leaves the cgroup and waits.
    sc.prctl(sc.PR_SET_DUMPABLE, 0)
    command_mask = pid1.block_signals()
    pid = _fork_pid1(cg, born_in, way_out)
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, command_mask)
        ctl.close()  # type: ignore[attr-defined]
        cgroups.CellCgroup.leave(way_out)  # C1 is no part of the cell: not in its limits, not pinning it
        _report(w, "pid1", pid)
        _, wstatus = _waitpid_eintr(pid)
        code, sig = pid1.status_of(wstatus)
        if sig:  # PID 1 itself was killed (a kill of the whole cell): it could not report
            _report(w, "exit", code, sig)
        os._exit(code)
    for fd in way_out:
        os.close(fd)
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    _pid1(spec, plan, w, ctl, command_mask)


def _born(spec: CellSpec, plan: mounts.MountPlan, w: int, ctl: object, cg: cgroups.CellCgroup | None,
          command_mask: set[int]) -> NoReturn:
    """PID 1 cloned by the supervisor itself (:func:`_clone_pid1`): steps 5-7 without a C1."""
    # 5. The cell dies with its supervisor. Non-dumpable at once (7; no uid map to write here): our memory
    #    holds the supervisor's environment. Born in the cell's v2 group, PID 1 joins its v1 groups before
    #    anything else: every process of the cell but itself is born inside them.
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
    sc.prctl(sc.PR_SET_DUMPABLE, 0)
    if cg is not None:
        _step("cgroup", cg.join_v1)
    # 6. New namespaces but the PID one, which PID 1 was born in: made here, not by the supervisor, which
    #    serves its next request meanwhile (a network namespace takes 0.3-3 ms to make here).
    _step("namespaces", sc.unshare, namespaces.flags_for(spec) & ~sc.CLONE_NEWPID)
    # 7. (Non-dumpable: above.) Forwarded signals are blocked from birth (the kernel drops a signal that
    #    reaches a namespace's init before it has a handler).
    _pid1(spec, plan, w, ctl, command_mask)


def _pid1(spec: CellSpec, plan: mounts.MountPlan, w: int, ctl: object, command_mask: set[int]) -> NoReturn:
    # 8. Mount tree: private propagation, tmpfs root, nosuid/nodev system binds, /proc, /dev; the cell's
    #    own paths by depth (masks last at each), protected re-binds among them; the host's secrets
    #    masked last; pivot_root, the old root detached.
    _step("mount", mounts.apply, plan)
    _step("pivot_root", mounts.pivot)
    plan.close()
    # 9. Network. With the proxy, its listening socket is made here, inside the cell's network
    #    namespace, and handed out: the proxy serves it from the host's namespace, and the cell,
    #    whose only interface is lo, reaches nothing else.
    if spec.network in ("loopback", "proxy"):
        _step("network", namespaces.loopback_up)
    if spec.network == "proxy":
        _step("network", namespaces.proxy_listener, ctl)
    # 10. Hostname.
    _step("hostname", namespaces.set_hostname, spec.hostname)
    # 11. Under the monitor: decoy credentials in the cell's home, watched before the command exists; as
    #     root, exec marks on the cell's own mounts (a setuid binary run from there is named by its file);
    #     the cell's root and mount namespace, which the monitor holds until its last look.
    _step("canaries", canary.plant_and_watch, spec, ctl)
    _step("exec marks", execmarks.mark_and_send, spec, ctl)
    if spec.watch:
        _step("cell root", mounts.send_root, ctl)
    # 12. PID 1 keeps none of the supervisor's stdio (it would hold a terminal or a pipe open), forks
    #     the command's process, and reaps until it ends; then it kills what is left.
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    pid1.run(lambda: _run_child(w, lambda: _command(spec, ctl, w)),
             lambda code, sig: _report(w, "exit", code, sig),
             close_after_fork=[ctl.fileno()], command_mask=command_mask)  # type: ignore[attr-defined]


def _fork_pid1(cg: cgroups.CellCgroup | None, born_in: int, way_out: list[int]) -> int:
    """fork() PID 1 into the cell's cgroup v2 group (``born_in``, from :meth:`CellCgroup.open_v2`; C1 is
    single-threaded, as :func:`agentcell.cell.syscalls.clone3` needs). Where the kernel refuses that, C1
    joins the group first, and leaves it with the others."""
    if cg is None or born_in < 0:
        return os.fork()
    try:
        return sc.clone3(0, born_in)
    except OSError:
        pass  # (no clone3 or no CLONE_INTO_CGROUP; a group that refuses us is the join's to report, below)
    finally:
        os.close(born_in)
    way_out.append(_step("cgroup", cg.join_v2))
    return os.fork()


def _command(spec: CellSpec, ctl: object, w: int) -> NoReturn:
    """The command's process: everything that does not depend on the command is done before it
    arrives (a warm cell waits here); the identity is dropped only once it has arrived, so a prepared
    cell never shows a process of the agent's account."""
    # 13. Default signal dispositions; a session of its own: no controlling terminal, so nothing it
    #     does reaches the caller's terminal (TIOCSTI); an interactive run gets the cell's own pty (18).
    for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP):
        signal.signal(s, signal.SIG_DFL)
    os.setsid()
    # 14. The Landlock ruleset (the mount tree again, as kernel rules), built now so a prepared cell has
    #     it ready; enforced at 19. The seccomp program (in memory since step 2) made ready to load at 21.
    #     What of the identity drop needs no command: the audit login uid pinned to the agent's, the
    #     capability bounding and ambient sets emptied (this process keeps its own until 16).
    rules = landlock.prepare(spec)
    install_filter = seccomp.ready(seccomp.program(spec.watch), listen=spec.watch)
    identity.ready(spec.identity)
    # 15. The command arrives: at once from `agentcell run`, later for a warm cell; none for a live one.
    #     A cell discarded unused ends here.
    cmd = handoff.recv(ctl)  # type: ignore[arg-type]
    if cmd is None:
        os._exit(0)
    # 16. Identity: the agent account (or our own uid in the user namespace), for good.
    _step("identity", lambda: identity.drop(spec.identity, readied=True))
    # 17. Working directory.
    cwd = spec.cwd or spec.identity.home
    _step(f"cwd {cwd}", os.chdir, cwd)
    # 18. fds onto the numbers the command expects (two passes: a target may hold a source); no
    #     directory on 0-2; an interactive run's pty of the cell's own devpts, its master to the caller.
    moved = {target: os.dup(fd) for target, fd in cmd.fds.items()}
    for target, fd in moved.items():
        os.dup2(fd, target)
    _stdio_no_directories()
    if cmd.tty_fds:
        _step("terminal", terminal.attach_new_pty, ctl, cmd.tty_fds)
    # 19. Landlock, enforced for good (it survives exec).
    if rules is not None:
        rules.enforce()
    # 20. No terminal but the cell's own; the scrubbed environment.
    keep = set(cmd.fds) | set(cmd.tty_fds)
    terminal.refuse_foreign(keep)
    env = spec.environ()
    # 21. seccomp, last: from here on this process only closes fds and execs (or serves). Under the
    #     monitor the filter's listener goes to the supervisor (which must have it before any call is
    #     notified).
    listener = install_filter()
    if listener is not None:
        handoff.send_fd(ctl, listener, b"S")  # type: ignore[arg-type]
        os.close(listener)
    # 22. Every other fd closed (w is close-on-exec: it reports a failed exec, then vanishes). A live
    #     cell keeps its channel and /dev/null on 0-2.
    if cmd.live:
        keep |= {0, 1, 2, ctl.fileno()}  # type: ignore[attr-defined]
    sc.close_fds_except(keep | {w})
    if not cmd.live:  # a live cell's channel stays close-on-exec: no command it spawns may hold it
        for fd in keep:
            os.set_inheritable(fd, True)
    # 23. exec the command; a live cell's process instead serves commands, each spawned from here with
    #     everything above in place (cell/execd.py).
    if cmd.live:
        execd.serve(ctl)  # type: ignore[arg-type]
    argv = cmd.argv
    try:
        execd.execvpe(argv, env)
    except FileNotFoundError:
        err = LaunchError("exec", f"{argv[0]}: command not found in the cell",
                          f"PATH={env.get('PATH', '')}; add its directory with --ro")
        err.exit_code = EXIT_NOT_FOUND
        raise err from None
    except PermissionError as e:
        err = LaunchError("exec", f"{argv[0]}: {e.strerror}")
        err.exit_code = EXIT_CANNOT_EXEC
        raise err from None
    raise AssertionError("unreachable")


def _stdio_no_directories() -> None:
    # A directory fd on 0-2 would be a handle to the host's tree (openat(fd, "..")): replace it.
    for fd in (0, 1, 2):
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                null = os.open("/dev/null", os.O_RDWR)
                os.dup2(null, fd)
                os.close(null)
        except OSError:
            pass
