"""``agentcell run``: launch one command in a cell. The hot path: stdlib + agentcell.cell only."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from ..cell import launch as launcher
from ..cell import mounts
from ..cell.spec import CellSpec
from ..errors import EXIT_CODES_HELP, AgentcellError
from ..policy import resolve as rs
from .common import Parser, fail

PROG = "agentcell run"


def parser() -> Parser:
    p = Parser(
        prog=PROG,
        usage="%(prog)s [OPTIONS] -- CMD [ARGS...]",
        description="Run CMD in a least-privilege cell: its own mount, PID, IPC, UTS and network "
        "namespaces, a read-only system, only the declared paths writable, a scrubbed environment, "
        "and never as root.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--rw", action="append", default=[], metavar="PATH", help="share PATH read-write at its own path")
    a("--ro", action="append", default=[], metavar="PATH", help="share PATH read-only (nosuid, nodev)")
    a("--vault-ro", action="append", default=[], metavar="PATH", help="OPS-1 spelling of --ro")
    a("--mask", action="append", default=[], metavar="PATH", help="hide PATH (an empty dir or file over it)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scratch", metavar="DIR", help="back the cell's writable /scratch with host DIR")
    g.add_argument("--tmpfs-scratch", action="store_true", help="a private tmpfs at /scratch (the default)")
    a("--home", metavar="DIR", help="back the cell's $HOME with host DIR (kept across runs); default a tmpfs")
    a("--net", choices=("none", "loopback"), default="none", help="network: none (default) or loopback only")
    a("--as", dest="as_", metavar="WHO", help="self (default), agent:NAME or UID (root only)")
    a("--env", action="append", default=[], metavar="K=V", help="set a variable in the cell")
    a("--keep-env", action="append", default=[], metavar="NAME", help="pass the host's NAME through")
    a("--cwd", metavar="DIR", help="working directory inside the cell (default: here if shared, else $HOME)")
    a("--timeout", type=float, metavar="S", help="kill the whole cell after S seconds")
    a("--allow-unsafe-path", action="store_true", help="accept /, a home dir or a credential dir as a path")
    a("--explain", action="store_true", help="print the policy and every privileged step; run nothing")
    a("--json", action="store_true", help="print one JSON result object as the last line of stdout")
    a("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    return p


def build_spec(ns: argparse.Namespace) -> CellSpec:
    ident = rs.resolve_identity(ns.as_)
    homes = rs.home_dirs()
    common = {"allow_unsafe": ns.allow_unsafe_path, "homes": homes}
    rw = rs.resolve_paths(ns.rw, field="--rw", writable=True, **common)
    ro = rs.resolve_paths(ns.ro + ns.vault_ro, field="--ro", writable=False, **common)
    masked = rs.resolve_paths(ns.mask, field="--mask", writable=False, allow_unsafe=True, homes=homes)
    rs.check_disjoint({"--rw": rw, "--ro": ro, "--mask": masked})
    scratch = rs.resolve_path(ns.scratch, field="--scratch", writable=True, **common) if ns.scratch else None
    home = rs.resolve_path(ns.home, field="--home", writable=True, **common) if ns.home else None
    if ns.timeout is not None and not ns.timeout > 0:
        raise AgentcellError("--timeout", f"{ns.timeout} is not a positive number of seconds", "e.g. --timeout 30")
    visible = (*rw, *ro)
    if ns.cwd:
        cwd = os.path.realpath(ns.cwd)
        if rs.cell_cwd(cwd, (*visible, ident.home), "") != cwd:
            raise AgentcellError("--cwd", f"{ns.cwd} is not visible in the cell", "share it with --rw or --ro")
    else:
        try:
            here = os.getcwd()
        except OSError:
            here = ident.home
        cwd = rs.cell_cwd(here, visible, ident.home)
    return CellSpec(
        identity=ident, rw_paths=rw, ro_paths=ro, masked_paths=masked, scratch_dir=scratch, home_dir=home,
        network=ns.net, env=rs.build_env(os.environ, ident, ns.env, ns.keep_env), cwd=cwd,
        cell_id=launcher.new_cell_id(),
    )


def explain(spec: CellSpec, command: list[str]) -> dict[str, object]:
    from ..cell import namespaces

    ident = spec.identity
    plan = mounts.plan(spec, open_fds=False)
    ns_names = ["mount", "pid", "ipc", "uts", "net"] + (["user"] if ident.userns else [])
    steps = [f"unshare({'|'.join('CLONE_NEW' + n.upper() for n in ns_names)})  # 0x{namespaces.flags_for(spec):x}"]
    if ident.userns:
        steps.append(f"write uid_map '{ident.uid} {ident.uid} 1', setgroups deny, gid_map '{ident.gid} {ident.gid} 1'")
    steps.append("fork -> PID 1 of the cell (reaper, non-dumpable)")
    steps.append("mount --make-rprivate /; tmpfs new root")
    steps += [f"  {d}" for d in plan.describe()]
    steps.append("remount new root read-only; pivot_root; detach old root")
    if spec.network == "loopback":
        steps.append("ip link set lo up")
    steps.append(f"sethostname {spec.hostname}")
    steps.append("fork -> the command (own process group)")
    if not ident.userns:
        steps.append(f"setgroups {list(ident.groups)}; setresgid {ident.gid}")
    steps.append("drop capability bounding set; clear ambient capabilities")
    steps.append(f"setresuid {ident.uid}; prctl(PR_SET_PDEATHSIG, SIGKILL); prctl(PR_SET_NO_NEW_PRIVS, 1)")
    steps.append(f"chdir {spec.cwd}; close every fd but 0-2; execve {command[0] if command else '?'} "
                 "with the environment below")
    return {
        "cell_id": spec.cell_id,
        "identity": {"mode": ident.mode, "uid": ident.uid, "gid": ident.gid, "user": ident.user, "home": ident.home},
        "network": spec.network,
        "rw": list(spec.rw_paths), "ro": list(spec.ro_paths), "masked": list(spec.masked_paths),
        "system_ro": [p for p in spec.system_paths if os.path.lexists(p)],
        "scratch": spec.scratch_dir or "tmpfs", "home": spec.home_dir or "tmpfs",
        "env": sorted(k for k, _ in spec.env),
        "cwd": spec.cwd,
        "command": command,
        "steps": steps,
    }


def _print_explain(info: dict[str, object]) -> None:
    out = sys.stdout.write
    for key in ("cell_id", "identity", "network", "rw", "ro", "masked", "system_ro", "scratch", "home", "env",
                "cwd", "command"):
        out(f"{key:>10}: {info[key]}\n")
    out("     steps:\n")
    for s in info["steps"]:  # type: ignore[attr-defined]
        out(f"            {s}\n")


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    try:
        spec = build_spec(ns)
        if ns.explain:
            info = explain(spec, command)
            if ns.json:
                sys.stdout.write(json.dumps(info) + "\n")
            else:
                _print_explain(info)
            return 0
        if not command:
            raise AgentcellError("command", "no command given", "put it after --, e.g. agentcell run -- true")
        take = launcher.terminal_is_ours()
        running = launcher.start(spec, command, take_terminal=take)
    except AgentcellError as e:
        return fail(PROG, e)

    def forward(sig: int, _frame: object) -> None:
        running.forward(sig)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    result = running.wait(ns.timeout)
    if take:
        launcher.reclaim_terminal()
    if result.error:
        sys.stderr.write(f"{PROG}: {result.error}\n")
    elif result.timed_out:
        sys.stderr.write(f"{PROG}: timed out after {ns.timeout:g} s; the cell was killed\n")
    if ns.json:
        sys.stdout.flush()
        sys.stdout.write(json.dumps({"command": command, **result.as_dict()}) + "\n")
    return result.exit_status
