"""The session lifecycle, model-checked (issue 30): SPIN verifies every property of model/lifecycle.pml in four
configurations (one session with every failure; two sessions on one uid range and one trail; one session beside
the warm launcher, both holding the monitor's host programs; two agents at once, sharing those programs), and
each revert model (a known bug put back) fails on the property it names. The model's node list and retry rules are the
graph's (so are the fault-injection hook's kill@NODE points): a change to one fails here until the other
follows. States explored and time are printed at the end of the run (the "lifecycle model" section).

No root, no kernel: spin and gcc (scripts/setup.sh installs both).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model" / "lifecycle.pml"

PROPERTIES = ["AgentNeedsBackup", "AgentNeedsNetRule", "AgentNeedsMonitor", "AgentWatchedByPrograms",
              "NoAgentAfterVerdict", "CleanMeansNothingLeft", "AuditDescribesState", "UniqueUids", "TeardownReachable"]
LIVENESS = {"TeardownReachable"}

# Budgets (model/README.md): ONE has every failure a session can meet (3 node failures exhaust the
# preflight's retries); TWO has two sessions at once, on a range of one free uid, with one crash; LAUNCHER one
# session beside the warm launcher holding the host programs, with two crashes (the launcher, a cell host) and
# a retried spawn; AGENTS two sessions whose agents run at once (two free uids), sharing the host programs.
CONFIGS = {
    "one session": {"N": 1, "U": 1, "CRASHES": 2, "FAULTS": 3, "REFUSALS": 1, "TICKS": 1, "LAUNCHER": 0},
    "two sessions": {"N": 2, "U": 1, "CRASHES": 1, "FAULTS": 0, "REFUSALS": 0, "TICKS": 0, "LAUNCHER": 0},
    "launcher": {"N": 1, "U": 1, "CRASHES": 2, "FAULTS": 1, "REFUSALS": 0, "TICKS": 0, "LAUNCHER": 1},
    "two agents": {"N": 2, "U": 2, "CRASHES": 0, "FAULTS": 0, "REFUSALS": 0, "TICKS": 0, "LAUNCHER": 0},
}

# Each known bug put back, the property it must fail, and where it shows.
REVERTS = [
    ("REVERT_PREFLIGHT_FAIL_OPEN", "AgentNeedsBackup", "one session"),  # Hazmat: a failed snapshot did not block
    ("REVERT_ADOPT_UNCHECKED", "AgentNeedsNetRule", "one session"),  # the host adopts a table it does not check
    ("REVERT_HOST_UNLOCKED", "AgentNeedsNetRule", "one session"),  # before this branch: recover vs a starting host
    ("REVERT_MONITOR_FAIL_KEEPS_CELL", "AgentNeedsMonitor", "one session"),  # before 1e2ae42
    ("REVERT_RING_AFTER_START", "AgentWatchedByPrograms", "one session"),  # the rings added after the command starts
    ("REVERT_RELEASE_DETACHES", "AgentWatchedByPrograms", "two agents"),  # one user's release detaches for all
    ("REVERT_KILL_WITHOUT_FREEZE", "NoAgentAfterVerdict", "one session"),
    ("REVERT_RECORD_AFTER_CREATE", "CleanMeansNothingLeft", "one session"),  # the account recorded once made
    ("REVERT_REVOKE_RECORDED_ONLY", "CleanMeansNothingLeft", "one session"),  # killed while granting
    ("REVERT_TABLE_BY_STATE_ONLY", "CleanMeansNothingLeft", "one session"),  # before this branch
    ("REVERT_UID_UNLOCKED", "CleanMeansNothingLeft", "two sessions"),  # before this branch
    ("REVERT_TORN_ANCHOR_REFUSED", "AuditDescribesState", "one session"),  # before 6a11407
    ("REVERT_UID_NONUNIQUE", "UniqueUids", "two sessions"),
    ("REVERT_RECOVER_BY_STATUS", "TeardownReachable", "one session"),
]

SAFETY = [p for p in PROPERTIES if p not in LIVENESS]
ALL_SAFETY = "AllSafety"  # the model's never claim: every safety property in one search

Search = tuple[int, int, float, str]  # (errors, states stored, seconds, pan's report): Pan.run's
Revert = tuple[Search, int | None]  # a revert's search, and AllSafety's errors for a safety property's

RESULTS: list[str] = []
WORKERS = os.cpu_count() or 2  # pan runs side by side, one a core (each search is single-threaded)


def _spin() -> str:
    spin, gcc = shutil.which("spin"), shutil.which("gcc")
    if spin is None or gcc is None:
        pytest.fail("the lifecycle model needs spin and gcc: apt-get install spin gcc (scripts/setup.sh does)")
    return spin


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    yield RESULTS
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capture is not None and RESULTS:
        with capture.global_and_fixture_disabled():  # (shown in ./test.sh's output, not only on a failure)
            tr.write_line("")
            tr.write_sep("-", "lifecycle model (SPIN)")
            for line in RESULTS:
                tr.write_line(line)


class Pan:
    """The model compiled for one set of defines: ``run(property)`` checks one of its properties."""

    def __init__(self, workdir: Path, defines: dict[str, int | bool]) -> None:
        self.dir = workdir
        self.dir.mkdir()
        shutil.copy(MODEL, self.dir / MODEL.name)
        self.defines = [f"-D{k}" if v is True else f"-D{k}={v}" for k, v in defines.items()]
        p = subprocess.run([_spin(), *self.defines, "-a", MODEL.name], cwd=self.dir, capture_output=True, text=True)
        assert p.returncode == 0 and (self.dir / "pan.c").exists(), p.stdout + p.stderr
        # COLLAPSE: compressed state vectors; MEMLIM: a search that outgrows 2 GB stops (and fails below).
        c = subprocess.run(["gcc", "-O0", "-w", "-DCOLLAPSE", "-DMEMLIM=2048", "-o", "pan", "pan.c"], cwd=self.dir,
                           capture_output=True, text=True)
        assert c.returncode == 0, c.stderr[-3000:]

    def run(self, prop: str) -> Search:
        """(errors, states stored, seconds, pan's report)."""
        args = ["./pan", "-m100000", "-N", prop] + (["-a"] if prop in LIVENESS else [])
        t = time.monotonic()
        p = subprocess.run(args, cwd=self.dir, capture_output=True, text=True, timeout=600)
        took = time.monotonic() - t
        out = p.stdout + p.stderr
        errors = re.search(r"errors: (\d+)", out)
        states = re.search(r"^\s*(\d+) states, stored", out, re.M)
        assert errors and states, out[-3000:]
        assert f"pan: ltl formula {prop}" in out, out[:2000]
        return int(errors.group(1)), int(states.group(1)), took, out


def _steps_in_model() -> list[str]:
    m = re.search(r"^mtype:node = \{([^}]*)\}", MODEL.read_text(), re.M)
    assert m, "model/lifecycle.pml declares no mtype:node list"
    return [s.strip() for s in m.group(1).split(",")]


def test_the_models_steps_are_the_graphs_nodes_and_the_hooks_kill_points() -> None:
    from agentcell.session.graph import build_graph

    nodes = [n for n in build_graph().get_graph().nodes if not n.startswith("__")]
    assert _steps_in_model() == nodes  # (the order build_graph adds them)
    text = "".join(p.read_text() for p in (ROOT / "src" / "agentcell" / "session" / "nodes").glob("*.py"))
    kill_points = set(re.findall(r'\bcrash\(rt, "([a-z]+)"\)', text))
    assert kill_points == set(nodes), "every node has its kill@NODE point, and no point names a node that is not"


def test_the_models_retry_rules_are_the_graphs() -> None:
    from agentcell.session import graph

    text = MODEL.read_text()

    def attempts(name: str) -> int:
        m = re.search(rf"^#define {name}_ATTEMPTS (\d+)", text, re.M)
        assert m, name
        return int(m.group(1))

    assert attempts("PREFLIGHT") == graph.PREFLIGHT_RETRY.max_attempts
    assert attempts("ACCOUNT") == graph.ACCOUNT_RETRY.max_attempts
    assert attempts("FIREWALL") == graph.FIREWALL_RETRY.max_attempts
    assert attempts("SPAWN") == graph.SPAWN_RETRY.max_attempts
    assert attempts("TELEMETRY") == graph.TELEMETRY_RETRY.max_attempts
    assert set(re.findall(r"^ltl (\w+)", text, re.M)) == set(PROPERTIES)
    # AllSafety is every safety property's predicate, and stands after the processes (before them it checks nothing)
    preds = dict(re.findall(r"^ltl (\w+) \{ \[\] each\((\w+)\) \}", text, re.M))
    assert set(preds) == set(SAFETY)
    m = re.search(r"^#define all_safe \(((?:[^\n]|\\\n)*)\)$", text, re.M)
    assert m and sorted(re.findall(r"each\((\w+)\)", m.group(1))) == sorted(preds.values())
    assert text.index(f"never {ALL_SAFETY} {{") > text.index("\ninit {")
    assert {r for r, _, _ in REVERTS} == set(re.findall(r"\b(REVERT_[A-Z_]+)\b", text)), \
        "every revert in the model is tested here, and every one tested is in the model"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_spin_verifies_every_property(tmp_path: Path, config: str, results: list[str]) -> None:
    """The safety properties in one search (the model's ``AllSafety``: each of them holds in every state
    there), beside the liveness one; only if that search fails is each safety property checked alone, to
    name the one that does not hold."""
    t = time.monotonic()
    pan = Pan(tmp_path / "pan", CONFIGS[config])
    compiled = time.monotonic() - t
    failed = []
    checks = [ALL_SAFETY, *LIVENESS]
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = list(pool.map(pan.run, checks))
        if runs[0][0]:
            checks += SAFETY
            runs += list(pool.map(pan.run, SAFETY))
    for prop, (errors, states, took, out) in zip(checks, runs, strict=True):
        name = f"{prop} ({len(SAFETY)} properties)" if prop == ALL_SAFETY else prop
        results.append(f"{config:<13} {name:<26} verified: {errors == 0} ({states:,} states, {took:.1f} s)")
        assert "max search depth too small" not in out and "MEMLIM" not in out, out[-2000:]
        if errors:
            failed.append(f"{prop}: {out[:1500]}")
    results.append(f"{config:<13} (spin -a and gcc: {compiled:.1f} s)")
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def reverts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Revert]]]:
    """Every revert model built and checked, side by side (each a spin, a gcc and a short search), the
    first time a test asks for one: each test waits for its own."""
    base = tmp_path_factory.mktemp("reverts")

    def check(revert: str, prop: str, config: str) -> Revert:
        """The named property's search; and the errors of ``AllSafety``'s, for a safety property's revert."""
        pan = Pan(base / revert, {**CONFIGS[config], revert: True})
        return pan.run(prop), (pan.run(ALL_SAFETY)[0] if prop in SAFETY else None)

    with ThreadPoolExecutor(WORKERS) as pool:
        yield {revert: pool.submit(check, revert, prop, config) for revert, prop, config in REVERTS}


@pytest.mark.parametrize(("revert", "prop", "config"), REVERTS)
def test_each_revert_model_fails_on_its_property(revert: str, prop: str, config: str, results: list[str],
                                                 reverts: dict[str, Future[Revert]]) -> None:
    (errors, states, took, out), all_safety = reverts[revert].result()
    results.append(f"{revert:<31} fails {prop}: {errors > 0} ({states:,} states, {took:.1f} s)"
                   + ("" if all_safety is None else f"; fails {ALL_SAFETY}: {all_safety > 0}"))
    assert errors == 1, out[-2000:]
    assert all_safety in (None, 1), f"{ALL_SAFETY} misses the bug {prop} finds"
    assert ("assertion violated" in out) if prop not in LIVENESS else ("acceptance cycle" in out), out[:2000]
