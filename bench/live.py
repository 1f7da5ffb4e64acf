"""Live cell benchmark: a command in an already running cell against a cold bubblewrap start, side by
side in one sitting, command `true`.

    .venv/bin/python bench/live.py [--runs N] [--json]

Measures (medians, milliseconds; ratios to bwrap measured in the same sitting):
  * bwrap --unshare-all with binds equivalent to agentcell's (bench/launch.py's configuration);
  * LiveCell.exec(["true"]) in one cell opened once (Cell.open), with its escape monitor (terminate)
    and without one;
  * the exec server alone, for scale: a live cell without monitor whose exec server this process
    drives itself (no cell host, no client thread: what those add is the difference to the row
    above it; ``true``'s own start in the cell is most of what remains);
  * 8 in flight: 8 threads each running `true` at once, the wall time of the batch, against 8 bwraps
    started at once.
The one-at-a-time rows are measured in --rounds rounds, each a block of every kind in turn, so a drift
of the machine over the sitting falls on all of them alike. Target (issue 29): a monitored live exec
<= 0.2x a cold bwrap start (issue 14 asked 0.3x). Needs root (a throwaway account ac-bench<hex> is
created and removed) and bwrap.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import bwrap_argv, median_ms, need_root_and_bwrap, throwaway_account  # noqa: E402

if TYPE_CHECKING:
    from agentcell.api import LiveCell


def batch_ms(one: Callable[[], object], n: int, runs: int) -> float:
    """Median wall time of ``n`` calls of ``one`` started at once from ``n`` threads."""
    def batch() -> None:
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return median_ms(batch, runs)


def interleaved(kinds: dict[str, Callable[[], object]], runs: int, rounds: int) -> dict[str, Any]:
    """The median of ``runs`` calls of each kind, measured in ``rounds`` blocks of every kind in turn
    (after one warm-up call each); ``bwrap_rounds``: bwrap's median in each round, the sitting's drift."""
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    per_round: list[str] = []
    for fn in kinds.values():
        fn()
    for r in range(rounds):
        n = runs // rounds + (1 if r < runs % rounds else 0)
        for key, fn in kinds.items():
            took = []
            for _ in range(n):
                t = time.perf_counter()
                fn()
                took.append(time.perf_counter() - t)
            samples[key] += took
            if key == "bwrap":
                per_round.append(f"{statistics.median(took) * 1000:.2f}")
    return {**{k: statistics.median(v) * 1000 for k, v in samples.items()}, "bwrap_rounds": " ".join(per_round)}


class ExecServer:
    """A live cell without monitor made in this process, whose exec server's channel this process drives
    itself: no cell host, no client. For scale only: a command's way through them is what it skips."""

    def __init__(self, spec: Any, null: int) -> None:
        from agentcell.cell.execd import encoded
        from agentcell.supervise import Supervised

        self.null = null
        self.sup = Supervised.start(spec, [], monitor=None, stdio=(null, null, null), live=True)
        self.channel = self.sup.running.live
        self.env, self.cwd = encoded(spec.environ()), spec.cwd or spec.identity.home
        self.rid = 0

    def true(self) -> None:
        self.rid += 1
        self.channel.exec(self.rid, ["true"], self.env, self.cwd, {0: self.null, 1: self.null, 2: self.null})
        while True:
            select.select([self.channel], [], [])
            reports = self.channel.reports()
            if reports is None:
                raise SystemExit("bench/live.py: the exec server's cell ended")
            if reports:
                return

    def __enter__(self) -> ExecServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.sup.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=60, help="of each kind, one at a time")
    ap.add_argument("--rounds", type=int, default=6, help="blocks of every kind in turn")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    need_root_and_bwrap("bench/live.py")
    from agentcell import Cell, CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity

    res: dict[str, Any] = {}
    with throwaway_account() as pw:
        ident = resolve_identity(str(pw.pw_uid), euid=0)
        spec = CellSpec(ident, env=build_env({"LANG": "C.UTF-8"}, ident), cwd=ident.home)
        bw = bwrap_argv(pw.pw_uid, pw.pw_gid, ident.home)
        null = os.open(os.devnull, os.O_RDWR)
        run_bw = lambda: subprocess.run(bw, check=True)  # noqa: E731
        # (first: the cell is made by this process, which must have no thread yet; Cell.open's client has one)
        with ExecServer(spec, null) as alone, Cell.open(spec, monitor="terminate") as watched, \
                Cell.open(spec, monitor=None) as plain:
            def one(c: LiveCell) -> Callable[[], object]:
                return lambda: c.spawn(["true"], stdin=null, stdout=null, stderr=null).wait()

            kinds: dict[str, Callable[[], object]] = {
                "bwrap": run_bw, "live_exec": one(watched), "live_exec_no_monitor": one(plain),
                "live_exec_captured": lambda: watched.exec(["true"]), "exec_server_alone": alone.true}
            res.update(interleaved(kinds, args.runs, args.rounds))
            res["bwrap_8_in_flight"] = batch_ms(run_bw, 8, max(5, args.runs // 4))
            res["live_8_in_flight"] = batch_ms(one(watched), 8, max(5, args.runs // 4))
    ratios = {key: res[key] / res["bwrap"] for key in
              ("live_exec", "live_exec_no_monitor", "live_exec_captured", "exec_server_alone")}
    ratios["live_8_in_flight"] = res["live_8_in_flight"] / res["bwrap_8_in_flight"]
    targets = {"live_exec": 0.2}
    if args.json:
        print(json.dumps({"median_ms": res, "ratio_to_bwrap": ratios, "targets": targets}))
        return 0
    print(f"`true`, median of {args.runs} runs of each in {args.rounds} interleaved rounds (ms; bwrap's per round: "
          f"{res['bwrap_rounds']}), ratio to bwrap in the same sitting")
    print(f"  {'bwrap --unshare-all (equivalent binds)':<50}{res['bwrap']:7.2f}")
    print(f"  {'8 bwraps at once (wall)':<50}{res['bwrap_8_in_flight']:7.2f}")
    rows = [("live_exec", "live cell exec, monitored (stdio /dev/null)"),
            ("live_exec_no_monitor", "live cell exec, no monitor"),
            ("live_exec_captured", "live cell exec, output captured (LiveCell.exec)"),
            ("exec_server_alone", "  for scale: the exec server alone (no host)"),
            ("live_8_in_flight", "8 live execs at once (wall; ratio to 8 bwraps)")]
    for key, label in rows:
        target = targets.get(key)
        verdict = f"  target <= {target:.1f}x: {'met' if ratios[key] <= target else 'MISSED'}" if target else ""
        print(f"  {label:<50}{res[key]:7.2f}  {ratios[key]:5.2f}x{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
