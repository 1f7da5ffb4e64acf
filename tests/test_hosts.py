"""``CellHost``: one interface, three hosts. The same behaviour through the in-process host
(:class:`Supervised`, in a single-threaded process of its own), the remote host (a private launcher,
and a cell host per supervised cell) and the fake one (no kernel: a script, named so), and the API and
the session's workflow driven by the fake host where what is tested is theirs, not the kernel's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agentcell import Cell, CellSpec
from agentcell.api import CellEnded
from agentcell.host.fake import FakeHost, FakeRun
from agentcell.monitor.event import CellEvent
from agentcell.policy.resolve import build_env, resolve_identity
from conftest import User, needs_root
from sessionkit import Env

# What the monitor reports of a refused read (a real event, made as its sources make it).
SHADOW = CellEvent("read", "/etc/shadow", "landlock: fs.read_file", source="landlock", cell="fake-1", pid=7,
                   exe="/usr/bin/cat", ts=1.0).as_dict()


def _spec(user: User, **kw: object) -> CellSpec:
    ident = resolve_identity(str(user.uid), euid=0)
    return CellSpec(identity=ident, env=build_env({}, ident), **kw)  # type: ignore[arg-type]


def _script(spec: CellSpec, argv: list[str]) -> FakeRun:
    if argv[:1] == ["cat"] and argv[1:] == ["/etc/shadow"]:
        return FakeRun(exit_status=1, stderr=b"cat: /etc/shadow: Permission denied\n", events=(SHADOW,))
    return FakeRun(exit_status=3 if "fail" in argv else 0, stdout=(" ".join(argv) + "\n").encode())


# ---- the same start() through every host ------------------------------------------------------------

IN_PROCESS = r'''
import json, os, sys
from agentcell.cell.spec import spec_from_dict
from agentcell.host.inprocess import InProcess
spec = spec_from_dict(json.loads(sys.argv[1]))
out = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
cell = InProcess().start(spec, ["sh", "-c", "echo hello; exit 3"], stdio=(0, out, 2), monitor=sys.argv[3] or None)
r = cell.wait(60)
print(json.dumps({"cell_id": cell.cell_id, "pid1": cell.pid1, "exit": r["exit_status"],
                  "watched": "monitor_sources" in r}))
'''


@needs_root
@pytest.mark.parametrize("host", ["in-process", "remote", "remote-supervised", "fake"])
def test_every_host_starts_a_cell_the_same_way(host: str, user: User, tmp_path: os.PathLike[str]) -> None:
    from agentcell.cell.spec import spec_to_dict
    from agentcell.host.remote import RemoteHost

    spec = _spec(user, watch=host == "remote-supervised")
    monitor = "terminate" if host == "remote-supervised" else None
    out = os.path.join(tmp_path, "out")
    if host == "in-process":  # the launcher forks: a single-threaded process, as agentcell run's cold path is
        p = subprocess.run([sys.executable, "-c", IN_PROCESS, json.dumps(spec_to_dict(spec)), out, ""],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        seen = json.loads(p.stdout)
        assert seen["exit"] == 3 and seen["cell_id"].startswith("agentcell-") and seen["pid1"] > 0
    else:
        fake = FakeHost(lambda s, a: FakeRun(exit_status=3, stdout=b"hello\n"))
        h = fake if host == "fake" else RemoteHost("private", prewarm=False)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            cell = h.start(spec, ["sh", "-c", "echo hello; exit 3"], stdio=(0, fd, 2), monitor=monitor)
            result = cell.wait(60)
        finally:
            os.close(fd)
            h.close()
        assert result["exit_status"] == 3 and cell.events() == [] and not cell.lost
        if host != "fake":
            assert cell.cell_id.startswith("agentcell-") and cell.pid1 > 0
        assert ("monitor_sources" in result) == (host == "remote-supervised")
    with open(out) as f:
        assert f.read() == "hello\n"


# ---- the API on a fake host ---------------------------------------------------------------------------


def test_the_api_runs_on_a_fake_host() -> None:
    """No kernel: ``Cell`` and ``LiveCell`` as a program sees them, their errors and ends included."""
    host = FakeHost(_script)
    spec = CellSpec(identity=None)  # type: ignore[arg-type]  # (no account: nothing is launched)
    with Cell(spec, host=host) as cell:
        r = cell.run(["echo", "hi"], text=True)
        assert (r.returncode, r.stdout, r.stderr) == (0, "echo hi\n", "")
        assert cell.run(["make", "fail"]).returncode == 3
        p = cell.spawn(["sleep", "1"], stdout=os.open(os.devnull, os.O_WRONLY))
        assert p.wait() == 0 and p.result["cell_id"].startswith("fake-")
    assert [c.argv for c in host.calls] == [["echo", "hi"], ["make", "fail"], ["sleep", "1"]]
    assert all(c.monitor is None for c in host.calls)

    live = Cell.open(spec, host=host)
    assert live.exec(["echo", "one"], text=True).stdout == "echo one\n"
    denied = live.exec(["cat", "/etc/shadow"], text=True)
    assert denied.returncode == 137 and denied.error and "escape attempt" in denied.error
    assert live.ended and live.events == [SHADOW]
    with pytest.raises(CellEnded, match="escape attempt"):
        live.exec(["true"])
    result = live.close()
    assert result is not None and result["terminated_by_monitor"]


def test_an_unwatched_fake_live_cell_carries_on_past_a_refusal() -> None:
    live = Cell.open(CellSpec(identity=None), monitor=None, host=FakeHost(_script))  # type: ignore[arg-type]
    assert live.exec(["cat", "/etc/shadow"]).returncode == 1 and live.ended is None
    assert live.exec(["true"]).returncode == 0
    live.close()


# ---- the session's workflow on a fake host ------------------------------------------------------------


@pytest.fixture
def graph_env(env: Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    monkeypatch.setenv("AGENTCELL_STATE_DIR", str(env.state))
    yield env


def _session(env: Env, host: FakeHost, argv: list[str]) -> dict[str, object]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from agentcell.session import config, graph, state

    cfg = config.load({"harness": "shell", "network": "none", "declared_paths": ["src"],
                       "audit_log_path": str(env.audit), "backup_dir": str(env.state / "backups")},
                      environ={"LANG": "C.UTF-8"}, cwd=str(env.project))
    rt = state.Runtime(environ={"LANG": "C.UTF-8"}, host=host)
    conn = state.connect()
    try:
        g = graph.build_graph(rt, checkpointer=SqliteSaver(conn, serde=state.Serde()))
        return dict(graph.run(g, {"session_id": graph.new_session_id(), "config": cfg.as_dict(), "argv": argv}))
    finally:
        conn.close()


def _audited(env: Env) -> list[str]:
    return [json.loads(line)["event"] for line in env.audit.read_text().splitlines()]


@needs_root
def test_a_session_ends_at_the_escape_its_host_reports(graph_env: Env) -> None:
    """The workflow's part, not the kernel's: the host reports an escape while the harness still runs;
    the session terminates the cell, says why, and audits it."""
    host = FakeHost(lambda s, a: FakeRun(hold=True, events=(SHADOW,)))
    final = _session(graph_env, host, ["harness"])
    assert final["status"] == "terminated" and "/etc/shadow" in str(final["reason"]), final.get("reason")
    assert host.calls[0].monitor == "terminate" and host.calls[0].options is not None
    assert host.calls[0].options.dedicated and not host.calls[0].options.guard
    events = _audited(graph_env)
    assert "session.spawn" in events and "session.terminate" in events and events[-1] == "session.end", events


@needs_root
def test_a_session_completes_with_its_harness_status(graph_env: Env) -> None:
    host = FakeHost(lambda s, a: FakeRun(exit_status=0))
    final = _session(graph_env, host, ["harness", "--task", "x"])
    assert final["status"] == "completed" and final["reason"] == "exit 0", final.get("reason")
    assert host.calls[0].argv == ["harness", "--task", "x"] and host.cells[0].terminations == []


# ---- what the red team found (review of this interface) ----------------------------------------------


@needs_root
def test_closing_a_cell_quarantines_what_a_running_command_planted(user: User, project: os.PathLike[str]) -> None:
    """A plain cell's protected-path step is the client's, taken at its end: Cell.close() must still
    read that end for a command it cuts short, or a harness's config planted by a dev server stays."""
    import time
    from pathlib import Path

    from agentcell.cli import run

    root = Path(project)
    spec = run.build_spec(run.parse(["--as", str(user.uid), "--rw", str(root), "--cwd", str(root), "--", "true"]))
    with Cell(spec, prewarm=False) as cell:
        cell.spawn(["sh", "-c", "echo '{}' > .mcp.json; echo ready; sleep 60"],
                   stdout=os.open(os.devnull, os.O_WRONLY))
        for _ in range(200):
            if (root / ".mcp.json").exists():
                break
            time.sleep(0.05)
        assert (root / ".mcp.json").exists()
        never_waited = cell.spawn(["sh", "-c", "mkdir -p .vscode; echo '{}' > .vscode/tasks.json"])
        while never_waited.cell.poll() is None and not (root / ".vscode" / "tasks.json").exists():
            time.sleep(0.05)
    assert not (root / ".mcp.json").exists() and not (root / ".vscode" / "tasks.json").exists()
    boxes = list(root.glob(".agentcell-quarantine-*"))
    assert boxes and any((b / ".mcp.json").exists() for b in boxes), list(root.iterdir())
    with pytest.raises(Exception, match="closed"):
        cell.run(["true"])


