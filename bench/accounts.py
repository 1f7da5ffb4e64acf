"""Agent-account benchmark: `agentcell agent run -- true` against `au run true` and bwrap, one sitting.

    .venv/bin/python bench/accounts.py [--runs N] [--json]

* `au` is agent-as-unix-user 2.2.0 from the package index, installed for this benchmark only into
  bench/.au-venv (git-ignored) with a Python >= 3.12 (it requires one; found on PATH or in pyenv).
  It needs `sudo` (apt-get install sudo) and a terminal on stdin (it fails without one), so it gets
  a pty. It runs as root, its "human", with a throwaway agent `ac-bau<hex>`.
* agentcell's agent `ac-bac<hex>` is made with `agentcell agent new` for a throwaway human, in a
  throwaway state dir; `agent run` builds its cell itself (no warm launcher runs during the bench).
* bwrap --unshare-all with binds like a cell's, as the same agent uid (its --uid maps root into a user
  namespace, which cannot enter the agent's 2770 home: it gets a tmpfs home instead).
Medians of interleaved runs; ratios in the same sitting. Everything made is removed at the end.
"""
from __future__ import annotations

import argparse
import glob
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

ROOT = Path(__file__).resolve().parent.parent
AGENTCELL = str(Path(sys.executable).parent / "agentcell")
AU_VENV = ROOT / "bench" / ".au-venv"
AU_VERSION = "2.2.0"


def python312() -> str:
    cands = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")), reverse=True)
    cands += [w for w in (shutil.which("python3.13"), shutil.which("python3.12")) if w]
    for cand in cands:  # a pyenv shim on PATH may name a version that is not installed: try each
        if subprocess.run([cand, "-c", "import sys; assert sys.version_info >= (3, 12)"],
                          capture_output=True).returncode == 0:
            return cand
    sys.exit("bench/accounts.py: au needs Python >= 3.12 and none was found (PATH, ~/.pyenv)")


def au_bin() -> str:
    au = AU_VENV / "bin" / "au"
    if not au.exists():
        subprocess.run([python312(), "-m", "venv", str(AU_VENV)], check=True)
        subprocess.run([str(AU_VENV / "bin" / "pip"), "install", "-q", f"agent-as-unix-user=={AU_VERSION}"],
                       check=True)
    return str(au)


def timed(argv: list[str], *, env: dict[str, str], tty: bool = False) -> float:
    t = time.perf_counter()
    if tty:
        master, slave = os.openpty()
        try:
            p = subprocess.Popen(argv, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
            while True:  # drain the pty so the command never blocks on output
                try:
                    if not os.read(master, 65536):
                        break
                except OSError:
                    break
            rc = p.wait()
        finally:
            os.close(master)
    else:
        rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
    if rc != 0:
        raise SystemExit(f"bench/accounts.py: {' '.join(argv)} exited {rc}")
    return time.perf_counter() - t


def ephemeral_ms(state: str, runs: int) -> tuple[float, float]:
    """Median time to make and to remove a per-session account (the issue asks: well under a second)."""
    os.environ["AGENTCELL_STATE_DIR"] = state
    from agentcell.accounts import ephemeral

    made, gone = [], []
    for i in range(runs):
        t = time.perf_counter()
        acct = ephemeral.create_ephemeral(f"bench-{secrets.token_hex(4)}-{i}")
        t2 = time.perf_counter()
        ephemeral.delete(acct)
        made.append(t2 - t)
        gone.append(time.perf_counter() - t2)
    return statistics.median(made) * 1000, statistics.median(gone) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/accounts.py: needs root (it creates throwaway accounts)")
    for tool, package in (("bwrap", "bubblewrap"), ("sudo", "sudo")):
        if not shutil.which(tool):
            sys.exit(f"bench/accounts.py: {tool} not found (apt-get install {package})")
    au = au_bin()
    tag = secrets.token_hex(3)
    human, ours, theirs = f"ac-bh{tag}", f"ac-bac{tag}", f"ac-bau{tag}"
    state = tempfile.mkdtemp(prefix="agentcell-bench-")
    au_config = os.path.join(state, "au.toml")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "AGENTCELL_STATE_DIR": state,
           "HOME": "/root", "USER": "root"}
    made_au = False
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", human], check=True)
    try:
        subprocess.run([AGENTCELL, "agent", "new", ours, "--human", human, "--yes"], env=env, check=True,
                       capture_output=True)
        made_au = True
        subprocess.run([au, "-C", au_config, "new", "-a", theirs, "--yes"], env=env, check=True, capture_output=True)
        pw = pwd.getpwnam(ours)
        bw = ["bwrap", "--unshare-all", "--die-with-parent", "--clearenv", "--uid", str(pw.pw_uid), "--gid",
              str(pw.pw_gid), "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--symlink", "usr/bin", "/bin",
              "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
              "--tmpfs", "/tmp", "--tmpfs", pw.pw_dir, "--chdir", pw.pw_dir, "true"]
        cases = {
            "bwrap": (bw, False),
            "agentcell_agent_run": ([AGENTCELL, "agent", "run", "--agent", ours, "--", "true"], False),
            "au_run": ([au, "-C", au_config, "run", "-a", theirs, "true"], True),
        }
        for argv, tty in cases.values():  # warm-up, and proof that each works
            timed(argv, env=env, tty=tty)
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.runs):
            for k, (argv, tty) in cases.items():
                samples[k].append(timed(argv, env=env, tty=tty))
        ms = {k: statistics.median(v) * 1000 for k, v in samples.items()}
        ms["ephemeral_create"], ms["ephemeral_delete"] = ephemeral_ms(state, min(args.runs, 10))
    finally:
        if made_au:
            subprocess.run([au, "-C", au_config, "delete", "-a", theirs, "--delete-home", "--yes"], env=env,
                           capture_output=True)
        subprocess.run([AGENTCELL, "agent", "delete", ours, "--delete-home", "--yes"], env=env, capture_output=True)
        subprocess.run(["userdel", human], check=False)
        shutil.rmtree(state, ignore_errors=True)
    ratios = {"agent_run_to_au": ms["agentcell_agent_run"] / ms["au_run"],
              "agent_run_to_bwrap": ms["agentcell_agent_run"] / ms["bwrap"],
              "au_to_bwrap": ms["au_run"] / ms["bwrap"]}
    if args.json:
        print(json.dumps({"median_ms": ms, "ratios": ratios, "runs": args.runs}))
        return 0
    print(f"`true` as an agent account, median of {args.runs} interleaved runs (ms)")
    print(f"  {'bwrap --unshare-all (same uid)':<48}{ms['bwrap']:8.2f}")
    print(f"  {'agentcell agent run -- true (cell built cold)':<48}{ms['agentcell_agent_run']:8.2f}"
          f"   {ratios['agent_run_to_bwrap']:5.2f}x bwrap, {ratios['agent_run_to_au']:5.2f}x au")
    print(f"  {'au run true (agent-as-unix-user ' + AU_VERSION + ', on a pty)':<48}{ms['au_run']:8.2f}"
          f"   {ratios['au_to_bwrap']:5.2f}x bwrap")
    print(f"per-session account: create {ms['ephemeral_create']:.1f} ms, "
          f"delete {ms['ephemeral_delete']:.1f} ms (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
