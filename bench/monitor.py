"""Escape-monitor benchmark: attempt-to-frozen latency, and the monitor's overhead on ordinary work.

    .venv/bin/python bench/monitor.py [--attempts N] [--files N] [--rounds N] [--json]

* Latency: N cells per kind of attempt (default 100), each a command that writes the time to a shared
  file and then makes one forbidden attempt: a TCP connect (Landlock denies it in a `--net none` cell:
  the audit stream), a read of a credential in a home the cell does not contain (ENOENT: the
  failed-call source, eBPF), a datagram to an address outside (ENETUNREACH: the same). The monitor (in
  this process, as `agentcell run --monitor` runs it) freezes the cell; latency = freeze time - attempt
  time. p50 and p95 per kind and over all (target p95 <= 50 ms).
* Overhead, the same cells with and without the monitor, interleaved (target <= 5 %), both through
  `Supervised` as `agentcell run` runs them; each workload as timed inside the cell and, apart, the
  whole run (set-up and teardown):
  - files: `find`, `git status` and `tar` over a generated tree of 20,000 files, four times;
  - build: the benign corpus's local part: `make` with cc over 40 C files, a Python import-heavy run
    (as pytest's start), `git add` and `git commit` of the sources.
* Host cost: a system call's time on the host outside every cell (``getppid`` in a loop in C, best of
  five runs, five rounds interleaved), with no cell watched, one, and --cells (default 8) at once:
  every process on the host pays for the program on ``sys_exit``, once however many cells are
  watched (target: the many cost the host no more than the one, within 5 %).
Needs root (a throwaway account ac-bench<hex> is created and removed). No network traffic leaves the
cells (the datagram's address has no route there).
"""
from __future__ import annotations

import argparse
import contextlib
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
           "try:\n    {}\nexcept OSError:\n    pass\ntime.sleep(5)\n")
KINDS = {  # the attempt, and the source that sees it
    "landlock": "socket.create_connection(('127.0.0.1', 1))",
    "calls (file)": "open('/root/.ssh/id_rsa')",
    # 198.18.0.0/15 (benchmarking): no route in the cell, so nothing is sent
    "calls (network)": "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('198.18.0.9', 9))",
}


def latency(spec: CellSpec, work: Path, attempts: int, attempt: str) -> list[float]:
    out = []
    for i in range(attempts):
        stamp = work / f"t{i}"
        cell = spec.replace(cell_id="agentcell-bench" + secrets.token_hex(4))
        sup = Supervised.start(cell, ["python3", "-c", ATTEMPT.format(attempt), str(stamp)], monitor="terminate",
                               stdio=NULLS)
        sup.wait(30)
        watch = sup.monitor
        assert watch is not None
        if watch.frozen_at is None or not stamp.exists():
            raise SystemExit(f"bench/monitor.py: attempt {i} was not frozen ({[e.line() for e in watch.events]})")
        out.append(watch.frozen_at - float(stamp.read_text()))
    return out


def files_workload(tree: Path, repeat: int = 4) -> str:
    """Four passes: one takes about 80 ms here, too short to time a few per cent of it through the noise."""
    once = (f"find {tree} -type f | wc -l >/dev/null; git -C {tree} status --porcelain >/dev/null; "
            f"tar -cf /dev/null -C {tree} .")
    return "; ".join([once] * repeat)


def build_workload(src: Path) -> str:
    return (f"cd {src} && make -s clean >/dev/null && make -s >/dev/null && python3 -c 'import json, email.parser, "
            "http.client, unittest, argparse, decimal, asyncio, sqlite3' && git add -A && "
            "git -c user.name=b -c user.email=b@b.invalid commit -qm build --allow-empty >/dev/null")


def overhead(spec: CellSpec, workload: str, rounds: int) -> dict[str, float]:
    """Medians: the workload as timed inside the cell (date before and after it), and the whole run
    (set-up and teardown included: the monitor's sources, the canaries, the seccomp listener), plain
    and monitored, interleaved."""
    work = f"s=$(date +%s%N); {workload}; echo $(( $(date +%s%N) - s ))"
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
            if r.get("events") or r.get("exit_status"):
                raise SystemExit(f"bench/monitor.py: the clean workload failed or raised {r.get('events')}")
            key = "monitored" if monitored else "plain"
            runs[key].append(inside)
            runs[key + "_total"].append(total)
    return {k: statistics.median(v) for k, v in runs.items()}


SYSCALLS = r"""#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
int main(void) {  /* ns per getppid, best of five runs of a million */
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int i = 0; i < 1000000; i++) syscall(SYS_getppid);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e6;
        if (ns < best) best = ns;
    }
    printf("%.2f\n", best);
    return 0;
}
"""


def host_cost(loop: Path, cells: int) -> float:
    """ns per ``getppid`` (``loop``: SYSCALLS, compiled) in a process outside every cell, while
    ``cells`` cells' failed calls are watched (each a cgroup of its own, as a cell's)."""
    from agentcell.cell.cgroups import ROOT, layout
    from agentcell.monitor.calls import FailedCalls

    v2 = Path(ROOT if layout() == "v2" else f"{ROOT}/unified")
    dirs = [v2 / f"agentcell-bench{secrets.token_hex(4)}" for _ in range(cells)]
    watched = []
    try:
        for d in dirs:
            d.mkdir()
            watched.append(FailedCalls(d.stat().st_ino))
        out = subprocess.run([str(loop)], capture_output=True, text=True, check=True).stdout
        return float(out)
    finally:
        for w in watched:
            w.close()
        for d in dirs:
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()


