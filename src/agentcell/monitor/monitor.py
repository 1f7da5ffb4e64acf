"""The escape monitor around one cell: sources → events → verdict → freeze, record, kill.

Each source is a unit behind :class:`agentcell.monitor.source.Source` that says what it saw in the
cell's terms; the monitor keeps them in a list, reads them in turn, adds each event's process and its
parents (the table of the cell's processes, :mod:`.procs`), applies the verdict and terminates. The
sources, in the order each pass reads them:

* ``seccomp`` — an escape call the cell's filter handed to us and we refused (:mod:`.seccompwatch`);
* ``canary`` — decoy credentials in the cell's home opened (:mod:`.canaries`);
* ``exec`` — the proc connector (:mod:`.execsource`): a privilege tool run in the cell, or a uid change;
  it keeps the table of the cell's processes, which outlives them a while; ``execmarks``: the execs
  PID 1 marked on the cell's own mounts (a binary with privilege of its own, a note); the processes
  left behind when the command ends (notes);
* ``calls`` — the cell's failed system calls (eBPF, :mod:`.calls`), what each means decided against the
  cell's view (:mod:`.attempts`): what the cell does not contain, secrets it masks, writes to the
  read-only system, the network outside;
* ``created`` — protected entries created in the project, as it happens (:mod:`.created`);
* ``landlock`` — Landlock denials from the audit stream (:mod:`.landlock`), attributed to the cell by
  the denying process's descent from its PID 1 (or by its Landlock domain: the kernel's record of who
  made it, or the first attributed denial);
* ``cgroup`` — the cell's cgroup events: an OOM kill, a refused fork at the task limit, the CPU
  ceiling holding it back (a note; :mod:`.resources`);
* ``egress`` — the proxy's and the firewall's refusals (:meth:`Monitor.add_source`, :mod:`.refusals`),
  read when the proxy rings, each pinned on the process that held the socket (:mod:`.sockets`);
* ``masks`` — a mask the host undid by renaming over the masked file (:mod:`.masks`);
* ``telemetry`` — every source reports in; one that fails is itself an event (and, under
  ``terminate``, ends the cell: a monitor that cannot see is no monitor).

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

import os
import queue
import select
import signal
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..cell.cgroups import CellCgroup
from .event import CellEvent
from .loop import Loop, Record
from .procs import CellProcs
from .refusals import EgressSource, Refusals
from .resources import ResourceSource
from .source import Holds, Source, Wakes

if TYPE_CHECKING:
    from ..cell.launch import Running
    from .callsource import AttemptSource
    from .cellview import View
    from .execsource import ExecSource
    from .masks import MaskSource

ESCAPES = ("read", "write", "execute", "network", "telemetry")
CLASSES = (*ESCAPES, "resource")
SESSION_ACCOUNT_PREFIX = "ac-s"  # accounts.ephemeral.PREFIX (not imported: agentcell run stays lean)
# The order a pass reads the sources in: who belongs to the cell (the connector's forks) before what
# names a process; the exec marks and the failed calls' execs before the processes left behind are named.
ORDER = ("seccomp", "canary", "exec", "execmarks", "calls", "created", "outlived", "landlock", "cgroup", "egress",
         "masks")
# The loop's pace when nothing wakes it (each source's file does; what has none paces itself): an idle
# cell costs its supervisor a few wake-ups a second, not fifty.
PASS_S = 0.1


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
        self.procs = CellProcs()
        self.procs.refresh = self._refresh
        self.trusted = self.procs.trusted  # agentcell's own processes in the cell's cgroup (its proxy)
        self.refusals = Refusals(self.procs, cell_id, dedicated)
        self.record = Record()
        self.events = self.record.events
        self.frozen_at: float | None = None
        self.terminated = False
        self.reason = ""
        self._final = False  # the cell has ended: nothing is frozen or killed any more (an attempt still counts)
        self._pidfd: int | None = None  # PID 1's, once the cell is attached
        self._cell_root: list[int] = []  # the cell's root and mount namespace, held to the last look
        self.loop = Loop()
        self._sources: list[Source] = []
        # What a pass waits on, which files' news has it read each source (:meth:`_add`), and which sources
        # hold a process: worked out when a source is added, not on every pass (a Protocol isinstance costs
        # microseconds; a pass came to ~0.2 ms of the GIL, taken from the host's loop serving a live cell)
        self._pass: tuple[list[Source], list[int], list[frozenset[int] | None]] = ([], [], [])
        self._holders: dict[int, Holds] = {}
        self._state: dict[str, str] = {}  # source -> "on" | why it is off
        # The sources the monitor asks more of than read(): the connector (a fork learnt at once), the
        # masks (the loop's pace), the failed calls (read to their end at the last look, and their drops)
        self._execs: ExecSource | None = None
        self._masks: MaskSource | None = None
        self.calls: AttemptSource | None = None
        self._resources = ResourceSource(lambda: self.cg, cell_id)
        self._add(self._resources)
        if rootless:
            self._state["landlock"] = "off: the audit stream needs root (CAP_AUDIT_CONTROL, CAP_AUDIT_READ)"
            self._state["exec"] = "off: the proc connector needs root (CAP_NET_ADMIN in the host's namespace)"
            self._state["cgroup"] = "off: no cgroup is delegated to unprivileged users here"
            self._state["calls"] = "off: eBPF needs root (CAP_BPF, CAP_PERFMON)"
            self._state["created"] = "off: fanotify needs root (created protected entries are reported at the end)"
            return
        self._watch_landlock()
        self._watch_execs()

    def _add(self, source: Source) -> None:
        """Into the list, in its place (a new list: the loop goes on over the one it has). A pass reads a
        source when one of its files has news; one without a file, and the masks (looked at by the
        clock too), on every pass; the connector (who belongs to the cell) on every pass that has news
        of any kind, so that a fork is known before what names its process, as when all were read; and
        the failed calls on every pass, whose rings are read without a system call (their task ring is
        not waited on: :class:`agentcell.monitor.callsource.AttemptSource`): a process's start, exec
        and end each reach the connector and a ring a few microseconds apart, and what came after the
        wait returned is taken in the same pass instead of waking the loop again."""
        sources = sorted((*self._sources, source), key=lambda s: ORDER.index(s.name))
        own = [[s.fileno(), *(w.fileno() for w in (s.wakers() if isinstance(s, Wakes) else ()))] for s in sources]
        fds = [fd for files in own for fd in files if fd >= 0]
        gates: list[frozenset[int] | None] = [
            None if s is self._masks or s is self.calls or files[0] < 0 else frozenset(fds if s is self._execs
                                                                                       else files)
            for s, files in zip(sources, own, strict=True)]
        self._holders = {id(s): s for s in sources if isinstance(s, Holds)}
        self._sources, self._pass = sources, (sources, fds, gates)

    def _off(self, name: str, e: OSError, what: str) -> None:
        """A source that cannot start: said in ``monitor_sources``, and a telemetry event."""
        self._state[name] = f"failed: {e}"
        self._event(CellEvent("telemetry", name, f"{what} ({e}): {_BLIND[name]}", source="telemetry",
                              cell=self.cell_id))

    def _watch_landlock(self) -> None:
        try:
            from .kaudit import AuditReader
            from .landlock import LandlockSource

            landlock = LandlockSource(AuditReader(), self.procs, self.cell_id, self.uid, self.exclusive,
                                      self.loop.progress)
        except OSError as e:
            return self._off("landlock", e, "the audit stream cannot be read")
        self._add(landlock)
        self._state["landlock"] = "on"

    def _watch_execs(self) -> None:
        from .execsource import ExecSource, Outlived
        from .execwatch import ExecWatch, ToolExecs

        try:
            execs = ExecWatch()
        except OSError as e:
            return self._off("exec", e, "the proc connector cannot be read")
        self._state["exec"] = "on"
        tools = None
        try:
            tools = ToolExecs()
        except OSError as e:  # the connector alone still sees execs, racing short-lived ones
            self._state["exec"] = f"on (without fanotify: {e.strerror}; a tool that exits at once may be missed)"
        self._execs = ExecSource(execs, tools, self.procs, self.cell_id, self.uid, lambda: self.cg,
                                 self.loop.progress, self.loop.news)
        self._add(self._execs)
        self._add(Outlived(self.procs, self.cell_id))

    def add_source(self, poll: Callable[[], list[dict[str, Any]]], fileno: int | None = None) -> None:
        """An egress source: ``poll()`` returns the refusals (proxy or firewall events) since its last call;
        ``fileno`` (if any) is readable when it has some (then they are read at once, not on the next pass)."""
        self._add(EgressSource(poll, fileno, self.refusals))
        self._state["egress"] = "on"

    def watch_calls(self, cg: CellCgroup | None, view: View) -> None:
        """The cell's failed calls (eBPF, by its cgroup), what they mean read against ``view`` (its mount
        tree: :class:`agentcell.monitor.cellview.View`). Called once the cell's cgroup exists and before
        its command does. A source that cannot start is a telemetry event (under terminate: no run)."""
        from .attempts import Classifier, Host
        from .callsource import AttemptSource

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
                                  f": {_BLIND['calls']}", source="telemetry", cell=self.cell_id))
            return
        classifier = Classifier(view, view.network, Host(), lambda: bool(calls.tasks_dropped()), self._refused)
        procs = self.procs
        self.calls = AttemptSource(calls, classifier, self.cell_id, procs.exe_of, lambda pid: pid in procs.trusted,
                                   procs.execed)
        self._add(self.calls)
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
            self._add(CreatedWatch(entries, self.cell_id, self.procs.is_member))
            self._state["created"] = "on"
        except OSError as e:  # what is created is still moved aside at the end: only the live report is lost
            self._state["created"] = f"off: {e.strerror or e} (created entries are reported when the cell ends)"

    def attach(self, running: Running) -> None:
        """The launched cell: its cgroup, and the watches it handed out (canaries, seccomp listener)."""
        from ..cell import canary

        self.cg = running.cg
        if running.root_fds is not None:  # (taken before anything here can fail: closed in stop())
            self._cell_root, running.root_fds = running.root_fds, None
            if self.calls is not None:
                self.calls.classifier.host.root_fd = self._cell_root[0]
        if running.pid1:
            self.procs.members.add(running.pid1)
            self.procs.seed = running.pid1
            if self.calls is not None:
                self.calls.classifier.host.pid1 = running.pid1
            try:  # signals go through a pidfd: never to a process that took PID 1's number after it
                self._pidfd = os.pidfd_open(running.pid1)
            except OSError:
                self._pidfd = None
        self._state.setdefault("cgroup", "on" if running.cg is not None else "off: the cell has no cgroup")
        if running.canary_fd is not None:
            from .canaries import CanarySource, CanaryWatch

            watch = CanaryWatch(running.canary_fd, canary.planned(running.spec), running.spec.identity.home)
            running.canary_fd = None  # ours now
            self._add(CanarySource(watch, self.procs, self.cell_id))
            self._state["canary"] = "on" if watch.kind == "fanotify" else \
                "on (inotify: the open is seen, not which process made it)"
        else:
            self._state["canary"] = ("off: the home is a host directory (--home); no decoys are planted there"
                                     if running.spec.home_dir else "off: the cell made no canaries")
        if running.pid1:
            self._watch_masks(running)
        if running.exec_fd is not None:
            from ..cell.execmarks import planned as marked
            from .execwatch import ExecMarks

            self._add(ExecMarks(running.exec_fd, running.pid1, self.cell_id, self.procs.named, marked(running.spec)))
            running.exec_fd = None
            self._state["execmarks"] = "on"
        if running.seccomp_fd is not None:
            from .seccompwatch import SeccompSource, SeccompWatch

            self._add(SeccompSource(SeccompWatch(running.seccomp_fd), self.procs, self.cell_id))
            running.seccomp_fd = None
            self._state["seccomp"] = "on"
        else:
            self._state["seccomp"] = "off: the cell's filter gave no listener"

    def _watch_masks(self, running: Running) -> None:
        from ..cell.spec import SECRET_FILES
        from .masks import MaskSource, MaskWatch

        try:
            secrets = tuple(p for p in SECRET_FILES if os.path.exists(p) and not os.path.islink(p))
            ident = running.spec.identity
            watch = MaskWatch(running.pid1, (*secrets, *running.spec.masked_paths), ident.uid,
                              (ident.gid, *ident.groups))
        except OSError as e:
            self._state["masks"] = f"off: {e.strerror or e}"
            return
        self._masks = MaskSource(watch, self.cell_id, self.loop.news)
        self._add(self._masks)
        self._state["masks"] = "on"

    def sources(self) -> dict[str, str]:
        """Each source and whether it is on (or why not)."""
        return dict(self._state)

    # ---- the loop --------------------------------------------------------------------------------

    def start(self) -> None:
        """The loop, and a watchdog beside it: a loop that hangs (a source that blocks) or dies is a
        telemetry event within about a second."""
        self.loop.start(self._run, self.check)

    def alive(self) -> bool:
        return self.loop.alive()

    def check(self) -> None:
        """For the supervisor's own loop: a monitor that has stopped seeing is itself an escape event."""
        loop = self.loop
        if loop.thread is not None and not loop.stopped.is_set() and not loop.alive():
            self._event(CellEvent("telemetry", "monitor", f"the monitor's loop stopped reporting (no progress for "
                                  f"{loop.stalled:.1f} s while the host was giving it time)"
                                  if loop.thread.is_alive() else "the monitor's loop ended",
                                  source="telemetry", cell=self.cell_id))

    def _run(self) -> None:
        try:
            while not self.loop.stopped.is_set():
                self.loop.progress()
                sources, fds, gates = self._pass
                # Every source with a file wakes the loop itself; a pass without news is for what has no
                # file to wait on (a mask just touched on the host: often, for half a second).
                idle = (self._masks.pace() if self._masks is not None else None) or PASS_S
                ready = self.loop.ready = set(select.select([*fds, self.loop.wake_r], [], [], idle)[0])
                self._read([s for s, gate in zip(sources, gates, strict=True) if gate is None or gate & ready])
        except Exception as e:  # noqa: BLE001 - a monitor that stops seeing must say so, and act
            self._event(CellEvent("telemetry", "monitor", f"the monitor stopped: {e!r}", source="telemetry",
                                  cell=self.cell_id))

    def _read(self, sources: list[Source]) -> None:
        for source in sources:
            for ev in source.read():
                self.loop.progress()
                self._event(ev)
            holds = self._holders.get(id(source))
            if holds is not None:  # recorded (and, under terminate, frozen): now the process may go on
                holds.release()

    def _refresh(self) -> None:
        """The connector's news now: a process that forked since it was last read is the cell's."""
        if self._execs is not None:
            for ev in self._execs.connector():
                self._event(ev)

    def stream(self, timeout: float | None = None) -> Iterator[CellEvent]:
        """Events as they come, until the monitor stops (or ``timeout`` seconds pass with none)."""
        while True:
            try:
                ev = self.record.queue.get(timeout=timeout)
            except queue.Empty:
                return
            if ev is None:
                return
            yield ev

    def stop(self) -> list[CellEvent]:
        self._final = True  # what is read from here on happened; the cell is over: nothing to freeze or kill
        hung = self.loop.stop()
        self.loop.ready = None  # every file is read to its end
        try:
            # What arrived after the loop's last look; the masks are not looked at again, nor the cgroup's
            # counters beside a loop that hangs in them (the cgroup is still there: it goes after the monitor)
            last = [s for s in self._sources if s is not self._masks and s is not self._resources]
            self._read(last)
            for _ in range(64):  # a flood of failed calls at the very end: the ring read to its end
                if self.calls is None or not select.select([self.calls], [], [], 0)[0]:
                    break
                self._read(last)
            for ev in self.calls.dropped() if self.calls is not None else ():
                self._event(ev)
            if not hung:
                for ev in self._resources.counts():
                    self._event(ev)
        except (OSError, ValueError) as e:
            self._event(CellEvent("telemetry", "monitor", f"a source failed: {e}", source="telemetry",
                                  cell=self.cell_id))
        sources, self._sources, self._pass = self._sources, [], ([], [], [])
        for source in sources:
            try:
                source.close()
            except OSError:
                pass
        self._execs = self._masks = self.calls = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        held, self._cell_root = self._cell_root, []
        for fd in held:  # the cell's tree goes with them
            os.close(fd)
        self.record.queue.put(None)
        return self.events

    # ---- verdicts --------------------------------------------------------------------------------

    def _event(self, ev: CellEvent) -> None:
        if ev.pid and not ev.exe:
            ev.exe = self.procs.exe_of(ev.pid)
        if ev.ancestry is None and ev.pid:
            ev.ancestry = self.procs.ancestry(ev.pid)
        with self.record.lock:
            if self.record.seen(ev):
                return  # a duplicate: counted, the first one stands (and has acted already)
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
            kept = self.record.keep(ev, self.cell_id)
        if kept is not None and self.callback is not None:
            self.callback(kept)

    def record_egress(self, refusals: list[dict[str, Any]]) -> None:
        """Refusals of the egress layer as events (also those read after the monitor stopped)."""
        for ev in self.refusals.events(refusals):
            self._event(ev)

    def _refused(self, target: str, pid: int) -> None:
        """A connect of the cell's that the host firewall refused (the failed-call source): its process,
        for the firewall's record of the same packet, before or after it."""
        self.refusals.refused(target, pid)
        with self.record.lock:
            for ev in self.events:
                if ev.source == "nftables" and ev.target == target and not ev.pid:
                    ev.pid, ev.exe, ev.ancestry = pid, self.procs.exe_of(pid), self.procs.ancestry(pid)

    def terminate(self, reason: str) -> None:
        """Freeze first (nothing of the cell runs on), then kill the whole cgroup."""
        with self.record.lock:
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


# What is not seen when a source cannot start
_BLIND = {"landlock": "Landlock denials are not seen", "exec": "execs are not seen",
          "calls": "attempts on what the cell does not contain are not seen"}
