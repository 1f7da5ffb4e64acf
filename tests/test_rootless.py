"""`agentcell run` started by a non-root user: identity `self` through a user namespace."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from conftest import AGENTCELL, User, agentcell_run, deny_syscall, needs_root

pytestmark = needs_root  # root is needed only to create the throwaway user


def test_rootless_cell_confines_writes_and_keeps_the_uid(user: User, project: Path) -> None:
    marker = f"agentcell-rootless-{os.getpid()}"
    r = agentcell_run(["--rw", str(project), "--", "sh", "-c",
                       f"id -u; echo in > {project}/in.txt; echo x > /usr/{marker} 2>/dev/null && echo WROTE;"
                       f"echo x > /etc/{marker} 2>/dev/null && echo WROTE; cat /proc/self/uid_map; true"],
                      as_user=user)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == str(user.uid)
    assert "WROTE" not in r.out
    assert lines[1].split() == [str(user.uid), str(user.uid), "1"]  # only our own uid is mapped
    assert (project / "in.txt").read_text() == "in\n"
    assert not os.path.exists(f"/usr/{marker}") and not os.path.exists(f"/etc/{marker}")


def test_rootless_cell_hides_host_and_scrubs_env(user: User) -> None:
    r = agentcell_run(["--", "sh", "-c", "test -e /root && echo ROOT; ls /proc | grep -cE '^[0-9]+$'; env"],
                      as_user=user, env={"ANTHROPIC_API_KEY": "sk-ant-secret"})
    assert r.rc == 0, r.err
    assert "ROOT" not in r.out and "sk-ant-secret" not in r.out
    assert int(r.out.splitlines()[0]) < 6


def test_rootless_cell_has_no_capabilities(user: User) -> None:
    r = agentcell_run(["--", "grep", "-E", "^(CapEff|CapPrm|CapBnd)", "/proc/self/status"], as_user=user)
    assert r.rc == 0, r.err
    assert all(int(line.split()[1], 16) == 0 for line in r.out.splitlines()), r.out


def test_rootless_agent_identity_needs_root(user: User) -> None:
    p = subprocess.run([*user.prefix(), AGENTCELL, "run", "--as", "agent:agent", "--", "true"],
                       capture_output=True, text=True)
    assert p.returncode == 125
    assert "needs root" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_rootless_exit_status_passes_through(user: User) -> None:
    r = agentcell_run(["--", "sh", "-c", "exit 42"], as_user=user)
    assert r.rc == 42


def test_refused_user_namespaces_are_explained(user: User) -> None:
    # unshare(CLONE_NEWUSER) -> EPERM, as on hosts that restrict unprivileged user namespaces
    # (Ubuntu's AppArmor rule, a container runtime's profile).
    deny = deny_syscall(272, errno.EPERM, arg0_mask=0x10000000)
    p = subprocess.run([*user.prefix(), str(Path(AGENTCELL).parent / "python"), "-c", deny, AGENTCELL,
                        "run", "--no-warm", "--", "true"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 123, p.stderr
    assert "user namespaces" in p.stderr and "agentcell doctor" in p.stderr and "Traceback" not in p.stderr


def test_rootless_fd_opened_outside_is_not_inherited(user: User) -> None:
    r_fd, w_fd = os.pipe()
    try:
        code = "import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')))"
        r = agentcell_run(["--", "python3", "-c", code], as_user=user, pass_fds=(w_fd,))
    finally:
        os.close(r_fd)
        os.close(w_fd)
    assert r.out.strip() == "[0, 1, 2, 3]", r.out + r.err


def test_rootless_background_process_dies_with_the_cell(user: User) -> None:
    tag = f"{os.getpid() % 997}.31"
    r = agentcell_run(["--", "sh", "-c", f"setsid sleep {tag} >/dev/null 2>&1 & exit 0"], as_user=user)
    assert r.rc == 0, r.err
    left = [p for p in filter(str.isdigit, os.listdir("/proc"))
            if _cmdline(p)[:2] == [b"sleep", tag.encode()]]
    assert not left


def test_rootless_loopback_and_pid1(user: User) -> None:
    code = ("import socket, os; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1);"
            "c = socket.create_connection(s.getsockname()); print('LOOP', os.path.exists('/proc/1'))")
    r = agentcell_run(["--net", "loopback", "--", "python3", "-c", code], as_user=user)
    assert r.out.strip() == "LOOP False", r.out + r.err


def _cmdline(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def test_rootless_command_cannot_signal_outside_its_cell(user: User) -> None:
    from agentcell.cell import landlock

    if landlock.abi() < 6:
        pytest.skip(f"Landlock ABI {landlock.abi()} has no signal scoping (needs 6, Linux 6.12)")
    # PID 1 has the same uid in rootless mode; only Landlock's scope keeps the command from it.
    r = agentcell_run(["--", "sh", "-c", "kill -0 1 && echo SIGNALLED; true"], as_user=user)
    assert r.rc == 0 and "SIGNALLED" not in r.out, r.out + r.err