def make_sources(src: Path, n: int = 40) -> None:
    src.mkdir()
    for i in range(n):
        (src / f"m{i}.c").write_text(f"#include <stdio.h>\n#include <string.h>\nint f{i}(const char *s) "
                                     f"{{ return (int)strlen(s) + {i}; }}\n")
    (src / "main.c").write_text("#include <stdio.h>\nint main(void) { puts(\"ok\"); return 0; }\n")
    objs = " ".join(f"m{i}.o" for i in range(n))
    (src / "Makefile").write_text(f"app: main.o {objs}\n\tcc -o app main.o {objs}\n%.o: %.c\n\tcc -O1 -c $< -o $@\n"
                                  "clean:\n\trm -f *.o app\n")
    subprocess.run(["git", "init", "-q", str(src)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attempts", type=int, default=100)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--cells", type=int, default=8)
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
        make_sources(work / "src")
        subprocess.run(["chown", "-R", name, str(work)], check=True)
        pw = pwd.getpwnam(name)
        ident = resolve_identity(str(pw.pw_uid), euid=0)
        spec = CellSpec(ident, env=build_env({"HOME": ident.home}, ident), rw_paths=(str(work),))
        lat = {kind: sorted(latency(spec, work, args.attempts, attempt)) for kind, attempt in KINDS.items()}
        git_ok = spec.replace(env=(*spec.env, ("GIT_CONFIG_COUNT", "1"), ("GIT_CONFIG_KEY_0", "safe.directory"),
                                   ("GIT_CONFIG_VALUE_0", "*")))
        over = {"files": overhead(git_ok, files_workload(tree), args.rounds),
                "build": overhead(git_ok, build_workload(work / "src"), args.rounds)}
        (work / "loop.c").write_text(SYSCALLS)
        subprocess.run(["cc", "-O2", "-o", str(work / "loop"), str(work / "loop.c")], check=True)
        hosts: dict[int, list[float]] = {n: [] for n in (0, 1, args.cells)}
        for _ in range(5):  # interleaved
            for n, got in hosts.items():
                got.append(host_cost(work / "loop", n))
        host = {n: min(v) for n, v in hosts.items()}
    finally:
        subprocess.run(["userdel", name], check=False)
        shutil.rmtree(work, ignore_errors=True)
    every = sorted(x for v in lat.values() for x in v)
    res: dict[str, object] = {"latency": {kind: _pcts(v) for kind, v in {**lat, "all": every}.items()},
                              "host_ns_per_call": {str(n): v for n, v in host.items()},
                              "host_many_over_one": host[args.cells] / host[1] - 1}
    for wl, o in over.items():
        res[wl] = {"workload_s": o["plain"], "workload_monitored_s": o["monitored"],
                   "overhead": o["monitored"] / o["plain"] - 1, "run_s": o["plain_total"],
                   "run_monitored_s": o["monitored_total"],
                   "run_overhead_ms": 1000 * (o["monitored_total"] - o["plain_total"])}
    if args.json:
        print(json.dumps(res))
        return 0
    for kind, v in {**lat, "all": every}.items():
        p = _pcts(v)
        print(f"attempt -> frozen, {kind}, {len(v)} attempts: p50 {p['p50_ms']:.1f} ms, p95 {p['p95_ms']:.1f} ms "
              f"(target p95 <= 50 ms: {'met' if p['p95_ms'] <= 50 else 'MISSED'}), max {p['max_ms']:.1f} ms")
    for wl, what in (("files", f"find + git status + tar over {args.files} files, 4 times"),
                     ("build", "make with cc over 40 files + python imports + git commit")):
        r = res[wl]
        assert isinstance(r, dict)
        print(f"{what}, in the cell: {r['workload_s']:.3f} s plain, {r['workload_monitored_s']:.3f} s monitored: "
              f"{100 * r['overhead']:+.1f} % (target <= 5 %: {'met' if r['overhead'] <= 0.05 else 'MISSED'}); "
              f"whole run {r['run_s']:.3f} s / {r['run_monitored_s']:.3f} s ({r['run_overhead_ms']:+.1f} ms)")
    many = res["host_many_over_one"]
    assert isinstance(many, float)
    print(f"a system call on the host outside the cells (getppid): {host[0]:.0f} ns with no cell watched, "
          f"{host[1]:.0f} ns with one, {host[args.cells]:.0f} ns with {args.cells}: the {args.cells} cost "
          f"{100 * many:+.1f} % over the one (target <= 5 %: {'met' if many <= 0.05 else 'MISSED'})")
    return 0


def _pcts(v: list[float]) -> dict[str, float]:
    return {"p50_ms": v[len(v) // 2] * 1000, "p95_ms": v[max(0, int(len(v) * 0.95) - 1)] * 1000, "max_ms": v[-1] * 1000}


if __name__ == "__main__":
    sys.exit(main())
