"""Sessions without root (issue 26): an ordinary user's ``agentcell session start`` runs its agent as the
user (a user namespace), with the proxy, what an unprivileged monitor can see, the snapshot and the audit
trail under the user's own state. Ceilings come from a cgroup delegated to the user; where there is none
the session refuses, unless the user says ``--ceilings off`` (in the audit trail and the summary): never a
silent demotion.

The delegated cgroup is made here by root for the throwaway user, as systemd's Delegate=yes or an
administrator would: a group of the user's own in each hierarchy (memory, cpu, pids, and the unified tree of
this hybrid host), which the user's shell is put into before it starts agentcell.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.cell import cgroups
from conftest import AGENTCELL, User, needs_root

pytestmark = needs_root


@pytest.fixture
def home(user: User) -> Iterator[Path]:
    """The user's home (their XDG state: the sessions, snapshots and trail), made here, removed after."""
    h = Path(f"/home/{user.name}")
    h.mkdir(mode=0o700)
    shutil.chown(h, user.uid, user.gid)
    try:
        yield h
    finally:
        shutil.rmtree(h, ignore_errors=True)


@contextlib.contextmanager
def _delegate(user: User, controllers: tuple[str, ...]) -> Iterator[list[Path]]:
    """A group of the user's own in each of ``controllers``' hierarchies, as an administrator delegates
    it: made and chowned by root, removed after (empty by then)."""
    if cgroups.layout() not in ("hybrid", "v1"):
        pytest.skip(f"made for v1/hybrid hierarchies; this host's cgroups are {cgroups.layout()}")
    name = f"agentcell-deleg-{secrets.token_hex(3)}"
    made = [Path(f"/sys/fs/cgroup/{c}/{name}") for c in controllers if Path(f"/sys/fs/cgroup/{c}").is_dir()]
    try:
        for d in made:
            d.mkdir()
            for p in (d, d / "cgroup.procs", *([d / "tasks"] if (d / "tasks").exists() else [])):
                os.chown(p, user.uid, user.gid)
        yield made
    finally:
        for d in made:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


@pytest.fixture
def delegated(user: User) -> Iterator[list[Path]]:
    """The hierarchies the ceilings need (memory, cpu, pids) and the unified one, delegated to the user."""
    with _delegate(user, ("memory", "cpu", "pids", "unified")) as made:
        yield made


def session(user: User, home: Path, project: Path, args: list[str], *, into: list[Path] | None = None,
            timeout: float = 120) -> tuple[int, str, dict[str, object]]:
    """``agentcell session start --json`` as the user, from a shell root has put into ``into`` first."""
    join = "".join(f"echo $$ > {d}/cgroup.procs && " for d in into or [])
    argv = ["sh", "-c", f'{join}exec "$@"', "sh", *user.prefix(), "env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin",
            "LANG=C.UTF-8", AGENTCELL, "session", "start", "--project", str(project), "--json", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=project, stdin=subprocess.DEVNULL)
    lines = p.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout + p.stderr, summary


def test_without_root_a_session_runs_as_you_with_ceilings_off_and_says_so(
        user: User, home: Path, project: Path) -> None:
    rc, out, summary = session(user, home, project, ["--", "sh", "-c", "id -u; echo work > done.txt"])
    assert rc == 125 and "--ceilings: " in out and "--ceilings off" in out and "delegate" in out, out
    assert not (project / "done.txt").exists()
    rc, out, summary = session(user, home, project, ["--ceilings", "off", "--", "sh", "-c",
                                                     "id -u; echo work > done.txt"])
    assert rc == 0 and summary["status"] == "completed", out
    assert summary["ceilings"] == "off (--ceilings off)" and summary["os_user"] == user.name, summary
    assert (project / "done.txt").read_text() == "work\n" and f"{user.uid}\n" in out
    trail = [json.loads(line) for line in (home / ".local/state/agentcell/audit/audit.jsonl").read_text().splitlines()]
    policy = next(r for r in trail if r["event"] == "session.policy" and r["session"] == summary["session"])
    assert policy["details"]["ceilings"] == "off" and policy["details"]["limits_from"] == "--ceilings off", policy


