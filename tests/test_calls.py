"""The failed-call source's own programs, on a cgroup of the test's (no cell): what the kernel hands over."""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentcell import hostfs
from agentcell.monitor import bpf, btf, callprog, calls, pidns

UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def groups() -> Iterator[Callable[[], Path]]:
    """Makes cgroup v2 directories of the test's, removed at its end."""
    why = calls.check() if os.geteuid() == 0 else "needs root"
    if why:
        pytest.skip(f"the failed-call source cannot run here: {why}")
    if not (UNIFIED / "cgroup.procs").exists():
        pytest.skip("no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    made: list[Path] = []

    def make() -> Path:
        d = UNIFIED / f"agentcell-test-{secrets.token_hex(4)}"
        made.append(d)
        d.mkdir()
        return d

    try:
        yield make
    finally:
        calls.settle()  # (what the test closed is out of the maps, and the programs let go, before the next)
        for d in made:
            for _ in range(100):  # its processes have been waited for; the kernel lets go of them at once
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    os.sched_yield()


@pytest.fixture
def group(groups: Callable[[], Path]) -> Path:
    return groups()


def _in(group: Path) -> Callable[[], None]:
    def join() -> None:
        with open(group / "cgroup.procs", "w") as f:
            f.write("0")
    return join


def _fail_open(group: Path, path: str) -> None:
    subprocess.run(["/bin/cat", path], preexec_fn=_in(group), stderr=subprocess.DEVNULL, check=False)


def _opens(source: calls.FailedCalls) -> list[str]:
    return [c.path for c in source.read() if c.name in ("open", "openat")]


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
        subprocess.run(["/bin/sh", "-c", f"{setuid}; exec /usr/bin/true; exit 3"], preexec_fn=_in(group), check=True)
        subprocess.run(["/bin/true"], check=True)  # (another cgroup's: not handed over)
        got = [(c.name, c.errno, c.comm, c.path, c.flags) for c in source.read() if c.name != "exit"]
    finally:
        source.close()
    modes = [callprog.MODE_KNOWN | os.stat(p).st_mode for p in ("/bin/sh", setuid, "/usr/bin/true")]
    assert got == [("execve", 0, "sh", "/bin/sh", modes[0]), ("execve", 0, "setuid-true", str(setuid), modes[1]),
                   ("execve", 0, "true", "/usr/bin/true", modes[2])], got
    assert modes[1] & callprog.SETID and not modes[2] & callprog.SETID


def _links(source: calls.FailedCalls) -> tuple[str, ...]:
    assert source.host is not None
    ids = source.host.ids()
    return ids["calls_link"], ids["exec_link"], ids["fork_link"], ids["exit_link"]


def _gone(link: str) -> bool:
    try:
        os.close(bpf.link_by_id(int(link.split(":")[1])))
        return False
    except OSError as e:
        assert e.errno == errno.ENOENT, e
        return True


def test_cells_share_one_program_and_each_gets_only_its_own_calls(groups: Callable[[], Path]) -> None:
    a, b = groups(), groups()
    first = calls.FailedCalls(os.stat(a).st_ino)
    try:
        second = calls.FailedCalls(os.stat(b).st_ino)
        try:
            assert second.host is first.host  # one program on sys_exit, however many cells
            _fail_open(a, "/nonexistent-agentcell-a")
            _fail_open(b, "/nonexistent-agentcell-b")
            assert _opens(first) == ["/nonexistent-agentcell-a"]
            assert _opens(second) == ["/nonexistent-agentcell-b"]
        finally:
            second.close()
        _fail_open(b, "/nonexistent-agentcell-b")  # (b is not watched any more: nobody's)
        _fail_open(a, "/nonexistent-agentcell-a2")
        assert _opens(first) == ["/nonexistent-agentcell-a2"]
        links = _links(first)
    finally:
        first.close()
    calls.settle()  # (a cell's rings leave the maps, and the programs their last user, after its end)
    assert all(_gone(link) for link in links)  # the last cell's close detached the programs


HOLDER = """
import sys
from agentcell.monitor import calls
source = calls.FailedCalls(int(sys.argv[1]))
print(*source.host.ids().values(), flush=True)
sys.stdin.read()
"""


def test_a_monitor_in_another_process_joins_the_programs_and_outlives_their_maker(groups: Callable[[], Path]) -> None:
    a, b, c = groups(), groups(), groups()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(os.stat(a).st_ino)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        theirs = holder.stdout.readline().split()
        assert len(theirs) == 7, theirs
        joined = calls.FailedCalls(os.stat(b).st_ino)
    finally:
        holder.kill()  # as a supervisor is killed: nothing of its own is closed by it
        holder.wait()
    try:
        assert _links(joined) == tuple(theirs[:4])  # its very links (taken with pidfd_getfd)
        a.rmdir()  # the killed monitor's cell has ended too; its ring is still in the programs' map
        _fail_open(b, "/nonexistent-agentcell-b")
        assert _opens(joined) == ["/nonexistent-agentcell-b"]  # still attached: this process holds it
        assert joined.host is not None
        keys = set(bpf.map_keys(joined.host.cells, 8))
        assert struct.pack("<Q", os.stat(b).st_ino) in keys
        assert len(keys) == 2, keys  # the killed one's, left in
        third = calls.FailedCalls(os.stat(c).st_ino)  # a new cell sweeps out the rings of cgroups gone
        try:
            assert set(bpf.map_keys(joined.host.cells, 8)) == {struct.pack("<Q", os.stat(p).st_ino) for p in (b, c)}
        finally:
            third.close()
        links = _links(joined)
    finally:
        joined.close()
    calls.settle()
    assert all(_gone(link) for link in links)


def test_each_task_that_starts_or_ends_comes_with_its_number_in_the_cells_pid_namespace(group: Path) -> None:
    if calls.part(calls.kernel_layout(), calls.TASK_FIELDS) is None:
        pytest.skip("this kernel's BTF does not say where a task keeps its pid")
    source = calls.FailedCalls(os.stat(group).st_ino)
    try:  # in a pid namespace of its own: sh is 1, the two trues 2 and 3; then a look for 3's /proc entry
        subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "/bin/sh", "-c",
                        "/bin/true; /bin/true; exec /bin/cat /proc/3/stat"], preexec_fn=_in(group),
                       stderr=subprocess.DEVNULL, check=False)
        failed = [c for c in source.read() if c.name in ("open", "openat")]
        tasks = source.read_tasks()
        lost = source.tasks_dropped()
    finally:
        source.close()
    # unshare's fork (1, the shell, then cat), the two trues; each ends; unshare itself ends, in the host's
    inside = [(t.kind, t.number) for t in tasks if t.number < 100]
    assert inside == [(pidns.FORK, 1), (pidns.FORK, 2), (pidns.EXIT, 2), (pidns.FORK, 3), (pidns.EXIT, 3),
                      (pidns.EXIT, 1)], tasks
    assert [t.ktime for t in tasks] == sorted(t.ktime for t in tasks) and lost == 0
    assert [c.path for c in failed] == ["/proc/3/stat"]
    gone = next(t for t in tasks if (t.kind, t.number) == (pidns.EXIT, 3))
    assert gone.ktime < failed[0].ktime and gone.tid == gone.tgid > 3  # (its host tid)