@needs_root
def test_each_supervised_cell_of_one_cell_gets_an_id_of_its_own(user: User) -> None:
    """Two watched cells of one Cell at once: the second must not take (and then remove) the first's
    cgroup and records, as a spec's own cell_id reused for every run would have it."""
    spec = _spec(user, watch=True, cell_id="agentcell-fixed0000000")
    with Cell(spec, prewarm=False) as cell:
        first = cell.spawn(["sleep", "30"], stdout=os.open(os.devnull, os.O_WRONLY))
        second = cell.run(["true"])
        assert second.returncode == 0, second.error
        assert first.poll() is None and os.path.exists(f"/run/agentcell/cgroups/{first.id}")
        assert first.id != second.cell_id and "fixed" not in first.id + second.cell_id
        first.kill()
        assert first.wait(30) == 137


def test_a_live_cell_refuses_what_it_does_not_take() -> None:
    """agentcell cell start and agentcell mcp take agentcell run's options: those a live cell would drop
    silently (a credential, --explain) are refused, and the cell is watched unless --no-monitor."""
    from agentcell.cli.cell import parser
    from agentcell.cli.runargs import live_monitor
    from agentcell.errors import AgentcellError

    def monitor(*flags: str) -> str | None:
        return live_monitor(parser().parse_args(["start", *flags]), command_fix="", timeout_fix="")

    for flags, field in ((["--explain"], "--explain"), (["--secret", "K"], "--secret"),
                         (["--no-monitor", "--on-escape", "record"], "--no-monitor"), (["--", "ls"], "command")):
        with pytest.raises(AgentcellError, match=f"^{field}"):
            monitor(*flags)
    assert monitor() == "terminate" and monitor("--on-escape", "record") == "record"
    assert monitor("--no-monitor") is None