def test_without_root_the_ceilings_hold_in_a_cgroup_delegated_to_you(
        user: User, home: Path, project: Path, delegated: list[Path]) -> None:
    bomb = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "        n += 1\nexcept OSError as e:\n    print('stopped at', n, e.errno)\n")
    rc, out, summary = session(user, home, project, ["--pids", "40", "--memory", "256M", "--", "python3", "-c", bomb],
                               into=delegated)
    assert summary.get("status") == "completed", out
    stopped = [line for line in out.splitlines() if line.startswith("stopped at")]
    assert stopped and int(stopped[0].split()[2]) < 40, out  # the task ceiling held the fork bomb
    assert summary["ceilings"].startswith("memory 256 MiB") and "tasks 40" in summary["ceilings"], summary
    left = [d for d in delegated for child in d.iterdir() if child.is_dir()]  # its groups went with it
    assert not left, left


def test_without_root_the_projects_caches_are_yours_kept_between_sessions_and_cleared(
        user: User, home: Path, project: Path) -> None:
    """The toolchain caches of a rootless session: in the user's own state, owned by them, at /cache in
    the next session of the project too; 'agentcell cache clear' removes them, read-only module
    directories (go's) included."""
    fill = ("stat -c owner=%u /cache/pip; echo kept > /cache/pip/mark; mkdir -p /cache/go/mod/m@v1 && "
            "echo x > /cache/go/mod/m@v1/f && chmod -R a-w /cache/go/mod")
    rc, out, summary = session(user, home, project, ["--ceilings", "off", "--", "sh", "-c", fill])
    assert rc == 0 and summary["status"] == "completed" and f"owner={user.uid}" in out, out
    rc, out, summary = session(user, home, project, ["--ceilings", "off", "--", "cat", "/cache/pip/mark"])
    assert rc == 0 and "kept" in out, out

    def cache(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*user.prefix(), "env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", AGENTCELL,
                               "cache", *args], capture_output=True, text=True, timeout=60)

    listed = json.loads(cache("list", "--json").stdout)
    tree = Path(listed[0]["path"])
    assert [e["project"] for e in listed] == [str(project)] and listed[0]["owner"] == f"{user.uid}:{user.gid}"
    assert tree.is_relative_to(home / ".local/state/agentcell/caches") and (tree / "pip/mark").exists(), listed
    p = cache("clear", "--project", str(project))
    assert p.returncode == 0 and not tree.exists() and not tree.parent.exists(), p.stdout + p.stderr
    p = cache("clear", "--project", str(project))
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "has no cache" in p.stderr, p.stderr


def test_without_root_a_ceiling_the_delegated_group_cannot_hold_is_refused_not_dropped(
        user: User, home: Path, project: Path) -> None:
    """A delegation without the cpu hierarchy: a session whose ceilings include CPU (every risk level's
    do) is refused in one line that says how to go on, and nothing runs. On cgroup v2 the same holds
    for a controller the delegated group does not give (CellCgroup._held, below)."""
    with _delegate(user, ("memory", "pids", "unified")) as made:
        rc, out, summary = session(user, home, project, ["--cpu", "20", "--", "sh", "-c", "echo ran > ran.txt"],
                                   into=made)
        assert rc == 125 and "cpu" in out and "--ceilings off" in out and out.count("\n") == 1, out
        assert not (project / "ran.txt").exists()


def test_a_delegated_v2_group_without_a_controller_a_ceiling_needs_refuses_the_launch() -> None:
    from agentcell.errors import LaunchError

    cg = cgroups.CellCgroup("v2", {})
    assert cg._held(cgroups.Limits(None, None, 64), {"pids"}) is cg
    with pytest.raises(LaunchError, match="memory, cpu controllers") as e:
        cg._held(cgroups.Limits(256 << 20, 50, 64), {"pids"})
    assert "--ceilings off" in str(e.value)


def test_without_root_the_explain_says_what_the_monitor_can_see_and_where_the_caches_are(
        user: User, home: Path, project: Path) -> None:
    rc, out, _ = session(user, home, project, ["--ceilings", "off", "--explain", "--", "true"])
    assert rc == 0, out
    monitor = next(line for line in out.splitlines() if line.strip().startswith("monitor:"))
    assert "without root" in monitor and "seccomp" in monitor and "not seen" in monitor, monitor
    caches = next(line for line in out.splitlines() if line.strip().startswith("caches:"))
    assert str(home / ".local/state/agentcell/caches") in caches, caches
