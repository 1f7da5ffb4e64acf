"""The escape monitor around one cell: sources → events → verdict → freeze, record, kill.

Sources in this version (each yields :class:`CellEvent`; the newer ones through the
:class:`agentcell.monitor.source.Source` interface, the older ones as records translated here):

* ``calls`` — the cell's failed system calls (eBPF, :mod:`.calls`), what each means decided against the
  cell's view (:mod:`.attempts`): what the cell does not contain, secrets it masks, writes to the
  read-only system, the network outside;
* ``created`` — protected entries created in the project, as it happens (:mod:`.created`);
* ``landlock`` — Landlock denials from the audit stream (:mod:`.kaudit`), attributed to the cell by
  the denying process's cgroup (or by its Landlock domain, learnt from the first attributed denial);
* ``resource`` — the cell's cgroup events: an OOM kill, a refused fork at the task limit, the CPU
  ceiling holding it back (a note);
* ``telemetry`` — every source reports in; one that fails is itself an event (and, under
  ``terminate``, ends the cell: a monitor that cannot see is no monitor);
* ``proxy`` / ``nftables`` — the egress layer's refusals (:meth:`Monitor.add_source`), read when the
  proxy rings, each pinned on the process that held the socket (:mod:`.sockets`);
* ``exec`` — the proc connector (:mod:`.execwatch`): a privilege tool run in the cell, or a uid change;
  the exec marks PID 1 made on the cell's own mounts (a binary with privilege of its own, a note); the
  processes left behind when the command ends (notes). With the failed-call source's exec names, they
  keep a table of the cell's processes that outlives them a while: every event names its process and
  its parents up to the cell's PID 1;
* ``canary`` — decoy credentials in the cell's home opened (:mod:`.canaries`);
* ``seccomp`` — an escape call the cell's filter handed to us and we refused (:mod:`.seccompwatch`).

Verdicts per class of event (:func:`parse_verdicts`): ``terminate`` (the default for read, write,
execute, network and telemetry): **freeze the cell's cgroup first** (nothing of it runs on while
the event is recorded), record, then kill the whole cgroup. ``record`` only records (the default
for resource events). Duplicates are counted, never dropped: the first event always stands.

Rootless, the kernel's audit stream, the proc connector and cgroup events are out of reach (they
need root; this host delegates no cgroup): canaries (inotify: the open, not who made it), seccomp
notification and the proxy's refusals remain, and :meth:`Monitor.sources` says which is which.

The monitor runs in a thread of the supervisor, started after the cell exists (the launcher never
forks from a process with threads).
"""
from __future__ import annotations

import collections
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..cell.cgroups import CellCgroup
from .event import CellEvent

ESCAPES = ("read", "write", "execute", "network", "telemetry")
CLASSES = (*ESCAPES, "resource")
MAX_LOOKUPS = 200  # egress refusals attributed by a socket lookup, per cell
CPU_NOTE = 10  # periods the CPU ceiling held the cell back before that is noted (a second at 0.1 s each)
MAX_EVENTS = 1000  # distinct events kept per cell, of each kind (acting, notes); duplicates are counted
# An audit overflow is held against the cell that made it: at least FLOOD of its own Landlock denials, and
# at least half of all the host's, in the last FLOOD_S seconds (a busy cell among a flood is not the flood).
FLOOD = 50
FLOOD_S = 2.0
SESSION_ACCOUNT_PREFIX = "ac-s"  # accounts.ephemeral.PREFIX (not imported: agentcell run stays lean)
# A loop that has not come round for this long *while the watchdog itself kept time* has stopped: a
# telemetry event. A starved host delays both threads alike (the watchdog's own ticks come late, the
# loop waits on the run queue): that time is not counted against the loop.
# The loop's pace when nothing wakes it (each source's file does), and the cgroup's counters' (OOM
# kills, refused forks: the kernel has acted already, the event only says so): an idle cell costs
# its supervisor a few wake-ups a second, not fifty.
PASS_S = 0.1
MASKS_PASS_S = 0.02
RESOURCES_S = 0.25
HEARTBEAT_S = 1.0
TICK_S = HEARTBEAT_S / 4
LATE_S = 2 * TICK_S  # a watchdog tick that took longer than this: the process was not getting the CPU


def parse_verdicts(text: str) -> dict[str, str]:
    """``terminate`` | ``record`` for every escape class, then ``CLASS=VERDICT`` overrides, comma
    separated: ``terminate,network=record``. Resource events are recorded unless said otherwise."""
    from ..errors import PolicyError

    out = {c: "terminate" for c in ESCAPES}
    out["resource"] = "record"
    for part in filter(None, (p.strip() for p in text.split(","))):
        cls, eq, verdict = part.rpartition("=") if "=" in part else ("", "", part)
        if verdict not in ("terminate", "record"):
            raise PolicyError("--on-escape", f"unknown verdict {verdict!r}", "use terminate or record, e.g. "
                              "--on-escape terminate,network=record")
        if not eq:
            out.update({c: verdict for c in ESCAPES})
        elif cls in CLASSES:
            out[cls] = verdict
        else:
            raise PolicyError("--on-escape", f"unknown class {cls!r}", f"classes: {', '.join(CLASSES)}")
    return out


_BLOCKERS = {"fs.execute": "execute", "fs.read_file": "read", "fs.read_dir": "read", "net.bind_tcp": "network",
             "net.connect_tcp": "network", "scope.abstract_unix_socket": "network", "scope.signal": "execute"}


