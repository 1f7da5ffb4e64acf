"""Fleet benchmark: sessions per minute on a Ray cluster of 1, 2 and 3 nodes, and what a session costs in
the fleet over a local ``agentcell session start``, side by side in one sitting.

    sudo .venv/bin/python bench/fleet.py [--sessions N] [--cells C] [--rounds R] [--nodes 1,2,3] [--json]

* Throughput: a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head with
  no cells, and 1, 2 or 3 worker nodes of ``--cells`` cells each) runs ``--sessions`` scripted sessions
  (each edits a file and runs it: about as short as a session gets) as one fleet run (``fleet.run`` from
  this process, connected; the cluster's own start and the connection are not measured), twice: the
  job's first run (``new job``: its Ray workers, and each one's session starter, start on the nodes in
  the time measured, as for ``agentcell fleet run``, a job of its own each time) and its second (``warm
  job``: a program that keeps its connection and runs one batch after another, as a training loop does;
  Ray keeps a job's idle workers, and each its starter). Its peers, in the same round, one after the
  other, as many at once as the cluster has cells: the same sessions as local ``session start``
  processes (what a user runs) without a warm launcher (``cold``: each a Python start and LangGraph's
  imports) and with root's (``warm``: the compiled front hands each to the launcher's session starter;
  started for the sitting if none runs, as ``bench/session.py`` does), and as sessions forked by session
  starters of this process (``agentcell.fleet.forkserver``, as a node forks them; the starters started in
  the time measured), without Ray: the fleet against that one is what Ray and the fleet's own steps cost.
  A fleet session makes its project (written as the owner) in the time measured; a local one's is made
  beforehand. Reported: sessions per minute, and the fleet's ratios: a new job against cold local
  sessions, a warm job against warm ones (like against like: nothing started in the time measured).
* Per-session overhead: ``--single`` sessions one after another on a 1-node, 1-cell cluster (one fleet
  run: its result collection included; the node's worker and starter already started) against as many
  local ``session start`` one after another (cold and warm), and as many forked by a started starter;
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
from agentcell.fleet import forkserver, node, plan

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


def launcher_running() -> bool:
    return subprocess.run([AGENTCELL, "warm", "status"], capture_output=True).returncode == 0


def in_fleet(base: Path, owner: str, ps: list[plan.SessionPlan]) -> float:
    """Seconds for ``ps`` on the connected cluster, every session completed."""
    t = time.perf_counter()
    res = fleet.run(ps, run_id=node.new_run_id(), base=str(base), owner=owner, recover_wait_s=0)
    took = time.perf_counter() - t
    bad = [(r["name"], r["status"], r["reason"]) for r in res if r["status"] != "completed"]
    if bad:
        raise SystemExit(f"bench/fleet.py: sessions did not complete: {bad[:3]}")
    return took


def local(work: Path, owner: str, ps: list[plan.SessionPlan], at_once: int, forked: str = "",
          warm_launcher: bool = False) -> float:
    """Seconds for ``ps`` as local ``session start`` processes, ``at_once`` at a time (``warm_launcher``:
    handed to root's warm launcher by the front, else each a Python of its own). ``forked``: each one
    forked by a session starter of this process, as a fleet node runs them, but without Ray; ``fresh``:
    the starters are started in the time measured (as a fleet run's new Ray workers start theirs),
    ``warm``: those of the last call serve."""
    uid, gid = _ids(owner)
    state = work / "local-state"
    state.mkdir(mode=0o700, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(state),
           **({} if warm_launcher else {"AGENTCELL_WARM": "off"})}
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
        argv = ["session", "start", "--json", *p.start_args(str(d))]
        if forked:
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
                forkserver.run(argv, env, str(work), (null.fileno(), out.fileno(), err.fileno()))
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read().decode(), err.read().decode()
        else:
            r = subprocess.run([AGENTCELL, *argv], env=env, cwd=d, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
            stdout, stderr = r.stdout, r.stderr
        if not stdout.strip() or json.loads(stdout.strip().splitlines()[-1])["status"] != "completed":
            raise SystemExit(f"bench/fleet.py: a local session did not complete: {stderr[-300:]}")

    if forked != "warm":
        forkserver.stop_idle()
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
    ap.add_argument("--nodes", default="1,2,3", help="the cluster sizes to measure, comma-separated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench/fleet.py: needs root (sessions make accounts)")
    owner = f"ac-bf{secrets.token_hex(3)}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", owner], check=True)
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-fleet-"))
    os.chmod(work, 0o711)
    rows: dict[str, Any] = {"throughput": [], "single": {}}
    started_launcher = False
    try:
        if not launcher_running():
            subprocess.run([AGENTCELL, "warm", "start"], check=True, capture_output=True)
            started_launcher = True
        for r in range(args.rounds):
            for n in sizes:
                with cluster_of(n, args.cells):
                    f = in_fleet(work / f"c{r}{n}" / "nodes", owner, plans(args.sessions, f"r{r}n{n}"))
                    fw = in_fleet(work / f"c{r}{n}" / "nodes", owner, plans(args.sessions, f"w{r}n{n}"))
                lo = local(work, owner, plans(args.sessions, f"l{r}n{n}"), n * args.cells)
                lw = local(work, owner, plans(args.sessions, f"lw{r}n{n}"), n * args.cells, warm_launcher=True)
                fo = local(work, owner, plans(args.sessions, f"f{r}n{n}"), n * args.cells, forked="fresh")
                rows["throughput"].append({"round": r, "nodes": n, "cells": n * args.cells,
                                           "fleet_per_min": 60 * args.sessions / f,
                                           "fleet_warm_job_per_min": 60 * args.sessions / fw,
                                           "local_per_min": 60 * args.sessions / lo,
                                           "local_warm_per_min": 60 * args.sessions / lw,
                                           "forked_per_min": 60 * args.sessions / fo})
        one_by_one: dict[str, list[float]] = {"fleet": [], "local": [], "local_warm": [], "forked": []}
        with cluster_of(1, 1):
            in_fleet(work / "solo", owner, plans(1, "warm"))  # the node's Ray worker and its starter started
            local(work, owner, plans(1, "fwarm"), 1, forked="fresh")  # as the fleet's: started
            for r in range(args.rounds):  # interleaved: a batch in the fleet, a batch local, a batch forked
                one_by_one["fleet"].append(in_fleet(work / "solo", owner, plans(args.single, f"s{r}")))
                one_by_one["local"].append(local(work, owner, plans(args.single, f"sl{r}"), 1))
                one_by_one["local_warm"].append(local(work, owner, plans(args.single, f"sw{r}"), 1, warm_launcher=True))
                one_by_one["forked"].append(local(work, owner, plans(args.single, f"sf{r}"), 1, forked="warm"))
        rows["single"] = {f"{k}_ms": 1000 * statistics.median(v) / args.single for k, v in one_by_one.items()}
    finally:
        for state in [*work.glob("*/nodes/*/state"), *work.glob("solo/*/state"), work / "local-state"]:
            subprocess.run([AGENTCELL, "session", "recover"], capture_output=True,
                           env={"PATH": os.environ["PATH"], "AGENTCELL_STATE_DIR": str(state)})
        subprocess.run(["chattr", "-R", "-i", str(work)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
        subprocess.run(["userdel", owner], capture_output=True)
        if started_launcher:
            subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.sessions} sessions a round, {args.cells} cells a node, {args.rounds} rounds (medians), sessions a "
          "minute; fleet: a Ray job's first run (new) and its second (warm job); local: as many `session start` "
          "processes at once as the cluster has cells, each a Python of its own (cold) or handed to root's warm "
          "launcher (warm); forked: each forked by a session starter as a fleet node does, without Ray")
    print(f"{'nodes':>5} {'cells':>5} {'fleet new':>10} {'fleet warm':>10} {'local cold':>10} {'local warm':>10} "
          f"{'forked':>8} {'new/cold':>9} {'warm/warm':>9} {'new/forked':>10}")
    for n in sizes:
        got = [t for t in rows["throughput"] if t["nodes"] == n]
        fm, fw, lm, lw, km = (statistics.median(t[f"{k}_per_min"] for t in got)
                              for k in ("fleet", "fleet_warm_job", "local", "local_warm", "forked"))
        print(f"{n:>5} {n * args.cells:>5} {fm:>10.1f} {fw:>10.1f} {lm:>10.1f} {lw:>10.1f} {km:>8.1f} "
              f"{fm / lm:>9.2f} {fw / lw:>9.2f} {fm / km:>10.2f}")
    s = rows["single"]
    print(f"a session, one at a time (the node's worker and starter up): fleet {s['fleet_ms']:.0f} ms, local session "
          f"start {s['local_ms']:.0f} ms cold ({s['fleet_ms'] / s['local_ms']:.2f}x), {s['local_warm_ms']:.0f} ms "
          f"warm ({s['fleet_ms'] / s['local_warm_ms']:.2f}x), forked without Ray {s['forked_ms']:.0f} ms "
          f"({s['fleet_ms'] / s['forked_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
