"""Every escape probe of :mod:`test_escape` as the agent of a whole session (``agentcell session start
--harness shell``, issue 15's acceptance): each stays contained, and each attempt either ends the session
(an acting event, the session's verdict: terminate) or is recorded as a note, with the process that made
it named: pid, executable and its parents up to the session's cell (the probe runs under a shell, as an
agent's tools run under its harness).

What acts and what is noted is :mod:`test_monitor_probes`'s table (the same monitor). A session shares
its declared paths read-write only: a probe's ``--ro`` share is dropped, and the attempt is then on a
path the cell does not contain (seen all the same). ``--timeout`` is the session's wall clock.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_escape import PROBE_USER_ENV, PROBES, Attempt, Outcome, World, _execute, nethost  # noqa: F401
from test_escape import world as world  # the fixture, under its own name
from test_monitor_probes import NOT_ATTEMPTS, SEEN

from conftest import AGENTCELL, needs_root
from sessionkit import Env, session_environ
from sessionkit import env as env  # the fixture, under its own name

pytestmark = needs_root

# Attempts no mechanism sees in a session on this kernel, each with the reason (none, now).
UNSEEN: dict[str, str] = {}


def _session_flags(flags: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "--ro":  # no read-only shares in a session: the path is one the cell does not contain
            i += 2
        elif flags[i] == "--timeout":
            out += ["--wall-clock", flags[i + 1]]
            i += 2
        else:
            out.append(flags[i])
            i += 1
    return out


def run_session(a: Attempt, env: Env) -> Outcome:
    """The probe as the shell harness's command, under ``sh`` (its parent: the harness in the chain)."""
    argv = [AGENTCELL, "session", "start", "--harness", "shell", "--project", str(env.project), "--json",
            *_session_flags(a.flags), "--", "sh", "-c", '"$@"; exit $?', "probe", *a.argv]
    o = _execute(argv, a, session_environ(env, {**PROBE_USER_ENV, **a.env}))
    lines = o.out.rstrip("\n").split("\n")
    assert lines and lines[-1].startswith("{"), (o.out[-2000:], o.err[-2000:])
    summary = json.loads(lines[-1])
    o.out = "\n".join(lines[:-1])
    shown = subprocess.run([AGENTCELL, "session", "show", summary["session"], "--json"], capture_output=True,
                           text=True, env=session_environ(env), timeout=60)
    state = json.loads(shown.stdout)
    o.result = {**(state.get("result") or {}), "summary": summary, "events": state.get("events") or [],
                "escape": state.get("escape")}
    return o


def test_enough_of_the_attempts_are_seen_in_a_session() -> None:
    attempts = set(PROBES) - set(NOT_ATTEMPTS)
    assert len(attempts - set(UNSEEN)) >= 0.95 * len(attempts), sorted(UNSEEN)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_in_a_session(name: str, world: World, env: Env) -> None:
    attempt = PROBES[name](world)
    attempt.tty = None  # on pipes: a session's harness on a terminal owns it (the ioctl still reaches seccomp)
    o = run_session(attempt, env)
    assert attempt.judge(o) is None, f"{name} escaped a session\nout: {o.out[-2000:]}\nerr: {o.err[-2000:]}"
    summary, events = o.result["summary"], o.result["events"]
    assert isinstance(summary, dict) and isinstance(events, list)
    if name in NOT_ATTEMPTS or name in UNSEEN:
        return
    acting = any(acts and op != "resource" for op, _src, _target, acts in SEEN[name])
    if acting:  # ended at the first attempt, which names the process and its parents up to the cell
        assert summary["status"] == "terminated", (name, summary, events)
        esc = o.result["escape"]
        assert isinstance(esc, dict) and esc["pid"] and esc["exe"], (name, esc)
        chain = [os.path.basename(str(exe)) for _pid, exe, _cmd in esc["ancestry"]]
        assert chain and chain[-1] in ("dash", "sh"), (name, esc["ancestry"])  # the probe's sh, under the cell's PID 1
    else:  # recorded, and the session went on to its end
        assert summary["status"] == "completed", (name, summary, events)
        noted = [e for e in events if not e["acts"] or e["operation"] == "resource"]
        assert noted, (name, events)
        assert all(e["pid"] and e["exe"] for e in noted if e["operation"] != "resource"), (name, noted)