def test_a_listed_holder_whose_pid_is_another_process_now_is_never_asked_for_its_fds(
        groups: Callable[[], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from agentcell.monitor import hostprog

    other = subprocess.Popen(["sleep", "30"])  # (a process of ours, not a holder: as a reused pid would be)
    asked: list[int] = []
    real = hostprog._pidfd_getfd
    monkeypatch.setattr(hostprog, "_pidfd_getfd", lambda pidfd, fd: asked.append(fd) or real(pidfd, fd))
    try:
        with hostprog._registry() as holders:
            holders.append({"pid": other.pid, "start": 1, "version": calls._version(),
                            "fds": {name: [0, "map_id:1"] for name in hostprog.SHARED}})
        source = calls.FailedCalls(os.stat(groups()).st_ino)
        try:
            assert asked == []
            with hostprog._registry() as holders:
                pids = [h["pid"] for h in holders]  # (another live holder of the machine's may be listed too)
                assert other.pid not in pids and os.getpid() in pids  # (the stale one dropped)
        finally:
            source.close()
    finally:
        other.kill()
        other.wait()


def test_programs_no_holder_list_names_are_detached_at_once(groups: Callable[[], Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from agentcell.monitor import hostprog

    made: list[str] = []
    create = calls._attached

    def remembered() -> dict[str, int]:
        fds = create()
        made.extend(bpf.object_id(fds[name]) for name in ("calls_link", "exec_link", "fork_link", "exit_link"))
        return fds

    monkeypatch.setattr(calls, "_attached", remembered)
    calls.settle()  # (an earlier test's cell, closed, lets go of the programs in a thread of its own)
    stale = Path(hostfs.run_dir()) / f"calls.json.{2 ** 22 + 1}"  # a writer killed mid-write (no such pid)
    stale.write_text("{")
    # As a process that holds none: this one may still hold an earlier test's (put back after)
    monkeypatch.setattr(hostprog, "_host", None)
    monkeypatch.setattr(hostprog, "_users", 0)
    # the list of holders cannot be written (a full /run): nobody could find these programs to share them
    monkeypatch.setattr(hostprog, "_boot", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        calls.FailedCalls(os.stat(groups()).st_ino)
    assert len(made) == 4 and all(made) and hostprog._host is None
    assert all(_gone(link) for link in made)
    assert not [p for p in os.listdir("/run/agentcell") if p.startswith("calls.json.")]