def landlock_event(raw: dict[str, Any], cell: str) -> CellEvent:
    """A completed Landlock denial (audit records) as a CellEvent, with the flag that would allow it."""
    ll, sc = raw.get("landlock", {}), raw.get("syscall", {})
    blockers = ll.get("blockers", "")
    op = next((v for k, v in _BLOCKERS.items() if blockers.startswith(k)), "write" if "fs." in blockers else "execute")
    if "daddr" in ll:
        target = f"{ll['daddr']}:{ll.get('dest', '?')}"
        allow = "--net loopback (a cell's own loopback) or --net proxy with --allow-domain"
    elif "path" in ll:
        target = ll["path"]
        allow = f"--ro {target}" if op in ("read", "execute") else f"--rw {target}"
    else:
        target, allow = ll.get("opid", blockers), ""
    pid = int(sc["pid"]) if sc.get("pid", "").isdigit() else None
    bind = blockers.startswith("net.bind_tcp")  # listening in a cell nothing outside can reach: noted only
    tuning = op == "write" and _tunes_itself(str(ll.get("path", "")))
    reason = f"blocked by Landlock ({blockers})"
    if tuning:  # one note per file, whichever process: they are alike
        target = "/proc/<pid>/" + target.rsplit("/", 1)[-1]
        reason += "; a process of the cell tuning itself (its OOM score, its name): refused, not held against it"
    return CellEvent(op, target, reason, source="landlock", cell=cell, pid=pid, exe=sc.get("exe", ""),
                     allow=allow, ts=raw.get("ts"), acts=not (bind or tuning))


# Files of a process's own /proc entry that runtimes write about themselves (node and its kin set their
# OOM score at start). The cell's /proc shows only its own processes, so the writer is the cell's.
_SELF_TUNING = frozenset({"oom_score_adj", "oom_adj", "comm", "timerslack_ns", "autogroup"})


def _tunes_itself(path: str) -> bool:
    parts = path.split("/")
    if len(parts) < 4 or parts[:2] != ["", "proc"] or parts[-1] not in _SELF_TUNING:
        return False
    who = parts[2:-1]
    if len(who) == 3 and who[1] == "task" and who[2].isdigit():  # /proc/PID/task/TID/comm
        who = who[:1]
    return len(who) == 1 and (who[0].isdigit() or who[0] in ("self", "thread-self"))


def _session_account(uid: int | None) -> bool:
    """Whether ``uid`` is a session's own account (``ac-s…``: made for one session, running nothing else)."""
    import pwd

    try:
        return uid is not None and pwd.getpwuid(uid).pw_name.startswith(SESSION_ACCOUNT_PREFIX)
    except KeyError:
        return False


