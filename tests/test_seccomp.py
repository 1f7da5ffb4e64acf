"""seccomp, the third wall: each denied call fails with its errno inside a real cell."""
from __future__ import annotations

import pytest

from conftest import User, agentcell_run, needs_root

pytestmark = needs_root

PROBE = """
import ctypes, errno, fcntl, sys
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "ptrace": lambda: libc.ptrace(16, 1, 0, 0),                       # PTRACE_ATTACH to PID 1
    "unshare_user": lambda: libc.unshare(0x10000000),
    "clone_newns": lambda: libc.syscall(56, 0x00020000 | 17, 0, 0, 0, 0),
    "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
    "keyctl": lambda: libc.syscall(250, 0, 0, 0, 0),
    "bpf": lambda: libc.syscall(321, 0, 0, 0),
    "perf_event_open": lambda: libc.syscall(298, 0, 0, -1, -1, 0),
    "userfaultfd": lambda: libc.syscall(323, 0),
    "io_uring_setup": lambda: libc.syscall(425, 1, 0),
    "open_by_handle_at": lambda: libc.syscall(304, 0, 0, 0),
    "open_tree": lambda: libc.syscall(428, -100, b"/", 1),
    "clone3": lambda: libc.syscall(435, 0, 0),
    "tiocsti": lambda: libc.ioctl(0, 0x5412, b"x"),
    "tioclinux": lambda: libc.ioctl(0, 0x541C, b"\\x00"),
    "personality_norandomize": lambda: libc.personality(0x0040000),
    "personality_high_bit": lambda: libc.personality(0x80040000),
    "vsock": lambda: libc.socket(40, 1, 0),
    "packet": lambda: libc.socket(17, 3, 0),
    "family_high_bits": lambda: libc.socket(0x100000028, 1, 0),
}
for name, call in calls.items():
    ctypes.set_errno(0)
    rc = call()
    print(name, rc, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
"""

EXPECTED = {name: "EPERM" for name in ("ptrace", "unshare_user", "clone_newns", "mount", "keyctl", "bpf",
                                      "perf_event_open", "userfaultfd", "io_uring_setup", "open_by_handle_at",
                                      "open_tree", "tiocsti", "tioclinux", "personality_norandomize",
                                      "personality_high_bit")}
EXPECTED.update(clone3="ENOSYS", vsock="EAFNOSUPPORT", packet="EAFNOSUPPORT", family_high_bits="EAFNOSUPPORT")


def test_denied_calls_fail_with_their_errno(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--", "python3", "-c", PROBE])
    assert r.rc == 0, r.err
    seen = {line.split()[0]: (line.split()[1], line.split()[2]) for line in r.out.splitlines()}
    for name, err in EXPECTED.items():
        assert seen[name] == ("-1", err), (name, seen[name])


def test_ordinary_work_still_runs(user: User) -> None:
    # fork/exec (clone without namespace flags, clone3 falling back), threads, pipes, plain PER_LINUX,
    # unix/IPv4/IPv6/netlink sockets.
    code = ("import subprocess, threading, ctypes, socket; t = threading.Thread(target=lambda: None); t.start();"
            "t.join(); [socket.socket(f, socket.SOCK_DGRAM).close() for f in (socket.AF_UNIX, socket.AF_INET,"
            " socket.AF_INET6)]; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close();"
            "print(subprocess.run(['sh', '-c', 'echo child | cat'], capture_output=True, text=True).stdout.strip(),"
            " ctypes.CDLL(None).personality(0) >= 0)")
    r = agentcell_run(["--as", str(user.uid), "--", "python3", "-c", code])
    assert r.out.strip() == "child True", r.out + r.err


@pytest.mark.parametrize("nr", [0x40000000 | 39])  # getpid through the x32 ABI
def test_a_foreign_architecture_call_kills_the_process(user: User, nr: int) -> None:
    r = agentcell_run(["--as", str(user.uid), "--", "python3", "-c",
                       f"import ctypes; ctypes.CDLL(None).syscall({nr}); print('SURVIVED')"])
    assert "SURVIVED" not in r.out
    assert r.result["signal"] == 31, r.result  # SIGSYS
