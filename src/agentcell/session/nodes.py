"""The session's nodes: each calls one layer and writes one audit record; edges and retries are the graph's.

A node returns the part of the state it changes. A node that fails raises: its ``RetryPolicy`` (in
:mod:`.graph`) retries it, and when the retries are spent its error handler (:meth:`Nodes.on_error`)
routes the session — to ``abort`` before anything runs, to ``terminate`` once something does. The
teardown nodes (``terminate``, ``cleanup``, ``abort``, ``audit``) never raise: they work from the
checkpointed state alone when the supervisor's handles are gone (``session recover``), and report what
they could not undo.

Fault injection (tests): :attr:`Runtime.faults` names a point and how many times it fails —
``preflight``, ``account``, ``firewall``, ``spawn``, ``telemetry``, ``audit@NODE`` (that node's audit
record is written to a path that cannot be written, so the trail's own retries run and fail for real),
and ``kill@NODE`` (the supervisor is killed with SIGKILL after that node's work, before its checkpoint).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from langgraph.errors import NodeError
from langgraph.types import Command

from .. import caches, hostfs
from ..audit.trail import AuditLog, AuditWriteError
from ..cell import cgroups
from ..cell.spec import DEFAULT_PATH
from ..errors import AgentcellError, PolicyError
from . import envfiles, gitcell
from .state import FINAL, SECRET_PLACEHOLDER, Runtime, SessionState

if TYPE_CHECKING:
    from ..policy.models import SessionPlan

UNWRITABLE_AUDIT = "/proc/agentcell-fault/audit.jsonl"  # /proc takes no new files: a real write failure
AUDIT_MIN_FREE = 1 << 20  # bytes left where the trail is, below which a running session stops
MAX_EVENTS = 100


class InjectedFault(AgentcellError):
    """A failure made on purpose by the fault-injection hook."""


class SpawnCrash(AgentcellError):
    """The cell's process failed before its command ran (a launch step, fork): retried once."""


class TelemetryLost(AgentcellError):
    """The session lost sight of its cell (the handle or the monitor's stream): retried, then a violation."""


def _line(e: BaseException) -> str:
    return e.line() if isinstance(e, AgentcellError) else f"{type(e).__name__}: {e}"


