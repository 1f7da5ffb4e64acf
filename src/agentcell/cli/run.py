"""``agentcell run``: launch one command in a cell. The hot path: stdlib + agentcell.cell only."""
from __future__ import annotations

import os
import sys

from ..cell import terminal
from ..cell.spec import NETWORK_MODES, TYPE_CHECKING, CellSpec, new_cell_id
from ..errors import EXIT_CODES_HELP, AgentcellError, report
from ..policy import resolve as rs

if TYPE_CHECKING:
    import signal
    from argparse import Namespace
    from typing import Any

    from ..cell.launch import Running
    from ..protect.check import SurfaceCheck
    from .common import Parser
else:  # see cell/launch.py
    import _signal as signal

PROG = "agentcell run"

# One table drives both parsers. kind: append (repeatable value), value, flag (no value).
OPTIONS: tuple[tuple[str, str, str, str, str], ...] = (
    ("--rw", "rw", "append", "PATH", "share PATH read-write at its own path"),
    ("--ro", "ro", "append", "PATH", "share PATH read-only (nosuid, nodev)"),
    ("--vault-ro", "vault_ro", "append", "PATH", "OPS-1 spelling of --ro"),
    ("--mask", "mask", "append", "PATH", "hide PATH (an empty dir or file over it)"),
    ("--allow-write", "allow_write", "append", "PATH", "let the command write a protected path (.git/hooks, "
     ".git/config, .claude/, .mcp.json, shell rc files, ...) inside a --rw path"),
    ("--scratch", "scratch", "value", "DIR", "back the cell's writable /scratch with host DIR"),
    ("--tmpfs-scratch", "tmpfs_scratch", "flag", "", "a private tmpfs at /scratch (the default)"),
    ("--home", "home", "value", "DIR", "back the cell's $HOME with host DIR (kept across runs); default a tmpfs"),
    ("--net", "net", "value", "MODE", "network: none (default), loopback only, proxy (allow-listed domains) or "
     "host-firewall (the host's network, nftables on the agent's uid)"),
    ("--allow-egress", "allow_egress", "append", "[tcp:|udp:]ADDR:PORT", "with --net host-firewall: what the "
     "agent may reach (*:443, 10.0.0.0/8:5432, udp:*:53; 'seed' is *:443)"),
    ("--allow-loopback", "allow_loopback", "flag", "", "with --net host-firewall: let the agent reach the host's "
     "loopback"),
    ("--allow-domain", "allow_domain", "append", "PATTERN[:PORT]", "with --net proxy: a domain the cell may reach "
     "(*.example.com for names below it; port 80 and 443 unless given; :* for any)"),
    ("--deny-domain", "deny_domain", "append", "PATTERN[:PORT]", "with --net proxy: never this domain (wins)"),
    ("--allow-preset", "allow_preset", "append", "NAME", "with --net proxy: a named allow-list (claude_code, codex, "
     "opencode, cursor, aider, gemini, pypi, npm, crates, go, github)"),
    ("--allow-range", "allow_range", "append", "CIDR", "with --net proxy: let names resolve into this non-public "
     "range"),
    ("--resolver", "resolver", "value", "ADDR[:PORT]", "with --net proxy: the DNS server the proxy asks (default: "
     "the host's resolver and /etc/hosts)"),
    ("--as", "as_", "value", "WHO", "self (default), agent:NAME or UID (root only)"),
    ("--env", "env", "append", "K=V", "set a variable in the cell (argv is public: pass secrets by --keep-env)"),
    ("--keep-env", "keep_env", "append", "NAME", "pass the host's NAME through"),
    ("--secret", "secret", "append", "NAME[=SOURCE]", "with --net proxy: a credential the cell gets only as a "
     "placeholder; the proxy puts the real value in requests to its --secret-host (SOURCE: env:VAR (default: "
     "NAME), file:PATH, cmd:COMMAND)"),
    ("--secret-host", "secret_host", "append", "NAME=HOST[,HOST][:HEADER]", "where --secret NAME may go: the "
     "hosts, and the request headers it may go in (default: any header)"),
    ("--upstream-ca", "upstream_ca", "value", "PEM", "with --secret: verify the secrets' hosts against this CA "
     "bundle instead of the host's trust store"),
    ("--cwd", "cwd", "value", "DIR", "working directory inside the cell (default: here if shared, else $HOME)"),
    ("--timeout", "timeout", "value", "S", "kill the whole cell after S seconds"),
    ("--allow-unsafe-path", "allow_unsafe_path", "flag", "", "accept /, a home dir or a credential dir as a path"),
    ("--explain", "explain", "flag", "", "print the policy and every privileged step; run nothing"),
    ("--json", "json", "flag", "", "print one JSON result object as the last line of stdout"),
    ("--memory", "memory", "value", "SIZE", "memory ceiling, e.g. 2G (default: 75%% of RAM; OOM kills are reported)"),
    ("--cpu", "cpu", "value", "PERCENT", "CPU ceiling in percent of one core, e.g. 50 (default: none)"),
    ("--pids", "pids", "value", "N", "most tasks the cell may have at once (default: 4096)"),
    ("--limits", "limits", "value", "PROFILE", "ops1: OPS-1's 2G memory, 50%% CPU, 64 tasks (flags above win)"),
    ("--landlock", "landlock", "value", "MODE", "required (default: refuse to run without Landlock) or best-effort"),
    ("--no-warm", "no_warm", "flag", "", "build the cell here even if a warm launcher runs (agentcell warm)"),
    ("--monitor", "monitor", "flag", "", "watch the cell for escape attempts (Landlock and seccomp refusals, "
     "canary credentials, privilege tools, egress refusals, resource events) and report them, attributed"),
    ("--on-escape", "on_escape", "value", "VERDICT", "with --monitor: terminate (default: freeze, record, kill "
     "the cell at the first attempt) or record; per class: terminate,network=record"),
)
NET_MODES = NETWORK_MODES
LANDLOCK_MODES = ("required", "best-effort")


