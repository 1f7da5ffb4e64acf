"""What the session tests share: a private state dir and a project per test (the ``env`` fixture), the
real CLI run as root, the audit trail's records of a session, a persistent agent (the ``agent`` fixture).

Each test gets its own state dir (AGENTCELL_STATE_DIR: checkpoints, account records, snapshots, audit
log); its finalizer recovers whatever a failed test left (account, ACL grants, cell) before removing it.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import AGENTCELL, User


@dataclass
class Env:
    state: Path
    project: Path

    @property
    def audit(self) -> Path:
        return self.state / "audit.jsonl"


@dataclass
class Session:
    rc: int
    out: str
    err: str
    summary: dict[str, Any]


def session_environ(env: Env, extra: dict[str, str] | None = None) -> dict[str, str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(env.state),
            "AUDIT_LOG_PATH": str(env.audit), "BACKUP_DIR": str(env.state / "backups"),
            "AGENTCELL_WARM": "off"}  # (a warm launcher left running on the machine must not choose the path tested)
    return {**base, **(extra or {})}


def session(env: Env, args: list[str], *, extra: dict[str, str] | None = None, timeout: float = 120) -> Session:
    p = subprocess.run([AGENTCELL, "session", *args], capture_output=True, text=True, env=session_environ(env, extra),
                       timeout=timeout, cwd=env.project, stdin=subprocess.DEVNULL)
    lines = p.stdout.rstrip("\n").split("\n")
    summary: dict[str, Any] = {}
    if lines and lines[-1].startswith(("{", "[")):
        summary = json.loads(lines[-1])
        lines = lines[:-1]
    assert "Traceback" not in p.stderr, p.stderr
    return Session(p.returncode, "\n".join(lines), p.stderr, summary)


def scripted(env: Env, steps: str, *args: str, extra: dict[str, str] | None = None) -> Session:
    script = env.state / f"steps-{secrets.token_hex(3)}.txt"
    script.write_text(steps)
    return session(env, ["start", "--harness", "scripted", "--json", *args, "--", str(script)], extra=extra)


def running(env: Env, *, stdout: int = subprocess.PIPE, extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A scripted session whose agent writes src/running.txt and sleeps: returned once the cell is up
    (the marker is there) or the session has ended. The caller kills it if it is still running."""
    marker = env.project / "src" / "running.txt"
    script = env.state / "steps.txt"
    script.write_text(f"write {marker} yes\nsleep 600\n")
    sup = subprocess.Popen([AGENTCELL, "session", "start", "--harness", "scripted", "--rw", "src", "--json", "--",
                            str(script)], env=session_environ(env, extra), cwd=env.project, stdout=stdout,
                           stderr=subprocess.DEVNULL, text=True)
    for _ in range(600):
        if marker.exists() or sup.poll() is not None:
            break
        time.sleep(0.05)
    return sup


def records(env: Env, sid: str) -> list[dict[str, Any]]:
    if not env.audit.exists():
        return []
    out = [json.loads(line) for line in env.audit.read_text().splitlines()]
    return [r for r in out if r["session"] == sid]


def account_gone(name: str | None) -> bool:
    if name is None:
        return True
    try:
        pwd.getpwnam(name)
        return False
    except KeyError:
        return True


def acl_names(path: Path) -> str:
    return subprocess.run(["getfacl", "-Rcp", str(path)], capture_output=True, text=True).stdout


def recover(env: Env) -> None:
    """``agentcell session recover`` on the test's state dir, run here: the command's own code, without
    a process (an interpreter and LangGraph's import, 0.65 s) after each of the suite's many sessions.
    Tests of recover itself run the CLI."""
    from agentcell.session import commands

    saved = dict(os.environ)
    os.environ.update(session_environ(env))
    try:
        commands.run("recover", argparse.Namespace(json=True))
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def env(user: User, project: Path) -> Iterator[Env]:
    """A project the throwaway user owns (src/ is declared, docs/ is not) and a private state dir."""
    state = Path("/tmp") / ("agentcell-test-state-" + secrets.token_hex(4))
    state.mkdir(mode=0o700)
    (project / "src").mkdir()
    (project / "src" / "app.py").write_text("x = 1\n")
    (project / "docs").mkdir()
    (project / "docs" / "notes.md").write_text("notes\n")
    for p in (project / "src", project / "src" / "app.py", project / "docs", project / "docs" / "notes.md"):
        shutil.chown(p, user.uid, user.gid)
    e = Env(state, project)
    try:
        yield e
    finally:
        # Whatever a failed test left: its sessions' teardown (cell, ACL grants, account), then the files.
        recover(e)
        left = sorted(os.listdir(state / "ephemeral")) if (state / "ephemeral").is_dir() else []
        for name in left:
            subprocess.run(["userdel", name], capture_output=True)
            subprocess.run(["groupdel", name], capture_output=True)
        subprocess.run(["chattr", "-R", "-i", str(state)], capture_output=True)
        shutil.rmtree(state, ignore_errors=True)
        assert not left, f"session accounts left behind: {left}"


@pytest.fixture
def agent(env: Env, user: User) -> Iterator[str]:
    """A persistent agent (its human: the throwaway user) with docs/ shared read-write, deleted after."""
    name = "ac-a" + secrets.token_hex(3)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AGENTCELL, "agent", *args], capture_output=True, text=True, env=session_environ(env),
                              cwd="/", stdin=subprocess.DEVNULL, timeout=60)

    assert cli("new", name, "--human", user.name, "--yes").returncode == 0
    try:
        assert cli("mount", "add", "--rw", str(env.project / "docs"), "--agent", name).returncode == 0
        yield name
    finally:
        p = cli("delete", name, "--delete-home", "--yes")
        assert p.returncode == 0, p.stderr