class Nodes:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    # ---- helpers -----------------------------------------------------------------------------------

    def _audit(self, state: SessionState, node: str, event: str, **details: Any) -> None:
        path = (state.get("config") or {}).get("audit_log_path")
        if self.rt.fault(f"audit@{node}"):
            path = UNWRITABLE_AUDIT
        AuditLog(path).append(event, session=state["session_id"], **details)

    def _audit_quietly(self, state: SessionState, node: str, event: str, **details: Any) -> dict[str, Any]:
        """For teardown nodes: a failed record is kept in the state, never raised."""
        try:
            self._audit(state, node, event, **details)
            return {}
        except AuditWriteError as e:
            return {"audit_error": e.line()}

    def _crash(self, node: str) -> None:
        """``kill@NODE``: the supervisor dies by SIGKILL here — after the node's work, before its
        checkpoint, the hardest place for ``session recover``."""
        if self.rt.fault(f"kill@{node}"):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def _inject(self, point: str, exc: type[AgentcellError]) -> None:
        if self.rt.fault(point):
            raise exc(point, "injected fault", f"unset {point} in the fault-injection hook")

    def on_error(self, node: str, route: str) -> Any:
        """The node's error handler: where the session goes once the node's retries are spent."""
        def handler(state: SessionState, error: NodeError) -> Command[str]:
            err = error.error
            if isinstance(err, AuditWriteError):  # nothing runs unrecorded: the session stops
                goto, reason = "terminate", f"the audit log cannot be written ({err.line()})"
            else:
                goto, reason = route, f"{node} failed: {_line(err)}"
            status = "aborted" if goto == "abort" else "terminated"
            update: dict[str, Any] = {"status": status, "reason": reason}
            if node == "monitor" and isinstance(err, TelemetryLost):
                update["reason"] = f"lost sight of the cell, after 3 reconnects: {err.problem}"
                update["escape"] = self._escape(state, "telemetry", "monitor", update["reason"], source="telemetry")
            return Command(goto=goto, update=update)
        handler.__name__ = f"on_{node}_error"
        return handler

    @staticmethod
    def _escape(state: SessionState, operation: str, target: str, reason: str, *, source: str,
                pid: int | None = None, exe: str | None = None, ts: float | None = None,
                ancestry: list[Any] | None = None) -> dict[str, Any]:
        from ..policy.models import EscapeEvent

        ev = EscapeEvent(session_id=state["session_id"], operation=operation,  # type: ignore[arg-type]
                         target=target, reason=reason, pid=pid, exe=exe or None, source=source,
                         ts=ts or time.time(), ancestry=[tuple(a) for a in ancestry or []])
        return ev.model_dump()

    # ---- plan → policy → preflight -------------------------------------------------------------------

    def plan(self, state: SessionState) -> dict[str, Any]:
        """The request, from the configuration and the harness profile (pure)."""
        plan, marks = make_plan(state["config"], state["session_id"], state.get("launch"))
        self._crash("plan")
        self._audit(state, "plan", "session.plan", harness=plan.harness, declared_paths=plan.declared_paths,
                    network=plan.network, allow_presets=plan.allow_presets, allow_domains=plan.allow_domains,
                    deny_domains=plan.deny_domains, wall_clock_limit_s=plan.wall_clock_limit_s, identity=plan.identity,
                    sources=state["config"].get("sources", {}))
        # Who gets what the agent makes is decided now, by whoever starts the session: not by whoever
        # later runs 'session recover' (their SUDO_UID is not the session's human).
        return {"plan": plan.model_dump(), "status": "running", "reason": "", "cell_id": f"agentcell-{plan.session_id}",
                "config_marks": marks, "root_ids": _ids([state["config"]["project_root"], *plan.declared_paths]),
                "human": self._human(state["config"]["project_root"]) if plan.identity.isdigit() else None}

    def _compile(self, state: SessionState, identity: str | None = None) -> dict[str, Any]:
        from ..policy.models import SessionPlan

        plan = SessionPlan.model_validate(state["plan"])
        return compile_policy(plan, self.rt.environ, state["config"]["project_root"], identity)

    def policy(self, state: SessionState) -> dict[str, Any]:
        policy = self._compile(state)
        self._crash("policy")
        self._audit(state, "policy", "session.policy", os_user=policy["os_user"], write_paths=policy["write_paths"],
                    read_paths=policy["read_paths"], env_allowlist=policy["env_allowlist"],
                    firewall_rule=policy["firewall_rule"], risk=state["plan"].get("risk"), limits=policy["limits"],
                    limits_from=state["config"].get("sources", {}).get("limits"), home=policy["home_dir"] or "tmpfs",
                    ceilings="on" if state["config"].get("ceilings", True) else "off")
        return {"policy": policy}

    def preflight(self, state: SessionState) -> dict[str, Any]:
        """The backup: no backup, no agent."""
        from ..snapshot.store import SnapshotError, Store

        self._inject("preflight", SnapshotError)
        store = Store(state["config"].get("backup_dir"))
        paths = _written(state)
        # A copy-on-write workspace is never written: its change set is on disk from the start, so
        # the project needs no backup (the other declared paths still get theirs).
        backup = store.take(paths) if paths else None
        self._crash("preflight")
        self._audit(state, "preflight", "session.preflight", backup_id=backup, store=store.path, paths=paths,
                    workspace=state["config"].get("workspace", "direct"))
        return {"backup_id": backup}

    def abort(self, state: SessionState) -> dict[str, Any]:
        reason = state.get("reason") or "aborted"
        if state.get("backup_id"):
            reason += f"; the backup {state['backup_id']} is kept"
        update: dict[str, Any] = {"status": "aborted", "reason": reason}
        update.update(self._audit_quietly(state, "abort", "session.abort", reason=update["reason"],
                                          backup_id=state.get("backup_id")))
        return update

    # ---- account → firewall → spawn ------------------------------------------------------------------

    def account(self, state: SessionState) -> dict[str, Any]:
        """The least-privilege account the agent runs as, and the declared paths shared with it (ACLs)."""
        from ..accounts.commands import Commands

        self._inject("account", InjectedFault)
        cmds = Commands()
        cfg, policy = state["config"], state["policy"]
        update: dict[str, Any] = {}
        if os.geteuid() != 0:
            account = {"kind": "self", "name": policy["os_user"], "uid": os.geteuid(), "gid": os.getegid(),
                       "group": ""}
            grants: list[dict[str, Any]] = []
        elif cfg.get("agent"):
            account, human, wanted = self._persistent(cfg["agent"], _written(state))
            update["human"] = human
            grants = self._grant(cmds, account, wanted)
        else:
            from ..accounts import ephemeral

            made = ephemeral.create_ephemeral(state["session_id"], cmds)
            account = {"kind": "ephemeral", "name": made.name, "uid": made.uid, "gid": made.gid, "group": made.name}
            grants = []
            try:
                update["human"] = state.get("human") or self._human(cfg["project_root"])
                grants = self._grant(cmds, account, _written(state))
                update["policy"] = self._compile(state, identity=str(made.uid))
            except BaseException:  # undone here, so that the retry starts clean
                _revoke(cmds, account, grants)
                ephemeral.delete(made, cmds)
                raise
        update.update(account=account, grants=grants)
        self._crash("account")
        self._audit(state, "account", "session.account", account=account,
                    grants=[g["path"] for g in grants])
        return update

    @staticmethod
    def _persistent(name: str, paths: list[str]) -> tuple[dict[str, Any], list[int] | None, list[str]]:
        import pwd

        from ..accounts.registry import open_registry

        with open_registry() as reg:
            rec = reg.get(name)
        if rec.state != "ready":
            raise AgentcellError("AGENT_OS_USER", f"agent '{name}' is {rec.state}, not ready",
                                 f"'agentcell agent delete {name} --yes' removes what was made")
        account = {"kind": "agent", "name": name, "uid": rec.uid, "gid": rec.gid, "group": rec.group}
        try:
            pw = pwd.getpwnam(rec.human)
            human: list[int] | None = [pw.pw_uid, pw.pw_gid]
        except KeyError:
            human = None
        # A path the agent already shares read-write keeps its share: granting and revoking it here would
        # take that share away at the end of the session.
        wanted = [p for p in paths if not any(s.mode == "rw" and (p == s.source or p.startswith(s.source + "/"))
                                              for s in rec.shares)]
        return account, human, wanted

    @staticmethod
    def _human(project_root: str) -> list[int]:
        return session_human(project_root)

    @staticmethod
    def _grant(cmds: Any, account: dict[str, Any], paths: list[str]) -> list[dict[str, Any]]:
        from ..accounts import acl

        grants: list[dict[str, Any]] = []
        try:
            for p in paths:
                grants.append({"path": p, "prior": acl.prior_acl(p)})  # first: a grant cut short is revoked too
                acl.grant(cmds, account["group"], account["gid"], p, "rw")
        except BaseException:
            _revoke(cmds, account, grants)
            raise
        return grants

    def firewall(self, state: SessionState) -> dict[str, Any]:
        """The egress rule before the agent exists. Namespaced modes need none on the host: the cell's
        own network namespace (none, loopback) or its proxy (made with the cell) is the rule. For
        host-firewall the table is made here, so that a host that cannot have it fails (retried once,
        then aborted) before anything runs; spawn hands it (and its log's socket) over to the cell's
        host, whose Supervised adopts it and removes it with the cell."""
        self._inject("firewall", InjectedFault)
        policy = state["policy"]
        table = None
        if policy["network"] == "host-firewall":
            from ..network import firewall, nflog

            rules = [r for e in policy["egress"] if e.startswith("egress:") for r in firewall.parse_egress(e[7:])]
            log = nflog.open_group()
            try:
                fw = firewall.HostFirewall.create(state["cell_id"], policy["identity"]["uid"], rules,
                                                  "loopback" in policy["egress"], log.group)
            except BaseException:
                log.close()
                raise
            self.rt.firewalls[state["session_id"]] = (fw, log)
            table = fw.table
        self._crash("firewall")
        self._audit(state, "firewall", "session.firewall", network=policy["network"], rule=policy["firewall_rule"],
                    table=table, egress=list(policy["egress"]))
        return {"firewall_table": table}

    def spawn(self, state: SessionState) -> dict[str, Any]:
        from ..policy.models import SandboxPolicy
        from ..protect import surface
        from . import spawn

        self._inject("spawn", SpawnCrash)
        sid = state["session_id"]
        policy = SandboxPolicy.model_validate(state["policy"])
        spec = policy.to_cell_spec()
        env = tuple((k, self.rt.secrets.get(k, "") if v == SECRET_PLACEHOLDER else v) for k, v in spec.env)
        spec = spec.replace(env=env)
        # What is there now of what git, shells and harnesses read (hooks, .envrc, CLAUDE.md, …): cleanup
        # moves aside what the agent creates there, as agentcell run does.
        since_ns = time.time_ns() - 100_000_000  # file times are coarse: some slack
        written = tuple(_written(state))
        before, truncated = surface.surface(written)
        env_files = envfiles.dotenv_files(list(written))[0]  # (what exists is hidden in the cell; see cleanup)
        ws_dir = None
        if state["config"].get("workspace") == "copy":
            spec, ws_dir = self._workspace(state, spec)
        git = self._git(state, spec.rw_paths)
        ours = [("gitconfig", git["config"], False)]
        if git.get("wrapper"):
            ours.append(("bin/git", git["wrapper"], False))
        seed_dir, seed_notes = self._seed(state, policy.identity.uid, policy.identity.gid, tuple(ours))
        if seed_dir is not None:
            cell_env = dict(spec.env)
            if git.get("wrapper"):  # the seed's git first (gitcell.wrapper)
                cell_env["PATH"] = os.path.join(seed_dir, "bin") + ":" + cell_env.get("PATH", DEFAULT_PATH)
            cell_env.update(gitcell.environment(os.path.join(seed_dir, "gitconfig"), git["name"], git["email"]))
            spec = spec.replace(ro_paths=(*spec.ro_paths, seed_dir), env=tuple(cell_env.items()))
        cache_dir, cache_notes = self._cache(state, policy.identity.uid, policy.identity.gid)
        if cache_dir is not None:
            spec = spec.replace(cache_dir=cache_dir,
                                env=(*spec.env, *caches.environment(dict(spec.env)).items()))
        made = self.rt.firewalls.get(sid)
        try:
            cell = spawn.start(spec, list(state["argv"]), stdio=self.rt.stdio, firewall=made,
                               credentials=self.rt.credentials, upstream_ca=self.rt.upstream_ca, host=self.rt.host)
        except (OSError, AgentcellError) as e:  # the table stays ours: a retry hands it over again, cleanup removes it
            raise SpawnCrash("", _line(e)) from None
        if made is not None:  # the cell's host owns the table now, and removes it with the cell
            self.rt.firewalls.pop(sid)
            made[1].close()
        pid1 = cell.pid1
        self.rt.cells[sid] = cell
        now = time.time()
        self._crash("spawn")
        self._audit(state, "spawn", "session.spawn", cell_id=cell.cell_id, pid1=pid1, argv0=state["argv"][0],
                    uid=policy.identity.uid, seed=seed_dir, home_from=state["config"].get("home_from"),
                    git_identity=f"{git['name']} <{git['email']}>", git_identity_from=git["from"],
                    git_safe_directories=git["safe"], cache=cache_dir, workspace=ws_dir)
        return {"harness_pid": pid1, "cell_id": cell.cell_id, "started_at": now, "cache_dir": cache_dir,
                "workspace_dir": ws_dir,
                "deadline": now + policy.wall_clock_limit_s, "seed_notes": [*seed_notes, *cache_notes],
                "protect": {"before": before, "truncated": truncated, "since_ns": since_ns,
                            "meanings": surface.meanings(before), "env_files": env_files}}

    @staticmethod
    def _workspace(state: SessionState, spec: Any) -> tuple[Any, str]:
        """The project as a copy-on-write view (agentcell.workspace): made once; a retried spawn finds it."""
        from .. import workspace

        cfg, sid = state["config"], state["session_id"]
        project = os.path.realpath(cfg["project_root"])
        st = os.stat(project)
        human = state.get("human") or [st.st_uid, st.st_gid]
        include = list(cfg.get("workspace_include") or [])
        # What the cell masks in the project is left out of the copy, but what the human names with
        # --workspace-include (their .env, say): that is theirs to give.
        inside = [m for m in spec.masked_paths if hostfs.within(m, project) and m != project
                  and os.path.relpath(m, project) not in include]
        ws = workspace.create(sid, project, owner=(int(human[0]), int(human[1])),
                              account=(spec.identity.uid, spec.identity.gid), include=include, masked=inside,
                              trail=cfg.get("audit_log_path"))
        # The copy is the whole project: declared paths inside it are in it; those outside stay as they are.
        rw = (project, *(p for p in spec.rw_paths if not hostfs.within(p, project)))
        spec = spec.replace(workspace=ws, rw_paths=rw, masked_paths=tuple(m for m in spec.masked_paths
                                                                          if not hostfs.within(m, project)))
        return spec, workspace.path_of(sid)

    @staticmethod
    def _cache(state: SessionState, uid: int, gid: int) -> tuple[str | None, list[str]]:
        """The project's toolchain caches (:mod:`agentcell.caches`), handed to the session's account;
        none with --cache off. A store that cannot be used is said, and the session runs cold."""
        cfg = state["config"]
        if cfg.get("cache") is False:
            return None, []
        try:
            tree, left = caches.prepare(cfg["project_root"], cfg.get("agent"), (uid, gid))
        except (OSError, AgentcellError) as e:
            return None, [f"toolchain caches: none this session ({_line(e)})"]
        return tree, left

    @staticmethod
    def _git(state: SessionState, rw_paths: tuple[str, ...]) -> dict[str, Any]:
        """The cell's own git configuration (:mod:`.gitcell`): the declared paths and the repositories in
        them as safe directories, the identity the agent commits under."""
        from ..protect import surface

        repos = surface.repositories(rw_paths)
        human = state.get("human")
        uid = human[0] if human else None if os.geteuid() == 0 else os.getuid()  # rootless: the user is the human
        name, email, where = gitcell.identity(state["config"].get("git_identity"), uid, repos,
                                              state["config"]["harness"])
        safe = list(dict.fromkeys((*rw_paths, *repos)))
        out = {"config": gitcell.system_config(safe, name, email), "name": name, "email": email, "from": where,
               "safe": safe}
        from ..harness import profiles

        real = shutil.which("git", path=DEFAULT_PATH)
        if profiles.get(state["config"]["harness"]).git_config_isolated and real:
            out["wrapper"] = gitcell.wrapper(os.path.realpath(real), safe)
        return out

    @staticmethod
    def _seed(state: SessionState, uid: int, gid: int, more: tuple[tuple[str, str, bool], ...] = ()
              ) -> tuple[str | None, list[str]]:
        """The seed directory (:mod:`agentcell.harness.seed`): the harness's settings files and the
        home it starts from, the account's, bound read-only into the cell; ``more`` files of the
        session's own (its git configuration). A retried spawn starts it again."""
        from ..harness import seed

        launch = state.get("launch") or {}
        files = [(f["path"], f["content"], f["home"]) for f in launch.get("files", [])] + list(more)
        home_from = state["config"].get("home_from")
        if not files and not home_from:
            return None, []
        seed.remove(state["session_id"])
        try:
            notes = seed.create(state["session_id"], files, home_from, (uid, gid))
        except (OSError, AgentcellError) as e:
            seed.remove(state["session_id"])
            raise SpawnCrash("seed", _line(e) if isinstance(e, AgentcellError) else f"{e.strerror}: "
                             f"{e.filename}") from None
        return seed.path(state["session_id"]), [f"--home-from: not copied: {n}" for n in notes]

    # ---- monitor ⟲ → terminate → cleanup → audit ---------------------------------------------------

    def monitor(self, state: SessionState) -> dict[str, Any]:
        """One watch of up to ``tick_s``: the first escape, the cell's end, the wall clock, a stop."""
        from ..monitor.monitor import ESCAPES

        sid = state["session_id"]
        self._inject("telemetry", TelemetryLost)
        cell = self.rt.cells.get(sid)
        if cell is None:
            raise TelemetryLost("monitor", "the supervisor holds no handle on the cell")
        self._crash("monitor")
        until = min(time.monotonic() + self.rt.tick_s, time.monotonic() + max(0.0, state["deadline"] - time.time()))
        next_line = time.monotonic()
        while True:
            # What the monitor acts on (an event it only notes, acts false, is not held against the cell).
            escape = next((e for e in cell.events() if e["operation"] in ESCAPES and e.get("acts", True)), None)
            result = cell.poll()
            if result is not None and escape is None and result.get("terminated_by_monitor"):
                # Ended by its monitor whatever the report kept: never a normal exit.
                escape = next((e for e in result.get("events", []) if e["operation"] in ESCAPES
                               and e.get("acts", True)), None) or {
                    "operation": "telemetry", "target": "monitor", "source": "telemetry",
                    "reason": result.get("monitor_reason") or "the monitor ended the cell"}
            if result is None and escape is None and cell.lost:
                raise TelemetryLost("monitor", "the cell's host ended without a word")
            if escape is not None:
                ev = self._escape(state, escape["operation"], escape["target"], escape["reason"],
                                  source=escape["source"], pid=escape.get("pid"), exe=escape.get("exe"),
                                  ts=escape.get("ts"), ancestry=escape.get("ancestry"))
                try:
                    self._audit(state, "monitor", "session.escape", allow=escape.get("allow", ""),
                                **{k: v for k, v in ev.items() if k != "session_id"})
                    unrecorded: dict[str, Any] = {}
                except AuditWriteError as e:  # the escape is still the session's verdict, and says so
                    unrecorded = {"audit_error": e.line()}
                who = f" by {os.path.basename(ev['exe'] or '?')} (pid {ev['pid']})" if ev["pid"] else ""
                return {"status": "terminated", "reason": f"escape: {ev['operation']} {ev['target']}{who}: "
                        f"{ev['reason']}" + (" (not in the audit log: it cannot be written)" if unrecorded else ""),
                        "escape": ev, **unrecorded}
            if result is not None:
                self._audit(state, "monitor", "session.exit", exit_status=result["exit_status"],
                            signal=result["signal"])
                return {"status": "completed", "reason": f"exit {result['exit_status']}", "result": result}
            if sid in self.rt.stop_requested:
                why = self.rt.stop_requested[sid]
                self._audit(state, "monitor", "session.stop", reason=why)
                return {"status": "terminated", "reason": f"stopped: {why}"}
            if time.time() >= state["deadline"]:
                self._audit(state, "monitor", "session.timeout",
                            wall_clock_limit_s=state["policy"]["wall_clock_limit_s"])
                return {"status": "completed", "reason": "timeout"}
            if time.monotonic() >= until:
                break
            if time.monotonic() >= next_line:  # once a second
                self._audit_room(state)
                if self.rt.status_line:
                    self._status_line(state, cell)
                next_line = time.monotonic() + 1.0
            time.sleep(0.05)
        # A record per tick: what the cell has used so far, and the proof the trail still takes records
        # (one that cannot ends the session now, not at its end).
        stats = cell.stats()
        self._audit(state, "monitor", "session.tick", cpu_s=stats.get("cpu_s"), memory_bytes=stats.get("memory_bytes"),
                    events=len(cell.events()))
        return {}

    def _audit_room(self, state: SessionState) -> None:
        """The trail's file system still has room: a session stops before its records are lost."""
        path = AuditLog((state.get("config") or {}).get("audit_log_path")).path
        try:
            st = os.statvfs(os.path.dirname(path))
        except OSError as e:
            raise AuditWriteError("audit", f"cannot reach {path}: {e.strerror}", "the session stops: fix the log") \
                from None
        free, inodes = st.f_bavail * st.f_frsize, st.f_favail
        if free < AUDIT_MIN_FREE or inodes < 16:
            raise AuditWriteError("audit", f"the file system of {path} is full ({free:,} bytes, {inodes:,} inodes "
                                  "left)", "the session stops before its records are lost: make room, then "
                                  "'agentcell audit verify'")

    def _status_line(self, state: SessionState, cell: Any) -> None:
        import sys

        s = cell.stats()
        mem = f"{s['memory_bytes'] / 2**20:.0f} MiB" if s.get("memory_bytes") else "-"
        cpu = f"{s['cpu_s']:.1f} s" if s.get("cpu_s") is not None else "-"
        sys.stderr.write(f"\r\033[Ksession {state['session_id']}: {time.time() - state['started_at']:.0f} s, "
                         f"cpu {cpu}, memory {mem}, events {len(cell.events())}")
        sys.stderr.flush()

    def terminate(self, state: SessionState) -> dict[str, Any]:
        """End the cell (freeze, then kill) whatever brought us here, and collect its result."""
        sid = state["session_id"]
        cell = self.rt.cells.pop(sid, None)
        update: dict[str, Any] = {}
        if state.get("status") not in FINAL:
            update["status"] = "terminated"
        if self.rt.status_line:
            import sys

            sys.stderr.write("\r\033[K")
        result = state.get("result")
        if cell is not None:
            if cell.poll() is None:
                cell.terminate(state.get("reason") or "terminated")
            result = cell.wait()
        elif state.get("cell_id"):
            cgroups.kill_by_name(state["cell_id"])
        if result is not None:
            update["result"] = {k: v for k, v in result.items() if k != "events"}
            update["events"] = list(result.get("events", []))[:MAX_EVENTS]
        self._crash("terminate")
        update.update(self._audit_quietly(state, "terminate", "session.terminate",
                                          status=update.get("status", state.get("status")),
                                          reason=state.get("reason"),
                                          exit_status=(result or {}).get("exit_status"),
                                          events=len(update.get("events", []))))
        return update

    def cleanup(self, state: SessionState) -> dict[str, Any]:
        """Undo everything made for the session: firewall table, ACL grants, the per-session account.
        Works from the state alone; each problem is reported, none stops the rest."""
        from ..accounts import acl, ephemeral
        from ..accounts.commands import Commands

        cmds = Commands()
        sid = state["session_id"]
        problems: list[str] = []
        fw = self.rt.firewalls.pop(sid, None)
        try:
            if fw is not None:
                fw[0].remove()
                fw[1].close()
            elif table := state.get("firewall_table"):
                from ..network import firewall

                firewall.HostFirewall(table, os.path.join(firewall.RECORDS, table)).remove()
        except OSError as e:
            problems.append(f"firewall: {e}")
        account = state.get("account")
        warnings = self._quarantine(state, account)
        agent = (state.get("config") or {}).get("agent")
        rw = list((state.get("policy") or {}).get("rw_paths", []))
        grants, human = state.get("grants"), state.get("human")
        if account is None and os.geteuid() == 0 and state.get("policy"):  # the account node did not finish
            try:
                if agent:
                    account, human, rw = self._persistent(agent, rw)  # never its own shares
                else:
                    account = _ephemeral_left(sid)
            except (OSError, AgentcellError) as e:
                problems.append(f"account: {_line(e)}")
        if human is None and account is not None and account.get("kind") == "ephemeral":
            try:  # recorded at plan time; a session that predates that: found again now
                human = self._human(state["config"]["project_root"])
            except (OSError, AgentcellError) as e:
                problems.append(f"the agent's files are left to root: {_line(e)}")
        cache = state.get("cache_dir") or _cache_left(state)
        if cache and state.get("escape"):  # nothing an agent ended at an escape wrote is built with next time
            try:
                caches.discard(cache)
                warnings.append("the project's toolchain cache was emptied: the session ended at an escape, and "
                                "what it wrote there would be the next session's build tools")
                cache = None
            except (OSError, AgentcellError) as e:
                problems.append(f"toolchain cache: not emptied after the escape ({_line(e)}): "
                                "'agentcell cache clear --project' removes it")
        if account is not None and account.get("kind") in ("ephemeral", "agent"):
            if grants is None:  # crashed while granting: revoke wherever it may have granted
                grants = [{"path": p, "prior": []} for p in rw]
            problems += _revoke(cmds, account, grants)
            give_to = (human[0], human[1]) if human else None
            paths = [g["path"] for g in grants]
            if (state.get("config") or {}).get("workspace") == "copy":
                try:  # the change set becomes the project owner's, as the agent's work in the project would
                    from .. import workspace

                    problems += workspace.give_back(sid, account["uid"], account["gid"])
                except (OSError, AgentcellError) as e:
                    problems.append(f"workspace: {_line(e)}")
            if account["kind"] == "ephemeral" and cache:
                try:  # what it made in the cache goes back to root before its number is freed
                    problems += acl.reassign(cmds, account["uid"], account["gid"], 0, 0, cache)
                except (OSError, AgentcellError) as e:  # (the account is deleted all the same)
                    problems.append(f"toolchain cache: {_line(e)}")
            try:
                if account["kind"] == "ephemeral":
                    ephemeral.delete(ephemeral.Account(account["name"], account["uid"], account["gid"], sid), cmds,
                                     paths=paths, give_to=give_to or (0, 0))
                else:
                    from ..accounts.accounts import defuse_home

                    home = (state.get("policy") or {}).get("home_dir")
                    if home:
                        warnings += defuse_home(home, account["uid"], account["gid"])
                    if give_to is not None:
                        for p in paths:
                            problems += acl.reassign(cmds, account["uid"], account["gid"], give_to[0], give_to[1],
                                                     p)
            except (OSError, AgentcellError) as e:
                problems.append(_line(e))
        if state.get("cell_id"):
            problems += cgroups.remove_by_name(state["cell_id"])
        from ..harness import seed

        problems += seed.remove(sid)
        warnings += state.get("seed_notes") or []
        self._crash("cleanup")
        warnings += [f"{f} was {'created' if was is None else 'changed'} during the session: the next session "
                     "reads it; review it first" for f, was in (state.get("config_marks") or {}).items()
                     if envfiles.fingerprint(f) != was]
        update: dict[str, Any] = {"problems": problems, "warnings": list(dict.fromkeys(warnings))}
        update.update(self._audit_quietly(state, "cleanup", "session.cleanup", problems=problems,
                                          account=(account or {}).get("name")))
        return update

    @staticmethod
    def _quarantine(state: SessionState, account: dict[str, Any] | None) -> list[str]:
        """Move aside what the agent created on the control surface (the run protocol's step,
        :func:`agentcell.protect.check.compare`, from the scan spawn checkpointed); say what it changed there.
        Before the account is deleted: what moves must be the account's."""
        from ..protect.check import compare, lines

        guard, policy = state.get("protect"), state.get("policy") or {}
        if not guard:
            return []
        human = state.get("human")
        try:  # whatever the agent left for the scan to read, teardown goes on
            found = compare(
                {k: tuple(v) for k, v in guard["before"].items()}, guard["truncated"], guard["since_ns"],
                state.get("cell_id", ""), tuple(_written(state)), tuple(policy.get("allow_write", ())),
                (*policy.get("ro_paths", ()), *policy.get("masked_paths", ())),
                (account or {}).get("uid") if (account or {}).get("kind") != "self" else None,
                (human[0], human[1]) if human else None, guard.get("meanings"))
        except Exception as e:  # noqa: BLE001 - a teardown that stops here leaves the account behind
            return [f"the protected paths could not be checked ({type(e).__name__}: {_line(e)}): review "
                    "repositories and agent config in the declared paths before you use them"]
        out = lines(found, "the agent", lift_hint=False)
        out += _set_aside_config(state, guard, account, (human[0], human[1]) if human else None)
        if found["scan_truncated"]:
            out.append("the declared paths hold more than the protected-path scan covers: review repositories and "
                       "agent config in them before you use them")
        return out

    def audit(self, state: SessionState) -> dict[str, Any]:
        """The session's last record: how it ended, and what it tried beyond its policy."""
        escape = state.get("escape")
        self._crash("audit")
        update: dict[str, Any] = {"finished": True, "ended_at": time.time()}
        update.update(self._audit_quietly(state, "audit", "session.end", status=state.get("status"),
                                          reason=state.get("reason"), escape=escape,
                                          backup_id=state.get("backup_id"),
                                          exit_status=(state.get("result") or {}).get("exit_status"),
                                          problems=state.get("problems", [])))
        return update


