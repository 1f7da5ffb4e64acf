"""The Python API: ``agentcell.Cell`` from a long-lived, multi-threaded program."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import Cell, CellSpec
from agentcell.policy.resolve import build_env, resolve_identity
from conftest import User, needs_root

pytestmark = needs_root


@pytest.fixture
def cell(user: User) -> Iterator[Cell]:
    ident = resolve_identity(str(user.uid), euid=0)
    spec = CellSpec(identity=ident, env=build_env({"OPENAI_API_KEY": "sk-x"}, ident))
    with Cell(spec) as c:
        yield c


def test_run_captures_output_input_and_status(cell: Cell, user: User) -> None:
    r = cell.run(["sh", "-c", "id -u; cat; echo oops >&2; exit 3"], input="fed\n", text=True)
    assert r.returncode == 3
    assert r.stdout == f"{user.uid}\nfed\n" and r.stderr == "oops\n"
    assert r.cell_id.startswith("agentcell-") and not r.timed_out


def test_run_environment_is_the_policy_s(cell: Cell) -> None:
    r = cell.run(["env"], text=True)
    assert "OPENAI_API_KEY" not in str(r.stdout)


def test_run_timeout_kills_the_cell(cell: Cell) -> None:
    r = cell.run(["sleep", "30"], timeout=0.3)
    assert r.timed_out and r.returncode == 124


def test_spawn_signal_and_wait(cell: Cell) -> None:
    p = cell.spawn(["sleep", "30"], stdout=os.open(os.devnull, os.O_WRONLY))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert p.result["signal"] == signal.SIGTERM


def test_each_run_is_a_fresh_cell(cell: Cell) -> None:
    cell.run(["sh", "-c", "echo left-behind > /tmp/x"])
    r = cell.run(["sh", "-c", "cat /tmp/x 2>/dev/null || echo clean"], text=True)
    assert r.stdout == "clean\n"


def test_concurrent_runs_from_many_threads(cell: Cell) -> None:
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        results[i] = str(cell.run(["sh", "-c", f"echo {i}"], text=True).stdout).strip()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: str(i) for i in range(8)}


def test_missing_command_is_127_not_an_exception(cell: Cell) -> None:
    r = cell.run(["no-such-command-agentcell"], text=True)
    assert r.returncode == 127 and r.error and "not found" in r.error


def test_launcher_process_goes_away_on_close(user: User) -> None:
    ident = resolve_identity(str(user.uid), euid=0)
    c = Cell(CellSpec(identity=ident, env=build_env({}, ident)))
    c.run(["true"])
    proc = c.host._proc  # type: ignore[attr-defined]  # (the default host, a RemoteHost)
    assert proc is not None and proc.poll() is None
    c.close()
    assert proc.poll() is not None


def test_signal_sent_at_once_after_spawn_is_not_lost(cell: Cell) -> None:
    p = cell.spawn(["sleep", "30"])
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM


def test_kill_reports_sigkill(cell: Cell) -> None:
    p = cell.spawn(["sleep", "30"])
    p.kill()
    assert p.wait(timeout=20) == 128 + signal.SIGKILL
    assert p.result["signal"] == signal.SIGKILL


def test_every_cell_gets_its_own_id(cell: Cell) -> None:
    ids = {cell.run(["true"]).cell_id for _ in range(3)}
    assert len(ids) == 3


PLANT = "open({marker!r}, 'w').write('planted code ran')\n"


def test_launcher_imports_nothing_from_the_callers_directory(user: User, tmp_path: Path) -> None:
    # A harness usually runs inside the agent's project; code the agent planted there must not run
    # in the (root) warm launcher.
    marker = tmp_path / "PWNED"
    project = tmp_path / "project"
    for d in ("cell", "host"):
        (project / "agentcell" / d).mkdir(parents=True)
    for rel in ("agentcell/__init__.py", "agentcell/cell/__init__.py", "agentcell/host/__init__.py",
                "agentcell/host/zygote.py", "json.py",
                "marshal.py", "select.py"):
        (project / rel).write_text(PLANT.format(marker=str(marker)))
    harness = ("import os, sys; from agentcell import Cell, CellSpec\n"
               "from agentcell.policy.resolve import build_env, resolve_identity\n"
               f"ident = resolve_identity('{user.uid}', euid=0)\n"
               "os.chdir(sys.argv[1]); os.environ['PYTHONPATH'] = sys.argv[1]\n"
               "with Cell(CellSpec(ident, env=build_env({}, ident))) as c:\n"
               "    print(c.run(['true']).returncode)\n")
    p = subprocess.run([sys.executable, "-c", harness, str(project)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.stdout.strip() == "0", p.stdout + p.stderr
    assert not marker.exists(), "the warm launcher imported code from the caller's directory"
