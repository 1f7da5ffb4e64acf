"""The failed-call source's own programs, on a cgroup of the test's (no cell): what the kernel hands over."""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.monitor import btf, calls

UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def group() -> Iterator[Path]:
    why = calls.check() if os.geteuid() == 0 else "needs root"
    if why:
        pytest.skip(f"the failed-call source cannot run here: {why}")
    if not (UNIFIED / "cgroup.procs").exists():
        pytest.skip("no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    d = UNIFIED / f"agentcell-test-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        yield d
    finally:
        for _ in range(100):  # its processes have been waited for; the kernel lets go of them at once
            try:
                d.rmdir()
                break
            except OSError:
                os.sched_yield()


def test_btf_says_where_a_kernel_structure_keeps_a_member(tmp_path: Path) -> None:
    if not Path(btf.VMLINUX).exists():
        pytest.skip(f"this kernel has no BTF ({btf.VMLINUX})")
    at = btf.member_offset("linux_binprm", "filename")
    assert isinstance(at, int) and 0 < at < 4096
    assert btf.member_offset("linux_binprm", "no_such_member") is None
    assert btf.member_offset("no_such_structure_agentcell", "filename") is None
    (tmp_path / "junk").write_bytes(b"\0" * 64)
    assert btf.member_offset("linux_binprm", "filename", str(tmp_path / "junk")) is None
    assert btf.member_offset("linux_binprm", "filename", str(tmp_path / "absent")) is None


def test_an_exec_is_named_by_its_file_with_its_mode_though_the_process_is_gone(group: Path, tmp_path: Path) -> None:
    setuid = tmp_path / "setuid-true"
    shutil.copy("/usr/bin/true", setuid)
    setuid.chmod(0o4755)
    source = calls.FailedCalls(os.stat(group).st_ino)
    try:
        procs = str(group / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write("0")

        subprocess.run(["/bin/sh", "-c", f"{setuid}; exec /usr/bin/true; exit 3"], preexec_fn=join, check=True)
        subprocess.run(["/bin/true"], check=True)  # (another cgroup's: not handed over)
        got = [(c.name, c.errno, c.comm, c.path, c.flags) for c in source.read()]
    finally:
        source.close()
    modes = [calls.MODE_KNOWN | os.stat(p).st_mode for p in ("/bin/sh", setuid, "/usr/bin/true")]
    assert got == [("execve", 0, "sh", "/bin/sh", modes[0]), ("execve", 0, "setuid-true", str(setuid), modes[1]),
                   ("execve", 0, "true", "/usr/bin/true", modes[2])], got
    assert modes[1] & calls.SETID and not modes[2] & calls.SETID