@needs_root
def test_a_lost_launcher_still_takes_the_protected_path_step(user: User, project: os.PathLike[str]) -> None:
    """The launcher killed under a plain cell: the cell dies with it, and what it planted on the control
    surface before is still moved aside (the step is the client's, and the end it reads is the loss)."""
    import signal
    import time
    from pathlib import Path

    from agentcell.cli import run
    from agentcell.errors import LaunchError

    root = Path(project)
    spec = run.build_spec(run.parse(["--as", str(user.uid), "--rw", str(root), "--cwd", str(root), "--", "true"]))
    with Cell(spec, prewarm=False) as cell:
        p = cell.spawn(["sh", "-c", "echo '{}' > .mcp.json; sleep 60"], stdout=os.open(os.devnull, os.O_WRONLY))
        for _ in range(200):
            if (root / ".mcp.json").exists():
                break
            time.sleep(0.05)
        os.kill(cell.host._proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]  # (the default RemoteHost's)
        try:
            with pytest.raises(LaunchError, match="launcher"):
                p.wait(30)
        finally:  # the launcher died before it could remove the cell's groups (a later launch sweeps them)
            _remove_groups_of(p.id)
    assert not (root / ".mcp.json").exists()
    assert any((b / ".mcp.json").exists() for b in root.glob(".agentcell-quarantine-*")), list(root.iterdir())


def _remove_groups_of(cell_id: str) -> None:
    from agentcell.cell import cgroups

    record = os.path.join(cgroups.records_dir(), cell_id)
    for _ in range(100):  # its processes are killed with the launcher, and leave their groups at once
        try:
            with open(record) as f:
                dirs = [d for d in f.read().split("\n") if d]
        except FileNotFoundError:
            return
        try:
            for d in dirs:
                if os.path.isdir(d):
                    os.rmdir(d)
            os.unlink(record)
            return
        except OSError:
            import time

            time.sleep(0.05)