class Args:
    """Parsed options (attribute per dest), filled by :func:`fast_parse` or argparse."""

    rw: list[str]
    allow_domain: list[str]
    deny_domain: list[str]
    allow_preset: list[str]
    allow_range: list[str]
    resolver: str | None
    allow_egress: list[str]
    allow_loopback: bool
    monitor: bool
    on_escape: str | None
    ro: list[str]
    vault_ro: list[str]
    mask: list[str]
    allow_write: list[str]
    env: list[str]
    keep_env: list[str]
    secret: list[str]
    secret_host: list[str]
    upstream_ca: str | None
    scratch: str | None
    home: str | None
    net: str | None
    landlock: str | None
    memory: str | None
    cpu: str | None
    pids: str | None
    limits: str | None
    as_: str | None
    cwd: str | None
    timeout: float | None
    tmpfs_scratch: bool
    allow_unsafe_path: bool
    explain: bool
    json: bool
    no_warm: bool

    def __init__(self) -> None:
        for _flag, dest, kind, _m, _h in OPTIONS:
            setattr(self, dest, [] if kind == "append" else False if kind == "flag" else None)
        self.command: list[str] = []
        self.agent_home: str | None = None  # set by `agentcell agent run` only


def fast_parse(argv: list[str]) -> Args | None:
    """Parse well-formed arguments without argparse (it imports re: ~10 ms per run on our machines).

    Returns None for anything unusual (help, an unknown or malformed option); the caller then lets
    argparse, built from the same table, produce the proper usage error.
    """
    by_flag = {o[0]: o for o in OPTIONS}
    ns = Args()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or not arg.startswith("-"):
            ns.command = argv[i + 1:] if arg == "--" else argv[i:]
            break
        name, eq, value = arg.partition("=")
        opt = by_flag.get(name)
        if opt is None:
            return None
        _flag, dest, kind, _m, _h = opt
        if kind == "flag":
            if eq:
                return None
            setattr(ns, dest, True)
        else:
            if not eq:
                i += 1
                if i == len(argv):
                    return None
                value = argv[i]
            if kind == "append":
                getattr(ns, dest).append(value)
            elif dest == "timeout":
                try:
                    ns.timeout = float(value)
                except ValueError:
                    return None
            else:
                setattr(ns, dest, value)
        i += 1
    if ns.net is None:
        ns.net = "none"
    if ns.landlock is None:
        ns.landlock = "required"
    if ns.net not in NET_MODES or ns.landlock not in LANDLOCK_MODES or (ns.scratch and ns.tmpfs_scratch):
        return None
    return ns