# ---- plan and policy (pure: the CLI runs them too, to refuse bad input before a session exists) --------

def _written(state: SessionState) -> list[str]:
    """The declared paths the agent writes on the host: all of them, but the project in a copy-on-write
    workspace (its writes go to the change set)."""
    rw = list((state.get("policy") or {}).get("rw_paths", []))
    cfg = state.get("config") or {}
    if cfg.get("workspace") == "copy":
        project = os.path.realpath(cfg["project_root"])
        return [p for p in rw if not hostfs.within(os.path.realpath(p), project)]
    return rw



def _ids(paths: list[str]) -> list[list[int]]:
    """Device and inode of each path that exists: a directory renamed since is still recognised."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append([st.st_dev, st.st_ino])
    return out


def _cache_left(state: SessionState) -> str | None:
    """The cache a session that crashed before its spawn returned may have handed to its account."""
    cfg = state.get("config") or {}
    if cfg.get("cache") is False or not cfg.get("project_root"):
        return None
    tree = caches.tree_of(cfg["project_root"], cfg.get("agent"))
    return tree if os.path.isdir(tree) and not os.path.islink(tree) else None


def session_human(project_root: str) -> list[int]:
    """Who gets what a per-session account made: the human behind sudo, else the project's owner;
    never root. A file the agent wrote must not become root's, which other tools (and agentcell's own
    configuration) take for the administrator's word."""
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if uid.isdigit() and gid.isdigit() and int(uid) != 0:
        return [int(uid), int(gid)]
    st = os.stat(project_root)
    if st.st_uid == 0:
        raise PolicyError("project_root", f"{project_root} is root's, and no one ran this session through sudo: "
                          "what the agent makes would become root's",
                          "run it with sudo as the person who works on the project, or chown the project to them")
    return [st.st_uid, st.st_gid]


