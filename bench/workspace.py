"""Copy-on-write workspace start-up (issue 27): a session's cost on a project of 10 files against one of
20,000, with ``--workspace copy`` (nothing copied: an overlay over the project, what git ignores hidden),
``--workspace direct`` (the project itself: a preflight backup and ACL grants, per file), and the peer
the other harnesses use for a private tree, ``git worktree add`` (a checkout of every file), in one
sitting.

    .venv/bin/python bench/workspace.py [--rounds N] [--files N] [--json]

Each project is a git repository a throwaway user owns (the files in 200 directories, committed, plus an
ignored build/ directory and a .env). What is timed is ``agentcell session start --harness shell -- true``
from the command's start to its end (the session's own fixed cost is the same for both sizes: the
difference is what the size costs), and ``git worktree add`` of a new branch, removed after each round.
Everything made is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rig import AGENTCELL, throwaway  # (bench/rig.py, beside this file)


def make_project(base: Path, files: int, uid: int, gid: int) -> Path:
    d = base / f"p{files}"
    d.mkdir()
    dirs = max(1, min(200, files // 10))
    for i in range(files):
        sub = d / f"src{i % dirs:03d}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:05d}.py").write_text(f"x = {i}\n")
    (d / ".gitignore").write_text("build/\n.env\n")
    (d / "build").mkdir()
    (d / "build" / "out.o").write_text("o\n")
    (d / ".env").write_text("TOKEN=1\n")
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(d)], check=True)
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run([*as_user, "git", "-C", str(d), *args], check=True, env=env, capture_output=True)
    return d


def session(project: Path, state: Path, mode: str) -> float:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": str(state),
           "AUDIT_LOG_PATH": str(state / "audit.jsonl"), "BACKUP_DIR": str(state / "backups")}
    t = time.perf_counter()
    p = subprocess.run([AGENTCELL, "session", "start", "--workspace", mode, "--harness", "shell", "--json", "--",
                        "true"], capture_output=True, text=True, env=env, cwd=project, stdin=subprocess.DEVNULL,
                       timeout=600)
    took = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"session failed ({p.returncode}): {p.stderr[-1500:]}")
    sid = json.loads(p.stdout.strip().splitlines()[-1])["session"]
    if mode == "copy":
        subprocess.run([AGENTCELL, "session", "discard", sid], env=env, capture_output=True, check=True)
    return took


def worktree(project: Path, uid: int, gid: int) -> float:
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    where = project.parent / f"wt-{secrets.token_hex(3)}"
    os.chmod(project.parent, 0o777)
    t = time.perf_counter()
    subprocess.run([*as_user, "git", "-C", str(project), "worktree", "add", "-q", "-b", where.name, str(where)],
                   check=True, env=env, capture_output=True)
    took = time.perf_counter() - t
    subprocess.run([*as_user, "git", "-C", str(project), "worktree", "remove", "--force", str(where)], check=True,
                   env=env, capture_output=True)
    subprocess.run([*as_user, "git", "-C", str(project), "branch", "-q", "-D", where.name], check=True, env=env,
                   capture_output=True)
    os.chmod(project.parent, 0o755)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (sessions make per-session accounts; the projects are a throwaway user's)")
    sizes = (10, args.files)
    rows: dict[str, list[float]] = {f"{what} {n}": [] for what in ("copy", "direct", "worktree") for n in sizes}
    with throwaway("ac-wbench", "workspace") as (pw, base, state):
        projects = {n: make_project(base, n, pw.pw_uid, pw.pw_gid) for n in sizes}
        for n in sizes:  # one untimed round each: the page cache holds both trees alike
            session(projects[n], state, "copy")
        for _ in range(args.rounds):
            for n in sizes:  # interleaved: a noisy moment costs both sizes alike
                rows[f"copy {n}"].append(session(projects[n], state, "copy"))
                rows[f"direct {n}"].append(session(projects[n], state, "direct"))
                rows[f"worktree {n}"].append(worktree(projects[n], pw.pw_uid, pw.pw_gid))
    med = {k: statistics.median(v) * 1000 for k, v in rows.items()}
    big, small = sizes[1], sizes[0]
    out = {"ms": med, "rounds": args.rounds, "files": list(sizes),
           "extra_ms": {w: round(med[f"{w} {big}"] - med[f"{w} {small}"], 1) for w in ("copy", "direct", "worktree")}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'':<22}{small:>10} files{big:>10} files{'difference':>14}")
    names = {"copy": "session, copy", "direct": "session, direct", "worktree": "git worktree add"}
    for w, name in names.items():
        print(f"{name:<22}{med[f'{w} {small}']:>13.0f} ms{med[f'{w} {big}']:>13.0f} ms"
              f"{out['extra_ms'][w]:>+11.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
