"""Shared fixtures: real throwaway accounts, real directories, the real CLI.

Everything a test creates is named ``agentcell``/``ac-`` and removed in a finalizer, even on failure.
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
AGENTCELL = str(VENV_BIN / "agentcell")

pytest_plugins = ("sessionkit",)  # the session tests' fixtures: env, agent

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates accounts and runs as other uids")


@dataclass
class User:
    name: str
    uid: int
    gid: int

    def prefix(self) -> list[str]:
        """argv prefix that runs a command as this user with a plain environment."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]


def _make_user() -> User:
    name = "ac-t" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-d", f"/home/{name}", "-s", "/usr/sbin/nologin", name], check=True)
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def _drop_user(u: User) -> None:
    # userdel refuses while a process of the account runs: that would be a cell (or launcher) that
    # outlived its test, a cleanup bug worth an error rather than a leftover account.
    p = subprocess.run(["userdel", u.name], capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError(f"could not delete test account {u.name}: {p.stderr.strip()}")


@pytest.fixture(scope="session")
def user() -> Iterator[User]:
    """A throwaway non-root account (no home on disk)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a throwaway account")
    u = _make_user()
    try:
        yield u
    finally:
        _drop_user(u)


@pytest.fixture
def project(user: User) -> Iterator[Path]:
    """A project directory the throwaway user owns, outside any home."""
    d = Path("/tmp") / ("agentcell-test-" + secrets.token_hex(4))
    d.mkdir(mode=0o755)
    (d / "README").write_text("hello\n")
    shutil.chown(d, user.uid, user.gid)
    shutil.chown(d / "README", user.uid, user.gid)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class Run:
    rc: int
    out: str
    err: str
    result: dict[str, object]


def agentcell_run(args: list[str], *, as_user: User | None = None, env: dict[str, str] | None = None,
                  timeout: float = 60, pass_fds: tuple[int, ...] = (), input: str | None = None,
                  cwd: str | None = None, warm: bool = False) -> Run:
    """Run the real CLI with --json and return the command's output and the parsed result line.
    Cells are built by the CLI itself unless ``warm``: a warm launcher someone left running on the
    machine must not decide which code path a test exercises."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    full = dict(base, **(env or {}))
    argv = [AGENTCELL, "run", "--json", *([] if warm else ["--no-warm"]), *args]
    if as_user:
        argv = as_user.prefix() + argv
    p = subprocess.run(argv, capture_output=True, text=True, env=full, timeout=timeout, pass_fds=pass_fds,
                       input=input, cwd=cwd)
    lines = p.stdout.rstrip("\n").split("\n")
    result: dict[str, object] = {}
    if lines and lines[-1].startswith("{"):
        result = json.loads(lines[-1])
        lines = lines[:-1]
    return Run(p.returncode, "\n".join(lines), p.stderr, result)


def deny_syscall(nr: int, err: int, *, arg0_mask: int | None = None) -> str:
    """Python code that installs a seccomp filter making syscall ``nr`` fail with ``err`` (only when
    its first argument has a bit of ``arg0_mask``, if given), then execs argv[1:]: a host without a
    kernel feature, made on this one."""
    check_arg = f"(0x20, 0, 0, 16), (0x45, 0, 1, {arg0_mask}), " if arg0_mask is not None else ""
    skip = 3 if arg0_mask is not None else 1
    return f"""
import ctypes, os, struct, sys
insns = [(0x20, 0, 0, 4), (0x15, 0, {skip + 2}, 0xC000003E), (0x20, 0, 0, 0), (0x15, 0, {skip}, {nr}),
         {check_arg}(0x06, 0, 0, 0x00050000 | {err}), (0x06, 0, 0, 0x7FFF0000)]
prog = b"".join(struct.pack("HBBI", *i) for i in insns)
buf = ctypes.create_string_buffer(prog)
fprog = struct.pack("HxxxxxxQ", len(insns), ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()
os.execv(sys.argv[1], sys.argv[1:])
"""


def proc_ppid(pid: int | str) -> int:
    """The parent of process ``pid`` (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def proc_uid(pid: str) -> int | None:
    """The uid that owns ``/proc/PID`` (None once the process is gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


# ---- where the suite's time goes: each file's total (setup, call and teardown), printed at the end -----

_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if len(_FILE_SECONDS) < 2:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"the 15 slowest files of {len(_FILE_SECONDS)} ({total:.0f} s in all)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
