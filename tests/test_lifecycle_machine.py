"""The lifecycle model's properties (model/lifecycle.pml) checked on the real code, so that the model and the
code cannot drift apart: a Hypothesis state machine starts real sessions (the scripted harness, real
per-session accounts, cells, host-firewall tables), fails nodes to run their retry rules, kills the supervisor at
a node's boundary (the hook's kill@NODE, for each node of the model's own list), kills or stops a session that is
running beside the others, runs ``session recover`` (killed itself too), and after every step checks what the
model proves against the machine:

* AgentNeedsBackup, AgentNeedsNetRule, AgentNeedsMonitor: every process of a session's account runs with the
  session's backup recorded, its rule (the host-firewall table, else a network namespace of its own) and its
  cell host (where its monitor runs) alive;
* NoAgentAfterVerdict: a session ended at an escape has no process that is not frozen;
* CleanMeansNothingLeft: a finished session has no account, group, account record, ACL entry, cgroup, nftables
  table, host lock or process left;
* AuditDescribesState: a finished session's last record is its session.end, with its status and its escape;
* UniqueUids: no two live session accounts share a uid;
* TeardownReachable: at the end of each run, ``session recover`` brings every session to its end, all clean.

In ./test.sh three runs of ten steps (the same each time); ``AGENTCELL_FUZZ=N`` runs N, drawn afresh (the long run:
AGENTCELL_FUZZ=30).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from conftest import needs_root
from sessionkit import Env, running, scripted, session

pytestmark = needs_root

ROOT = Path(__file__).resolve().parent.parent
RUNS = int(os.environ.get("AGENTCELL_FUZZ", "3"))
STEPS = [s.strip() for s in re.search(r"^mtype:node = \{([^}]*)\}", (ROOT / "model" / "lifecycle.pml").read_text(),
                                      re.M).group(1).split(",")]  # type: ignore[union-attr]
# The retry rules by fault injection (quick ones: preflight's second retry waits 3 s); an unwritable record.
RETRIES = ["preflight=1", "account=1", "account=2", "firewall=1", "firewall=2", "spawn=1", "spawn=2", "telemetry=1",
           "telemetry=4", "audit@spawn=1", "audit@monitor=1"]
FINAL = ("completed", "terminated", "aborted")
COUNTS: dict[str, int] = {}


def _count(what: str) -> None:
    COUNTS[what] = COUNTS.get(what, 0) + 1


def _proc_status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _processes_of(uids: set[int]) -> list[tuple[int, int, str]]:
    """(pid, uid, start) of every live process whose real uid is one of ``uids``."""
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            s = _proc_status(int(e))
            if s and not s.get("State", "").startswith("Z") and int(s["Uid"].split()[0]) in uids:
                out.append((int(e), int(s["Uid"].split()[0]), _start(int(e))))
    return out


def _host_alive(pid: int) -> bool:
    """A cell host (agentcell.host.server) is among the process's ancestors: the top one of them."""
    chain, p = [], pid
    while p > 1:
        p = int(_proc_status(p).get("PPid", "0") or 0)
        chain.append(p)
    hosts = [p for p in chain if b"agentcell.host.server" in _cmdline(p)]
    return bool(hosts) and _start(hosts[-1]) != ""


def _frozen(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            rel = next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))
        with open(f"/sys/fs/cgroup{rel}/cgroup.events") as f:
            return "frozen 1" in f.read()
    except (OSError, StopIteration):
        return False