def _address(host_port: str) -> Any:
    import ipaddress

    host = host_port.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def session_network(cfg: dict[str, Any]) -> str:
    """The network a configuration gets: --net, else host-firewall with FIREWALL_ENABLED, else the proxy
    when it names domains (or a model API), else the harness's own."""
    from ..harness import profiles

    domain_rules = any(cfg.get(k) for k in ("allow_domains", "deny_domains", "allow_presets", "allow_ranges",
                                            "resolver"))
    return str(cfg.get("network") or ("host-firewall" if cfg.get("firewall_enabled") else
                                      "proxy" if domain_rules else profiles.get(cfg["harness"]).network))


def make_plan(cfg: dict[str, Any], session_id: str, launch: dict[str, Any] | None = None
              ) -> tuple[SessionPlan, dict[str, str | None]]:
    """The plan of a session from its configuration and its harness's launch (the profile's env,
    the cell's PATH, the model API's host: :func:`agentcell.harness.profiles.launch`; without one,
    the profile's env alone)."""
    from ..accounts import ephemeral
    from ..harness import profiles
    from ..policy.models import Limits, SessionPlan

    prof = profiles.get(cfg["harness"])
    launch = launch or {}
    network = session_network(cfg)
    api_host = launch.get("api_host")
    if api_host and network in ("none", "loopback"):
        raise PolicyError(cfg.get("sources", {}).get("network", "network"), f"--api-base needs a way out, and the "
                          f"network is {network}", "leave --net out (the harness's proxy) or give --net proxy")
    if api_host and _address(api_host) is not None:  # the proxy reaches an address only through a range
        import ipaddress

        addr = _address(api_host)

        def covers(r: str) -> bool:
            try:
                return addr in ipaddress.ip_network(r, strict=False)
            except ValueError:  # refused with its own message when the egress rules are checked
                return False

        if not any(covers(r) for r in cfg.get("allow_ranges") or []):
            raise PolicyError("--api-base", f"{api_host} is an address: the proxy reaches one only in a range you "
                              "allow", f"add --allow-range {addr}/{32 if addr.version == 4 else 128} (every port of "
                              "it), or give the server's name")
        api_host = None
    if os.geteuid() != 0:
        identity = "self"
    elif cfg.get("agent"):
        identity = f"agent:{cfg['agent']}"
    else:  # the per-session account does not exist yet: checked against a uid of its range
        identity = str(ephemeral.UID_FIRST)
        session_human(cfg["project_root"])  # refused now, before anything exists
    declared = list(cfg.get("declared_paths") or [cfg["project_root"]])
    ro, masked, marks = _config_files(cfg.get("config_files", []), declared)
    env = dict(launch.get("env") or prof.env)
    if launch.get("path"):
        env["PATH"] = launch["path"]
    env.update(dict(cfg.get("env") or []))  # the user's --env wins over the profile
    memory, cpu, pids = (cfg.get("limits") or [None, None, None])
    plan = SessionPlan(
        session_id=session_id, harness=cfg["harness"], declared_paths=declared, ro_paths=ro, masked_paths=masked,
        wall_clock_limit_s=cfg["wall_clock_limit_s"], network=network,  # type: ignore[arg-type]
        identity=identity, env=env, keep_env=sorted(cfg.get("secret_names") or []),
        risk=cfg.get("risk") or "medium", limits=Limits(memory_bytes=memory, cpu_percent=cpu, pids=pids),
        home_persistent=bool(cfg.get("agent")) and os.geteuid() == 0,
        allow_presets=[*([prof.egress_preset] if network == "proxy" and prof.egress_preset else []),
                       *cfg.get("allow_presets", [])],
        allow_domains=[*cfg.get("allow_domains", []), *([api_host] if api_host and network == "proxy" else [])],
        deny_domains=list(cfg.get("deny_domains", [])),
        allow_ranges=list(cfg.get("allow_ranges", [])), resolver=cfg.get("resolver"),
        allow_egress=["seed"] if network == "host-firewall" else [])
    return plan, marks


