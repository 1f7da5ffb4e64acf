"""One cell and everything that lives beside it in the supervisor: the protected-path baseline, the
host firewall's table and the reader of what it rejects, the egress proxy, and the escape monitor.

``agentcell run`` (cold path), live cells (:mod:`agentcell.host.server`) and the session workflow start
cells through :class:`Supervised`, so the order below is written once:

0. the control surface (hooks, git and harness config in the writable paths) is scanned: what the
   agent creates there is moved aside at the end (:class:`SurfaceCheck`);
1. host-firewall: the nftables table and its log reader exist before the agent's first packet;
2. the monitor's sources are open before the command can run (nothing it does is missed);
3. the cell is launched; the proxy serves its one way out from inside its cgroup;
4. the monitor thread starts (a thread only now: the launcher never forks from a threaded process);
5. at the end, in reverse: monitor, proxy, the cell's cgroup, the table, the log; then the control
   surface is compared with step 0's scan.
"""
from __future__ import annotations

# agentcell run's cold path comes here: not typing, threading or collections.abc (together ~18 ms
# of imports per run here); a lock from _thread is the same lock.
import _thread

from .cell import launch
from .cell.spec import TYPE_CHECKING, CellSpec
from .errors import AgentcellError, Terminated, held, mark_after_go, termination_held
from .protect.check import SurfaceCheck

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from .cell.cgroups import CellCgroup
    from .monitor.event import CellEvent
    from .monitor.monitor import Monitor


MAX_BLOCKED = 1000  # distinct refused targets a run's result lists