class Monitor:
    """Watch one running cell. ``on_escape``: terminate | record | ``CLASS=VERDICT,…`` (:func:`parse_verdicts`).

    For Python programs: ``callback`` is called (from the monitor's thread) with every new event, and
    :meth:`stream` yields them as they come."""

    def __init__(self, cell_id: str, cg: CellCgroup | None, on_escape: str = "terminate",
                 callback: Callable[[CellEvent], None] | None = None, uid: int | None = None,
                 rootless: bool = False, dedicated: bool = False) -> None:
        self.cell_id, self.cg, self.callback = cell_id, cg, callback
        self.verdicts = parse_verdicts(on_escape)
        self.on_escape = on_escape
        self.uid = uid  # the cell's account: the launcher's own drop to it is not an event
        # The account exists for agents alone (agent:NAME, a session's own): whatever its uid does
        # on the host's network is the cell's. A person's uid (--as UID, sudo's caller) is not.
        self.dedicated = dedicated
        self.exclusive = dedicated and _session_account(uid)  # only this cell runs as it
        # Landlock denials the host reported lately: (when, whether this cell's); as many as the audit backlog
        self._denials: collections.deque[tuple[float, bool]] = collections.deque(maxlen=8192)
        self.trusted: set[int] = set()  # agentcell's own processes in the cell's cgroup (its proxy)
        self.events: list[CellEvent] = []
        self._kept = {True: 0, False: 0}  # events kept, by whether they act
        self.frozen_at: float | None = None
        self.terminated = False
        self.reason = ""
        self.heartbeat = time.monotonic()
        self.stalled = 0.0  # the loop's time without progress while the host gave it time (the watchdog's)
        self._queue: queue.Queue[CellEvent | None] = queue.Queue()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # stop() wakes the loop's select
        self._thread: threading.Thread | None = None
        self._domains: set[str] = set()
        self._resources = {"oom_kills": 0, "pids_limit_hits": 0}
        self._sources: list[Callable[[], list[dict[str, Any]]]] = []
        self._bells: list[int] = []  # the egress sources' fds, readable when they have news
        self._lookups = 0  # egress refusals attributed by a socket lookup so far
        self._refused_by: dict[str, int] = {}  # a firewall-refused address -> the process whose connect failed
        self._state: dict[str, str] = {}  # source -> "on" | why it is off
        self.audit: Any = None
        self.execs: Any = None
        self.canaries: Any = None
        self.seccomp: Any = None
        self.tools: Any = None
        self.masks: Any = None
        self._masks_checked = self._masks_until = 0.0
        self._running: Any = None
        self._members: set[int] = set()  # the cell's processes, followed by descent from its PID 1
        # What each of them is, kept a while after it exits (a failed call is often read after its
        # process is gone): pid -> [parent, executable, command line]
        self._procs: dict[int, list[Any]] = {}
        self.calls: Any = None  # the cell's failed calls (attempts.AttemptSource), from before its command
        self.created: Any = None  # protected entries created (created.CreatedWatch)
        self.execmarks: Any = None  # execs from the cell's own mounts (execwatch.ExecMarks)
        self._calls_dropped = 0
        self._exited: collections.deque[tuple[float, int]] = collections.deque()  # members gone, forgotten after 5 s
        self._leftover: list[tuple[int, str]] = []  # what ran on when the command ended (named later)
        self._index: dict[tuple[str, str, str, bool], CellEvent] = {}
        self._final = False  # the cell has ended: nothing is frozen or killed any more (an attempt still counts)
        self._pidfd: int | None = None
        self._audit_lost: int | None = None
        self._seed = 0  # the cell's PID 1
        self._command: int | None = None  # its child: the command
        if rootless:
            self._state["landlock"] = "off: the audit stream needs root (CAP_AUDIT_CONTROL, CAP_AUDIT_READ)"
            self._state["exec"] = "off: the proc connector needs root (CAP_NET_ADMIN in the host's namespace)"
            self._state["cgroup"] = "off: no cgroup is delegated to unprivileged users here"
            self._state["calls"] = "off: eBPF needs root (CAP_BPF, CAP_PERFMON)"
            self._state["created"] = "off: fanotify needs root (created protected entries are reported at the end)"
            return
        try:
            from .kaudit import AuditReader

            self.audit = AuditReader()
            self.audit.on_read = self._progress
            self._state["landlock"] = "on"
            try:
                from .kaudit import audit_lost

                self._audit_lost = audit_lost()
            except OSError:
                pass
        except (OSError, PermissionError) as e:
            self._state["landlock"] = f"failed: {e}"
            self._event(CellEvent("telemetry", "landlock", f"the audit stream cannot be read ({e}): Landlock "
                                  "denials are not seen", source="telemetry", cell=cell_id))
        try:
            from .execwatch import ExecWatch, ToolExecs

            self.execs = ExecWatch()
            self.execs.on_read = self._progress
            self._state["exec"] = "on"
            try:
                self.tools = ToolExecs()
            except OSError as e:  # the connector alone still sees execs, racing short-lived ones
                self._state["exec"] = f"on (without fanotify: {e.strerror}; a tool that exits at once may be missed)"
        except (OSError, PermissionError) as e:
            self._state["exec"] = f"failed: {e}"
            self._event(CellEvent("telemetry", "exec", f"the proc connector cannot be read ({e}): execs are not "
                                  "seen", source="telemetry", cell=cell_id))

    def add_source(self, poll: Callable[[], list[dict[str, Any]]], fileno: int | None = None) -> None:
        """An egress source: ``poll()`` returns the refusals (proxy or firewall events) since its last call;
        ``fileno`` (if any) is readable when it has some (then they are read at once, not on the next pass)."""
        self._sources.append(poll)
        if fileno is not None:
            self._bells.append(fileno)
        self._state["egress"] = "on"

    def watch_calls(self, cg: CellCgroup | None, view: Any) -> None:
        """The cell's failed calls (eBPF, by its cgroup), what they mean read against ``view`` (its mount
        tree: :class:`agentcell.monitor.attempts.View`). Called once the cell's cgroup exists and before
        its command does. A source that cannot start is a telemetry event (under terminate: no run)."""
        from .attempts import AttemptSource, Classifier, Host

        if "calls" in self._state:  # rootless: said why in __init__
            return
        cgroup_id = cg.v2_id() if cg is not None else None
        try:
            if cgroup_id is None:
                raise OSError(95, "the cell has no cgroup v2 directory to filter on")
            from .calls import FailedCalls

            calls = FailedCalls(cgroup_id)
        except OSError as e:
            self._state["calls"] = f"failed: {e.strerror or e}"
            self._event(CellEvent("telemetry", "calls", f"the cell's failed calls cannot be watched ({e.strerror or e})"
                                  ": attempts on what the cell does not contain are not seen", source="telemetry",
                                  cell=self.cell_id))
            return
        classifier = Classifier(view, view.network, Host(), lambda: bool(calls.tasks_dropped()), self._refused)
        self.calls = AttemptSource(calls, classifier, self.cell_id, self._exe_of,
                                   lambda pid: pid in self.trusted, self._execed)
        self._state["calls"] = "on"

    def watch_created(self, entries: tuple[str, ...]) -> None:
        """Protected entries that do not exist yet (the command may create them: they cannot be bound
        read-only), watched from before the command exists."""
        if "created" in self._state:  # rootless
            return
        if not entries:
            self._state["created"] = "on (no protected entry is missing)"
            return
        from .created import CreatedWatch

        try:
            self.created = CreatedWatch(entries, self.cell_id, self._is_member)
            self._state["created"] = "on"
        except OSError as e:  # what is created is still moved aside at the end: only the live report is lost
            self._state["created"] = f"off: {e.strerror or e} (created entries are reported when the cell ends)"

    def _is_member(self, pid: int) -> bool:
        if pid not in self._members:
            self._drain_connector()  # it may have forked since the connector was read
        return pid in self._members and pid not in self.trusted

    def _execed(self, pid: int, comm: str, path: str) -> None:
        """An exec of the cell's that succeeded (the failed-call source's exec program), with the new
        program's name and the file as execve was given it (the kernel's copy): what the process is,
        though it exited before /proc could be read. A relative name is not a name: then it is the one
        the kernel gave the process."""
        exe = _readlink(f"/proc/{pid}/exe")  # (the file it resolves to, while the process lives: sh is dash)
        entry = self._procs.get(pid)
        if entry is not None:
            del entry[3:]
            entry.append(comm)
            if exe or path.startswith("/"):
                entry[1] = exe or os.path.normpath(path)
                if entry[2] is None:
                    entry[2] = _cmdline(pid) or entry[1]

    def _named(self, pid: int, path: str) -> None:
        """An exec's file, from a mark: the process is that program now (read before it can be gone)."""
        entry = self._procs.get(pid)
        if entry is not None:
            entry[1] = path
            if entry[2] is None:
                entry[2] = _cmdline(pid) or path

    def _known(self, pid: int) -> tuple[str, str] | None:
        """(exe, command line) from the table: a process that has not exec'd is what its parent is."""
        for _ in range(64):
            entry = self._procs.get(pid)
            if entry is None:
                return None
            if entry[1] is not None:
                return str(entry[1]), str(entry[2])
            pid = entry[0]
        return None

    def _exe_of(self, pid: int) -> str:
        """The process's executable: from the table, from /proc, else the name its last exec gave it."""
        known = self._known(pid)
        if known and known[0]:
            return known[0]
        exe = _readlink(f"/proc/{pid}/exe")
        if exe:
            return exe
        entry = self._procs.get(pid)
        return str(entry[3]) if entry is not None and len(entry) > 3 else ""

    def _last_comm(self, pid: int) -> str:
        """The name the kernel gave the last exec of the process, or of the parent it forked from (the
        failed-call source hears every exec): for one that exited before its file could be read."""
        for _ in range(64):
            entry = self._procs.get(pid)
            if entry is None:
                return ""
            if len(entry) > 3:
                return str(entry[3])
            pid = entry[0]
        return ""

    def attach(self, running: Any) -> None:
        """The launched cell: its cgroup, and the watches it handed out (canaries, seccomp listener)."""
        from ..cell import canary

        self.cg, self._running = running.cg, running
        if running.pid1:
            self._members.add(running.pid1)
            self._seed = running.pid1
            if self.calls is not None:
                self.calls.classifier.host.pid1 = running.pid1
            try:  # signals go through a pidfd: never to a process that took PID 1's number after it
                self._pidfd = os.pidfd_open(running.pid1)
            except OSError:
                self._pidfd = None
        self._state.setdefault("cgroup", "on" if running.cg is not None else "off: the cell has no cgroup")
        planned = canary.planned(running.spec)
        if running.canary_fd is not None:
            from .canaries import CanaryWatch

            self.canaries = CanaryWatch(running.canary_fd, planned, running.spec.identity.home)
            running.canary_fd = None  # ours now
            self._state["canary"] = "on" if self.canaries.kind == "fanotify" else \
                "on (inotify: the open is seen, not which process made it)"
        else:
            self._state["canary"] = ("off: the home is a host directory (--home); no decoys are planted there"
                                     if running.spec.home_dir else "off: the cell made no canaries")
        if running.pid1:
            from ..cell.spec import SECRET_FILES
            from .masks import MaskWatch

            try:
                secrets = tuple(p for p in SECRET_FILES if os.path.exists(p) and not os.path.islink(p))
                ident = running.spec.identity
                self.masks = MaskWatch(running.pid1, (*secrets, *running.spec.masked_paths), ident.uid,
                                       (ident.gid, *ident.groups))
                self._state["masks"] = "on"
            except OSError as e:
                self._state["masks"] = f"off: {e.strerror or e}"
        if running.exec_fd is not None:
            from ..cell.execmarks import planned as marked
            from .execwatch import ExecMarks

            self.execmarks = ExecMarks(running.exec_fd, running.pid1, self.cell_id, self._named,
                                       marked(running.spec))
            running.exec_fd = None
            self._state["execmarks"] = "on"
        if running.seccomp_fd is not None:
            from .seccompwatch import SeccompWatch

            self.seccomp = SeccompWatch(running.seccomp_fd)
            running.seccomp_fd = None
            self._state["seccomp"] = "on"
        else:
            self._state["seccomp"] = "off: the cell's filter gave no listener"

    def sources(self) -> dict[str, str]:
        """Each source and whether it is on (or why not)."""
        return dict(self._state)

    def start(self) -> None:
        """The loop, and a watchdog beside it: a loop that hangs (a source that blocks) or dies is a
        telemetry event within about a second."""
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="agentcell-monitor", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watchdog, name="agentcell-monitor-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """Tells a stuck loop from a starved host. Without progress (a pass of the loop, or an event
        read), the loop's stalled time is what the host gave it and it did not use: each tick that
        came on time (the process is getting the CPU) while the loop's thread was not itself waiting
        for a CPU (not runnable: blocked in a call, a lock, a source), plus the CPU time the loop's
        thread spent since its last progress (it ran, and went nowhere: a spin). A late tick, or the
        loop's thread on the run queue without being given the CPU, is the host's. Progress resets it."""
        last, beat = time.monotonic(), self.heartbeat
        blocked, spun_from = 0.0, self._loop_cpu()
        while not self._stop.wait(TICK_S):
            now, cpu = time.monotonic(), self._loop_cpu()
            tick, last = now - last, now
            if self.heartbeat != beat:
                beat, blocked, spun_from = self.heartbeat, 0.0, cpu
            elif tick <= LATE_S and not self._loop_runnable():
                blocked += tick
            self.stalled = blocked + max(0.0, cpu - spun_from)
            self.check()

    def _progress(self) -> None:
        """The loop moved: a pass, or a message read from a source (whoever's it was: reading the
        host's messages to drop them is work, not a spin)."""
        self.heartbeat = time.monotonic()

    def _loop_cpu(self) -> float:
        """The CPU time the loop's thread has used, from the kernel by its thread id (0 once it is
        gone: then :meth:`alive` says so; never through a pthread handle that may be freed)."""
        tid = getattr(self._thread, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _loop_runnable(self) -> bool:
        """Whether the loop's thread is waiting for a CPU (state R), not blocked."""
        tid = getattr(self._thread, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            return False

    def alive(self) -> bool:
        """The loop is running and has not stalled for HEARTBEAT_S of the watchdog's own time. When not,
        the caller records a telemetry event (:meth:`check`)."""
        return self._thread is not None and self._thread.is_alive() and self.stalled < HEARTBEAT_S

    def check(self) -> None:
        """For the supervisor's own loop: a monitor that has stopped seeing is itself an escape event."""
        if self._thread is not None and not self._stop.is_set() and not self.alive():
            self._event(CellEvent("telemetry", "monitor", f"the monitor's loop stopped reporting (no progress for "
                                  f"{self.stalled:.1f} s while the host was giving it time)"
                                  if self._thread.is_alive() else "the monitor's loop ended",
                                  source="telemetry", cell=self.cell_id))

    def stream(self, timeout: float | None = None) -> Iterator[CellEvent]:
        """Events as they come, until the monitor stops (or ``timeout`` seconds pass with none)."""
        while True:
            try:
                ev = self._queue.get(timeout=timeout)
            except queue.Empty:
                return
            if ev is None:
                return
            yield ev

    def stop(self) -> list[CellEvent]:
        self._stop.set()
        self._final = True  # what is drained from here on happened; the cell is over: nothing to freeze or kill
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5)
        try:
            self._drain()  # what arrived after the loop's last look
            for _ in range(64):  # a flood of failed calls at the very end: the ring read to its end
                if self.calls is None or not _readable(self.calls):
                    break
                self._drain()
            self._poll_calls_dropped()
            self._poll_egress()
            if self._thread is None or not self._thread.is_alive():  # (not beside a loop that hangs in it)
                self._poll_resources()  # the cgroup's last counts: it is still there, it goes after the monitor
        except (OSError, ValueError) as e:
            self._event(CellEvent("telemetry", "monitor", f"a source failed: {e}", source="telemetry",
                                  cell=self.cell_id))
        for source in (self.audit, self.execs, self.seccomp, self.masks, self.calls):
            if source is not None:
                try:
                    source.close()
                except OSError:
                    pass
        # Closing a fanotify group waits for an SRCU grace period (10-30 ms here): off the caller's
        # path. The cell is gone by now; a decoy's waiting open (there is none left) would be let go.
        groups = [g for g in (self.tools, self.canaries, self.created, self.execmarks) if g is not None]
        if groups:
            threading.Thread(target=_close_all, args=(groups,), name="agentcell-monitor-close", daemon=True).start()
        self.audit = self.execs = self.tools = self.canaries = self.seccomp = self.masks = self.calls = None
        self.created = self.execmarks = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
        self._queue.put(None)
        return self.events

    # ---- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        last_lost_check = last_resources = time.monotonic()
        try:
            while not self._stop.is_set():
                self._progress()
                watched = [s for s in (self.audit, self.execs, self.tools, self.canaries, self.seccomp, self.masks,
                                       self.calls, self.created, self.execmarks) if s is not None]
                watched += self.calls.wakers() if self.calls is not None else []
                # Every source wakes the loop itself; a pass without news is for what has no file to
                # wait on (a mask just touched on the host: often, for half a second).
                idle = PASS_S if time.monotonic() >= self._masks_until else MASKS_PASS_S
                if select.select([*watched, *self._bells, self._wake_r], [], [], idle)[0]:
                    self._drain()
                if time.monotonic() - last_resources >= RESOURCES_S:
                    last_resources = time.monotonic()
                    self._poll_resources()
                self._poll_egress()
                self._poll_masks()
                if time.monotonic() - last_lost_check >= 1:
                    last_lost_check = time.monotonic()
                    if self.audit is not None:
                        self._poll_audit_lost()
                    self._poll_calls_dropped()
        except Exception as e:  # noqa: BLE001 - a monitor that stops seeing must say so, and act
            self._event(CellEvent("telemetry", "monitor", f"the monitor stopped: {e!r}", source="telemetry",
                                  cell=self.cell_id))

    def _drain(self) -> None:
        for n in self.seccomp.read() if self.seccomp is not None and _readable(self.seccomp) else []:
            self._seccomp_event(n)
        for c in self.canaries.read() if self.canaries is not None else []:
            if c.get("lost"):
                self._event(CellEvent("telemetry", "canary", "the kernel dropped canary events", source="telemetry",
                                      cell=self.cell_id))
                continue
            pid = c.get("pid")
            if pid in self.trusted:
                self.canaries.answer(c)
                continue
            self._drain_connector()  # the opener's parents may have forked since the connector was read
            self._event(CellEvent("read", c["path"], "a canary credential was opened (a decoy agentcell planted "
                                  "in the cell's home: nothing legitimate reads it)", source="canary",
                                  cell=self.cell_id, pid=pid, exe=c.get("exe", ""),
                                  ancestry=self.ancestry(pid) if pid else None,  # it waits
                                  allow="nothing: it is a decoy; give real credentials with --ro PATH if a tool "
                                  "needs them"))
            self.canaries.answer(c)  # recorded (and, under terminate, frozen): now the open may go on
        # Order: who belongs to the cell first (forks, from the connector), then the tools' execs
        # (fanotify, in the order they happened), then the connector's own exec and uid events.
        tools = self.tools.read() if self.tools is not None else []
        self._drain_connector(tools)
        for source in (self.execmarks, self.calls, self.created):  # after the connector: forks and execs are known
            for ev in source.read() if source is not None else ():
                self._progress()
                self._event(ev)
        if self._leftover:
            self._outlived()
        if self.audit is None:
            return
        for raw in self.audit.read(accept=self._accept):
            if raw.get("lost"):
                self._audit_overflow("the audit stream overflowed")
                continue
            if self._ours(raw):
                self._event(landlock_event(raw, self.cell_id))

    def _drain_connector(self, tools: list[dict[str, Any]] | None = None) -> None:
        """Who belongs to the cell first (forks, from the connector), then the tools' execs (fanotify,
        in the order they happened), then the connector's own exec and uid events."""
        execs = self.execs.read() if self.execs is not None else []
        for ex in execs:
            if ex["kind"] in ("fork", "exit", "lost"):
                self._progress()  # a flood read is not a spin
                self._exec_event(ex)
        for ex in (*(tools or ()), *(e for e in execs if e["kind"] not in ("fork", "exit", "lost"))):
            self._progress()
            self._exec_event(ex)

    def _accept(self, pid: int, domain: str) -> bool:
        """A Landlock denial worth parsing: by one of the cell's processes (or its domain). A process
        forked after the connector was last read is looked up after reading it again."""
        ours = pid in self._members or domain in self._domains or self._our_domain(domain)
        if not ours:
            self._drain_connector()
            ours = pid in self._members
        self._denials.append((time.monotonic(), ours))
        return ours

    def _poll_masks(self) -> None:
        """The host's events on the masked names (the kernel reports the rename a moment before it
        detaches the mount: look again on each pass for half a second), and every 0.1 s anyway."""
        if self.masks is None:
            return
        now = time.monotonic()
        if self.masks.touched():
            self._masks_until = now + 0.5
        if now < self._masks_until or now - self._masks_checked >= 0.1:
            self._masks_checked = now
            for path, readable in self.masks.check():
                if not readable:  # useradd on the host replacing /etc/shadow: root's 0600 again, nothing to see
                    continue      # (looked at again on every pass: a chmod later would be seen)
                self._event(CellEvent("read", path, "the mask over it is gone: the file was replaced on the host (a "
                                      "rename over a masked file detaches the mask in every cell), and the cell's "
                                      "account can read the new one", source="masks", cell=self.cell_id,
                                      allow="keep masked files from being replaced while a cell runs"))

    def _poll_calls_dropped(self) -> None:
        """Failed calls the kernel could not hand over: its ring was full. Only this cell's calls go into
        it, so the cell made them, faster than the monitor reads (about 7,000 in flight): one attempt may
        hide among them. That acts like any attempt."""
        if self.calls is None:
            return
        try:
            dropped = self.calls.dropped()
        except OSError:
            return
        if dropped > self._calls_dropped:
            self._calls_dropped = dropped
            self._event(CellEvent("telemetry", "calls", f"the kernel dropped {dropped} of the cell's failed calls "
                                  "(the cell made them faster than the monitor reads): one may be missing from this "
                                  "report", source="telemetry", cell=self.cell_id))

    def _poll_audit_lost(self) -> None:
        """Records the kernel dropped before anyone could read them (its backlog was full). Host-wide,
        so noted, not held against the cell: a denial may be missing from the report, never allowed."""
        from .kaudit import audit_lost

        try:
            lost = audit_lost()
        except OSError:
            return
        if self._audit_lost is not None and lost > self._audit_lost:
            self._audit_overflow("the kernel dropped audit records (its backlog was full)")
        self._audit_lost = lost

    def _audit_overflow(self, what: str) -> None:
        """Lost Landlock records. If this cell was itself making Landlock refuse things just now, it may
        have flooded the stream to hide one attempt among them: that ends it like any attempt. If it
        was quiet, the host's other Landlock users did it: noted, not held against the cell (a denial
        may be missing from the report; the kernel still refused it)."""
        # A flood of its own, not the odd refusal (a runtime setting its OOM score): another cell's flood,
        # or another user's, must not end this one.
        since = time.monotonic() - FLOOD_S
        recent = [ours for t, ours in self._denials if t >= since]
        mine = sum(recent)
        busy = mine >= FLOOD and 2 * mine >= len(recent)
        self._event(CellEvent("telemetry", "landlock", f"{what}: a Landlock denial may be missing from this report"
                              + (" while the cell itself was being refused" if busy else
                                 " (the kernel still refused it)"),
                              source="telemetry", cell=self.cell_id, acts=busy))

    def _cgroup_pids(self) -> set[int]:
        return _pids_in(self.cg)

    def _seccomp_event(self, n: dict[str, Any]) -> None:
        from .seccompwatch import NOTED, describe

        op, target, reason = describe(n["call"], n["args"])
        self._drain_connector()  # the caller's parents may have forked since the connector was read (it waits)
        self._event(CellEvent(op, target, reason, source="seccomp", cell=self.cell_id, pid=n["pid"],
                              exe=n.get("exe", ""), allow="nothing: a cell never gets this call",
                              acts=n["call"] not in NOTED))
        self.seccomp.refuse(n)  # recorded (and, under terminate, frozen): now the call fails

    def _exec_event(self, ex: dict[str, Any]) -> None:
        from .execwatch import PRIVILEGE_TOOLS

        if ex["kind"] == "lost":
            if ex.get("tools"):  # the tools' own queue: an exec may be missed
                self._event(CellEvent("telemetry", "exec", "the kernel dropped exec events", source="telemetry",
                                      cell=self.cell_id))
                return
            # The connector carries the whole host's forks: a busy host can overflow it. Who is in the
            # cell is read again from its cgroup (a tool's exec is still named by fanotify).
            self._members = self._cgroup_pids() | ({self._seed} if self._seed else set())
            self._event(CellEvent("telemetry", "exec", "the proc connector overflowed (a busy host); the cell's "
                                  "processes were re-read from its cgroup", source="telemetry", cell=self.cell_id,
                                  acts=False))
            return
        kind, pid = ex["kind"], int(ex.get("pid") or 0)
        if kind == "fork":
            parent = ex["parent"]
            if parent in self._members:
                self._members.add(pid)
                self._procs[pid] = [parent, None, None]  # what its parent is, until it execs
                if parent == self._seed and self._command is None:
                    self._command = pid  # PID 1 forks once: the command (a live cell's exec server)
            elif pid != self._seed:  # (PID 1 itself was forked by the launcher, outside)
                self._members.discard(pid)  # a pid the cell used before, now someone else's
                self._procs.pop(pid, None)
            return
        if kind == "exit":  # kept a while: the fanotify event of a tool that exited at once may come later
            if pid in self._members and pid == self._command and ex.get("status", 0) & 0x7F != 9:
                # (not when it was killed: then the whole cell was, at once). Named at the end of this
                # drain: the exec marks of what it left may not have been read yet.
                gone = {p for _, p in self._exited}
                self._leftover = [(p, _readlink(f"/proc/{p}/exe"))  # (read now: PID 1 is about to kill it)
                                  for p in sorted(self._members - gone - {self._seed, self._command or 0, pid})]
            if pid in self._members:
                now = time.monotonic()
                self._exited.append((now, pid))
                while self._exited and self._exited[0][0] < now - 5:
                    _, old = self._exited.popleft()
                    if not _thread_group_alive(old):  # a leader that exited before its threads still counts
                        self._members.discard(old)
                        self._procs.pop(old, None)
            return
        if pid not in self._members or pid in self.trusted:
            return  # another process of the host (or ours)
        if kind in ("exec", "uid"):  # read now, for the cell's processes only (the host's are many)
            from .execwatch import identify

            ex = {**identify(pid), **ex}
            if kind == "exec":  # (gone already: what an exec mark named it stays)
                entry = self._procs.setdefault(pid, [0, None, None])
                entry[:3] = [entry[0] or _ppid(pid), ex.get("exe") or entry[1] or "", _cmdline(pid) or entry[2] or ""]
        name = ex.get("tool") or os.path.basename(ex.get("exe", "")) or ex.get("comm", "")
        if kind in ("tool", "exec") and name in PRIVILEGE_TOOLS:  # a copy under the same name too (exec)
            self._event(CellEvent("execute", name, f"a privilege tool was run in the cell ({name}: mounts are "
                                  "nosuid, so it can only be an attempt)", source="exec", cell=self.cell_id,
                                  pid=ex["pid"], exe=ex.get("exe", ""), allow="nothing: a cell never gains privilege"))
        elif ex["kind"] == "uid" and not (ex.get("ruid") == ex.get("euid") == self.uid):
            self._event(CellEvent("execute", f"uid {ex.get('ruid')}/{ex.get('euid')}", "a process of the cell "
                                  "changed its uid", source="exec", cell=self.cell_id, pid=ex["pid"],
                                  exe=ex.get("exe", "")))

    def _outlived(self) -> None:
        """The command has ended: what of the cell still ran then is noted (PID 1 kills it now; nothing
        outlives a cell, but a process that tried to is worth knowing)."""
        leftover, self._leftover = self._leftover, []
        for pid, seen in leftover:
            exe = self._exe_of(pid) or seen or self._last_comm(pid)
            self._event(CellEvent("execute", exe or f"pid {pid}", "a process still ran when the command ended "
                                  "(detached or left behind; it was killed with the cell)", source="exec",
                                  cell=self.cell_id, pid=pid, exe=exe, acts=False))

    def _our_domain(self, domain: str) -> bool:
        """Whether the kernel's record of ``domain`` says the cell made it: for a session's own account
        (it runs nothing but this cell), made by that account. No fork needs to have been seen, so a
        flood of the proc connector cannot hide a denial. Not by the maker's pid: the record is
        written at the domain's first denial, long after, and the number may be another process's by
        then (an outsider could have a cell's new process take it). Not for a persistent agent's
        account, which may run two cells at once, nor for a person's uid."""
        maker = self.audit.domains.get(domain) if self.audit is not None and self.exclusive else None
        if maker is None or maker[1] != self.uid:
            return False
        if len(self._domains) < 4096:
            self._domains.add(domain)
        return True

    def _ours(self, raw: dict[str, Any]) -> bool:
        """Is the denying process one of this cell's? Its Landlock domain says so (the kernel's record
        of who made it, or a first denial of it attributed); its descent from PID 1 says so too."""
        domain = raw.get("landlock", {}).get("domain", "")
        if domain in self._domains or self._our_domain(domain):
            return True
        pid = raw.get("syscall", {}).get("pid", "")
        if pid.isdigit() and int(pid) in self._members:  # by descent: a process that is already gone counts
            self._domains.add(domain)
            return True
        return False

    def _poll_egress(self) -> None:
        for poll in self._sources:
            self.record_egress(poll())

    def record_egress(self, refusals: list[dict[str, Any]]) -> None:
        """Refusals of the egress layer as events (also those read after the monitor stopped)."""
        for raw in refusals:
            reason = str(raw.get("reason", ""))
            allow = ""
            if "add " in reason:
                cut = reason.find("add ")
                allow = reason[cut + 4:].rstrip(")").removesuffix(" to allow it")
                reason = reason[:cut].rstrip(" ;:,(")
            source = str(raw.get("source", "egress"))
            # The proxy serves this cell alone. The host firewall matches the account's uid: its
            # refusal is the cell's when the account is an agent's own (nothing else runs as it);
            # for a person's uid it is recorded, not pinned on the cell.
            acts = (source != "nftables" or self.dedicated) and not raw.get("note")
            if source == "nftables" and not self.dedicated:
                reason += " (matched by a person's uid, which runs outside the cell too: not held against it)"
            elif raw.get("note"):
                reason += " (an allowed name: refused, not held against the cell)"
            target = str(raw.get("target", "?"))
            self._event(CellEvent("network", target, reason, source=source, cell=self.cell_id,
                                  pid=self._egress_owner(raw, target), allow=allow, ts=raw.get("ts"), acts=acts))

    def _egress_owner(self, raw: dict[str, Any], target: str) -> int | None:
        """The process a refusal was for: the proxy knows the client's port in the cell (whose socket is in
        the cell's network namespace, connected to the proxy's), the firewall the packet's source port on
        the host; else a failed connect to that very address (the failed-call source)."""
        from .sockets import owner

        # Each lookup reads the namespace's socket tables, which a flood of refusals grows: the first
        # MAX_LOOKUPS refusals are attributed (the first one is what ends a cell), later ones are not.
        self._lookups += 1
        if self._lookups > MAX_LOOKUPS:
            return self._refused_by.get(target) if raw.get("source") == "nftables" else None
        members = sorted(self._members - {self._seed} - self.trusted)
        if raw.get("source") == "proxy" and self._seed:
            from ..cell.spec import PROXY_PORT

            return owner(self._seed, "tcp", int(raw.get("peer_port") or 0), PROXY_PORT, members)
        if raw.get("source") == "nftables":
            pid = owner("self", str(raw.get("protocol", "tcp")), int(raw.get("sport") or 0), None, members)
            return pid or self._refused_by.get(target)
        return None

    def _refused(self, target: str, pid: int) -> None:
        """A connect of the cell's that the host firewall refused (the failed-call source, on the host's
        network): its process, for the firewall's record of the same packet, before or after it."""
        if len(self._refused_by) < 1000:
            self._refused_by.setdefault(target, pid)
        with self._lock:
            for ev in self.events:
                if ev.source == "nftables" and ev.target == target and not ev.pid:
                    ev.pid, ev.exe, ev.ancestry = pid, self._exe_of(pid), self.ancestry(pid)

    def _poll_resources(self) -> None:
        if self.cg is None:
            return
        try:
            now = self.cg.events() or {}
        except OSError:
            return
        for key, what in (("oom_kills", "a process was killed for memory (OOM) at the cell's --memory"),
                          ("pids_limit_hits", "a fork was refused at the cell's --pids"),
                          ("cpu_throttled", f"the cell was held at its CPU ceiling (--cpu) for {CPU_NOTE} periods of "
                                            "0.1 s or more: it wanted more")):
            n = int(now.get(key, 0))
            # (a start-up's burst past the ceiling, its proxy's and its own, says nothing: held back a while)
            if n > self._resources.get(key, 0) and (key != "cpu_throttled" or n >= CPU_NOTE):
                self._resources[key] = n
                self._event(CellEvent("resource", key, what, source="cgroup", cell=self.cell_id,
                                      acts=key != "cpu_throttled"))

    # ---- verdicts --------------------------------------------------------------------------------

    def _event(self, ev: CellEvent) -> None:
        if ev.pid and not ev.exe:
            ev.exe = self._exe_of(ev.pid)
        if ev.ancestry is None and ev.pid:
            ev.ancestry = self.ancestry(ev.pid)
        with self._lock:
            seen = self._index.get(ev.key())
            if seen is not None:
                seen.count += 1  # a duplicate: counted, the first one stands (and has acted already)
                return
            # The verdict first: a cap on what is kept must never decide what is acted on.
            if ev.acts and self.verdicts.get(ev.operation) == "terminate" and not self.terminated:
                if not self._final:
                    self.terminate(ev.line())
                elif ev.operation != "telemetry":
                    # Found after the cell ended (its command ran on past the attempt before the loop
                    # looked: a rootless watch learns of a decoy's open after it; the proxy's last
                    # refusals): nothing is left to freeze or kill, but the run ended at an escape
                    # attempt and says so. A source failing at teardown is only noted.
                    self.terminated, self.reason = True, ev.line()
            # Notes and acting events are capped apart: a flood of notes never pushes an attempt out.
            if self._kept[ev.acts] >= MAX_EVENTS:
                kind = "events" if ev.acts else "notes"
                overflow = CellEvent("telemetry", kind, f"more than {MAX_EVENTS} distinct {kind}: the rest are "
                                     "counted here", source="telemetry", cell=self.cell_id, acts=False)
                kept = self._index.get(overflow.key())
                if kept is not None:
                    kept.count += 1
                    return
                ev = overflow
            self._index[ev.key()] = ev
            self.events.append(ev)
            self._kept[ev.acts] += 1
        self._queue.put(ev)
        if self.callback is not None:
            self.callback(ev)

    def ancestry(self, pid: int) -> list[list[Any]]:
        """The parents of ``pid`` ([pid, exe, command line]), nearest first, up to the cell's PID 1 (not
        listed): from the table of the cell's processes (forks and execs as they came, so a process that
        has exited is still placed), else as far as /proc still has them."""
        if pid not in self._procs:
            return ancestry(pid, self._seed, self._members)
        out: list[list[Any]] = []
        seen = {pid}
        for _ in range(32):
            ppid = self._procs[pid][0] if pid in self._procs else _ppid(pid)
            if ppid <= 1 or ppid == self._seed or ppid in seen or ppid not in self._members:
                break
            known = self._known(ppid)
            if known is not None and known[0]:
                out.append([ppid, *known])
            else:
                out.append([ppid, self._exe_of(ppid), _cmdline(ppid)])
            seen.add(ppid)
            pid = ppid
        return out

    def terminate(self, reason: str) -> None:
        """Freeze first (nothing of the cell runs on), then kill the whole cgroup."""
        with self._lock:
            if self.terminated:
                return
            self.terminated, self.reason = True, reason
        killed = False
        if self.cg is not None:
            try:
                self.cg.freeze()
                self.frozen_at = time.time()
            except OSError:
                pass
            killed = self.cg.kill()
        if self._pidfd is not None:  # and in any case PID 1: its death ends the cell's PID namespace
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except OSError:
                pass  # already gone
        elif not killed:
            self._event(CellEvent("telemetry", "monitor", "the cell could not be killed (no cgroup.kill, no PID 1 "
                                  "known)", source="telemetry", cell=self.cell_id))


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    """The start of a process's command line (its own words, at most four, 300 characters)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode("utf-8", "replace") for a in f.read(4096).split(b"\0")[:4] if a)[:300]
    except OSError:
        return ""


def ancestry(pid: int, pid1: int | None, members: set[int] | None = None, limit: int = 32) -> list[list[Any]]:
    """The parents of ``pid`` ([pid, exe, the start of its command line: the process's own word]),
    nearest first, up to the cell's PID 1 (agentcell's reaper, not listed), the first one gone, or the
    first that is not among ``members`` (the cell's processes by descent: a number the host reused is
    never named)."""
    out: list[list[Any]] = []
    for _ in range(limit):
        ppid = _ppid(pid)
        if ppid <= 1 or ppid == pid1 or (members and ppid not in members):
            break
        try:
            exe = os.readlink(f"/proc/{ppid}/exe")
        except OSError:
            exe = ""
        out.append([ppid, exe, _cmdline(ppid)])
        pid = ppid
    return out


def _pids_in(cg: CellCgroup | None) -> set[int]:
    out: set[int] = set()
    for d in (cg.dirs.values() if cg is not None else ()):
        try:
            with open(f"{d}/cgroup.procs") as f:
                out |= {int(x) for x in f.read().split() if x.isdigit()}
        except OSError:
            pass
    return out


def _thread_group_alive(pid: int) -> bool:
    """Some thread of ``pid``'s group still runs (its leader may have exited before the others)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    threads = next((line.split()[1] for line in status.splitlines() if line.startswith("Threads:")), "0")
    return threads.isdigit() and int(threads) > 0 and "\nState:\tX" not in status


def _close_all(sources: list[Any]) -> None:
    for source in sources:
        try:
            source.close()
        except OSError:
            pass


def _readable(source: Any) -> bool:
    return bool(select.select([source], [], [], 0)[0])