def compile_policy(plan: SessionPlan, environ: dict[str, str], project_root: str,
                   identity: str | None = None) -> dict[str, Any]:
    """The policy, as state: secrets are placeholders (filled in at spawn, never checkpointed)."""
    from ..policy.compile import compile_plan

    if identity is not None:
        plan = plan.model_copy(update={"identity": identity})
    env = {k: v for k, v in environ.items() if k in ("LANG", "TERM") or k.startswith("LC_")}
    env.update({k: SECRET_PLACEHOLDER for k in plan.keep_env})
    return compile_plan(plan, environ=env, host_cwd=project_root).model_dump()


# ---- the session's own configuration inside the project -------------------------------------------

def _config_files(files: list[str], declared: list[str]) -> tuple[list[str], list[str], dict[str, str | None]]:
    """The agent must not change what configures its next session, nor read the secrets in ``.env``: an
    ``agentcell.toml`` inside a declared path is bound read-only, a ``.env`` there is hidden. One that
    does not exist yet cannot be bound: cleanup warns if the agent created it."""
    roots = [os.path.realpath(d) for d in declared]
    ro: list[str] = []
    masked: list[str] = []
    marks: dict[str, str | None] = {}
    for f in files:
        parent = os.path.realpath(os.path.dirname(f))
        if not any(parent == r or parent.startswith(r.rstrip("/") + "/") for r in roots):
            continue
        marks[f] = envfiles.fingerprint(f)
        if marks[f] is not None:  # the env file the session read (whatever its name) is hidden, the toml read-only
            (ro if os.path.basename(f) == "agentcell.toml" else masked).append(f)
    found, stopped = envfiles.dotenv_files(declared)
    masked += [f for f in found if f not in masked]
    if stopped is not None:
        raise PolicyError("declared_paths", f"the search for .env files in {', '.join(declared)} stopped after "
                          f"{envfiles.MAX_ENV_DIRS:,} directories, at {stopped}: one past it would not be hidden from "
                          "the agent",
                          "declare narrower paths with --rw, or remove what fills them")
    return ro, masked, marks


