"""Fleet benchmark: sessions per minute on a Ray cluster of 1, 2 and 3 nodes, and what a session costs in
the fleet over a local ``agentcell session start``, side by side in one sitting.

    sudo .venv/bin/python bench/fleet.py [--sessions N] [--cells C] [--rounds R] [--json]

* Throughput: a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head with
  no cells, and 1, 2 or 3 worker nodes of ``--cells`` cells each) runs ``--sessions`` scripted sessions
  (each edits a file and runs it: about as short as a session gets). The peer, in the same round: the
  same sessions as local ``session start`` processes, as many at once as the cluster has cells.
  Reported: sessions per minute, and the fleet's ratio to the local peer.
* Per-session overhead: ``--single`` sessions one after another on a 1-node, 1-cell cluster (one fleet
  run: its result collection included) against as many local ``session start`` one after another;
  the time per session, median over the rounds.

Every node runs on these same 2 cores, so more nodes add cells and Ray processes, not CPUs: the numbers
say what the fleet layer costs, not how a real cluster scales. Needs root; makes a throwaway owner
ac-bf<hex>, /tmp/agentcell-bench-fleet-* and Ray's scratch /tmp/ray-bench-fleet-*; removes them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from agentcell.fleet import cluster as fleet
from agentcell.fleet import node, plan

AGENTCELL = str(Path(sys.executable).parent / "agentcell")
STEPS = "edit app.py 'x = 1' 'x = 2'\nrun python3 app.py\nwrite out.txt done"


def plans(n: int, tag: str) -> list[plan.SessionPlan]:
    return [plan.parse({"name": f"{tag}-{i}", "project": {"files": {"app.py": "x = 1\nprint(x)\n"}},
                        "harness": "scripted", "script": STEPS, "wall_clock_s": 120}) for i in range(n)]


# Ray's own scratch: an ending Ray process may write in it. RAY_TMPDIR too: the cluster writes its address to
# $RAY_TMPDIR/ray/ray_current_cluster whatever temp_dir says (/tmp/ray by default, on no fresh machine).
RAY_TMPDIR = tempfile.mkdtemp(prefix="ray-bench-fleet-")
RAY_TMP = os.path.join(RAY_TMPDIR, "ray")
os.mkdir(RAY_TMP)
os.environ["RAY_TMPDIR"] = RAY_TMPDIR


@contextlib.contextmanager
def cluster_of(nodes: int, cells: int) -> Iterator[None]:
    """A fresh Ray cluster, connected: a head with no cells and ``nodes`` worker nodes of ``cells`` each."""
    c = Cluster()  # the head is added inside the try: one that fails half-way is shut down too
    try:
        c.add_node(num_cpus=0, include_dashboard=False, object_store_memory=80 << 20, temp_dir=RAY_TMP)
        for i in range(nodes):
            c.add_node(num_cpus=2, object_store_memory=80 << 20, resources={fleet.CELLS: cells},
                       labels={fleet.LABEL: f"b{i}"})
        c.wait_for_nodes()
        fleet.connect(c.address)
        yield
    finally:
        ray.shutdown()
        c.shutdown()


def in_fleet(base: Path, owner: str, ps: list[plan.SessionPlan]) -> float:
    """Seconds for ``ps`` on the connected cluster, every session completed."""
    t = time.perf_counter()
    res = fleet.run(ps, run_id=node.new_run_id(), base=str(base), owner=owner, recover_wait_s=0)
    took = time.perf_counter() - t
    bad = [(r["name"], r["status"], r["reason"]) for r in res if r["status"] != "completed"]
    if bad:
        raise SystemExit(f"bench/fleet.py: sessions did not complete: {bad[:3]}")
    return took


def local(work: Path, owner: str, ps: list[plan.SessionPlan], at_once: int) -> float:
    """Seconds for ``ps`` as local ``session start`` processes, ``at_once`` at a time."""
    uid, gid = _ids(owner)
    state = work / "local-state"
    state.mkdir(mode=0o700, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(state)}
    projects = []
    for p in ps:
        d = work / "local" / p.name / secrets.token_hex(2)
        d.mkdir(parents=True)
        (d / "app.py").write_text("x = 1\nprint(x)\n")
        for f in (d, d / "app.py"):
            os.chown(f, uid, gid)
        projects.append((p, d))

    def one(item: tuple[plan.SessionPlan, Path]) -> None:
        p, d = item
        r = subprocess.run([AGENTCELL, "session", "start", "--json", *p.start_args(str(d))], env=env, cwd=d,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if not r.stdout.strip() or json.loads(r.stdout.strip().splitlines()[-1])["status"] != "completed":
            raise SystemExit(f"bench/fleet.py: a local session did not complete: {r.stderr[-300:]}")

    t = time.perf_counter()
    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(one, projects))
    return time.perf_counter() - t


def _ids(name: str) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--cells", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--single", type=int, default=6, help="sessions one at a time, for the per-session overhead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/fleet.py: needs root (sessions make accounts)")
    owner = f"ac-bf{secrets.token_hex(3)}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", owner], check=True)
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-fleet-"))
    os.chmod(work, 0o711)
    rows: dict[str, Any] = {"throughput": [], "single": {}}
    try:
        for r in range(args.rounds):
            for n in (1, 2, 3):
                with cluster_of(n, args.cells):
                    f = in_fleet(work / f"c{r}{n}" / "nodes", owner, plans(args.sessions, f"r{r}n{n}"))
                lo = local(work, owner, plans(args.sessions, f"l{r}n{n}"), n * args.cells)
                rows["throughput"].append({"round": r, "nodes": n, "cells": n * args.cells,
                                           "fleet_per_min": 60 * args.sessions / f,
                                           "local_per_min": 60 * args.sessions / lo})
        fleet_s, local_s = [], []
        with cluster_of(1, 1):
            in_fleet(work / "solo", owner, plans(1, "warm"))  # the node's first Ray worker started, as in use
            for r in range(args.rounds):  # interleaved: a batch in the fleet, a batch local
                fleet_s.append(in_fleet(work / "solo", owner, plans(args.single, f"s{r}")) / args.single)
                local_s.append(local(work, owner, plans(args.single, f"sl{r}"), 1) / args.single)
        rows["single"] = {"fleet_ms": 1000 * statistics.median(fleet_s), "local_ms": 1000 * statistics.median(local_s)}
    finally:
        for state in [*work.glob("*/nodes/*/state"), *work.glob("solo/*/state"), work / "local-state"]:
            subprocess.run([AGENTCELL, "session", "recover"], capture_output=True,
                           env={"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": str(state)})
        subprocess.run(["chattr", "-R", "-i", str(work)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
        subprocess.run(["userdel", owner], capture_output=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.sessions} sessions a round, {args.cells} cells a node, {args.rounds} rounds (medians)")
    print(f"{'nodes':>5} {'cells':>5} {'fleet/min':>10} {'local/min':>10} {'ratio':>6}")
    for n in (1, 2, 3):
        got = [t for t in rows["throughput"] if t["nodes"] == n]
        fm = statistics.median(t["fleet_per_min"] for t in got)
        lm = statistics.median(t["local_per_min"] for t in got)
        print(f"{n:>5} {n * args.cells:>5} {fm:>10.1f} {lm:>10.1f} {fm / lm:>6.2f}")
    s = rows["single"]
    print(f"a session, one at a time: fleet {s['fleet_ms']:.0f} ms, local session start {s['local_ms']:.0f} ms, "
          f"overhead {s['fleet_ms'] - s['local_ms']:+.0f} ms ({s['fleet_ms'] / s['local_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
