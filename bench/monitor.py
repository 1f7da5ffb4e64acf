"""Escape-monitor benchmark: attempt-to-frozen latency, and the monitor's overhead on file-heavy work.

    .venv/bin/python bench/monitor.py [--attempts N] [--files N] [--json]

* Latency: N cells (default 100), each a command that writes the time to a shared file and then
  makes one forbidden TCP connect (Landlock denies it in a `--net none` cell). The monitor (in this
  process, as `agentcell run --monitor` runs it) freezes the cell; latency = freeze time - attempt
  time. p50 and p95 (target p95 <= 50 ms).
* Overhead: `find`, `git status` and `tar` over a generated tree of 20,000 files in a cell, with and
  without the monitor, interleaved (target <= 5 %), both through `Supervised` as `agentcell run`
  runs them; the workload as timed inside the cell and, apart, the whole run (set-up and teardown).
Needs root (a throwaway account ac-bench<hex> is created and removed). No network traffic.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentcell import CellSpec
from agentcell.policy.resolve import build_env, resolve_identity
from agentcell.supervise import Supervised

NULLS = (os.open(os.devnull, os.O_RDWR),) * 3

ATTEMPT = ("import socket, time, sys\nopen(sys.argv[1], 'w').write(repr(time.time()))\n"
           "try:\n    socket.create_connection(('127.0.0.1', 1))\nexcept OSError:\n    pass\ntime.sleep(5)\n")


def latency(spec: CellSpec, work: Path, attempts: int) -> list[float]:
    out = []
    for i in range(attempts):
        stamp = work / f"t{i}"
        cell = spec.replace(cell_id="agentcell-bench" + secrets.token_hex(4))
        sup = Supervised.start(cell, ["python3", "-c", ATTEMPT, str(stamp)], monitor="terminate", stdio=NULLS)
        sup.wait(30)
        watch = sup.monitor
        assert watch is not None
        if watch.frozen_at is None or not stamp.exists():
            raise SystemExit(f"bench/monitor.py: attempt {i} was not frozen ({[e.line() for e in watch.events]})")
        out.append(watch.frozen_at - float(stamp.read_text()))
    return out


def overhead(spec: CellSpec, tree: Path, rounds: int) -> dict[str, float]:
    """Medians: the workload as timed inside the cell (date before and after it), and the whole run
    (set-up and teardown included: the monitor's sources, the canaries, the seccomp listener), plain
    and monitored, interleaved."""
    work = (f"s=$(date +%s%N); find {tree} -type f | wc -l >/dev/null; git -C {tree} status --porcelain >/dev/null;"
            f" tar -cf /dev/null -C {tree} .; echo $(( $(date +%s%N) - s ))")
    runs: dict[str, list[float]] = {"plain": [], "monitored": [], "plain_total": [], "monitored_total": []}
    for _ in range(rounds):
        for monitored in (False, True):
            cell = spec.replace(cell_id="agentcell-bench" + secrets.token_hex(4))
            r_out, w_out = os.pipe()
            t = time.perf_counter()
            sup = Supervised.start(cell, ["sh", "-c", work], monitor="record" if monitored else None,
                                   stdio=(NULLS[0], w_out, NULLS[2]))
            os.close(w_out)
            r = sup.wait(120)
            total = time.perf_counter() - t
            with os.fdopen(r_out) as f:
                inside = int(f.read().strip()) / 1e9
            if r.get("events"):
                raise SystemExit(f"bench/monitor.py: the clean workload raised {r['events'][0]}")
            key = "monitored" if monitored else "plain"
            runs[key].append(inside)
            runs[key + "_total"].append(total)
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attempts", type=int, default=100)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/monitor.py: needs root")
    name = "ac-bench" + secrets.token_hex(3)
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-mon-", dir="/var/tmp"))
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        work.chmod(0o777)
        tree = work / "tree"
        for i in range(args.files):
            d = tree / f"d{i % 100:02d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i}.txt").write_text(f"file {i}\n")
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
        subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(tree), "-c", "user.name=b", "-c", "user.email=b@b.invalid", "commit", "-qm",
                        "x"], check=True)
        subprocess.run(["chown", "-R", name, str(work)], check=True)
        pw = pwd.getpwnam(name)
        ident = resolve_identity(str(pw.pw_uid), euid=0)
        spec = CellSpec(ident, env=build_env({"HOME": ident.home}, ident), rw_paths=(str(work),))
        lat = sorted(latency(spec, work, args.attempts))
        o = overhead(spec.replace(env=(*spec.env, ("GIT_CONFIG_COUNT", "1"),
                                                     ("GIT_CONFIG_KEY_0", "safe.directory"),
                                                     ("GIT_CONFIG_VALUE_0", "*"))), tree, args.rounds)
    finally:
        subprocess.run(["userdel", name], check=False)
        shutil.rmtree(work, ignore_errors=True)
    p50, p95 = lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.95) - 1] * 1000
    res = {"attempts": len(lat), "p50_ms": p50, "p95_ms": p95, "max_ms": lat[-1] * 1000,
           "workload_s": o["plain"], "workload_monitored_s": o["monitored"],
           "overhead": o["monitored"] / o["plain"] - 1,
           "run_s": o["plain_total"], "run_monitored_s": o["monitored_total"],
           "run_overhead_ms": 1000 * (o["monitored_total"] - o["plain_total"])}
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"attempt -> frozen, {len(lat)} attempts: p50 {p50:.1f} ms, p95 {p95:.1f} ms (target p95 <= 50 ms: "
          f"{'met' if p95 <= 50 else 'MISSED'}), max {lat[-1] * 1000:.1f} ms")
    print(f"find + git status + tar over {args.files} files, in the cell: {o['plain']:.3f} s plain, "
          f"{o['monitored']:.3f} s monitored: {100 * res['overhead']:+.1f} % (target <= 5 %: "
          f"{'met' if res['overhead'] <= 0.05 else 'MISSED'})")
    print(f"whole run incl. set-up and teardown: {o['plain_total']:.3f} s plain, {o['monitored_total']:.3f} s "
          f"monitored ({res['run_overhead_ms']:+.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