def _set_aside_config(state: SessionState, guard: dict[str, Any], account: dict[str, Any] | None,
                      give_to: tuple[int, int] | None) -> list[str]:
    """Env files and session configuration the agent created in the declared paths: the next session and
    the human's tools load them (a ``.env`` setting ``CODEX_HOME=./.codex`` runs the project's config the
    next time the human starts Codex; ``WALL_CLOCK_LIMIT_S``), so they are the human's to accept: moved
    into the quarantine box, as created git hooks and harness config are. The ones that existed were
    hidden (env files) or read-only (``agentcell.toml``) in the cell."""
    from ..protect import check, surface

    policy = state.get("policy") or {}
    rw = tuple(policy.get("rw_paths", ()))
    before = set(guard.get("env_files") or ())
    now, _ = envfiles.dotenv_files(list(rw))
    # (an example file documents the variables: no tool loads it)
    created = [f for f in now if f not in before and not f.endswith((".example", ".sample", ".template", ".dist"))
               and f"/{surface.QUARANTINE_DIR}" not in f]  # (nor what was just moved aside)
    created += [f for f, was in (state.get("config_marks") or {}).items()
                if was is None and os.path.basename(f) == "agentcell.toml" and os.path.lexists(f)]
    if not created:
        return []
    owner = (account or {}).get("uid") if (account or {}).get("kind") != "self" else None
    moved, failed = check.set_aside(sorted(set(created)), state.get("cell_id", ""), rw, owner_uid=owner,
                                    since_ns=guard["since_ns"], give_to=give_to)
    out = [f"the agent created {old}, which the next session or your tools load (an env file, the session's "
           f"configuration); it was moved to {new}: move it back if you accept it" for old, new in moved]
    out += [f"the agent created {f}, which the next session or your tools load, and it could not be moved aside: "
            "review it before you use the project" for f in failed]
    return out


# ---- teardown from the state alone (the supervisor may be gone) ------------------------------------

def _revoke(cmds: Any, account: dict[str, Any], grants: list[dict[str, Any]]) -> list[str]:
    """Remove the session's ACL entries from each granted path; what could not be removed."""
    from ..accounts import acl

    problems: list[str] = []
    for g in grants:
        try:
            problems += acl.revoke(cmds, account["uid"], account["gid"], g["path"], g["prior"])
        except (OSError, AgentcellError) as e:
            problems.append(f"revoke {g['path']}: {_line(e)}")
    return problems


def _ephemeral_left(session_id: str) -> dict[str, Any] | None:
    from ..accounts import ephemeral

    for a in ephemeral.leftovers():
        if a.session_id == session_id:
            return {"kind": "ephemeral", "name": a.name, "uid": a.uid, "gid": a.gid, "group": a.name}
    return None
