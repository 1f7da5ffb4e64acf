"""Snapshot benchmark: agentcell's store against `tar -czf` (the seed's backup), restic and borg.

    .venv/bin/python bench/snapshot.py [--files N] [--mb N] [--json]

One sitting, on a generated project (default 20,000 files, 500 MB: 70 % text, 30 % random binary,
in nested directories) under a temporary directory. For each engine it times a first snapshot, a
second of the unchanged tree, a third after 1 % of the files changed, and a full restore into an
empty directory. tar is the seed's `tar -czf` (every run rereads and recompresses everything).
restic (apt: restic) and borg (apt: borgbackup) are measured when installed, with no encryption
for borg and restic's default (it has no unencrypted mode). Targets (issue 6): a repeat snapshot
<= 1/20 of tar's time; a first snapshot no slower than tar. Everything made is removed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agentcell.snapshot import Store

WORDS = ["def", "class", "return", "import", "self", "value", "data", "agent", "cell", "snapshot", "store",
         "restore", "file", "path", "tree", "test", "assert", "error", "config", "build", "run", "main", "print",
         "list", "dict", "none", "true", "false", "for", "while", "if", "else"]


def generate(root: Path, files: int, total_mb: int) -> list[Path]:
    rnd = random.Random(42)
    pool = " ".join(rnd.choice(WORDS) + ("\n" if rnd.random() < 0.1 else "") for _ in range(400_000)).encode()
    mean = total_mb * (1 << 20) // files
    made = []
    for i in range(files):
        d = root / f"pkg{i % 40:02d}" / f"mod{i % 400:03d}"
        d.mkdir(parents=True, exist_ok=True)
        size = max(16, int(rnd.expovariate(1 / mean)))
        if i % 10 < 7:
            start = rnd.randrange(0, len(pool) - 1)
            data = (pool[start:] + pool)[:size]
            p = d / f"file{i}.py"
        else:
            data = os.urandom(size)
            p = d / f"blob{i}.bin"
        p.write_bytes(data)
        made.append(p)
    return made


def change(files: list[Path], share: float) -> None:
    rnd = random.Random(7)
    for p in rnd.sample(files, int(len(files) * share)):
        with open(p, "ab") as f:
            f.write(b"\n# changed\n")


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(*argv: str, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})}, cwd=cwd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-snap-", dir="/var/tmp"))
    res: dict[str, dict[str, float]] = {}
    try:
        tree = work / "project"
        files = generate(tree, args.files, args.mb)
        run("sync")

        def phases(take: Callable[[int], object], restore: Callable[[Path], object]) -> dict[str, float]:
            out = {"first": timed(lambda: take(1)), "unchanged": timed(lambda: take(2))}
            change(files, 0.01)
            out["one_percent"] = timed(lambda: take(3))
            target = work / "restore"
            out["restore"] = timed(lambda: restore(target))
            shutil.rmtree(target, ignore_errors=True)
            return out

        tars = work / "tar"
        tars.mkdir()
        res["tar -czf"] = phases(lambda n: run("tar", "-czf", str(tars / f"{n}.tgz"), "-C", str(work), "project"),
                                 lambda t: (t.mkdir(), run("tar", "-xzf", str(tars / "3.tgz"), "-C", str(t))))
        store = Store(str(work / "store"))
        ids: list[str] = []
        res["agentcell"] = phases(lambda n: ids.append(store.take([str(tree)])),
                                  lambda t: store.restore(ids[-1], to=str(t)))
        if shutil.which("restic"):
            repo, env = str(work / "restic"), {"RESTIC_PASSWORD": "bench", "RESTIC_CACHE_DIR": str(work / "rc")}
            run("restic", "-r", repo, "init", env=env)
            res["restic"] = phases(lambda n: run("restic", "-r", repo, "backup", "--quiet", str(tree), env=env),
                                   lambda t: run("restic", "-r", repo, "restore", "latest", "--target", str(t),
                                                 env=env))
        if shutil.which("borg"):
            repo = str(work / "borg")
            benv = {"BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes", "BORG_BASE_DIR": str(work / "bb")}
            run("borg", "init", "--encryption=none", repo, env=benv)
            res["borg"] = phases(lambda n: run("borg", "create", f"{repo}::s{n}", str(tree), env=benv),
                                 lambda t: (t.mkdir(), run("borg", "extract", f"{repo}::s3", env=benv, cwd=str(t))))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tar = res["tar -czf"]
    ratios = {k: {p: v[p] / tar[p] for p in v} for k, v in res.items()}
    if args.json:
        print(json.dumps({"seconds": res, "ratio_to_tar": ratios, "files": args.files, "mb": args.mb}))
        return 0
    print(f"{args.files} files, {args.mb} MB (70 % text, 30 % random binary); seconds, and the ratio to tar")
    print(f"  {'engine':<12}{'first':>16}{'unchanged':>18}{'1 % changed':>18}{'restore':>16}")
    for k, v in res.items():
        cells = "".join(f"{v[p]:9.2f} ({ratios[k][p]:4.2f}x)" for p in ("first", "unchanged", "one_percent",
                                                                        "restore"))
        print(f"  {k:<12}{cells}")
    a = ratios["agentcell"]
    print(f"targets: repeat <= 0.05x tar: {'met' if a['unchanged'] <= 0.05 else 'MISSED'} "
          f"({a['unchanged']:.3f}); first <= 1x tar: {'met' if a['first'] <= 1 else 'MISSED'} ({a['first']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
