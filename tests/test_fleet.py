"""Fleets (issue 17): session plans run on the nodes of a real multi-node Ray cluster on this machine.

The cluster is Ray's own ``ray.cluster_utils.Cluster``: a head node (no cells) and worker nodes, each a
separate raylet with its own worker processes, named by the ``agentcell.node`` label and offering
``agentcell_cells``. The fleet is driven the way a user drives it, by ``agentcell fleet run`` in a process
of its own connected to the cluster's address. A node "crash" is a SIGSTOP then SIGKILL of every process
of that node (its raylet, its Ray workers, their session supervisors and cells), by PID; the node then
comes back under the same name, and its sessions must be recovered there.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentcell.fleet.node import whole
from conftest import AGENTCELL, User, needs_root

ray = pytest.importorskip("ray", reason="the agentcell[ray] extra is not installed (./test.sh installs it)")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = needs_root

CELLS = 2  # per worker node
NODE_ARGS = {"num_cpus": 2, "object_store_memory": 80 << 20}
# Node deaths noticed in seconds, not the default half minute: only how soon Ray declares a node dead.
SYSTEM = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 1000}


@dataclass
class Fleet:
    cluster: Cluster
    base: Path
    workers: dict[str, Any]

    def add(self, name: str) -> None:
        self.workers[name] = self.cluster.add_node(resources={"agentcell_cells": CELLS},
                                                   labels={"agentcell.node": name}, **NODE_ARGS)

    def run(self, plans: list[dict[str, Any]], owner: str, *args: str, timeout: float = 600,
            **popen: Any) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
        path = self.base / f"plans-{len(list(self.base.glob('plans-*')))}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in plans))
        cmd = [AGENTCELL, "fleet", "run", str(path), "--address", self.cluster.address, "--owner", owner,
               "--base", str(self.base / "nodes"), *args]
        env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}
        if popen:
            return subprocess.Popen(cmd, text=True, env=env, stdin=subprocess.DEVNULL, **popen)
        return subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=timeout)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    return kids


def crash(node: Any) -> int:
    """Stop, then kill, every process of a Ray node: those it started, and all their descendants."""
    # Only those still running: one that has ended and been reaped may have left its PID to a stranger.
    roots = {info.process.pid for infos in node.all_processes.values() for info in infos
             if info.process and info.process.poll() is None}
    stopped: set[int] = set()
    while True:
        kids, todo, found = _children(), list(roots), set()
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo += kids.get(pid, [])
        new = found - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(stopped)


def leftovers() -> list[str]:
    left = [p.pw_name for p in pwd.getpwall() if p.pw_name.startswith("ac-")
            and not p.pw_name.startswith("ac-t")]  # ac-t…: the tests' own throwaway users (the owner)
    for base in ("/sys/fs/cgroup", *(str(p) for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir())):
        left += [str(p) for p in Path(base).glob("agentcell*")]
    return left


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    # Ray's own scratch (sockets, logs) in pytest's temporary tree: a Ray process that is ending writes its
    # empty session directory back there after the cluster's shutdown, seconds later. RAY_TMPDIR too: the
    # cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster whatever temp_dir says (/tmp/ray by
    # default, which only a machine that ran Ray before has).
    scratch = tmp_path_factory.mktemp("ray")
    (scratch / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(scratch))
    base = Path("/tmp") / f"agentcell-fleet-{os.urandom(3).hex()}"
    before = set(leftovers())
    base.mkdir(mode=0o711)
    cluster = Cluster()  # nothing started yet: the head is added below, inside the try
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, object_store_memory=80 << 20,
                         temp_dir=str(scratch / "ray"), _system_config=SYSTEM)
        f = Fleet(cluster, base, {})
        for name in ("w1", "w2"):
            f.add(name)
        cluster.wait_for_nodes()
        yield f
    finally:
        cluster.shutdown()  # the processes it started (a head that failed half-way too), by their Popen objects
        nodes = base / "nodes"
        for d in sorted(nodes.iterdir()) if nodes.is_dir() else []:  # whatever a failed test left running
            subprocess.run([AGENTCELL, "session", "recover"], capture_output=True, timeout=300,
                           env={"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": str(d / "state")})
        subprocess.run(["chattr", "-R", "-i", str(base)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        assert set(leftovers()) <= before, set(leftovers()) - before


def _plan(i: int, kind: str) -> dict[str, Any]:
    files = {"app.py": "x = 1\nprint(x)\n", "docs/notes.md": "notes\n"}
    script = {"edits": f"write out-{i}.txt done-{i}\nedit app.py 'x = 1' 'x = {i}'\nrun python3 app.py",
              "escapes": "write before.txt yes\nread ~/.ssh/id_rsa\nwrite after.txt no",
              "long": f"write started-{i}.txt yes\nsleep 25\nwrite out-{i}.txt late"}[kind]
    return {"name": f"{kind}-{i}", "project": {"files": files}, "harness": "scripted", "script": script,
            "wall_clock_s": 120}


def _overlap(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_thirty_sessions_over_two_nodes_one_node_crashes_and_its_sessions_are_recovered(fleet: Fleet,
                                                                                      user: User) -> None:
    # Four long sessions first: each node has one running when w1 goes down.
    before = set(leftovers())
    plans = [_plan(i, "long") for i in range(4)]
    plans += [_plan(i, "escapes" if i % 5 == 0 else "edits") for i in range(4, 30)]
    out = fleet.base / "results.jsonl"
    proc = fleet.run(plans, user.name, "--out", str(out), "--recover-wait", "240",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(proc, subprocess.Popen)
    try:
        w1 = fleet.base / "nodes" / "w1" / "projects"
        deadline = time.monotonic() + 180
        while not list(w1.glob("*/long-*/started-*.txt")):  # a long session is running on w1
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        killed = crash(fleet.workers["w1"])
        assert killed > 3  # the raylet, its workers, their supervisors and cells
        fleet.cluster.remove_node(fleet.workers.pop("w1"), allow_graceful=False)
        time.sleep(3)
        fleet.add("w1")  # the machine comes back under its name
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in stderr, stderr
    results = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(results) == sorted(p["name"] for p in plans)
    not_whole = {n: (r["status"], r.get("reason"), r.get("audit")) for n, r in results.items() if not whole(r)}
    assert proc.returncode == 0 and not not_whole, (not_whole, stderr)
    assert stdout.startswith("NAME "), stdout  # Ray's own messages (a node marked dead) went to stderr

    recovered = [n for n, r in results.items() if r.get("recovered")]
    assert recovered and all(results[n]["node"] == "w1" and "lost" in results[n] for n in recovered), stderr
    assert any(n.startswith("long-") for n in recovered), recovered
    assert {r["node"] for r in results.values()} == {"w1", "w2"}
    for name, r in results.items():
        assert r["audit"]["verified"], (name, r["audit"])  # the chain is whole and the session's trail ends
        events = [rec["event"] for rec in r["audit"]["records"]]
        assert events[0] == "session.plan" and events[-1] == "session.end", (name, events)
        if r.get("recovered"):
            assert r["status"] == "terminated" and "recover" in r["reason"], (name, r["reason"])
        elif name.startswith("escapes"):
            assert r["status"] == "terminated" and r["summary"]["escape_target"].endswith(".ssh/id_rsa"), r
            assert r["diff"]["added"] == ["before.txt"], r["diff"]  # killed at the attempt: no after.txt
        elif name.startswith("long"):
            i = name.split("-")[1]
            assert (r["status"], r["exit_status"]) == ("completed", 0), r
            assert r["diff"]["added"] == sorted([f"out-{i}.txt", f"started-{i}.txt"]), r["diff"]
        else:
            i = name.split("-")[1]
            assert (r["status"], r["exit_status"]) == ("completed", 0), r
            assert r["diff"]["added"] == [f"out-{i}.txt"] and r["diff"]["modified"] == ["app.py"], r["diff"]
            assert f"+x = {i}" in r["diff"]["text"], r["diff"]["text"]
    assert "NAME" in stdout and "(recovered)" in stdout  # the table

    # Back-pressure: no node ever ran more sessions at once than it offers cells.
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in results.values():
        recs = r["audit"]["records"]
        spans.setdefault(r["node"], []).append((recs[0]["ts"], recs[-1]["ts"]))
    assert all(_overlap(s) <= CELLS for n, s in spans.items() if n == "w2"), spans
    # Nothing of the sessions is left on any node: accounts, cgroups, processes.
    assert set(leftovers()) <= before, set(leftovers()) - before
    for node in ("w1", "w2"):
        listed = subprocess.run([AGENTCELL, "session", "list", "--json"], capture_output=True, text=True,
                                env={"PATH": os.environ["PATH"],
                                     "AGENTCELL_STATE_DIR": str(fleet.base / "nodes" / node / "state")})
        assert not any(s["needs_recover"] for s in json.loads(listed.stdout)), listed.stdout


def test_a_plan_the_node_refuses_is_reported_and_the_others_run(fleet: Fleet, user: User) -> None:
    plans = [_plan(1, "edits"), {**_plan(2, "edits"), "harness": "shell", "script": None, "args": ["true"],
                                 "allow_domains": ["bad..name"]},
             {**_plan(3, "edits"), "model": "--rw=/etc"}]  # a value is never taken for a flag
    r = fleet.run(plans, user.name)
    assert isinstance(r, subprocess.CompletedProcess)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
    assert " completed " in rows["edits-1"], r.stdout
    assert " refused " in rows["edits-2"] and "allow-domain" in rows["edits-2"], r.stdout
    assert " refused " in rows["edits-3"] and "--model" in rows["edits-3"], r.stdout  # a value, not --rw


@pytest.fixture
def node_base() -> Iterator[Path]:
    base = Path("/tmp") / f"agentcell-fleet-{os.urandom(3).hex()}"
    base.mkdir(mode=0o711)
    try:
        yield base
    finally:
        for d in sorted(base.iterdir()):
            if (d / "state").is_dir():
                subprocess.run([AGENTCELL, "session", "recover"], capture_output=True, timeout=300,
                               env={"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": str(d / "state")})
        subprocess.run(["chattr", "-R", "-i", str(base)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_a_project_from_a_path_or_git_is_made_as_its_owner(node_base: Path, user: User) -> None:
    from agentcell.fleet import node, plan

    src = node_base / "src"
    src.mkdir(mode=0o755)
    (src / "app.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(src)]
    for cmd in (["init", "-q", "-b", "main"], ["add", "app.py"], ["commit", "-qm", "one"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    (src / "app.py").write_text("x = 2\n")  # the working tree differs from the commit
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(src)], check=True)  # the owner's repository
    here = node.Node(str(node_base), "n1")
    run = node.new_run_id()
    steps = "edit app.py 'x = ' 'x = 3 + '\nrun python3 app.py"
    for name, project, before in (("from-path", {"path": str(src)}, "x = 2"),
                                  ("from-git", {"git": str(src), "ref": "main"}, "x = 1")):
        p = plan.parse({"name": name, "project": project, "harness": "scripted", "script": steps})
        r = node.run_plan(p, run, here, user.name)
        assert (r["status"], r["exit_status"]) == ("completed", 0), r["reason"]
        assert r["diff"]["modified"] == ["app.py"] and f"-{before}" in r["diff"]["text"], r["diff"]
        made = Path(here.project(run, name))
        assert {(f.stat().st_uid, f.stat().st_gid) for f in [made, *made.rglob("*")]} == {(user.uid, user.gid)}
    # Copied as the owner, not as root: what the owner cannot read stays out of the project.
    secret = node_base / "private"
    secret.mkdir(mode=0o700)
    (secret / "key").write_text("root's\n")
    for name, project, field in (("from-private", {"path": str(secret)}, "project.path"),
                                 ("from-ext", {"git": "ext::sh -c touch% /tmp/agentcell-pwned"}, "project.git")):
        r = node.run_plan(plan.parse({"name": name, "project": project}), run, here, user.name)
        assert r["status"] == "failed" and field in r["reason"], r
        assert not list(Path(here.project(run, name)).iterdir())
    assert not Path("/tmp/agentcell-pwned").exists()
    r = node.run_plan(plan.parse({"name": "no-owner", "project": {"path": str(src)}}), run, here, "ac-nobody-here")
    assert r["status"] == "failed" and "no account ac-nobody-here" in r["reason"], r
    r = node.run_plan(plan.parse({"name": "by-root", "project": {"path": str(src)}}), run, here, "root")
    assert r["status"] == "failed" and "root" in r["reason"], r


def test_a_session_recover_cannot_finish_stays_lost_with_its_reason_and_the_others_come_back(
        node_base: Path, user: User, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that came back, one of whose dead sessions recover refuses (its checkpoint names a cell agentcell
    does not make): the other is recovered and brought back; the refused one stays lost, marked unrecovered
    (the caller does not try it again in a loop), with recover's reason for it."""
    from agentcell.fleet import node
    from agentcell.session import graph

    here, run = node.Node(str(node_base), "n1"), node.new_run_id()
    os.makedirs(here.state, mode=0o700)
    os.makedirs(here.ledger(run))
    sids = {}
    for name in ("a", "b"):
        project = Path(here.project(run, name))
        project.mkdir(parents=True)
        os.chown(project, user.uid, user.gid)
        sids[name] = node.session_id(run, name)
        p = subprocess.run([AGENTCELL, "session", "start", "--id", sids[name], f"--project={project}",
                            "--harness=scripted", "--wall-clock=30", "--", "--text", "sleep 600"],
                           capture_output=True, text=True, timeout=120,
                           env={**here.environ(), "AGENTCELL_TEST_FAULTS": "kill@monitor=1", "AGENTCELL_WARM": "off"})
        assert p.returncode == -9, p.stderr  # the supervisor died mid-session: the node's crash
        Path(here.ledger(run), f"{name}.json").write_text(json.dumps(
            {"name": name, "session": sids[name], "attempt": 1, "node": "n1", "project": str(project),
             "started": time.time(), "trail_from": 0}))
    monkeypatch.setenv("AGENTCELL_STATE_DIR", here.state)
    g, conn = graph.open_graph()
    cfg = {"configurable": {"thread_id": sids["b"]}}
    real = graph.load(g, sids["b"])
    assert real is not None
    try:
        g.update_state(cfg, {"cell_id": "../ac-victim"}, as_node="monitor")  # type: ignore[arg-type]
        got = {r["name"]: r for r in node.recover(here, run)}
        assert got["a"]["status"] == "terminated" and got["a"]["recovered"] and whole(got["a"]), got["a"]
        b = got["b"]
        assert (b["status"], b.get("unrecovered"), whole(b)) == ("lost", True, False), b
        assert b["reason"].startswith(f"session recover failed on node n1: agentcell session: session {sids['b']} "
                                      f"was not recovered: session: session {sids['b']}: recorded cell "
                                      "'../ac-victim' is not one agentcell makes"), b["reason"]
    finally:
        g.update_state(cfg, {"cell_id": real["cell_id"]}, as_node="monitor")  # type: ignore[arg-type]
        conn.close()
    [b] = node.recover(here, run, ["b"])
    assert b["status"] == "terminated" and b["recovered"] and whole(b), b


