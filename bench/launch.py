"""Launch benchmark: agentcell against bubblewrap, side by side in one sitting, command `true`.

    .venv/bin/python bench/launch.py [--runs N] [--json]

Measures (medians, milliseconds, ratio to bwrap measured in the same sitting):
  * bwrap --unshare-all with a configuration equivalent to agentcell's (same binds, masks, tmpfs);
  * CLI:       `agentcell run --as UID -- true` (a new process per command): building the cell itself
               (--no-warm: the compiled front runs the Python CLI); with a running `agentcell warm`
               launcher, the compiled front handing the command line to it (the launcher forks the
               CLI's process, issue 29), and the Python CLI handing it its cell (AGENTCELL_FRONT=off);
  * warm API:  `Cell(spec).run(["true"])` from a long-lived process, calls spaced 50 ms apart as an
               agent's tool calls are (the warm launcher prepares the next cell in between);
  * warm API, back to back (no gap), and without pre-warming, for the record;
  * supervised: `agentcell run --monitor` cold, and through the warm launcher (which forks it a cell
    host: the monitor's set-up is paid there, the Python start and imports are not);
  * the hardening's cost: the launcher in this process with Landlock, seccomp and the cell's cgroup,
    and with each switched off in turn (issue #3).
  * the Codex CLI's own sandbox, `codex sandbox -- true` (bwrap + seccomp, its native binary), when
    it is installed: the harness tests' cache (tests/harnesses.py) or AGENTCELL_CODEX=PATH; issue 14
    asks agentcell run, cold and through the warm launcher, to beat it.
Targets (issues 2 and 29): CLI <= 3x bwrap; warm API <= 1.0x bwrap. Needs root (a throwaway account
ac-bench<hex> is created and removed) and bwrap (apt package bubblewrap).
"""
from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import pwd
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENTCELL = str(Path(sys.executable).parent / "agentcell")
GAP_S = 0.05


def median_ms(fn: Callable[[], object], runs: int, gap: float = 0.0) -> float:
    fn()  # warm-up: page cache, bytecode, first prepared cell
    samples = []
    for _ in range(runs):
        if gap:
            time.sleep(gap)
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1000


def bwrap_argv(uid: int, gid: int, home: str) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--clearenv", "--uid", str(uid), "--gid", str(gid)]
    for p in ("/usr", "/etc", "/opt"):
        if os.path.isdir(p) and not os.path.islink(p):
            argv += ["--ro-bind", p, p]
    for p in ("/bin", "/sbin", "/lib", "/lib64"):
        if os.path.islink(p):
            argv += ["--symlink", os.readlink(p), p]
    for p in ("/etc/shadow", "/etc/gshadow"):
        if os.path.exists(p):
            argv += ["--ro-bind", "/dev/null", p]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", home, "--tmpfs", "/scratch",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", home, "--chdir", home]
    return [*argv, "true"]


def need_root_and_bwrap(prog: str) -> None:
    if os.geteuid() != 0:
        sys.exit(f"{prog}: needs root (it creates a throwaway account)")
    if not shutil.which("bwrap"):
        sys.exit(f"{prog}: bwrap not found (apt-get install bubblewrap)")


@contextlib.contextmanager
def throwaway_account() -> Iterator[pwd.struct_passwd]:
    """An account ac-bench<hex> for the benchmark's cells, removed after."""
    name = "ac-bench" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


def codex_binary() -> str | None:
    """The Codex CLI's native binary (the npm package's launcher is node, which adds its own start)."""
    given = os.environ.get("AGENTCELL_CODEX")
    if given:
        return given
    found = sorted(Path("/opt/agentcell-test/harnesses").glob(
        "npm-*codex*/node_modules/@openai/codex-linux-*/vendor/*/bin/codex"))
    return str(found[-1]) if found else None


