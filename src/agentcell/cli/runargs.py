"""``agentcell run``'s options: one table, the two parsers it drives, and the plan they fill.

Standard library only, and none of its slow parts: this is on ``agentcell run``'s path.
"""
from __future__ import annotations

from ..cell.spec import NETWORK_MODES, TYPE_CHECKING
from ..errors import EXIT_CODES_HELP, AgentcellError
from ..policy.plan import FLAGS, Plan

if TYPE_CHECKING:
    from argparse import Namespace

    from .common import Parser

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


def to_plan(ns: Args | Namespace) -> Plan:
    """The plan the options ask for; what only the options can get wrong is refused here, the rest by the
    compiler (:func:`agentcell.policy.plan.compile_spec`), each in the flags' own names."""
    if ns.on_escape is not None:
        if not ns.monitor:
            raise AgentcellError("--on-escape", "says what the monitor does", "add --monitor")
        from ..monitor.monitor import parse_verdicts

        parse_verdicts(ns.on_escape)  # a bad verdict is refused before anything is made
    if ns.timeout is not None and not ns.timeout > 0:
        raise AgentcellError("--timeout", f"{ns.timeout} is not a positive number of seconds", "e.g. --timeout 30")
    from .. import limits

    memory_max, cpu_percent, pids_max = limits.parse(ns.memory, ns.cpu, ns.pids, ns.limits)
    return Plan(
        identity=ns.as_, declared_paths=ns.rw, ro_paths=ns.ro + ns.vault_ro, masked_paths=ns.mask,
        scratch=ns.scratch, home=ns.home, agent_home=getattr(ns, "agent_home", None),
        allow_unsafe_paths=ns.allow_unsafe_path, cwd=ns.cwd, env=ns.env, keep_env=ns.keep_env,
        allow_write=ns.allow_write,
        network=ns.net if ns.net in ("loopback", "proxy", "host-firewall") else "none",  # type: ignore[arg-type]
        allow_domains=ns.allow_domain, deny_domains=ns.deny_domain, allow_presets=ns.allow_preset,
        allow_ranges=ns.allow_range, resolver=ns.resolver, allow_egress=ns.allow_egress,
        allow_loopback=ns.allow_loopback, landlock="best-effort" if ns.landlock == "best-effort" else "required",
        memory_max=memory_max, cpu_percent=cpu_percent, pids_max=pids_max, watch=ns.monitor, terms=FLAGS)


def live_monitor(ns: Args | Namespace, *, command_fix: str, timeout_fix: str) -> str | None:
    """agentcell run's options given to a live cell (``agentcell cell start``, ``agentcell mcp``), checked
    for what a live cell does not take, and its monitor's verdict: watched by default (``--on-escape``
    sets the verdict), unwatched with ``--no-monitor``. ``ns.monitor`` is set to match."""
    if ns.command[:1] == ["--"]:
        ns.command = ns.command[1:]
    if ns.command:
        raise AgentcellError("command", "a live cell is started without one: its commands come later", command_fix)
    if ns.timeout is not None:
        raise AgentcellError("--timeout", "is per command here", timeout_fix)
    refused = {"--explain": ns.explain, "--secret": ns.secret, "--secret-host": ns.secret_host,
               "--upstream-ca": ns.upstream_ca, "--no-warm": ns.no_warm}
    for flag in (f for f, given in refused.items() if given):
        raise AgentcellError(flag, "is not taken by a live cell", "use it with agentcell run")
    no_monitor = bool(getattr(ns, "no_monitor", False))
    if no_monitor and (ns.monitor or ns.on_escape):
        raise AgentcellError("--no-monitor", "contradicts --monitor and --on-escape", "give one or the other")
    ns.monitor = not no_monitor
    return (ns.on_escape or "terminate") if ns.monitor else None