def test_inline_files_are_written_by_the_owner_and_the_agent_cannot_hide_the_summary(node_base: Path,
                                                                                    user: User) -> None:
    from agentcell.fleet import node, plan

    here = node.Node(str(node_base), "n1")
    run = node.new_run_id()
    # The harness's last output has no newline: the summary comes through a file of its own.
    p = plan.parse({"name": "a", "project": {"files": {"deep/er/app.py": "x = 1\n", "b.txt": "b\n"}},
                    "args": ["sh", "-c", "echo changed > b.txt; printf '{\"status\": \"completed\"'"]})
    r = node.run_plan(p, run, here, user.name)
    assert (r["status"], r["exit_status"], r["diff"]["modified"]) == ("completed", 0, ["b.txt"]), r["reason"]
    assert r["stdout"].endswith('{"status": "completed"') and r["audit"]["verified"]
    made = Path(here.project(run, "a"))
    assert {(f.stat().st_uid, f.stat().st_gid) for f in [made, *made.rglob("*")]} == {(user.uid, user.gid)}
    assert (made / "deep/er/app.py").read_text() == "x = 1\n" and (made / "deep/er/app.py").stat().st_mode == 0o100644
    # The next session's verdict is on its own part of the node's trail (from where it ended as it began).
    r2 = node.run_plan(plan.parse({"name": "b", "project": {"files": {"a": ""}}, "args": ["true"]}), run, here,
                       user.name)
    assert r["audit"]["since"] == 0 and r2["audit"]["verified"] and r2["audit"]["since"] > 0, r2["audit"]
    assert all(rec["session"] == r2["session"] for rec in r2["audit"]["records"])
    # A path given twice (a plan's paths are normalized) is refused, the first kept.
    r3 = node.run_plan(plan.parse({"name": "c", "project": {"files": {"a": "1", "x/../a": "2"}}}), run, here,
                       user.name)
    assert r3["status"] == "failed" and "a: Cannot open: File exists" in r3["reason"], r3
    # Directories as the old writer made them: 0755 less the umask, whatever tar gives a parent by default.
    old = os.umask(0)
    try:
        node.run_plan(plan.parse({"name": "d", "project": {"files": {"x/y/z": ""}}, "args": ["true"]}), run, here,
                      user.name)
    finally:
        os.umask(old)
    made = Path(here.project(run, "d"))
    assert [oct(p.stat().st_mode & 0o777) for p in (made / "x", made / "x/y", made / "x/y/z")] == \
        ["0o755", "0o755", "0o644"]
    # A retry's id and project never meet another plan's: names have no '_'.
    assert node.session_id(run, "a", 2) != node.session_id(run, "a-r2") and "_r2" in node.session_id(run, "a", 2)
    assert here.project(run, "a", 2) != here.project(run, "a-r2")


