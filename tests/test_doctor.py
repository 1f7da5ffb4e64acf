"""``agentcell doctor`` against the real kernel: no mocks, every probe really runs."""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell import doctor
from agentcell.cell import landlock
from agentcell.doctor import cgroupfs, checks, namespaces, report
from agentcell.monitor import kaudit as kernel_audit

AGENTCELL = str(Path(sys.executable).parent / "agentcell")
SRC = str(Path(__file__).resolve().parent.parent / "src")
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a throwaway account")


def run_cli(*args: str, prefix: tuple[str, ...] = (), argv0: tuple[str, ...] = (AGENTCELL,),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *argv0, "doctor", *args], capture_output=True, text=True, cwd="/",
                          env=env or ENV, timeout=120)


def doctor_json(*args: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    p = run_cli("--json", *args, **kw)
    assert p.returncode in (0, 1), p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout
    return p.returncode, json.loads(lines[0])


def by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [i for i in items if i["name"] == name]
    assert len(found) == 1, f"{name} not reported exactly once: {[i['name'] for i in items]}"
    return found[0]


# ---------------------------------------------------------------------------------------------------
# The whole command


def test_json_runs_and_parses() -> None:
    rc, rep = doctor_json()
    assert rep["uid"] == os.geteuid()
    assert rep["root"] == (os.geteuid() == 0)
    names = [c["name"] for c in rep["checks"]]
    for expected in ("kernel", "landlock", "seccomp", "libseccomp", "user namespaces", "cgroups", "audit",
                     "monitor", "nftables", "bwrap", "setfacl"):
        assert expected in names
    for c in rep["checks"] + rep["modes"]:
        assert c["status"] in ("ok", "warn", "missing"), c
        assert c["detail"] and "\n" not in c["detail"], c
        if c["status"] != "ok":
            assert c["fix"] and "\n" not in c["fix"], c
    assert [m["name"] for m in rep["modes"]] == ["self", "agent", "uid", "none", "loopback", "proxy",
                                                  "host-firewall"]
    fw = by_name(rep["modes"], "host-firewall")
    assert fw["works"] == (os.geteuid() == 0 and by_name(rep["checks"], "nftables")["data"]["listed"] is True)
    # Exit status follows the default needs of this user.
    expected_needs = ["agent", "uid", "none"] if os.geteuid() == 0 else ["self", "none"]
    assert rep["needs"] == expected_needs
    assert rep["ready"] == all(by_name(rep["modes"], n)["works"] for n in expected_needs)
    assert rc == (0 if rep["ready"] else 1)


def test_human_table() -> None:
    p = run_cli()
    assert p.returncode in (0, 1), p.stderr
    lines = p.stdout.splitlines()
    assert any(ln.split()[:2] == ["ok", "kernel"] for ln in lines if ln.strip())
    # Every line that is not ok is followed by its fix, indented.
    for i, ln in enumerate(lines):
        words = ln.split()
        if words and words[0] in ("warn", "MISSING"):
            assert lines[i + 1].strip().startswith("fix: "), (ln, lines[i + 1])
    assert lines[-1].startswith(("ready for:", "NOT ready for:"))


def test_need_unknown_value_is_a_usage_error() -> None:
    p = run_cli("--need", "sideways")
    assert p.returncode == 125
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and "sideways" in p.stderr


def test_bad_flag_is_a_usage_error() -> None:
    p = run_cli("--frobnicate")
    assert p.returncode == 125 and len(p.stderr.splitlines()) == 1


def test_need_sets_the_exit_status() -> None:
    _, rep = doctor_json()
    for name in doctor.NEEDABLE_MODES:
        rc, one = doctor_json("--need", name)
        assert one["needs"] == [name] and one["needs_explicit"]
        assert rc == (0 if by_name(rep["modes"], name)["works"] else 1), name
    rc, _ = doctor_json("--need", "self", "--need", "none", "--need", "self")
    assert rc == (0 if all(by_name(rep["modes"], n)["works"] for n in ("self", "none")) else 1)
    if os.geteuid() == 0:
        rc, _ = doctor_json("--need", "agent", "--need", "uid")
        assert rc == 0, "root with working namespaces must be able to run agent/uid cells"


# ---------------------------------------------------------------------------------------------------
# Landlock


def test_landlock_abi_found() -> None:
    lsm = Path("/sys/kernel/security/lsm")
    if lsm.exists() and "landlock" not in lsm.read_text().split(","):
        pytest.skip(f"Landlock is not an active LSM here ({lsm}: {lsm.read_text().strip()})")
    abi = landlock.version()
    assert isinstance(abi, int), f"landlock_create_ruleset version probe failed: {abi}"
    assert abi >= 1
    _, rep = doctor_json()
    ll = by_name(rep["checks"], "landlock")
    assert ll["data"]["abi"] == abi
    assert ll["status"] in ("ok", "warn")
    if abi >= 4:
        assert "TCP rules" in ll["detail"]
    if abi >= 7:
        assert ll["status"] == "ok" and "audit log flags" in ll["detail"]


# ---------------------------------------------------------------------------------------------------
# cgroups


V2_ONLY = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw
25 22 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""

HYBRID = """\
22 1 259:1 / / rw,relatime - ext4 /dev/root rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

V1_ONLY = """\
22 1 259:1 / / rw,relatime - ext4 /dev/root rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/my\\040pids rw,relatime - cgroup cgroup rw,pids,clone_children
"""


def test_the_cgroup_migration_wait_is_named_with_the_mount_option_that_removes_it() -> None:
    slow = cgroupfs.check_cgroup_migration(cgroupfs.parse_cgroup_mounts(HYBRID))
    assert slow.status == "warn" and "remount,favordynmods /sys/fs/cgroup/unified" in slow.fix, slow
    fast_info = HYBRID.replace("cgroup2 cgroup2 rw\n", "cgroup2 cgroup2 rw,favordynmods\n")
    fast = cgroupfs.check_cgroup_migration(cgroupfs.parse_cgroup_mounts(fast_info))
    assert (fast.status, fast.data["favordynmods"]) == ("ok", ["/sys/fs/cgroup/unified"]), fast


def test_no_cgroup_migration_wait_where_pid1_is_born_in_its_group() -> None:
    born = cgroupfs.check_cgroup_migration(cgroupfs.parse_cgroup_mounts(HYBRID), born_in=True)
    assert born.status == "ok" and "v1 groups as a thread" in born.detail, born
    v1_only = cgroupfs.check_cgroup_migration(cgroupfs.parse_cgroup_mounts(V1_ONLY), born_in=True)
    assert v1_only.status == "warn", v1_only  # no v2 group to be born in: the v1 joins decide


def test_the_kernel_here_lets_a_child_be_born_in_a_cgroup() -> None:
    # The probe doctor uses, against this kernel (6.x, clone3 allowed): the launcher's PID 1 path.
    assert cgroupfs.clone_into_cgroup_usable()


def test_cgroup_layout_v2_only() -> None:
    cg = cgroupfs.parse_cgroup_mounts(V2_ONLY)
    assert (cg.layout, cg.unified, cg.v1) == ("v2", "/sys/fs/cgroup", {})


def test_cgroup_layout_hybrid() -> None:
    cg = cgroupfs.parse_cgroup_mounts(HYBRID)
    assert cg.layout == "hybrid"
    assert cg.unified == "/sys/fs/cgroup/unified"
    assert cg.v1 == {"cpu": "/sys/fs/cgroup/cpu,cpuacct", "cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
                     "memory": "/sys/fs/cgroup/memory", "freezer": "/sys/fs/cgroup/freezer",
                     "pids": "/sys/fs/cgroup/pids"}  # name=systemd is a named hierarchy, not a controller


def test_cgroup_layout_v1_only() -> None:
    cg = cgroupfs.parse_cgroup_mounts(V1_ONLY)
    assert cg.layout == "v1" and cg.unified is None
    assert cg.v1 == {"memory": "/sys/fs/cgroup/memory", "pids": "/sys/fs/cgroup/my pids"}


def test_cgroup_layout_none() -> None:
    assert cgroupfs.parse_cgroup_mounts("22 1 259:1 / / rw - ext4 /dev/root rw\n").layout == "none"


def _fs_type(path: str) -> str:
    p = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def test_cgroup_layout_of_this_machine() -> None:
    """The detection agrees with statfs(2) of the cgroup mount points (hybrid on the project's VMs)."""
    if _fs_type("/sys/fs/cgroup") == "cgroup2fs":
        expected = "v2"
    else:
        v1 = any(_fs_type(f"/sys/fs/cgroup/{c}") == "cgroupfs" for c in ("memory", "cpu", "pids", "freezer"))
        v2 = _fs_type("/sys/fs/cgroup/unified") == "cgroup2fs"
        expected = ("hybrid" if v2 else "v1") if v1 else ("v2" if v2 else "none")
    cg = cgroupfs.parse_cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    assert cg.layout == expected
    _, rep = doctor_json()
    data = by_name(rep["checks"], "cgroups")["data"]
    assert data["layout"] == expected
    if expected == "hybrid":
        assert data["unified"] == "/sys/fs/cgroup/unified"
        for c in ("memory", "cpu", "pids", "freezer"):
            if _fs_type(f"/sys/fs/cgroup/{c}") == "cgroupfs":
                assert data["cell_controllers"][c] == "v1", c


# ---------------------------------------------------------------------------------------------------
# Namespaces


def _direct_userns_probe() -> bool:
    """util-linux unshare(1), as uid 65534 when we are root: what a non-root user gets."""
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"] if os.geteuid() == 0 else []
    p = subprocess.run([*drop, "unshare", "--user", "true"], capture_output=True, text=True, cwd="/")
    return p.returncode == 0


def test_userns_probe_agrees_with_a_direct_probe() -> None:
    direct = _direct_userns_probe()
    _, rep = doctor_json()
    check = by_name(rep["checks"], "user namespaces")
    assert check["data"]["probe_ok"] == direct
    restricted = check["data"]["apparmor_restrict_unprivileged_userns"] == 1
    assert (check["status"] == "ok") == (direct and not restricted)
    assert threading.active_count() == 1 and namespaces.thread_count() == 1, "pytest must be single-threaded here"
    assert namespaces.probe_userns().ok == direct


def test_probes_refuse_to_fork_from_a_threaded_process() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        res = namespaces.probe_userns()
    finally:
        stop.set()
        t.join()
    assert not res.ok and not res.probed and "multi-threaded" in res.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="the cell's namespaces without a user namespace need root")
def test_root_namespaces_probe() -> None:
    direct = subprocess.run(["unshare", "--mount", "--pid", "--ipc", "--uts", "--net", "--fork", "true"],
                            capture_output=True, cwd="/").returncode == 0
    assert namespaces.probe_cell_namespaces(rootless=False).ok == direct
    _, rep = doctor_json()
    assert by_name(rep["checks"], "namespaces")["status"] == ("ok" if direct else "missing")


def test_modes_follow_the_probes() -> None:
    ok, bad = namespaces.ProbeResult(True), namespaces.ProbeResult(False, "EPERM: Operation not permitted", errno=1)
    user = {m.name: m for m in report.evaluate_modes(root=False, userns_ok=True, userns_fix="",
                                                     ns_root=None, ns_rootless=ok)}
    assert user["self"].works and user["none"].works and user["loopback"].works
    assert not user["agent"].works and "needs root" in user["agent"].detail
    assert not user["uid"].works and "needs root" in user["uid"].detail
    blocked = {m.name: m for m in report.evaluate_modes(root=False, userns_ok=False, userns_fix="sysctl …",
                                                        ns_root=None, ns_rootless=bad)}
    assert not blocked["self"].works and blocked["self"].fix == "sysctl …"
    assert not blocked["none"].works and blocked["none"].status == "missing"
    root = {m.name: m for m in report.evaluate_modes(root=True, userns_ok=False, userns_fix="x",
                                                     ns_root=ok, ns_rootless=bad)}
    assert root["agent"].works and root["uid"].works and root["none"].works
    assert not root["self"].works


# ---------------------------------------------------------------------------------------------------
# Audit (read-only)


@pytest.mark.skipif(os.geteuid() != 0, reason="reading the audit status needs CAP_AUDIT_CONTROL")
def test_audit_status_is_read_and_left_alone() -> None:
    if not os.path.exists("/proc/self/loginuid"):
        pytest.skip("kernel without audit")
    before = dict(zip(kernel_audit.STATUS_FIELDS, kernel_audit.audit_status(), strict=False))
    assert before["enabled"] in (0, 1, 2)
    _, rep = doctor_json()
    audit = by_name(rep["checks"], "audit")
    assert audit["data"]["enabled"] == before["enabled"]
    assert kernel_audit.audit_enabled() == before["enabled"]
    if shutil.which("auditctl"):
        out = subprocess.run(["auditctl", "-s"], capture_output=True, text=True).stdout
        assert f"enabled {before['enabled']}" in out


# ---------------------------------------------------------------------------------------------------
# As a throwaway non-root user


@pytest.fixture
def doc_user() -> Iterator[pwd.struct_passwd]:
    name = "ac-doc" + secrets.token_hex(2)
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def _as_user_command(u: pwd.struct_passwd) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """runuser + the venv's agentcell when that user can run the venv; else setpriv + the system python
    with agentcell's source on PYTHONPATH (doctor is stdlib-only)."""
    runuser = ("runuser", "-u", u.pw_name, "--")
    probe = subprocess.run([*runuser, sys.executable, "-c", "import agentcell.cli.doctor"],
                           capture_output=True, cwd="/", env=ENV)
    if probe.returncode == 0:
        return runuser, (AGENTCELL,), ENV
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python, f"{u.pw_name} cannot run {sys.executable} and there is no system python3"
    setpriv = ("setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups", "--")
    return setpriv, (python, "-m", "agentcell.cli.main"), dict(ENV, PYTHONPATH=SRC)


@root_only
def test_doctor_as_a_non_root_user(doc_user: pwd.struct_passwd) -> None:
    prefix, argv0, env = _as_user_command(doc_user)
    p = run_cli("--json", prefix=prefix, argv0=argv0, env=env)
    assert p.returncode in (0, 1), p.stderr
    rep = json.loads(p.stdout)
    assert rep["uid"] == doc_user.pw_uid and rep["user"] == doc_user.pw_name and rep["root"] is False
    assert rep["needs"] == ["self", "none"]
    this = by_name(rep["checks"], "user namespaces")
    assert this["data"]["probed_as"] == "self"
    assert this["data"]["probe_ok"] == _direct_userns_probe()
    self_mode = by_name(rep["modes"], "self")
    assert self_mode["works"] == (this["status"] == "ok" and
                                  by_name(rep["checks"], "namespaces (rootless)")["status"] == "ok")
    for name in ("agent", "uid"):
        m = by_name(rep["modes"], name)
        assert m["works"] is False and m["status"] == "missing" and "needs root" in m["detail"], m
    assert "namespaces" not in [c["name"] for c in rep["checks"]]  # root's own probe is not run
    assert by_name(rep["checks"], "audit")["data"]["enabled"] is None
    assert p.returncode == (0 if self_mode["works"] and by_name(rep["modes"], "none")["works"] else 1)
    # --need agent as a non-root user is never satisfied.
    p = run_cli("--json", "--need", "agent", prefix=prefix, argv0=argv0, env=env)
    assert p.returncode == 1


def test_acl_support_is_read_from_the_file_system() -> None:
    # /proc keeps no POSIX ACLs on any kernel: the negative case is real, not simulated.
    assert checks.check_acl_fs("/proc").status == "warn"
    assert checks.check_acl_fs("/proc").fix
    assert checks.check_acl_fs("/tmp").status == ("ok" if _tmp_keeps_acls() else "warn")


def _tmp_keeps_acls() -> bool:
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(dir="/tmp") as f:
        return subprocess.run(["setfacl", "-m", "u:root:r", f.name], capture_output=True).returncode == 0


@root_only
def test_doctor_says_which_monitor_sources_a_user_has(user: Any) -> None:
    as_root = by_name(doctor_json()[1]["checks"], "monitor")["data"]["sources"]
    assert all(v.startswith("on") for v in as_root.values()), as_root
    _, rep = doctor_json(prefix=tuple(user.prefix()))
    mine = by_name(rep["checks"], "monitor")
    assert mine["status"] == "warn" and "sudo" in mine["fix"]
    assert {k for k, v in mine["data"]["sources"].items() if v.startswith("on")} == {"seccomp", "canary"}


def test_the_extras_are_reported_installed_or_with_their_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "EXTRAS", (*checks.EXTRAS, ("nothing", "agentcell-no-such-dist", "nothing at all")))
    got = {c.name: c for c in checks.check_extras()}
    assert got["extra ray"].status == "ok" and got["extra ray"].data["version"], got["extra ray"]  # test.sh installs it
    missing = got["extra nothing"]
    assert missing.status == "warn" and missing.fix.startswith("pip install 'agentcell[nothing]'"), missing
