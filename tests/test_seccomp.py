"""seccomp, the third wall: each denied call fails with its errno inside a real cell."""
from __future__ import annotations

import shutil
from pathlib import Path

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


SET_ID_PROBE = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(os.environ["WORK"])
open("f", "w").close()
fd = os.open("f", os.O_RDONLY)
calls = {
    "chmod_setuid": lambda: libc.chmod(b"f", 0o4755),
    "chmod_setgid": lambda: libc.chmod(b"f", 0o2755),
    "fchmod_setgid": lambda: libc.fchmod(fd, 0o2755),
    "fchmodat_setuid": lambda: libc.fchmodat(-100, b"f", 0o4755, 0),
    "fchmodat2_setuid": lambda: libc.syscall(452, -100, b"f", 0o4755, 0),
    "creat_setgid": lambda: libc.creat(b"g", 0o2755),
    "open_creat_setuid": lambda: libc.syscall(2, b"h", 0o100 | 1, 0o4755),
    "openat_creat_setgid": lambda: libc.syscall(257, -100, b"i", 0o100 | 1, 0o2755),
    "mknod_setgid": lambda: libc.mknod(b"j", 0o100000 | 0o2755, 0),
    "openat2": lambda: libc.syscall(437, -100, b"f", 0, 0),
    "chmod_plain": lambda: libc.chmod(b"f", 0o1777) if libc.chmod(b"f", 0o755) == 0 else -1,
    "open_plain": lambda: libc.syscall(257, -100, b"k", 0o100 | 1, 0o755),
    "mkdir": lambda: libc.mkdir(b"d", 0o2775),
}
for name, call in calls.items():
    ctypes.set_errno(0)
    rc = call()
    print(name, "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
print("modes", *(oct(os.stat(n).st_mode & 0o7777) for n in ("f", "d")), os.path.exists("g") or os.path.exists("h"))
"""


def test_no_setuid_or_setgid_bit_is_made_in_a_cell(user: User, tmp_path: Path) -> None:
    """The cell's mounts are nosuid, the host's view of the same files is not: a setuid or setgid bit the
    agent sets on a file would lend its uid or gid (and its grant) to anyone on the host who runs it.
    Every call that can set one refuses it; the same calls without those bits work."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.chown(work, user.uid, user.gid)
    r = agentcell_run(["--as", str(user.uid), "--rw", str(work), "--env", f"WORK={work}", "--", "python3", "-c",
                       SET_ID_PROBE])
    assert r.rc == 0, r.err
    seen = dict(line.split(" ", 1) for line in r.out.splitlines())
    refused = ("chmod_setuid", "fchmodat_setuid", "fchmodat2_setuid", "creat_setgid", "open_creat_setuid",
               "openat_creat_setgid", "mknod_setgid")
    assert {k: seen[k] for k in refused} == dict.fromkeys(refused, "EPERM"), seen
    # chmod's setgid bit: a directory's, which chmod keeps, cannot be told from a file's (see seccomp.MODE_CALLS)
    assert (seen["chmod_setgid"], seen["fchmod_setgid"]) == ("ok", "ok")
    assert (seen["openat2"], seen["chmod_plain"], seen["open_plain"], seen["mkdir"]) == ("ENOSYS", "ok", "ok", "ok")
    assert seen["modes"].split()[:2] == ["0o1777", "0o755"] and seen["modes"].endswith("False"), seen["modes"]
    assert not any(p.stat().st_mode & 0o4000 for p in work.iterdir())