def parser(prog: str = PROG) -> Parser:
    import argparse

    from .common import Parser

    p = Parser(
        prog=prog,
        usage="%(prog)s [OPTIONS] -- CMD [ARGS...]",
        description="Run CMD in a least-privilege cell: its own mount, PID, IPC, UTS and network "
        "namespaces, a read-only system, only the declared paths writable, a scrubbed environment, "
        "and never as root.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    excl = p.add_mutually_exclusive_group()
    for flag, dest, kind, metavar, help_ in OPTIONS:
        target = excl if dest in ("scratch", "tmpfs_scratch") else p
        if kind == "flag":
            target.add_argument(flag, dest=dest, action="store_true", help=help_)
        elif kind == "append":
            target.add_argument(flag, dest=dest, action="append", default=[], metavar=metavar, help=help_)
        elif dest == "net":
            target.add_argument(flag, dest=dest, choices=NET_MODES, default="none", help=help_)
        elif dest == "landlock":
            target.add_argument(flag, dest=dest, choices=LANDLOCK_MODES, default="required", help=help_)
        else:
            target.add_argument(flag, dest=dest, metavar=metavar, help=help_,
                                type=float if dest == "timeout" else str)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    return p


def parse(argv: list[str], prog: str = PROG) -> Args | Namespace:
    """``agentcell run``'s options (``prog``: the command they are given to, for its errors)."""
    fast = fast_parse(argv)
    if fast is not None:
        return fast
    ns = parser(prog).parse_args(argv)
    if ns.command[:1] == ["--"]:
        ns.command = ns.command[1:]
    return ns


def build_spec(ns: Args | Namespace) -> CellSpec:
    if ns.on_escape is not None:
        if not ns.monitor:
            raise AgentcellError("--on-escape", "says what the monitor does", "add --monitor")
        from ..monitor.monitor import parse_verdicts

        parse_verdicts(ns.on_escape)  # a bad verdict is refused before anything is made
    ident = rs.resolve_identity(ns.as_)
    if ns.net == "host-firewall" and ident.userns:
        raise AgentcellError("--net", "host-firewall rules key on an account's uid, and a rootless cell has none of "
                             "its own", "run through sudo with --as, or use --net proxy")
    homes = rs.home_dirs() if (ns.rw or ns.ro or ns.vault_ro or ns.mask or ns.scratch or ns.home
                               or ns.allow_write) else set()
    unsafe = ns.allow_unsafe_path
    rw = rs.resolve_paths(ns.rw, field="--rw", writable=True, allow_unsafe=unsafe, homes=homes)
    ro = rs.resolve_paths(ns.ro + ns.vault_ro, field="--ro", writable=False, allow_unsafe=unsafe, homes=homes)
    masked = rs.resolve_paths(ns.mask, field="--mask", writable=False, allow_unsafe=True, homes=homes)
    rs.check_masks(masked)
    rs.check_disjoint({"--rw": rw, "--ro": ro, "--mask": masked})
    scratch = home = None
    if ns.scratch:
        scratch = rs.resolve_path(ns.scratch, field="--scratch", writable=True, allow_unsafe=unsafe, homes=homes)
    if ns.home:
        # An agent account's own home is its $HOME (agentcell agent run sets agent_home; no flag can).
        own = getattr(ns, "agent_home", None) == ns.home
        home = rs.resolve_path(ns.home, field="--home", writable=True, allow_unsafe=unsafe or own, homes=homes)
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
    memory_max, cpu_percent, pids_max = _limits(ns)
    allow_write = rs.allowed_writes(ns.allow_write, rw, field="--allow-write", homes=homes)
    return CellSpec(
        egress=_egress(ns),
        allow_write=allow_write,
        memory_max=memory_max, cpu_percent=cpu_percent, pids_max=pids_max,
        identity=ident, rw_paths=rw, ro_paths=ro, masked_paths=masked, scratch_dir=scratch, home_dir=home,
        network=ns.net if ns.net in ("loopback", "proxy", "host-firewall") else "none",  # type: ignore[arg-type]
        env=rs.build_env(os.environ, ident, ns.env, ns.keep_env), cwd=cwd,
        landlock="best-effort" if ns.landlock == "best-effort" else "required",
        # In the host's network the host's abstract unix sockets (X11, D-Bus, ...) are reachable but
        # for Landlock's scope, which needs ABI 6: below it such a cell fails closed.
        landlock_min_abi=6 if ns.net == "host-firewall" else 1,
        watch=bool(ns.monitor),
        cell_id=new_cell_id(),
    )


def _egress(ns: Args | Namespace) -> tuple[str, ...]:
    """The proxy's or the firewall's rules as text, checked now (one line, before anything runs)."""
    if not (ns.net in ("proxy", "host-firewall") or ns.allow_domain or ns.deny_domain or ns.allow_preset
            or ns.allow_range or ns.resolver or ns.allow_egress or ns.allow_loopback):
        return ()  # the hot path: nothing to import
    from ..network import compile as nc

    return nc.egress(ns.net or "none", allow_domains=ns.allow_domain, deny_domains=ns.deny_domain,
                     allow_presets=ns.allow_preset, allow_ranges=ns.allow_range, resolver=ns.resolver,
                     allow_egress=ns.allow_egress, allow_loopback=ns.allow_loopback, names=nc.FLAGS)


def _credentials(ns: Args | Namespace, spec: CellSpec) -> tuple[Any, str | None]:
    """``--secret``/``--secret-host``/``--upstream-ca``: the credential set (values read now, on the host)
    and the upstream CA's PEM; (None, None) without ``--secret``. Each bound host must be one the proxy
    lets through."""
    if not ns.secret:
        for flag, given in (("--secret-host", ns.secret_host), ("--upstream-ca", ns.upstream_ca)):
            if given:
                raise AgentcellError(flag, "says where a --secret goes", "add --secret NAME")
        return None, None
    if spec.network != "proxy":
        raise AgentcellError("--secret", "credentials are injected by the egress proxy", "add --net proxy")
    from ..network.credentials import CredentialSet, off_the_list, parse_bindings, read_values
    from ..network.rules import Policy

    creds = CredentialSet.build(read_values(ns.secret), parse_bindings(ns.secret_host))
    rules = Policy.from_rules(spec.egress)
    host = off_the_list((h for s in creds.secrets.values() for h in s.hosts), rules.name_verdict)
    if host is not None:
        raise AgentcellError("--secret-host", f"{host} is not on the allow-list",
                             f"add --allow-domain {host.removeprefix('http://')}")
    pem = None
    if ns.upstream_ca:
        from ..network.tlsca import read_bundle

        pem = read_bundle(ns.upstream_ca, "--upstream-ca")
    return creds, pem


def _limits(ns: Args | Namespace) -> tuple[int | None, int | None, int | None]:
    from .. import limits

    return limits.parse(ns.memory, ns.cpu, ns.pids, ns.limits)


def explain(spec: CellSpec, command: list[str]) -> dict[str, object]:
    from ..cell import landlock, mounts, namespaces
    from ..protect import binds

    ident = spec.identity
    plan = mounts.plan(spec, *binds.for_cell(spec))
    ns_names = ["mount", "pid", "ipc", "uts", "net"] + (["user"] if ident.userns else [])
    steps = []
    if os.geteuid() == 0:
        from ..cell import cgroups
        from ..cell.launch import cell_limits

        lim = cell_limits(spec)
        steps.append(f"cgroup {cgroups.PARENT}/{spec.cell_id} ({cgroups.layout()}): memory {lim.memory} bytes, "
                     f"cpu {f'{lim.cpu_percent}% of a core' if lim.cpu_percent else 'not capped'}, "
                     f"pids {lim.pids}; the cell joins it before anything else")
    else:
        steps.append("cgroup: none (not root: no delegated cgroup here; see agentcell doctor)")
    steps.append(f"unshare({'|'.join('CLONE_NEW' + n.upper() for n in ns_names)})  # 0x{namespaces.flags_for(spec):x}")
    if ident.userns:
        steps.append(f"write uid_map '{ident.uid} {ident.uid} 1', setgroups deny, gid_map '{ident.gid} {ident.gid} 1'")
    steps.append("fork -> PID 1 of the cell (reaper, non-dumpable)")
    steps.append("mount --make-rprivate /; tmpfs new root")
    steps += [f"  {d}" for d in plan.describe()]
    steps.append("remount new root read-only; pivot_root; detach old root")
    if spec.network == "loopback":
        steps.append("ip link set lo up")
    steps.append(f"sethostname {spec.hostname}")
    steps.append("fork -> the command: setsid (a session of its own, no controlling terminal)")
    if not ident.userns:
        steps.append(f"setgroups {list(ident.groups)}; setresgid {ident.gid}")
    steps.append("drop capability bounding set; clear ambient capabilities")
    steps.append(f"setresuid {ident.uid}; prctl(PR_SET_PDEATHSIG, SIGKILL); prctl(PR_SET_NO_NEW_PRIVS, 1)")
    steps.append(f"chdir {spec.cwd}; receive argv and stdio fds; close every other fd")
    version = landlock.abi()
    if version >= max(spec.landlock_min_abi, 1):
        steps.append(f"landlock (ABI {version}) restrict_self" + (", LOG_NEW_EXEC_ON" if version >= 7 else "") + ":")
        steps += [f"  {rule}" for rule in landlock.describe(spec)]
    else:
        steps.append(f"landlock: ABI {version} here; " + ("refused (required)" if spec.landlock == "required"
                                                          else "SKIPPED (--landlock best-effort)"))
    from ..cell import seccomp

    steps.append("seccomp filter (libseccomp), loaded last:")
    steps += [f"  {rule}" for rule in seccomp.describe()]
    steps.append(f"execve {command[0] if command else '?'} with the environment listed above")
    return {
        "cell_id": spec.cell_id,
        "identity": {"mode": ident.mode, "uid": ident.uid, "gid": ident.gid, "user": ident.user, "home": ident.home},
        "network": spec.network,
        "rw": list(spec.rw_paths), "ro": list(spec.ro_paths), "masked": list(spec.masked_paths),
        "protected": [s.dest for s in plan.steps if s.kind == "bind" and s.readonly and s.dest not in spec.ro_paths
                      and s.dest not in spec.system_paths],
        "system_ro": [p for p in spec.system_paths if os.path.lexists(p)],
        "scratch": spec.scratch_dir or "tmpfs", "home": spec.home_dir or "tmpfs",
        "env": sorted(k for k, _ in spec.env),
        "cwd": spec.cwd,
        "command": command,
        "steps": steps,
    }


def _print_explain(info: dict[str, object]) -> None:
    out = sys.stdout.write
    steps = info["steps"]
    assert isinstance(steps, list)
    for key in ("cell_id", "identity", "network", "rw", "ro", "masked", "protected", "system_ro", "scratch", "home",
                "env",
                "cwd", "command"):
        out(f"{key:>10}: {info[key]}\n")
    out("     steps:\n")
    for s in steps:
        out(f"            {s}\n")


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def protected_lines(result: dict[str, Any]) -> list[str]:
    """What a result's protected-path step found, as warnings (the CLI's and a live cell's stop)."""
    from ..protect.check import lines

    out = lines(result, "the command", lift_hint=True)
    if result.get("scan_truncated"):
        from ..protect import surface

        out.append(f"the writable paths hold more than the protected-path scan covers ({surface.MAX_DEPTH} levels, "
                   f"{surface.MAX_DIRS} directories): repositories and agent config past that were neither protected "
                   "nor checked; review them before you use them")
    return out


def _run_here(spec: CellSpec, command: list[str], timeout: float | None, ttys: tuple[int, ...],
              interactive: bool, guard: SurfaceCheck, monitor: str | None = None, credentials: Any = None,
              upstream_ca: str | None = None) -> dict[str, Any]:
    """The cold path: build the cell in this process. Where our 0, 1, 2 are terminals the cell gets a
    pty of its own, relayed; stdin only when the run is interactive (else /dev/null)."""
    from ..supervise import Supervised

    stdio = [0, 1, 2]
    if 0 in ttys and not interactive:
        stdio[0] = os.open(os.devnull, os.O_RDONLY)
        ttys = tuple(fd for fd in ttys if fd != 0)
    sup = Supervised.start(spec, command, monitor=monitor, stdio=stdio, tty_fds=ttys, guard=guard,
                           credentials=credentials, upstream_ca=upstream_ca)
    try:
        cell = _wait_here(sup.running, timeout, interactive)
    except BaseException:
        sup.finish(None)
        raise
    return sup.finish(cell)


def monitor_lines(result: dict[str, Any]) -> list[str]:
    """What the monitor saw, from a result (the cold path's, or a warm launcher's cell host's)."""
    if "monitor_sources" not in result:
        return []
    from ..monitor.lines import chain, event_kind, event_line

    out = []
    off = {k: v for k, v in result["monitor_sources"].items() if not str(v).startswith("on")}
    if off:
        out.append(f"monitor: not watched: {'; '.join(f'{k} ({v})' for k, v in sorted(off.items()))}")
    for ev in result.get("events") or []:
        out.append(f"{event_kind(ev)}: {event_line(ev)}")
        if event_kind(ev) == "escape" and chain(ev):  # who tried, from the cell's PID 1 down
            out.append(f"  by: {chain(ev)}")
    if result.get("terminated_by_monitor"):  # named here too: a flood of events may have pushed it out of the list
        reason = str(result.get("monitor_reason") or "")
        shown = reason if reason.isprintable() else repr(reason)
        out.append(f"the cell was {'frozen and ' if result.get('monitor_frozen') else ''}killed at the first escape "
                   f"attempt: {shown} (--on-escape record to only record)")
    return out


def _wait_here(running: Running, timeout: float | None, interactive: bool) -> dict[str, Any]:
    relay = terminal.Relay(running.pty_master, interactive) if running.pty_master is not None else None

    def forward(sig: int, _frame: object) -> None:
        running.forward(sig)

    for s in FORWARDED:
        signal.signal(s, forward)
    timed_out = False
    if relay is not None:
        timed_out = relay.pump(running, None if timeout is None else running.started + timeout)
    result = running.wait(None if timed_out else timeout, clean_up=False)
    if timed_out:
        result.timed_out, result.exit_status, result.signal = True, 124, signal.SIGKILL
    return dict(result.as_dict(), via="here")


def main(argv: list[str]) -> int:
    return execute(parse(argv))


def execute(ns: Args | Namespace) -> int:
    command = ns.command
    try:
        spec = build_spec(ns)
        if ns.explain:
            info = explain(spec, command)
            if ns.json:
                import json

                sys.stdout.write(json.dumps(info) + "\n")
            else:
                _print_explain(info)
            return 0
        if not command:
            raise AgentcellError("command", "no command given", "put it after --, e.g. agentcell run -- true")
        credentials, upstream_ca = _credentials(ns, spec)
        ttys, interactive = terminal.tty_fds(), terminal.is_ours()
        from ..protect.check import SurfaceCheck, human

        guard = SurfaceCheck(spec, human())  # the protected-path step, on either path
        result = None
        monitor = ns.on_escape or "terminate" if ns.monitor else None
        # A terminal stays here (job control needs the cell in its session); so do credentials (the warm
        # launcher is another process: the values go no further than this one and its proxy).
        if not ttys and not ns.no_warm and credentials is None:
            from ..host import warm

            result = warm.run(spec, command, ns.timeout, monitor)
            if result is not None:
                result["via"] = "warm launcher"
                guard.check(result, str(result.get("cell_id") or spec.cell_id))
        if result is None:
            result = _run_here(spec, command, ns.timeout, ttys, interactive, guard, monitor=monitor,
                               credentials=credentials, upstream_ca=upstream_ca)
    except AgentcellError as e:
        return report(PROG, e)
    for sig in FORWARDED:  # the cell has ended: a signal now ends us, as it would any command
        signal.signal(sig, signal.SIG_DFL)
    for line in monitor_lines(result):
        sys.stderr.write(f"{PROG}: {line}\n")
    for line in protected_lines(result):
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    if result.get("egress_blocked"):
        from ..network import egress

        sys.stderr.write(f"{PROG}: {egress.summary(result['egress_blocked'])}\n")
    if result["error"]:
        sys.stderr.write(f"{PROG}: {result['error']}\n")
    elif result["timed_out"]:
        sys.stderr.write(f"{PROG}: timed out after {ns.timeout:g} s; the cell was killed\n")
    if result.get("terminated_by_monitor") and result["exit_status"] != 128 + signal.SIGKILL:
        # Killed at an escape attempt, even where the command ended first (a rootless monitor learns of a
        # decoy's open after it): the status says so, whatever the command's own was.
        result["command_exit_status"], result["exit_status"], result["signal"] = result["exit_status"], 137, 9
    if ns.json:
        import json

        sys.stdout.flush()
        sys.stdout.write(json.dumps({"command": command, **result}) + "\n")
    return int(result["exit_status"])
