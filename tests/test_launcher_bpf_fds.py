"""Red-team pass on root's warm launcher holding the monitor's host programs (zygote._hold_programs,
monitor/calls.hold): no process in a cell, and none of the cell's account, ever has one of their fds.

Root's launcher listens at a fixed path (/run/agentcell/launcher.sock) that other tests on the machine may
use at the same time: this one runs its own in a private mount namespace with a tmpfs on /run/agentcell
(the launcher's socket and the programs' registry, calls.json, private to it; everything else shared).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import AGENTCELL, User, needs_root

pytestmark = needs_root

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    agentcell, uid = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "agentcell-rt29", "/run/agentcell"], check=True)

    def bpf_holders():
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            kinds = set()
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:  # (one closed since the listing is skipped, not the process: the launcher is busy)
                try:
                    kinds.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            try:
                status = open(f"/proc/{pid}/status").read()
                cgroup = open(f"/proc/{pid}/cgroup").read()
            except OSError:
                continue
            if any(k.startswith("anon_inode:bpf") for k in kinds):
                uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
                out.append({"pid": int(pid), "uids": uids, "in_cell": "/agentcell/" in cgroup})
        return out

    def parent(pid):
        try:
            return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    report = {}
    started = subprocess.run([agentcell, "warm", "start"], capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stderr
        launcher = int(started.stdout.split(" pid ")[1].split(",")[0])
        cell = subprocess.Popen([agentcell, "run", "--json", "--as", uid, "--monitor", "--", "sh", "-c",
                                 "echo up; exec sleep 30"], stdout=subprocess.PIPE, text=True)
        assert cell.stdout.readline() == "up\\n"
        report["holders"] = [h["pid"] for h in json.load(open("/run/agentcell/calls.json"))["holders"]]
        report["launcher"] = launcher
        report["while_watched"] = bpf_holders()
        cell.terminate()
        cell.communicate(timeout=60)
        # An unwatched cell through the launcher, while it still holds the programs: the next one is
        # prepared (forked from the launcher, its identity dropped) and waits for its command.
        plain = subprocess.run([agentcell, "run", "--json", "--as", uid, "--", "true"], capture_output=True,
                               text=True)
        assert plain.returncode == 0, plain.stderr
        for _ in range(100):
            prepared = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if parent(pid) == launcher]
            if prepared:
                break
            time.sleep(0.05)
        report["launcher_children"] = prepared
        report["while_prepared"] = bpf_holders()
        report["holders_after"] = [h["pid"] for h in json.load(open("/run/agentcell/calls.json"))["holders"]]
    finally:
        subprocess.run([agentcell, "warm", "stop"], capture_output=True)
    print(json.dumps(report))
""")


def test_no_cell_and_no_process_of_its_account_holds_the_launchers_bpf_programs(user: User) -> None:
    """HELD. Root's launcher holds the programs (it is in the registry) while a watched cell of the
    account runs and while it has the next cell prepared; every process holding a BPF object then is
    root's and outside every cell's cgroup: the cell's PID 1, its command and the prepared cell's
    processes have none (each child closes every fd it was not given right after its fork)."""
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c", SCRIPT,
                        AGENTCELL, str(user.uid)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.splitlines()[-1])
    assert report["launcher"] in report["holders"] and report["launcher"] in report["holders_after"], report
    assert report["launcher_children"], "a prepared cell waits"
    for phase in ("while_watched", "while_prepared"):
        holders = report[phase]
        assert any(h["pid"] == report["launcher"] for h in holders), (phase, holders)
        bad = [h for h in holders if h["in_cell"] or str(user.uid) in h["uids"] or set(h["uids"]) != {"0"}]
        assert bad == [], (phase, bad)
