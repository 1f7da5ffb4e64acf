"""Session benchmark: what the whole workflow costs over doing its steps by hand, side by side.

    sudo .venv/bin/python bench/session.py [--runs N] [--files N] [--no-warm] [--json]

Three ways of running ``true`` as a fresh least-privilege account on a project of ``--files`` small
files (owned by a throwaway human ac-bh<hex>), alternated run by run in one sitting. The sessions and
the steps by hand each have a project of their own, as alike as two copies: each grants and revokes
ACLs on every file, which moves the files' ctime, and a session's backup reads again only the files
that changed since its last one (the steps by hand would make each session read them all):
  * session: ``agentcell session start --harness shell -- true`` — plan, policy, preflight backup,
    a per-session account with ACL grants, the cell with its escape monitor, teardown, the
    hash-chained audit trail, a LangGraph checkpoint per step;
  * by hand: the same steps as shell commands, without monitor, audit or checkpoints: ``useradd``,
    ``setfacl -R``, ``agentcell snapshot take``, ``agentcell run --as UID --rw P -- true``,
    ``setfacl -R -x``, ``chown`` back, ``userdel``;
  * run: ``agentcell run --as UID --rw P -- true`` for an account that already exists (the floor).
All three run as a user runs them after the README's set-up: root's warm launcher running (started for
the sitting if none runs, stopped after), which the compiled front hands ``session start`` and ``run`` to
(a session's cell is forked there too); ``--no-warm`` runs all three without it (AGENTCELL_WARM=off).
Reported: medians in ms, the session's ratio to each peer, and side by side where each one's time
goes: each step by hand, and a session's time before its first audit record (the interpreter, its
imports, the graph), between records (from the trail's timestamps) and after its last one. Needs
root; everything it makes is named ac-b*/agentcell-bench-* and removed.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENTCELL = str(Path(sys.executable).parent / "agentcell")


def sh(*argv: str) -> None:
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench/session.py: {' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[-300:]}")


def timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return (time.perf_counter() - t) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--no-warm", action="store_true", help="no warm launcher: every command starts Python")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/session.py: needs root (it makes accounts)")
    tag = secrets.token_hex(3)
    human, floor_user = f"ac-bh{tag}", f"ac-bf{tag}"
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-"))
    made_users: list[str] = []
    started_launcher = False
    try:
        if args.no_warm:
            os.environ["AGENTCELL_WARM"] = "off"  # (the steps by hand and the runs inherit it)
        elif subprocess.run([AGENTCELL, "warm", "status"], capture_output=True).returncode != 0:
            sh(AGENTCELL, "warm", "start")
            started_launcher = True
        for u in (human, floor_user):
            made_users.append(u)
            sh("useradd", "-M", "-s", "/usr/sbin/nologin", u)
        uid, gid = int(subprocess.check_output(["id", "-u", human])), int(subprocess.check_output(["id", "-g", human]))
        proj, hand_proj = work / "proj", work / "hand-proj"
        for root in (proj, hand_proj):
            for i in range(args.files):
                d = root / "src" / f"m{i // 100}"
                d.mkdir(parents=True, exist_ok=True)
                (d / f"f{i}.py").write_text(f"x = {i}\n" * 50)
            for p in [root, *root.rglob("*")]:
                os.chown(p, uid, gid)
        work.chmod(0o755)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "SUDO_UID": str(uid),
               "SUDO_GID": str(gid), "AGENTCELL_STATE_DIR": str(work / "state"),
               **({"AGENTCELL_WARM": "off"} if args.no_warm else {}),
               "AUDIT_LOG_PATH": str(work / "state" / "audit.jsonl"), "BACKUP_DIR": str(work / "state" / "backups")}
        (work / "state").mkdir(mode=0o700)

        spans: list[tuple[float, float]] = []  # each timed session's (start, end), for the trail's records

        def session() -> None:
            t = time.time()
            p = subprocess.run([AGENTCELL, "session", "start", "--harness", "shell", "--project", str(proj),
                                "--json", "--", "true"], env=env, cwd=proj, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True)
            spans.append((t, time.time()))
            summary = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
            if p.returncode != 0 or summary.get("status") != "completed":
                raise SystemExit(f"bench/session.py: session failed ({p.returncode}): {p.stderr.strip()[-300:]}")

        steps: dict[str, list[float]] = {}

        def step(name: str, *argv: str) -> None:
            steps.setdefault(name, []).append(timed(lambda: sh(*argv)))

        def by_hand() -> None:
            name = f"ac-bx{secrets.token_hex(3)}"
            made_users.append(name)
            step("useradd", "useradd", "-M", "-s", "/usr/sbin/nologin", name)
            step("setfacl -R -m (grant)", "setfacl", "-R", "-m", f"u:{name}:rwX,d:u:{name}:rwX", str(hand_proj))
            step("snapshot take", AGENTCELL, "snapshot", "take", "--store", str(work / "hand-store"), str(hand_proj))
            agent_uid = subprocess.check_output(["id", "-u", name], text=True).strip()
            step("run --as", AGENTCELL, "run", "--as", agent_uid, "--rw", str(hand_proj), "--", "true")
            step("setfacl -R -x (revoke)", "setfacl", "-R", "-x", f"u:{name},d:u:{name}", str(hand_proj))
            step("find -uid | chown", "find", str(hand_proj), "-uid", agent_uid, "-exec", "chown", f"{uid}:{gid}",
                 "{}", "+")
            step("userdel", "userdel", name)
            made_users.remove(name)

        floor_uid = subprocess.check_output(["id", "-u", floor_user], text=True).strip()

        def run() -> None:
            sh(AGENTCELL, "run", "--as", floor_uid, "--rw", str(proj), "--", "true")

        for fn in (session, by_hand, run):  # warm the page cache and the store once each
            fn()
        spans.clear()
        steps.clear()
        times: dict[str, list[float]] = {"session": [], "by_hand": [], "run": []}
        for _ in range(args.runs):
            for name, fn in (("session", session), ("by_hand", by_hand), ("run", run)):
                times[name].append(timed(fn))
        phases: dict[str, list[float]] = {}
        records = [json.loads(line) for line in (work / "state" / "audit.jsonl").read_text().splitlines()]
        by_session: dict[str, list[dict[str, object]]] = {}
        for r in records:
            by_session.setdefault(str(r["session"]), []).append(r)
        for (t0, t1), recs in zip(spans, list(by_session.values())[1:], strict=True):  # not the warm-up
            ts = [float(r["ts"]) for r in recs]  # type: ignore[arg-type]
            phases.setdefault("(start) -> session.plan", []).append((ts[0] - t0) * 1000)
            for a, b, ta, tb in zip(recs, recs[1:], ts, ts[1:], strict=False):
                phases.setdefault(f"{a['event']} -> {b['event']}", []).append((tb - ta) * 1000)
            phases.setdefault(f"{recs[-1]['event']} -> (exit)", []).append((t1 - ts[-1]) * 1000)
        med = {k: statistics.median(v) for k, v in times.items()}
        out = {"runs": args.runs, "files": args.files, "warm_launcher": not args.no_warm,
               "median_ms": {k: round(v, 1) for k, v in med.items()},
               "session_over_by_hand": round(med["session"] / med["by_hand"], 2),
               "session_over_run": round(med["session"] / med["run"], 2),
               "session_phases_median_ms": {k: round(statistics.median(v), 1) for k, v in phases.items()},
               "by_hand_steps_median_ms": {k: round(statistics.median(v), 1) for k, v in steps.items()}}
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{args.runs} runs, a project of {args.files} files, "
                  f"{'without' if args.no_warm else 'with'} the warm launcher; medians:")
            for k, v in med.items():
                print(f"  {k:8} {v:8.1f} ms")
            print(f"  session / by hand = {out['session_over_by_hand']}x, session / run = {out['session_over_run']}x")
            left = [f"{k:42} {v:8.1f}" for k, v in out["session_phases_median_ms"].items()]
            right = [f"{k:24} {v:8.1f}" for k, v in out["by_hand_steps_median_ms"].items()]
            print(f"  {'a session, between its audit records (ms)':51}   by hand, step by step (ms)")
            for i in range(max(len(left), len(right))):
                print(f"    {left[i] if i < len(left) else '':51} {right[i] if i < len(right) else ''}")
        return 0
    finally:
        if started_launcher:
            subprocess.run([AGENTCELL, "warm", "stop"], capture_output=True)
        for u in made_users:
            subprocess.run(["userdel", u], capture_output=True)
        subprocess.run([AGENTCELL, "session", "recover"], env={"PATH": os.environ.get("PATH", ""),
                       "AGENTCELL_STATE_DIR": str(work / "state")}, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
