"""Red-team pass on the warm launcher's session starter (host/starter.py): what a session forked there
inherits, and what becomes of it when its front, the starter or the launcher goes.

Three of them showed bugs, since fixed: a session now reads its front's connection itself (a front's
signal reaches it, and a front that goes is its SIGTERM) whatever became of the starter or the launcher,
and a front whose session never started is answered.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import AGENTCELL, User, needs_root
from test_warm import launcher_status, runtime_dir, warm  # noqa: F401 - runtime_dir: the fixture

pytestmark = needs_root

WALL_CLOCK = "15"  # the sessions here end by themselves after this, whatever happens to their front


@pytest.fixture
def home(user: User) -> Iterator[Path]:
    d = Path(f"/home/{user.name}")
    d.mkdir(mode=0o700)
    shutil.chown(d, user.uid, user.gid)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _front(user: User, rt: Path, home: Path, project: Path, script: str, *, front: str = "on",
           extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(rt),
           "AGENTCELL_FRONT": front, **(extra or {})}
    return subprocess.Popen([*user.prefix(), AGENTCELL, "session", "start", "--ceilings", "off", "--harness", "shell",
                             "--wall-clock", WALL_CLOCK, "--project", str(project), "--json", "--", "sh", "-c",
                             script], cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _children(ppid: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"\nPPid:\t{ppid}\n" in Path(f"/proc/{pid}/status").read_text():
                out.append(int(pid))
        except OSError:
            continue
    return out


def _summary(out: str) -> dict[str, Any]:
    return dict(json.loads(out.splitlines()[-1]))


def _up(p: subprocess.Popen[str]) -> None:
    assert p.stdout is not None and p.stdout.readline() == "up\n"


def _link(pid: int, fd: str) -> str:
    """Where the fd leads; empty if it was closed since the listing (a session's thread reading a file)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
        return ""


def _what_it_has(pid: int) -> dict[str, Any]:
    """What a session's process has that decides what it may do, beside its own doing."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    keys = ("Uid", "Gid", "Groups", "Umask", "SigBlk", "SigIgn", "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff",
            "CapBnd", "CapAmb")
    links = (_link(pid, fd) for fd in os.listdir(f"/proc/{pid}/fd"))
    kinds = sorted(t.split(":[")[0] if ":[" in t else t for t in links if t)
    return {**{k: status[k].strip() for k in keys}, "fds": kinds, "cwd": os.readlink(f"/proc/{pid}/cwd"),
            "limits": Path(f"/proc/{pid}/limits").read_text(), "cgroup": Path(f"/proc/{pid}/cgroup").read_text(),
            "oom_score_adj": Path(f"/proc/{pid}/oom_score_adj").read_text(),
            "nice": Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]}


def test_a_session_forked_by_the_starter_has_what_a_cold_one_has_and_one_socket_more(
        user: User, runtime_dir: Path, home: Path, project: Path) -> None:  # noqa: F811 - the fixture
    """HELD. The session's process as the starter forks it and as the front's own Python is, compared
    while their agents run: the same identity, umask, signal mask and ignored signals, limits, cgroup,
    nice and OOM score, working directory, and the same open files but one socket (the front's
    connection, on which it says its status): nothing of the launcher's or the starter's is open in it."""
    assert warm(user, runtime_dir, "start").returncode == 0
    seen: dict[str, dict[str, Any]] = {}
    for front in ("on", "off"):
        p = _front(user, runtime_dir, home, project, "echo up; exec sleep 60", front=front)
        try:
            _up(p)
            if front == "on":
                starter = int(launcher_status(user, runtime_dir)["session_starter"])
                (pid,) = _children(starter)
            else:
                pid = p.pid  # (setpriv execs the front, which execs Python)
            seen[front] = _what_it_has(pid)
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 120 and _summary(out)["reason"] == "stopped: signal 15", (p.returncode, err)
    # (files of its own state dir come and go as it writes: its checkpoints, a record of the trail)
    warm_fds, cold_fds = ([f for f in seen[k].pop("fds") if not f.startswith(f"{home}/")] for k in ("on", "off"))
    assert seen["on"] == seen["off"]
    assert sorted(cold_fds + ["socket"]) == warm_fds, (warm_fds, cold_fds)


def test_a_front_stops_its_session_after_the_starter_has_died(user: User, runtime_dir: Path, home: Path,  # noqa: F811 - the fixture
                                                               project: Path) -> None:
    assert warm(user, runtime_dir, "start").returncode == 0
    p = _front(user, runtime_dir, home, project, "echo up; exec sleep 60")
    try:
        _up(p)
        starter = int(launcher_status(user, runtime_dir)["session_starter"])
        os.kill(starter, signal.SIGKILL)  # (a process this test made: the launcher's child)
        for _ in range(200):
            if launcher_status(user, runtime_dir)["session_starter"] is None:
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)  # (the session ends at its wall clock in any case)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert _summary(out)["reason"] == "stopped: signal 15", (p.returncode, _summary(out)["reason"], err)


def test_a_front_stops_its_session_after_the_launcher_was_stopped(user: User, runtime_dir: Path, home: Path,  # noqa: F811 - the fixture
                                                                  project: Path) -> None:
    assert warm(user, runtime_dir, "start").returncode == 0
    p = _front(user, runtime_dir, home, project, "echo up; exec sleep 60")
    try:
        _up(p)
        assert warm(user, runtime_dir, "stop").returncode == 0
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert _summary(out)["reason"] == "stopped: signal 15", (p.returncode, _summary(out)["reason"], err)


def test_a_front_whose_session_never_started_is_answered(user: User, runtime_dir: Path, home: Path,  # noqa: F811 - the fixture
                                                         project: Path) -> None:
    assert warm(user, runtime_dir, "start").returncode == 0
    first = _front(user, runtime_dir, home, project, "true")
    first.communicate(timeout=120)
    assert first.returncode == 0
    status = launcher_status(user, runtime_dir)
    starter, served = int(status["session_starter"]), int(status["fronts_served"])
    os.kill(starter, signal.SIGSTOP)  # it takes no request from here on
    p = _front(user, runtime_dir, home, project, "echo up")
    try:
        for _ in range(400):  # the launcher has answered "started" and handed the request to the starter
            if launcher_status(user, runtime_dir)["fronts_served"] > served:
                break
            time.sleep(0.05)
        os.kill(starter, signal.SIGKILL)
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        answered = p.poll() is not None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert answered, "the front still waits for a session that will never run"