class Supervised:
    """A running cell under supervision. Use :meth:`start`; then :meth:`wait` (or :meth:`poll`), which
    returns the same result dict as ``agentcell run --json``."""

    def __init__(self, spec: CellSpec, running: launch.Running, monitor: Monitor | None, proxy: Any,
                 firewall: Any, log: Any, guard: SurfaceCheck | None = None) -> None:
        self.spec, self.running, self.monitor, self.guard = spec, running, monitor, guard
        self._proxy, self._fw, self._log = proxy, firewall, log
        self._blocked: dict[tuple[str, str, str], dict[str, Any]] = {}  # refusals, one per target, counted
        self._blocked_lock = _thread.allocate_lock()  # the monitor's loop adds while the end reads (a slow stop)
        self._finish_lock = _thread.allocate_lock()  # a host's control thread and its main thread may both end it
        self._result: dict[str, Any] | None = None
        self._trust: Any = None  # the session CA's certificates for the cell (network.tlsca.CellTrust)

    @property
    def cell_id(self) -> str:
        return self.running.cell_id

    @property
    def pid1(self) -> int:
        while not self.running.pid1 and not self.running.finished_reading():
            self.running.poll_messages(0.05)
        return self.running.pid1

    @property
    def cg(self) -> CellCgroup | None:
        return self.running.cg

    @classmethod
    def start(cls, spec: CellSpec, argv: Sequence[str], *, monitor: str | None = "terminate",
              callback: Callable[[CellEvent], None] | None = None, stdio: Sequence[int] = (0, 1, 2),
              tty_fds: Sequence[int] = (), dedicated: bool | None = None, live: bool = False,
              guard: SurfaceCheck | None | bool = True, give_to: tuple[int, int] | None = None,
              adopt: tuple[Any, Any] | None = None, credentials: Any = None,
              upstream_ca: str | None = None, on_go: Callable[[str], None] | None = None) -> Supervised:
        """Launch ``argv`` in a cell for ``spec`` (``live``: no argv; the cell serves commands through
        ``running.live`` until that is closed, see :mod:`agentcell.cell.execd`). ``monitor``: terminate |
        record | ``CLASS=VERDICT,…`` (:func:`agentcell.monitor.monitor.parse_verdicts`) | None (no monitor).
        ``dedicated``: the cell's account exists for agents alone (default: an ``agent:NAME`` identity),
        so what its uid does on the host's network is the cell's (a session's own account is).
        ``guard``: the protected-path step (:class:`SurfaceCheck`, made here when True, with ``give_to`` as the
        owner of what is moved aside; False: the caller checks the control surface itself).
        ``adopt``: a host-firewall table and its log reader made before (the session's firewall step,
        so that a host that cannot have one fails before anything runs): adopted, and removed with the
        cell; if the cell cannot start, they are left to their maker.
        ``credentials`` (:class:`agentcell.network.credentials.CredentialSet`, ``--net proxy`` only): the
        cell's environment gets their placeholders and trusts a CA made for this cell alone, whose leaves
        let the proxy put the real values in the requests to their hosts (verified upstream against the
        host's trust store, or ``upstream_ca``, a PEM: a test's CA standing in for the public ones).
        ``on_go(cell_id)`` is called just before the command is let go: from then on it may have run, so
        whoever asked must never start it again (a host that dies after this is lost, not unavailable)."""
        trust = ca = secrets = None
        try:
            if credentials is not None and credentials.secrets:
                if spec.network != "proxy":
                    raise AgentcellError("--secret", "credentials are injected by the egress proxy",
                                         "use --net proxy (with --allow-domain for their hosts)")
                from .cell.spec import new_cell_id
                from .network.tlsca import CellTrust, SessionCA

                if not spec.cell_id:  # (its trust directory is named by it)
                    spec = spec.replace(cell_id=new_cell_id())
                placeholders = credentials.cell_env()
                env = tuple((k, v) for k, v in spec.env if k not in placeholders)
                spec = spec.replace(env=(*env, *placeholders.items()))
                if credentials.hosts():  # (bound over plain HTTP alone: nothing to terminate, no CA)
                    ca = SessionCA(spec.cell_id, credentials.hosts())
                    with held():  # (made and known as one step: a SIGTERM comes once it can be removed)
                        trust = CellTrust(spec.cell_id, ca, upstream_ca)
                    env = tuple((k, v) for k, v in spec.env if k not in dict(trust.env()))
                    spec = spec.replace(env=(*env, *trust.env()), ro_paths=(*spec.ro_paths, trust.dir))
                secrets = (credentials, ca, upstream_ca)
            return cls._start(spec, argv, monitor=monitor, callback=callback, stdio=stdio, tty_fds=tty_fds,
                              dedicated=dedicated, live=live, guard=guard, give_to=give_to, adopt=adopt,
                              secrets=secrets, trust=trust, on_go=on_go)
        except BaseException:
            if trust is not None:
                trust.remove()
            raise

    @classmethod
    def _start(cls, spec: CellSpec, argv: Sequence[str], *, monitor: str | None, callback: Callable[[CellEvent], None]
               | None, stdio: Sequence[int], tty_fds: Sequence[int], dedicated: bool | None, live: bool,
               guard: SurfaceCheck | None | bool, give_to: tuple[int, int] | None, adopt: tuple[Any, Any] | None,
               secrets: tuple[Any, Any, str | None] | None, trust: Any,
               on_go: Callable[[str], None] | None = None) -> Supervised:
        if spec.watch and monitor is None:  # its canaries and seccomp listener wait on a monitor
            raise AgentcellError("watch", "a watched cell needs its monitor", "pass monitor='terminate' or 'record'")
        if guard is True:
            guard = SurfaceCheck(spec, give_to)
        fw = log = None
        made = adopt if spec.network == "host-firewall" else None
        if made is not None:
            fw, log = made
        elif spec.network == "host-firewall":
            from .network import firewall, nflog

            rules = [r for e in spec.egress if e.startswith("egress:") for r in firewall.parse_egress(e[7:])]
            try:
                log = nflog.open_group()
            except OSError as e:
                raise AgentcellError("--net", f"cannot read the firewall's log: {e.strerror}",
                                     "see 'agentcell doctor'") from None
            try:
                fw = firewall.HostFirewall.create(spec.cell_id, spec.identity.uid, rules, "loopback" in spec.egress,
                                                  log.group)
            except BaseException:
                log.close()
                raise
        watch = running = prepared = None
        try:
            if monitor is not None:
                from .monitor import calls
                from .monitor.monitor import Monitor

                if not calls.supported():
                    calls.kernel_layout()  # (the kernel's BTF, read before the monitor listens to the host's forks)

                watch = Monitor(spec.cell_id, None, monitor, uid=spec.identity.uid, callback=callback,
                                rootless=spec.identity.userns,
                                dedicated=spec.identity.mode == "agent" if dedicated is None else dedicated)
                if watch.terminated:  # a source that cannot start, under terminate: the cell never runs
                    raise AgentcellError("--monitor", f"the monitor cannot see: {watch.reason}",
                                         "see 'agentcell doctor', or --on-escape record to run without that source")
                if not spec.watch:
                    spec = spec.replace(watch=True)  # canaries and seccomp reports: only a monitor serves them
            from .protect import binds

            if not argv and not live:
                raise AgentcellError("command", "no command given", "put it after --")
            cell_binds, creatable = binds.for_watched_cell(spec) if watch is not None else (binds.for_cell(spec), ())
            prepared = launch.prepare(spec, cell_binds)
            if watch is not None:  # its failed calls and the protected entries it creates, before its command
                try:
                    from .monitor.attempts import View

                    watch.watch_calls(prepared.cg, View(spec, *cell_binds))
                    watch.watch_created(creatable)
                    if watch.terminated:
                        raise AgentcellError("--monitor", f"the monitor cannot see: {watch.reason}", "see "
                                             "'agentcell doctor', or --on-escape record to run without that source")
                except BaseException:
                    prepared.discard()
                    raise
            with held():  # (a SIGTERM meanwhile: raised once the cell is ours to kill, below)
                if on_go is not None:
                    try:
                        on_go(prepared.cell_id)
                    except BaseException:
                        prepared.discard()
                        raise
                stopped = termination_held()
                if stopped:  # stopped meanwhile: the command is never let go
                    prepared.discard()
                    raise Terminated(stopped)
                running = prepared.go(list(argv), stdio=stdio, tty_fds=tty_fds, live=live)
        except BaseException as e:
            # The command may have run once it was sent: the prepared cell says so, whatever error this is (go
            # marks its own; a SIGTERM held over the start replaces them as the hold ends).
            if prepared is not None and prepared.sent:
                mark_after_go(e)
                if running is not None:  # (a signal held over its start: the cell is killed, as below)
                    _noted(e, "killing the cell", running.kill)
                    _noted(e, "waiting for the cell", lambda: running.wait(None))
                _guard_after(guard, prepared.cell_id, e)  # (the cell is dead: go killed it, or the lines above)
            _beside_down(e, watch, fw if made is None else None, log if made is None else None)
            raise
        proxy = None
        try:
            if running.egress_fd is not None:
                from .network import egress

                proxy = egress.ProxyProcess(running.egress_fd, spec.egress,
                                            egress.secrets_memfd(*secrets) if secrets is not None else None)
                if running.cg is not None:  # the proxy serves this cell alone: it counts against its ceilings
                    try:
                        running.cg.adopt(proxy.proc.pid)
                    except OSError:
                        pass  # it exited at once: the cell will find no one on its one way out
            sup = cls(spec, running, watch, proxy, fw, log, guard or None)
        except BaseException as e:  # (a SIGTERM, say, before the supervisor holds it all): taken down whole
            mark_after_go(e)
            _noted(e, "stopping the proxy", proxy.stop if proxy is not None else None)  # (first: in the groups)
            _noted(e, "killing the cell", running.kill)
            _noted(e, "waiting for the cell", lambda: running.wait(None))
            _guard_after(guard, running.cell_id, e)
            _beside_down(e, watch, fw if made is None else None, log if made is None else None)
            raise
        sup._trust = trust
        if watch is not None:
            try:
                _ = sup.pid1  # known before the monitor follows the cell's processes by descent from it
                watch.attach(running)
                if proxy is not None:
                    watch.add_source(proxy.new_events, proxy.fileno())
                    watch.trusted.add(proxy.proc.pid)  # it becomes nobody inside the cell's cgroup: not the agent
                if log is not None:
                    watch.add_source(sup._firewall_events, log.fileno())
                watch.start()
            except BaseException as e:  # the cell runs already: it is taken down whole before the error goes on
                mark_after_go(e)
                try:
                    ended = sup.finish(None)  # (its last step: the protected-path step)
                except Exception as finish_failed:  # noqa: BLE001 - the error that ended the start goes on
                    e.add_note(f"taking the cell down failed too: {finish_failed}")
                    _guard_after(guard, running.cell_id, e)
                else:
                    _said(e, ended)
                raise
        return sup

    def _firewall_events(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = self._log.events()
        self._keep_blocked(new)
        return new

    def _keep_blocked(self, new: list[dict[str, Any]]) -> None:
        """The run's refused packets, one entry per (target, protocol, uid) with a count, at most
        MAX_BLOCKED of them: a cell sending refused packets as fast as it can (when refusals do not
        end it: a person's uid, --on-escape record) costs the supervisor no memory per packet."""
        with self._blocked_lock:
            for e in new:
                key = (str(e.get("target")), str(e.get("protocol", "")), str(e.get("uid", "")))
                seen = self._blocked.get(key)
                if seen is not None:
                    seen["count"] = seen.get("count", 1) + 1
                elif len(self._blocked) < MAX_BLOCKED:
                    self._blocked[key] = {**e, "count": 1}
                else:
                    more = self._blocked.setdefault(("...", "", ""), {**e, "target": "...", "count": 0,
                                                                      "reason": "more refused targets, not listed"})
                    more["count"] += 1

    def events(self) -> list[CellEvent]:
        return list(self.monitor.events) if self.monitor is not None else []

    def stats(self) -> dict[str, float]:
        """What the cell has used so far (cgroup accounting; empty without a cgroup)."""
        cg = self.running.cg
        if cg is None:
            return {}
        out: dict[str, float] = {}
        try:
            out["cpu_s"] = cg.cpu_usage_s() or 0.0
            out["memory_bytes"] = float(cg.memory_current() or 0)
        except OSError:
            pass
        return out

    def terminate(self, reason: str) -> None:
        """Freeze the whole cell, then kill it (the monitor's own verdict path, for a caller's reason)."""
        if self.monitor is not None:
            self.monitor.terminate(reason)
        else:
            if self.running.cg is not None:
                try:
                    self.running.cg.freeze()
                except OSError:
                    pass
            self.running.kill()

    def poll(self) -> dict[str, Any] | None:
        """The result once the cell has ended, else None; never blocks."""
        if self._result is not None:
            return self._result
        self.running.poll_messages(0)
        if self.running.reported() or self.running.finished_reading():
            return self.wait()
        return None

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the end (``timeout`` seconds from the start: then the cell is killed, exit 124)."""
        if self._result is not None:
            return self._result
        try:
            r = self.running.wait(timeout, clean_up=False)
        except BaseException:
            self.finish(None)
            raise
        return self.finish(dict(r.as_dict()))

    def finish(self, result: dict[str, Any] | None) -> dict[str, Any]:
        """Take down what lives beside the cell, in reverse order, and complete ``result`` (from
        ``Running.wait``) with the events and refusals. Idempotent; whole (a SIGTERM or SIGHUP that comes
        meanwhile is raised after it)."""
        with self._finish_lock, held():
            if self._result is None:
                self._result = self._finish(result)
            return self._result

    def _finish(self, result: dict[str, Any] | None) -> dict[str, Any]:
        if result is None:  # an abnormal end (an exception on the way): the cell is killed and reaped first
            try:
                self.running.kill()
                self.running.wait(None, clean_up=False)
            except Exception:  # noqa: BLE001 - what can be taken down still is, below
                pass
        events = self.monitor.stop() if self.monitor is not None else []
        blocked = self._proxy.stop() if self._proxy is not None else []
        self.running.clean_up()  # its cgroup, now that the proxy has left it too
        if self._trust is not None:
            self._trust.remove()
        if self._fw is not None:
            self._fw.remove()
        if self._log is not None:
            late = self._log.events()  # a refusal of the cell's last moments may come after the monitor's last look
            if self.monitor is not None:
                self.monitor.record_egress(late)
            self._keep_blocked(late)
            with self._blocked_lock:
                blocked = list(self._blocked.values())
            self._log.close()
        events = self.monitor.events if self.monitor is not None else []
        out = dict(result or {})
        if self.spec.network in ("proxy", "host-firewall"):
            out["egress_blocked"] = blocked
        if self.monitor is not None:
            out["events"] = [ev.as_dict() for ev in events]
            out["terminated_by_monitor"] = self.monitor.terminated
            out["monitor_reason"] = self.monitor.reason if self.monitor.terminated else None
            out["monitor_frozen"] = bool(self.monitor.frozen_at)
            out["monitor_sources"] = self.monitor.sources()
        if self.guard is not None:
            self.guard.check(out, self.cell_id)
        return out


def _guard_after(guard: SurfaceCheck | None | bool, cell_id: str, e: BaseException) -> None:
    """A start that failed once its command was let go, the cell killed: what the command planted on the
    control surface meanwhile is moved aside all the same, and said as notes on the error that goes on."""
    if isinstance(guard, SurfaceCheck):
        try:
            _said(e, guard.check({}, cell_id))
        except Exception as check_failed:  # noqa: BLE001 - the error that ended the start goes on
            e.add_note(f"the protected-path step failed too: {check_failed}")


def _said(e: BaseException, found: dict[str, Any]) -> None:
    """The protected-path step's findings in ``found`` as notes on ``e`` (the warnings a finished run gives)."""
    from .protect.check import protected_lines

    for line in protected_lines(found):
        e.add_note(line)


def _beside_down(e: BaseException, watch: Any, fw: Any, log: Any) -> None:
    """What a failed start made beside its cell (its monitor, and the table and log it made itself, not
    one adopted), taken down; each one's failure a note on ``e``."""
    _noted(e, "stopping the monitor", watch.stop if watch is not None else None)
    _noted(e, "removing the table", fw.remove if fw is not None else None)
    _noted(e, "closing the firewall's log", log.close if log is not None else None)


def _noted(e: BaseException, what: str, step: Callable[[], object] | None) -> None:
    """One teardown step of a failed start; its own failure a note on ``e``, which goes on (it says whether
    the command may have run, which a new error would lose)."""
    if step is None:
        return
    try:
        step()
    except Exception as failed:  # noqa: BLE001 - the error that ended the start goes on
        e.add_note(f"{what} failed too: {failed}")