def test_when_the_caller_dies_its_forked_session_gets_sigterm_and_tears_itself_down(node_base: Path,
                                                                                   user: User) -> None:
    # The caller (a Ray worker, here a plain process) runs sessions through its session starter, which
    # forks each one: killing the caller kills the starter, and the session ends as terminated, torn down.
    run = "r1"
    code = ("import sys; from agentcell.fleet import node, plan; p = plan.parse({'name': 'a', 'harness': 'scripted', "
            "'project': {'files': {'a.py': ''}}, 'script': 'write started.txt yes\\nsleep 60\\nwrite late.txt no'}); "
            "node.run_plan(p, sys.argv[1], node.Node(sys.argv[2], 'n1'), sys.argv[3])")
    caller = subprocess.Popen([sys.executable, "-c", code, run, str(node_base), user.name],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = node_base / "n1" / "projects" / run / "a"
    try:
        deadline = time.monotonic() + 120
        while not (made / "started.txt").exists():
            assert caller.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        caller.kill()
        caller.wait()
    env = {"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": str(node_base / "n1" / "state")}
    deadline = time.monotonic() + 120
    while True:
        listed = subprocess.run([AGENTCELL, "session", "list", "--json"], capture_output=True, text=True, env=env)
        rows = [s for s in json.loads(listed.stdout or "[]") if s["session"] == f"{run}-a"]
        if rows and rows[0]["status"] == "terminated":
            break
        assert time.monotonic() < deadline, listed.stdout
        time.sleep(0.5)
    assert not rows[0]["needs_recover"], rows  # its own teardown ran: nothing left for session recover
    assert not (made / "late.txt").exists()


def test_a_clone_is_from_public_addresses_unless_trusted_and_pinned_to_the_address_checked(node_base: Path,
                                                                                          user: User) -> None:
    from agentcell.fleet import node, plan

    repo = node_base / "served" / "app.git"
    work = node_base / "work"
    work.mkdir()
    (work / "app.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["-C", str(work), "init", "-q", "-b", "main"], ["-C", str(work), "add", "app.py"],
                ["-C", str(work), "commit", "-qm", "one"], ["clone", "-q", "--bare", str(work), str(repo)],
                ["-C", str(repo), "update-server-info"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0", "--directory",
                               str(repo.parent)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split(" port ")[1].split()[0])
        here = node.Node(str(node_base), "n1")
        p = plan.parse({"name": "g", "project": {"git": f"http://localhost:{port}/app.git"}, "args": ["true"]})
        run = node.new_run_id()
        r = node.run_plan(p, run, here, user.name)  # the node's loopback is not a public address
        assert r["status"] == "failed" and "localhost is 127.0.0.1, not a public address" in r["reason"], r
        r = node.run_plan(p, run, here, user.name, attempt=2, caps=plan.Caps(plan_network=True))
        assert r["status"] == "completed", r["reason"]
        assert (Path(here.project(run, "g", 2)) / "app.py").read_text() == "x = 1\n"
    finally:
        server.kill()
        server.wait()


def test_values_a_plan_names_come_from_the_nodes_env_file(node_base: Path, user: User) -> None:
    from agentcell.errors import AgentcellError
    from agentcell.fleet import node, plan

    keys = node_base / "keys.env"
    keys.write_text("AC_TEST_TOKEN=tok-on-the-node\n")
    keys.chmod(0o600)
    here = node.Node(str(node_base), "n1")
    p = plan.parse({"name": "k", "project": {"files": {"a": ""}}, "keep_env": ["AC_TEST_TOKEN"],
                    "args": ["sh", "-c", "echo token=$AC_TEST_TOKEN"]})
    run = node.new_run_id()
    got = [node.run_plan(p, run, here, user.name, attempt=i + 1, env_file=f) for i, f in enumerate((str(keys), None))]
    assert [(r["status"], r["stdout"]) for r in got] == [("completed", "token=tok-on-the-node\n"),
                                                         ("completed", "token=\n")], got
    # At the caller: only the names the operator allows, and never the key's host.
    with pytest.raises(AgentcellError, match="--allow-keep-env AC_TEST_TOKEN"):
        plan.Caps(keys=True).check(p, "k")
    plan.Caps(keys=True, keep_env=("AC_TEST_TOKEN",)).check(p, "k")
    gateway = plan.parse({"name": "k", "project": {"path": "/srv"}, "harness": "codex", "api_base": "https://x.test"})
    with pytest.raises(AgentcellError, match="where the harness's key goes"):
        plan.Caps(keys=True).check(gateway, "k")
    plan.Caps(keys=True, api_bases=("https://x.test",)).check(gateway, "k")
    bare = plan.parse({"name": "k", "project": {"path": "/srv"}, "harness": "codex", "network": "loopback"})
    with pytest.raises(AgentcellError, match="enter the cell as they are"):
        plan.Caps(keys=True).check(bare, "k")
    plan.Caps().check(bare, "k")


def test_the_operator_caps_what_a_plan_may_ask_for(node_base: Path, user: User) -> None:
    from agentcell import limits
    from agentcell.errors import AgentcellError
    from agentcell.fleet import node, plan

    caps = plan.Caps(memory=512 << 20, pids=100, wall_clock_s=600)
    for ask, field in (({"memory": "1G"}, "memory"), ({"pids": 101}, "pids"), ({"wall_clock_s": 601}, "wall_clock_s"),
                       ({"allow_ranges": ["10.0.0.0/8"]}, "allow_ranges"), ({"resolver": "10.0.0.2"}, "resolver"),
                       ({"network": "host-firewall"}, "network"), ({"memory": "lots"}, "memory")):
        p = plan.parse({"name": "a", "project": {"path": "/srv"}, **ask})
        with pytest.raises(AgentcellError) as e:
            caps.check(p, "plans.jsonl: a")
        assert e.value.field == f"plans.jsonl: a: {field}", e.value
    plan.Caps(plan_network=True).check(plan.parse({"name": "a", "project": {"path": "/srv"},
                                                   "allow_ranges": ["10.0.0.0/8"]}), "a")
    # On the node: a plan's own ceilings, held to the caps (or to the node's most generous default).
    assert caps.ceilings(plan.parse({"name": "a", "project": {"path": "/srv"}, "memory": "256M", "pids": 50})) \
        == (256 << 20, limits.for_risk("medium")[1], 50)
    assert plan.Caps().ceilings(plan.parse({"name": "a", "project": {"path": "/srv"}, "pids": 10 ** 7}))[2] \
        == limits.for_risk("low")[2]
    here = node.Node(str(node_base), "n1")
    r = node.run_plan(plan.parse({"name": "c", "project": {"files": {"a": ""}}, "memory": "100T", "args": ["true"]}),
                      node.new_run_id(), here, user.name, caps=caps)
    policy = next(rec for rec in r["audit"]["records"] if rec["event"] == "session.policy")
    assert policy["details"]["limits"]["memory_bytes"] == 512 << 20, policy


@pytest.mark.parametrize("line, field", [
    ('{"name": "Bad", "project": {"files": {}}}', "name"),
    ('{"name": "a", "project": {"files": {"../x": ""}}}', "project"),
    ('{"name": "a", "project": {"files": {"x/../..": ""}}}', "project"),
    ('{"name": "a", "project": {"path": "/srv"}, "script": "say hi"}', "plan"),
    ('{"name": "a", "project": {"path": "/srv"}, "wall_clock_s": "soon"}', "wall_clock_s"),
    ('{"name": "a", "project": {"git": "/srv/r", "ref": "--orphan=x"}}', "project"),
    ('{"name": "a", "project": {"files": {"a\\ud800": ""}}}', "project"),
    ('{"name": "a"', "not JSON"),
])
def test_a_bad_plan_is_refused_in_one_line_before_anything_is_sent(tmp_path: Path, line: str, field: str) -> None:
    plans = tmp_path / "plans.jsonl"
    plans.write_text('{"name": "ok", "project": {"path": "/srv"}}\n' + line + "\n")
    for cmd in (["plans", str(plans)], ["run", str(plans), "--owner", "nobody", "--address", "127.0.0.1:9"]):
        p = subprocess.run([AGENTCELL, "fleet", *cmd], capture_output=True, text=True, timeout=60)
        assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert f"plans.jsonl:2: {field}" in p.stderr, p.stderr


def test_names_that_only_begin_with_two_dots_are_files_inside_the_project() -> None:
    import io
    import tarfile

    from agentcell.fleet import node, plan

    p = plan.parse({"name": "a", "project": {"files": {"..a": "1", "...": "2", "b/..c": "3"}}})
    assert p.project.files is not None
    with tarfile.open(fileobj=io.BytesIO(node._archive(p.project.files))) as archive:
        assert sorted(m.name for m in archive.getmembers()) == ["...", "..a", "b", "b/..c"]


def test_a_plan_over_the_operators_caps_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    plans = tmp_path / "plans.jsonl"
    plans.write_text('{"name": "ok", "project": {"path": "/srv"}}\n'
                     '{"name": "a", "project": {"path": "/srv"}, "allow_ranges": ["10.0.0.0/8"]}\n')
    p = subprocess.run([AGENTCELL, "fleet", "run", str(plans), "--owner", "nobody", "--address", "127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "plans.jsonl: a: allow_ranges" in p.stderr and "--trust-plan-network" in p.stderr, p.stderr
    p = subprocess.run([AGENTCELL, "fleet", "run", str(plans), "--owner", "nobody", "--max-memory", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 125 and "--max-memory" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_plans_prints_each_session_start_line_and_run_needs_an_owner(tmp_path: Path) -> None:
    plans = tmp_path / "plans.jsonl"
    plans.write_text('# two plans\n{"name": "a", "project": {"git": "/srv/repo.git"}, "harness": "scripted", '
                     '"script": "say hi", "allow_domains": ["pypi.org"]}\n\n'
                     '{"name": "b", "project": {"path": "/srv/p"}, "args": ["make", "test"], "memory": "1G"}\n')
    p = subprocess.run([AGENTCELL, "fleet", "plans", str(plans)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "a: agentcell session start '--project=<a>' --harness=scripted --allow-domain=pypi.org -- --text 'say hi'",
        "b: agentcell session start '--project=<b>' --harness=shell --memory=1G -- make test"]
    p = subprocess.run([AGENTCELL, "fleet", "run", str(plans)], capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ["PATH"]})
    assert p.returncode == 125 and "--owner" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
