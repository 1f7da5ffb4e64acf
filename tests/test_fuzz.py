"""The fuzzer's runs (tests/fuzzing.py). In ./test.sh a bounded budget; AGENTCELL_FUZZ=N runs N cases per
property (the large run: AGENTCELL_FUZZ=3400 gives over 10,000 cases). A case fails on a traceback, a hang
or a refusal longer than three lines; the module fails if anything outside its playground changed.
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import AGENTCELL, needs_root
from fuzzing import Playground, argv, dotenv_files, host_state, policy_files, toml_files

pytestmark = needs_root

CASES = int(os.environ.get("AGENTCELL_FUZZ", "30"))
FUZZ = settings(max_examples=CASES, deadline=None, database=None, derandomize=CASES <= 30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def pg() -> Iterator[Playground]:
    before = host_state()
    p = Playground()
    try:
        yield p
    finally:
        subprocess.run([AGENTCELL, "session", "recover"], env=p.env(), capture_output=True, timeout=300)
        p.close()
        after = host_state()
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        print(f"\nfuzz: {sum(COUNTS.values())} cases {COUNTS}")
        assert not changed, f"the fuzzer changed the host outside its playground: {changed}"


def _case(pg: Playground, args: list[str], extra: dict[str, str] | None = None) -> None:
    proc = subprocess.Popen([AGENTCELL, *args], env=pg.env(extra), cwd=pg.project, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we started: the case and what it started
        proc.communicate()
        pytest.fail(f"hang: agentcell {' '.join(a[:80] for a in args)}")
    text = err.decode("utf-8", "replace")
    assert "Traceback" not in text, (args, text[-3000:])
    if proc.returncode == 125:
        assert len(text.strip().splitlines()) <= 3, (args, text[:3000])


@FUZZ
@given(data=st.data())
def test_the_cli_never_tracebacks_hangs_or_rambles(pg: Playground, data: st.DataObject) -> None:
    args = data.draw(argv(pg))
    COUNTS["cli"] = COUNTS.get("cli", 0) + 1
    _case(pg, args)


@FUZZ
@given(data=st.data())
def test_config_files_are_read_or_refused_in_one_line(pg: Playground, data: st.DataObject) -> None:
    """agentcell.toml and .env in the project, and an --env-file: through the config reader (in this
    process: many cases), and one case in four through the CLI."""
    from agentcell.errors import AgentcellError
    from agentcell.session import config

    toml, dotenv, named = data.draw(toml_files(pg)), data.draw(dotenv_files(pg)), data.draw(dotenv_files(pg))
    COUNTS["config"] = COUNTS.get("config", 0) + 1
    (pg.project / "agentcell.toml").write_text(toml, errors="surrogateescape")
    (pg.project / ".env").write_text(dotenv, errors="surrogateescape")
    env_file = pg.state / "named.env"
    env_file.write_text(named, errors="surrogateescape")
    try:
        for dot in (None, str(env_file)):
            try:
                config.load({"harness": None, "harness_args": ["true"]}, environ={"PATH": "/usr/bin"},
                            cwd=str(pg.project), dotenv=dot)
            except AgentcellError as e:
                assert "\n" not in e.line().strip() or e.line().count("\n") < 3
        if data.draw(st.integers(0, 3)) == 0:
            _case(pg, ["session", "start", "--explain", "--env-file", str(env_file), "--", "true"])
    finally:
        for f in (pg.project / "agentcell.toml", pg.project / ".env", env_file):
            f.unlink(missing_ok=True)


@FUZZ
@given(data=st.data())
def test_policy_files_load_and_compile_or_are_refused_with_the_field(pg: Playground, data: st.DataObject) -> None:
    from agentcell.errors import AgentcellError
    from agentcell.policy.compile import compile_plan, load_plan

    text = data.draw(policy_files(pg))
    COUNTS["policy"] = COUNTS.get("policy", 0) + 1
    path = pg.root / "policy.toml"
    path.write_text(text, errors="surrogateescape")
    try:
        plan = load_plan(path)
        compile_plan(plan, environ={"PATH": "/usr/bin"}, euid=0)
    except AgentcellError as e:
        assert e.field and e.line().count("\n") < 3
    finally:
        path.unlink(missing_ok=True)