class Lifecycle(RuleBasedStateMachine):
    def __init__(self, env: Env) -> None:
        super().__init__()
        self.env = env
        self.background: subprocess.Popen[str] | None = None
        self.n = 0

    # ---- what the machine is: the checkpoints, the trail, the accounts' records ------------------------------

    def sessions(self) -> dict[str, dict[str, Any]]:
        """Every session of the state dir, as its checkpoint has it (the state recover works from)."""
        from agentcell.session import graph
        from agentcell.session.records import plain

        old = os.environ.get("AGENTCELL_STATE_DIR")
        os.environ["AGENTCELL_STATE_DIR"] = str(self.env.state)
        try:
            g, conn = graph.open_graph()
            try:
                return {sid: plain(dict(graph.load(g, sid) or {})) for sid in graph.session_ids(conn)}
            finally:
                conn.close()
        finally:
            if old is None:
                del os.environ["AGENTCELL_STATE_DIR"]
            else:
                os.environ["AGENTCELL_STATE_DIR"] = old

    def trail(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        if self.env.audit.exists():
            for line in self.env.audit.read_text().splitlines():
                r = json.loads(line)
                out.setdefault(r["session"], []).append(r)
        return out

    def uids(self, sessions: dict[str, dict[str, Any]]) -> dict[int, str]:
        """uid -> session, from the accounts' records (written before each account) and the checkpoints."""
        from agentcell.accounts import ephemeral

        out = {int(a["uid"]): sid for sid, st in sessions.items() if (a := st.get("account"))}
        d = self.env.state / "ephemeral"
        for name in os.listdir(d) if d.is_dir() else []:
            try:
                rec_name, uid, sid = (d / name).read_text().split("\n")[:3]
            except (OSError, ValueError):  # (gone, or being written, as we read)
                continue
            if rec_name == ephemeral.name_for(sid):
                out[int(uid)] = sid
        return out

    # ---- the steps ---------------------------------------------------------------------------------------------

    @rule(retry=st.sampled_from(["", *RETRIES]), kill=st.sampled_from(["", *STEPS]), firewall=st.booleans(),
          escape=st.booleans())
    def a_session(self, retry: str, kill: str, firewall: bool, escape: bool) -> None:
        """A session to its end, or to its supervisor's SIGKILL at ``kill``'s boundary."""
        self.n += 1
        faults = ",".join(f for f in (retry, f"kill@{kill}=1" if kill else "") if f)
        _count("session " + (faults or "(no fault)") + (" escape" if escape else "") + (" fw" if firewall else ""))
        steps = f"write {self.env.project}/src/m{self.n}.txt yes\n" + ("read ~/.ssh/id_rsa\n" if escape else "")
        s = scripted(self.env, steps + "sleep 600\n", "--rw", "src", "--wall-clock", "2",
                     extra={"AGENTCELL_TEST_FAULTS": faults, "FIREWALL_ENABLED": "true" if firewall else "false"})
        assert s.rc in (0, 120, 123, 70, -9), (faults, s.rc, s.err[-2000:])
        if s.rc != -9:
            assert s.summary["problems"] == [], s.summary

    @precondition(lambda self: self.background is None)
    @rule(firewall=st.booleans())
    def a_session_that_keeps_running(self, firewall: bool) -> None:
        _count("running session" + (" fw" if firewall else ""))
        marker = self.env.project / "src" / "running.txt"
        marker.unlink(missing_ok=True)
        self.background = running(self.env, stdout=subprocess.DEVNULL,
                                  extra={"FIREWALL_ENABLED": "true" if firewall else "false"})

    @precondition(lambda self: self.background is not None)
    @rule(sig=st.sampled_from([signal.SIGKILL, signal.SIGTERM]))
    def its_supervisor_killed_or_stopped(self, sig: int) -> None:
        assert self.background is not None
        _count("running session's supervisor " + ("killed" if sig == signal.SIGKILL else "stopped"))
        self.background.send_signal(sig)  # our own child
        self.background.wait(timeout=120)
        self.background = None

    @rule(kill=st.sampled_from(["", "terminate", "cleanup", "audit"]))
    def recover(self, kill: str) -> None:
        """``session recover``, killed itself at ``kill``'s boundary (its first session's)."""
        _count("recover" + (f" kill@{kill}" if kill else ""))
        r = session(self.env, ["recover", "--json"], extra={"AGENTCELL_TEST_FAULTS": f"kill@{kill}=1" if kill else ""})
        assert r.rc in (0, -9), (r.rc, r.err[-2000:])
        if r.rc == 0:
            assert all(d["problems"] == [] for d in r.summary), r.summary  # type: ignore[union-attr]

    # ---- the model's properties, on the machine ---------------------------------------------------------------

    @invariant()
    def agents_have_their_backup_rule_and_monitor_and_none_runs_after_a_verdict(self) -> None:
        from agentcell.network import firewall

        sessions = self.sessions()
        trail = self.trail()
        owner = self.uids(sessions)
        host_net = os.readlink("/proc/self/ns/net")
        for pid, uid, start in _processes_of(set(owner)):
            sid = owner[uid]
            st_ = sessions.get(sid, {})
            network = (st_.get("policy") or {}).get("network")
            cell = st_.get("cell_id") or f"agentcell-{sid}"
            checks = {
                "AgentNeedsBackup": bool(st_.get("backup_id")),
                "AgentNeedsNetRule": firewall.exists(firewall.table_name(cell)) if network == "host-firewall"
                else _netns(pid) not in ("", host_net),
                "AgentNeedsMonitor": _host_alive(pid),
                # (the monitor's verdict, as the trail has it: a lost cell's "escape" is the graph's, not a verdict)
                "NoAgentAfterVerdict": not any(r["event"] == "session.escape" for r in trail.get(sid, []))
                or _frozen(pid),
            }
            if _start(pid) != start:  # it ended while we looked: nothing to hold against it
                continue
            failed = [k for k, ok in checks.items() if not ok]
            assert not failed, (failed, sid, pid, _cmdline(pid), st_.get("status"))

    @invariant()
    def finished_sessions_leave_nothing_and_their_last_record_says_how_they_ended(self) -> None:
        from agentcell.accounts import ephemeral
        from agentcell.cell import cgroups
        from agentcell.network import firewall

        sessions = self.sessions()
        trail = self.trail()
        accounts = self.uids(sessions)
        for sid, st_ in sessions.items():
            if not st_.get("finished"):
                continue
            name, cell = ephemeral.name_for(sid), st_.get("cell_id") or f"agentcell-{sid}"
            uids = {u for u, s in accounts.items() if s == sid}
            left = {
                "account": _exists(["getent", "passwd", name]), "group": _exists(["getent", "group", name]),
                "record": (self.env.state / "ephemeral" / name).exists(),
                "acl": any(f":{u}:" in _acls(self.env.project) for u in uids),
                "cgroup": bool(cgroups.groups_of(cell)), "table": firewall.exists(firewall.table_name(cell)),
                "host lock": Path(f"/run/agentcell/hosts/{cell}.lock").exists(),
                "process": bool(_processes_of(uids)),
            }
            assert not any(left.values()), ("CleanMeansNothingLeft", sid, {k for k, v in left.items() if v})
            if st_.get("audit_error"):  # a record the trail refused (the fault hook): the model's refusal
                continue
            last = trail.get(sid, [{}])[-1]
            assert last.get("event") == "session.end", ("AuditDescribesState", sid, last)
            assert last["details"]["status"] == st_["status"] in FINAL, ("AuditDescribesState", sid, last)
            assert (last["details"]["escape"] is None) == (st_.get("escape") is None), ("AuditDescribesState", sid)

    @invariant()
    def no_two_live_session_accounts_share_a_uid(self) -> None:
        import pwd

        live = [p for p in pwd.getpwall() if p.pw_name.startswith("ac-s")]
        assert len({p.pw_uid for p in live}) == len(live), ("UniqueUids", [(p.pw_name, p.pw_uid) for p in live])

    def teardown(self) -> None:
        """TeardownReachable: from wherever the run stopped, recover finishes every session, all clean."""
        if self.background is not None:
            self.background.send_signal(signal.SIGTERM)
            self.background.wait(timeout=120)
        for _ in range(5):
            if not any(not st_.get("finished") for st_ in self.sessions().values()):
                break
            r = session(self.env, ["recover", "--json"])
            assert r.rc == 0, r.err[-2000:]
        unfinished = [sid for sid, st_ in self.sessions().items() if not st_.get("finished")]
        assert not unfinished, ("TeardownReachable", unfinished)
        self.finished_sessions_leave_nothing_and_their_last_record_says_how_they_ended()


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def _exists(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True).returncode == 0


def _acls(path: Path) -> str:
    return subprocess.run(["getfacl", "-Rpn", str(path)], capture_output=True, text=True).stdout


def test_the_models_properties_hold_on_the_real_lifecycle(env: Env) -> None:
    t = time.monotonic()
    run_state_machine_as_test(lambda: Lifecycle(env), settings=settings(
        max_examples=RUNS, stateful_step_count=10, deadline=None, database=None, derandomize=RUNS <= 3,
        suppress_health_check=list(HealthCheck)))
    print(f"\nlifecycle machine: {RUNS} runs, {sum(COUNTS.values())} steps in {time.monotonic() - t:.0f} s:")
    for what, n in sorted(COUNTS.items()):
        print(f"  {n:3} {what}")



def test_recover_waits_for_the_cell_host_that_holds_a_cell_and_a_later_host_refuses() -> None:
    """The lock that closed REVERT_HOST_UNLOCKED (host/owner.py), between two processes."""
    from agentcell.errors import AgentcellError
    from agentcell.host import owner

    cell = "agentcell-test-" + secrets.token_hex(4)
    code = (f"import sys; from agentcell.host import owner; owner.hold({cell!r}, lambda: False); print('held', "
            "flush=True); sys.stdin.read()")  # a cell host: the lock, held until it ends (here: its stdin's EOF)
    host = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdin is not None
        assert host.stdout.readline() == "held\n"
        assert owner.wait_ended(cell, timeout=0.2) is False  # recover waits while a host holds the cell
        host.stdin.close()
        assert host.wait(timeout=60) == 0
        assert owner.wait_ended(cell) is True  # ... and goes on once it has ended
        with pytest.raises(AgentcellError, match="the session's supervisor is gone"):
            owner.hold(cell, lambda: True)  # a host that comes after its supervisor died
    finally:
        if host.poll() is None:
            host.kill()  # our own child
            host.wait()
        owner.forget(cell)
    assert not os.path.exists(f"/run/agentcell/hosts/{cell}.lock")
