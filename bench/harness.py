"""Harness benchmark: each real harness CLI through a whole agentcell session, against the same CLI run
directly, side by side, against the same scripted model endpoint.

    sudo .venv/bin/python bench/harness.py [--runs N] [--harness H ...] [--json]

Per harness (installed as the tests install them: tests/harnesses.py), alternated run by run in one
sitting, a 3-turn script (a shell command, another, a text answer) on a fake internet of its own:
  * session: ``agentcell session start --harness H --api-base http://model.test:8080 … -- PROMPT``:
    plan, policy, backup, a per-session account, the cell with its monitor and proxy, teardown, audit;
  * direct: the same launch line, environment and settings files, run as a throwaway account in a
    fresh home on the host, straight to the endpoint's address (no cell, no proxy, no monitor).
Reported: medians of the time to the model's first request and of the whole run, and the session's
ratio to the direct run. Needs root; everything it makes is named ac-b*/agentcell-* and removed.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from agentcell.harness import profiles  # noqa: E402
from agentcell.harness.check import MODEL, MODEL_PORT, Rig  # noqa: E402
from harnesses import PINS, Unavailable, bin_dir, session_env  # noqa: E402

AGENTCELL = str(Path(sys.executable).parent / "agentcell")
STEPS = [{"shell": "echo bench > BENCH.txt && cat BENCH.txt"}, {"shell": "wc -c BENCH.txt"}, {"text": "Done."}]
PROMPT = "Write BENCH.txt and count its bytes."
KEYS = {"ANTHROPIC_API_KEY": "sk-ant-bench", "OPENAI_API_KEY": "sk-bench", "GEMINI_API_KEY": "gm-bench",
        "COPILOT_PROVIDER_API_KEY": "cp-bench"}


def first_request(rig: Rig, since: float) -> float | None:
    ts = [r["ts"] for r in rig.requests() if r.get("api") not in ("http", "count")]
    return min(ts) - since if ts else None


def via_session(rig: Rig, name: str, bindir: Path, work: Path, human: tuple[int, int]) -> tuple[float, float | None]:
    project = Path(tempfile.mkdtemp(prefix="agentcell-bench-p-", dir=work))
    state = Path(tempfile.mkdtemp(prefix="agentcell-bench-s-", dir=work))
    os.chown(project, *human)
    env = {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(state),
           **KEYS}
    rig.serve(STEPS, fenced=profiles.PROFILES[name].fenced)
    t0 = time.time()
    p = subprocess.run([AGENTCELL, "session", "start", "--harness", name, "--project", str(project), *rig.flags(),
                        *session_env(name), "--json", "--", PROMPT], env=env, cwd=project, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=600)
    total = time.time() - t0
    if not (project / "BENCH.txt").exists():
        raise SystemExit(f"bench/harness.py: {name} in a session did not run its turn: {p.stderr[-800:]}")
    subprocess.run([AGENTCELL, "session", "recover"], env=env, capture_output=True)
    shutil.rmtree(project, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    return total, first_request(rig, t0)


def direct(rig: Rig, name: str, bindir: Path, work: Path, user: tuple[int, int]) -> tuple[float, float | None]:
    home = Path(tempfile.mkdtemp(prefix="agentcell-bench-h-", dir=work))
    project = Path(tempfile.mkdtemp(prefix="agentcell-bench-p-", dir=work))
    seed = Path(tempfile.mkdtemp(prefix="agentcell-bench-seed-", dir=work))
    prof = profiles.PROFILES[name]
    launch = profiles.launch(prof, [PROMPT], seed_dir=str(seed),
                             api_base=f"http://{rig.addr}:{MODEL_PORT}", model=MODEL, secrets=tuple(KEYS),
                             search_path=f"{bindir}:/usr/bin:/bin")
    for f in launch.files:
        dest = seed / "home" / f.path if f.home else seed / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.content)
    subprocess.run(["chmod", "-R", "a+rX", str(seed)], check=True)
    for d in (home, project):
        os.chown(d, *user)
    env = {"PATH": launch.path or "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "USER": "bench",
           "LANG": "C.UTF-8", "TERM": "dumb", **{launch.renames.get(k, k): v for k, v in KEYS.items()},
           **launch.env}
    for extra in session_env(name)[1::2]:
        k, _, v = extra.partition("=")
        env[k] = v
    rig.serve(STEPS, fenced=prof.fenced)
    t0 = time.time()
    subprocess.run(["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", "--", *launch.argv],
                   env=env, cwd=project, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    total = time.time() - t0
    if not (project / "BENCH.txt").exists():
        raise SystemExit(f"bench/harness.py: {name} run directly did not run its turn")
    for d in (home, project, seed):
        shutil.rmtree(d, ignore_errors=True)
    return total, first_request(rig, t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--harness", action="append", choices=sorted(PINS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/harness.py: needs root (sessions make accounts; the fake internet is a netns)")
    tag = secrets.token_hex(3)
    user = f"ac-bh{tag}"
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-"))
    os.chmod(work, 0o755)
    subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", user], check=True)
    rig = None
    rows = []
    try:
        import pwd

        pw = pwd.getpwnam(user)
        ids = (pw.pw_uid, pw.pw_gid)
        rig = Rig(str(work))
        for name in args.harness or sorted(PINS):
            try:
                bindir = bin_dir(name)
            except Unavailable as e:
                print(f"{name}: skipped ({e})", file=sys.stderr)
                continue
            times: dict[str, list[tuple[float, float | None]]] = {"session": [], "direct": []}
            for _ in range(args.runs):
                times["direct"].append(direct(rig, name, bindir, work, ids))
                times["session"].append(via_session(rig, name, bindir, work, ids))

            def med(kind: str, i: int, t: dict[str, list[tuple[float, float | None]]] = times) -> float:
                return statistics.median(x[i] for x in t[kind] if x[i] is not None)

            row = {"harness": name, "runs": args.runs,
                   "first_request_s": {"session": med("session", 1), "direct": med("direct", 1)},
                   "total_s": {"session": med("session", 0), "direct": med("direct", 0)}}
            row["ratio_first"] = row["first_request_s"]["session"] / row["first_request_s"]["direct"]
            row["ratio_total"] = row["total_s"]["session"] / row["total_s"]["direct"]
            rows.append(row)
            print(f"{name:<12} first request: session {row['first_request_s']['session']:6.2f} s  direct "
                  f"{row['first_request_s']['direct']:6.2f} s  ({row['ratio_first']:.2f}x)   whole 3 turns: session "
                  f"{row['total_s']['session']:6.2f} s  direct {row['total_s']['direct']:6.2f} s  "
                  f"({row['ratio_total']:.2f}x)", flush=True)
    finally:
        if rig is not None:
            rig.close()
        subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