def layer_costs(spec: object, runs: int) -> dict[str, float]:
    """The launcher called in this process (no warm launcher, no CLI), with every hardening layer and
    with each one switched off in turn — by replacing it here, for the benchmark only (forked cells
    inherit the replacement). The difference is that layer's cost per launch."""
    from agentcell.cell import cgroups, landlock, launch, seccomp
    from agentcell.protect.binds import for_cell

    guarded = for_cell(spec)  # type: ignore[arg-type]

    real = {"landlock": landlock.prepare, "seccomp": seccomp.ready, "cgroup": cgroups.CellCgroup.create}
    off = {"landlock": lambda _spec: None, "seccomp": lambda _prog, listen=False: lambda: None,
           "cgroup": lambda *_a: None}
    targets = {"landlock": (landlock, "prepare"), "seccomp": (seccomp, "ready"),
               "cgroup": (cgroups.CellCgroup, "create")}
    out = {"launch_all_layers": median_ms(lambda: launch.launch(spec, ["true"], guards=guarded), runs)}  # type: ignore[arg-type]
    for name, (owner, attr) in targets.items():
        setattr(owner, attr, off[name])
        try:
            out[f"launch_without_{name}"] = median_ms(lambda: launch.launch(spec, ["true"], guards=guarded), runs)  # type: ignore[arg-type]
        finally:
            setattr(owner, attr, real[name])
    for name, (owner, attr) in targets.items():
        setattr(owner, attr, off[name])
    try:
        out["launch_no_hardening"] = median_ms(lambda: launch.launch(spec, ["true"], guards=guarded), runs)  # type: ignore[arg-type]
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, real[name])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    need_root_and_bwrap("bench/launch.py")
    compileall.compile_dir(str(ROOT / "src"), quiet=1)  # as an installed package would have

    from agentcell import Cell, CellSpec
    from agentcell.policy.resolve import build_env, resolve_identity

    with throwaway_account() as pw:
        ident = resolve_identity(str(pw.pw_uid), euid=0)
        spec = CellSpec(ident, env=build_env({"LANG": "C.UTF-8"}, ident))
        bw = bwrap_argv(pw.pw_uid, pw.pw_gid, ident.home)
        cli = [AGENTCELL, "run", "--as", str(pw.pw_uid), "--no-warm", "--", "true"]
        cli_warm = [AGENTCELL, "run", "--as", str(pw.pw_uid), "--", "true"]
        # Supervised: the escape monitor beside the cell (through the launcher, in a cell host it forks).
        cli_mon = [AGENTCELL, "run", "--as", str(pw.pw_uid), "--monitor", "--no-warm", "--", "true"]
        cli_mon_warm = [AGENTCELL, "run", "--as", str(pw.pw_uid), "--monitor", "--", "true"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        run = lambda argv: subprocess.run(argv, check=True, env=env, stderr=subprocess.DEVNULL)  # noqa: E731
        python_env = dict(env, AGENTCELL_FRONT="off")  # the compiled front runs the Python CLI at once
        run_python = lambda argv: subprocess.run(argv, check=True, env=python_env,  # noqa: E731
                                                 stderr=subprocess.DEVNULL)
        res: dict[str, float] = {}
        # Hardening cost: the same cell without Landlock (best-effort with an unreachable minimum ABI).
        bare = spec.replace(landlock="best-effort", landlock_min_abi=1 << 30)
        with (Cell(spec) as warm, Cell(spec, prewarm=False) as cold_api,
              Cell(bare, prewarm=False) as bare_api):
            res["bwrap"] = median_ms(lambda: run(bw), args.runs)
            res["cli"] = median_ms(lambda: run(cli), args.runs)
            res["cli_monitor"] = median_ms(lambda: run(cli_mon), args.runs)
            had_launcher = subprocess.run([AGENTCELL, "warm", "status"], capture_output=True).returncode == 0
            subprocess.run([AGENTCELL, "warm", "start"], check=True, capture_output=True)
            try:
                res["cli_warm_launcher"] = median_ms(lambda: run(cli_warm), args.runs)
                res["cli_warm_launcher_python"] = median_ms(lambda: run_python(cli_warm), args.runs)
                res["cli_warm_launcher_spaced"] = median_ms(lambda: run(cli_warm), args.runs, GAP_S)
                res["cli_monitor_warm_launcher"] = median_ms(lambda: run(cli_mon_warm), args.runs)
            finally:
                if not had_launcher:
                    subprocess.run([AGENTCELL, "warm", "stop"], check=True, capture_output=True)
            res["bwrap_spaced"] = median_ms(lambda: run(bw), args.runs, GAP_S)
            res["api_warm_spaced"] = median_ms(lambda: warm.run(["true"]), args.runs, GAP_S)
            res["api_warm_back_to_back"] = median_ms(lambda: warm.run(["true"]), args.runs)
            res["api_no_prewarm"] = median_ms(lambda: cold_api.run(["true"]), args.runs)
            res["api_no_prewarm_no_landlock"] = median_ms(lambda: bare_api.run(["true"]), args.runs)
            res["python_startup"] = median_ms(lambda: run([sys.executable, "-c", "pass"]), args.runs)
            codex = codex_binary()
            if codex:
                # Its own sandbox refuses a CODEX_HOME under /tmp; one of its own, removed after.
                home = Path("/var/tmp") / f"agentcell-bench-codex-{secrets.token_hex(3)}"
                home.mkdir(mode=0o700)
                try:
                    cenv = dict(env, CODEX_HOME=str(home))
                    had = set(Path("/tmp").glob("codex-*"))  # (its own scratch there: removed after)
                    res["codex_sandbox"] = median_ms(
                        lambda: subprocess.run([codex, "sandbox", "--", "true"], check=True, env=cenv,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), args.runs)
                finally:
                    shutil.rmtree(home, ignore_errors=True)
                    for left in set(Path("/tmp").glob("codex-*")) - had:
                        shutil.rmtree(left, ignore_errors=True)
            res.update(layer_costs(spec, args.runs))

    ratios = {
        "cli": res["cli"] / res["bwrap"],
        "cli_warm_launcher": res["cli_warm_launcher"] / res["bwrap"],
        "cli_warm_launcher_python": res["cli_warm_launcher_python"] / res["bwrap"],
        "cli_warm_launcher_spaced": res["cli_warm_launcher_spaced"] / res["bwrap_spaced"],
        "api_warm_spaced": res["api_warm_spaced"] / res["bwrap_spaced"],
        "api_warm_back_to_back": res["api_warm_back_to_back"] / res["bwrap"],
        "api_no_prewarm": res["api_no_prewarm"] / res["bwrap"],
        "api_no_prewarm_no_landlock": res["api_no_prewarm_no_landlock"] / res["bwrap"],
        "python_startup": res["python_startup"] / res["bwrap"],
        "cli_monitor": res["cli_monitor"] / res["bwrap"],
        "cli_monitor_warm_launcher": res["cli_monitor_warm_launcher"] / res["bwrap"],
        "cli_monitor_warm_vs_cold": res["cli_monitor_warm_launcher"] / res["cli_monitor"],
        **{k: res[k] / res["bwrap"] for k in res if k.startswith("launch_")},
    }
    if "codex_sandbox" in res:
        ratios["codex_sandbox"] = res["codex_sandbox"] / res["bwrap"]
        ratios["cli_vs_codex"] = res["cli"] / res["codex_sandbox"]
        ratios["cli_warm_launcher_vs_codex"] = res["cli_warm_launcher"] / res["codex_sandbox"]
    targets = {"cli": 3.0, "cli_warm_launcher": 3.0, "cli_warm_launcher_spaced": 3.0,
               "api_warm_spaced": 1.0, "cli_vs_codex": 1.0, "cli_warm_launcher_vs_codex": 1.0}
    if args.json:
        print(json.dumps({"median_ms": res, "ratio_to_bwrap": ratios, "targets": targets}))
        return 0
    print(f"launch of `true`, median of {args.runs} runs (ms), ratio to bwrap in the same sitting")
    print(f"  {'bwrap --unshare-all (equivalent binds)':<46}{res['bwrap']:7.2f}")
    print(f"  {'bwrap, spaced 50 ms':<46}{res['bwrap_spaced']:7.2f}")
    rows = [("cli", "agentcell run --no-warm (cold CLI)"),
            ("cli_warm_launcher", "agentcell run, warm launcher (compiled front)"),
            ("cli_warm_launcher_python", "  ... the Python CLI (AGENTCELL_FRONT=off)"),
            ("cli_warm_launcher_spaced", "agentcell run, warm launcher, spaced 50 ms"),
            ("api_warm_spaced", "Cell.run, warm, spaced 50 ms"),
            ("api_warm_back_to_back", "Cell.run, warm, back to back"),
            ("api_no_prewarm", "Cell.run, no pre-warm"),
            ("api_no_prewarm_no_landlock", "Cell.run, no pre-warm, without Landlock"),
            ("cli_monitor", "agentcell run --monitor --no-warm"),
            ("cli_monitor_warm_launcher", "agentcell run --monitor, warm launcher (its host)"),
            ("python_startup", "python -c pass (floor of any CLI)"),
            ("launch_all_layers", "launcher in-process, all hardening"),
            ("launch_without_landlock", "  ... without Landlock"),
            ("launch_without_seccomp", "  ... without seccomp"),
            ("launch_without_cgroup", "  ... without its cgroup"),
            ("launch_no_hardening", "  ... with none of the three")]
    if "codex_sandbox" in res:
        rows.insert(3, ("codex_sandbox", "codex sandbox -- true (native binary)"))
    for key, label in rows:
        target = targets.get(key)
        verdict = ""
        if target is not None:
            verdict = f"  target <= {target:.1f}x: {'met' if ratios[key] <= target else 'MISSED'}"
        print(f"  {label:<46}{res[key]:7.2f}  {ratios[key]:5.2f}x{verdict}")
    print(f"  {'--monitor: warm launcher / cold':<46}{'':7}  {ratios['cli_monitor_warm_vs_cold']:5.2f}x")
    for key, label in (("cli_vs_codex", "agentcell run --no-warm / codex sandbox"),
                       ("cli_warm_launcher_vs_codex", "agentcell run, warm launcher / codex sandbox")):
        if key in ratios:
            met = "met" if ratios[key] <= targets[key] else "MISSED"
            print(f"  {label:<46}{'':7}  {ratios[key]:5.2f}x  target <= {targets[key]:.1f}x: {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
