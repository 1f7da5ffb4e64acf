"""Every cell in a cgroup of its own: ceilings hold, hits are reported, nothing is left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentcell.cell import cgroups
from conftest import AGENTCELL, User, agentcell_run, deny_syscall, needs_root

pytestmark = [needs_root, pytest.mark.skipif(cgroups.layout() == "none", reason="no cgroup filesystem mounted")]


def leftovers() -> list[str]:
    found = []
    for base in ("/sys/fs/cgroup", *(str(p) for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir())):
        found += [str(p) for p in Path(base).glob("agentcell*")]
        found += [str(p) for p in Path(base).glob("agentcell*/agentcell*")]  # (which cell holds a parent)
    return found


def test_a_fork_bomb_is_held_at_the_task_limit_and_reported(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--pids", "32", "--timeout", "20", "--", "sh", "-c",
                       "i=0; while [ $i -lt 200 ]; do sleep 5 & i=$((i+1)); done 2>/dev/null; echo spawned"])
    assert r.result["limits_hit"]["pids_limit_hits"] > 0, r.result  # type: ignore[index]
    assert not leftovers()


def test_a_memory_hog_is_oom_killed_at_the_limit_and_reported(user: User) -> None:
    hog = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"
    r = agentcell_run(["--as", str(user.uid), "--memory", "96M", "--timeout", "60", "--", "python3", "-c", hog])
    assert r.result["limits_hit"]["oom_kills"] >= 1, r.result  # type: ignore[index]
    assert r.rc == 128 + 9 and r.result["signal"] == 9
    assert not leftovers()


def test_a_spinner_is_held_near_its_cpu_share(user: User) -> None:
    # 20 % of one core for 1.5 s of wall time is ~0.3 s of CPU by the cell's own accounting; without
    # the ceiling the spinner would use ~1.5 s. The bound is loose on purpose: a ceiling only caps.
    r = agentcell_run(["--as", str(user.uid), "--cpu", "20", "--timeout", "1.5", "--", "python3", "-c",
                       "while True: pass"])
    cpu = r.result["cpu_s"]
    assert r.result["timed_out"] is True
    assert isinstance(cpu, float) and 0.05 < cpu < 0.75, r.result


def test_every_cell_has_a_cgroup_even_without_limits_and_it_goes_away(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--", "cat", "/proc/self/cgroup"])
    assert r.rc == 0, r.err
    assert "agentcell" in r.out or r.out.strip() == "0::/", r.out  # inside its cgroup namespace-less view
    assert r.result["limits_hit"] == {"oom_kills": 0, "pids_limit_hits": 0, "cpu_throttled": 0}
    assert not leftovers()
    records = Path("/run/agentcell/cgroups")
    assert not (records.exists() and any(records.iterdir()))


def in_every_group(cgroup_lines: str, cell_id: str) -> list[str]:
    """The lines of /proc/self/cgroup that do not show the cell's own group where the cell has one (each
    v1 hierarchy agentcell uses, and the unified one)."""
    wanted = {*cgroups.V1_CONTROLLERS, ""}
    return [line for line in cgroup_lines.splitlines()
            if wanted & set(line.split(":")[1].split(",")) and not line.endswith(f"/{cgroups.PARENT}/{cell_id}")]


def test_the_command_is_born_in_every_group_of_its_cell(user: User) -> None:
    # PID 1 is forked into the v2 group (clone3's CLONE_INTO_CGROUP) after C1 joined the v1 groups as a
    # thread (their tasks files): the command, forked by PID 1, is in all of them.
    r = agentcell_run(["--as", str(user.uid), "--", "cat", "/proc/self/cgroup"])
    assert r.rc == 0, r.err
    assert not in_every_group(r.out, str(r.result["cell_id"])), r.out
    assert len(r.out.splitlines()) > 1 or cgroups.layout() == "v2"


def test_where_clone3_is_refused_pid1_joins_its_group_first(user: User) -> None:
    # Container runtimes' seccomp profiles answer clone3 with ENOSYS (libc falls back to clone): C1 then
    # joins the v2 group through cgroup.procs and forks PID 1 as before.
    deny = deny_syscall(435, 38)  # clone3 -> ENOSYS
    p = subprocess.run([sys.executable, "-c", deny, AGENTCELL, "run", "--no-warm", "--json", "--as", str(user.uid),
                        "--", "cat", "/proc/self/cgroup"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    *out, last = p.stdout.rstrip("\n").split("\n")
    cell_id = str(json.loads(last)["cell_id"])
    assert f"0::/{cgroups.PARENT}/{cell_id}" in out and not in_every_group("\n".join(out), cell_id), p.stdout
    assert not [g for g in leftovers_of(cell_id)], "the cell's groups were left behind"


def leftovers_of(cell_id: str) -> list[str]:
    return cgroups.groups_of(cell_id)


@pytest.mark.parametrize(("flag", "value"), [("--memory", "lots"), ("--memory", "10K"), ("--cpu", "0"),
                                             ("--pids", "-1"), ("--limits", "tiny")])
def test_bad_limits_give_one_line(user: User, flag: str, value: str) -> None:
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), flag, value, "--", "true"],
                       capture_output=True, text=True)
    assert p.returncode == 125 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_ops1_profile_sets_outrigger_limits(user: User) -> None:
    p = subprocess.run([AGENTCELL, "run", "--as", str(user.uid), "--limits", "ops1", "--explain", "--", "true"],
                       capture_output=True, text=True)
    assert f"memory {2 << 30} bytes, cpu 50% of a core, pids 64" in p.stdout, p.stdout


V2_HARNESS = """
import sys
from agentcell.cell import cgroups, launch
from agentcell.cell.spec import CellSpec
from agentcell.protect.binds import for_cell
from agentcell.policy.resolve import build_env, resolve_identity
cgroups.ROOT = sys.argv[1]
assert cgroups.layout() == "v2", cgroups.layout()
ident = resolve_identity(sys.argv[2], euid=0)
spec = CellSpec(ident, env=build_env({}, ident))
r = launch.launch(spec, ["cat", "/proc/self/cgroup"], guards=for_cell(spec))
print("RESULT", r.exit_status, r.limits_hit)
running = launch.start(spec, ["sleep", "30"], guards=for_cell(spec))
running.kill()  # through cgroup.kill
r = running.wait(20)
print("KILLED", r.signal, "timed out" if r.timed_out else "at once")
"""


def test_the_cgroup_v2_code_path_on_a_private_cgroup2_mount(user: User) -> None:
    # This host is hybrid (its controllers are bound to v1), so the v2 tree has no memory/cpu/pids:
    # what this proves is the v2 structure — a group per cell, joined before exec, killed as a whole
    # through cgroup.kill, removed afterwards. Limits on v2 need a v2 host.
    mnt = Path(f"/tmp/agentcell-cg2-{os.getpid()}")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "cgroup2", "agentcell-cg2", str(mnt)], check=True)
    try:
        p = subprocess.run([sys.executable, "-c", V2_HARNESS, str(mnt), str(user.uid)], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "0::/agentcell/agentcell-" in p.stdout, p.stdout
        assert "RESULT 0" in p.stdout and "KILLED 9 at once" in p.stdout, p.stdout
        assert not list(mnt.glob("agentcell*")), "the cell's v2 group was left behind"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


def test_ceilings_without_a_cgroup_are_refused_not_ignored(user: User) -> None:
    p = subprocess.run([*user.prefix(), AGENTCELL, "run", "--no-warm", "--memory", "200M", "--", "true"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 125 and "cgroup" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_cells_tmpfs_are_bounded_by_its_memory_ceiling(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--memory", "400M", "--", "df", "-k", "--output=size", "/tmp",
                       "/dev/shm", "/scratch"])
    sizes = [int(x) for x in r.out.split()[1:] if x.isdigit()]
    assert sizes and all(s <= 100 * 1024 for s in sizes), r.out  # a quarter of 400M each


def test_groups_left_by_a_killed_supervisor_are_swept(user: User) -> None:
    import time

    name = "agentcell-stale" + os.urandom(3).hex()
    stale = Path(f"/sys/fs/cgroup/pids/{cgroups.PARENT}/{name}")
    record = Path(cgroups.RECORDS) / name
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(f"{stale}\n")
    stale.mkdir(parents=True)
    old = time.time() - cgroups.STALE_S - 5
    os.utime(record, (old, old))
    try:
        r = agentcell_run(["--as", str(user.uid), "--", "true"])
        assert r.rc == 0, r.err
        assert not stale.exists() and not record.exists()
    finally:
        if stale.exists():
            stale.rmdir()
        if record.exists():
            record.unlink()
