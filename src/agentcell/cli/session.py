"""``agentcell session``: run an agent through the whole session workflow, and look after sessions.

    agentcell session start [--harness H] [--agent NAME] [--rw P]... [--json] [OPTIONS] [-- HARNESS ARGS]
    agentcell session list [--json]
    agentcell session show ID [--json]
    agentcell session stop ID
    agentcell session restore ID
    agentcell session diff ID [--json]
    agentcell session recover [--json]

Configuration: flags > environment > .env > the project's agentcell.toml [session] > defaults (see
agentcell.session.config). Sessions are kept in <state dir>/sessions (LangGraph's SQLite checkpoints).
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from ..errors import EXIT_SETUP, AgentcellError, printable, report
from .common import Parser

PROG = "agentcell session"
EXIT_TERMINATED = 120  # the session was terminated (an escape attempt, a stop, a lost account or audit log)
EXIT_ABORTED = EXIT_SETUP  # aborted before the agent ran (no backup, no firewall, no cell)
EPILOG = f"""exit status of start:
  0 or the harness's own status when it ended by itself (0 when the wall clock ended it)
  {EXIT_TERMINATED}  terminated: an escape attempt, 'session stop', a lost account, monitor or audit log
  {EXIT_ABORTED}  aborted before the agent ran (backup, firewall or launch failed)
  125  refused: a bad flag or configuration value; nothing was created
"""


def parser() -> Parser:
    import argparse

    p = Parser(prog=PROG, description="Run an agent in a planned, backed-up, watched and audited session.",
               epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="start|list|show|stop|restore|diff|recover", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("start", help="start a session (harness args after --)")
    sp.add_argument("--harness", help="claude_code, codex, opencode, cursor, aider, gemini, shell, scripted "
                    "(AGENT_HARNESS; default shell)")
    sp.add_argument("--agent", metavar="NAME", help="run as this persistent agent account (AGENT_OS_USER); "
                    "default, as root: a per-session account deleted at the end")
    sp.add_argument("--rw", action="append", metavar="PATH", dest="declared_paths",
                    help="a declared path, shared read-write (repeatable; DECLARED_PATHS; default: the project)")
    sp.add_argument("--project", metavar="DIR", dest="project_root", help="the project (PROJECT_ROOT; default: .)")
    sp.add_argument("--env-file", metavar="FILE", help="the .env file (default: ./.env). Only a file named "
                    "here, outside the project and writable by you alone, may set PROJECT_ROOT, BACKUP_DIR, "
                    "AUDIT_LOG_PATH or AGENT_OS_USER")
    sp.add_argument("--wall-clock", type=str, metavar="S", dest="wall_clock_limit_s",
                    help="end the session (normally) after S seconds (WALL_CLOCK_LIMIT_S; default 3600)")
    sp.add_argument("--backup-dir", metavar="DIR", help="the snapshot store for the preflight backup (BACKUP_DIR)")
    sp.add_argument("--audit-log", metavar="FILE", dest="audit_log_path", help="the audit trail (AUDIT_LOG_PATH)")
    sp.add_argument("--firewall", action="store_const", const="true", dest="firewall_enabled",
                    help="the seed's host firewall: egress to port 443 only (FIREWALL_ENABLED)")
    sp.add_argument("--net", dest="network", metavar="MODE", help="none | loopback | proxy | host-firewall "
                    "(default: host-firewall with FIREWALL_ENABLED, else the harness's)")
    for flag, dest, metavar, help_ in (
            ("--allow-domain", "allow_domains", "PATTERN[:PORT]", "with the proxy: a domain the agent may reach "
             "besides its harness's API (*.example.com for names below it; repeatable; implies --net proxy)"),
            ("--deny-domain", "deny_domains", "PATTERN[:PORT]", "with the proxy: never this domain (wins)"),
            ("--allow-preset", "allow_presets", "NAME", "with the proxy: a named allow-list too (pypi, npm, "
             "crates, go, github, or a harness's)"),
            ("--allow-range", "allow_ranges", "CIDR", "with the proxy: let names resolve into this non-public range")):
        sp.add_argument(flag, action="append", dest=dest, metavar=metavar, help=help_)
    sp.add_argument("--resolver", metavar="ADDR[:PORT]", help="with the proxy: the DNS server it asks "
                    "(default: the host's)")
    sp.add_argument("--api-base", metavar="URL", help="the harness's model API: a gateway or a local model server "
                    "(AGENT_API_BASE; its host joins the allow-list)")
    sp.add_argument("--model", metavar="NAME", help="the model the harness asks for (AGENT_MODEL)")
    sp.add_argument("--upstream-ca", metavar="PEM", help="with the proxy: verify the API hosts the keys are injected "
                    "for against this CA bundle, not the host's trust store (a TLS-inspecting gateway's CA)")
    sp.add_argument("--secret", action="append", metavar="NAME[=SOURCE]", help="with the proxy: another credential "
                    "the cell gets only as a placeholder (SOURCE: env:VAR (default NAME), file:PATH, cmd:COMMAND, run "
                    "as you); bound with --secret-host")
    sp.add_argument("--secret-host", action="append", metavar="NAME=HOST[,HOST][:HEADER]", help="where --secret NAME "
                    "may go: the hosts (http://HOST: over plain HTTP) and the request headers")
    sp.add_argument("--env", action="append", metavar="NAME=VALUE", help="set a variable in the cell (repeatable; "
                    "visible in the process list: pass secrets with --keep-env)")
    sp.add_argument("--keep-env", action="append", metavar="NAME", help="pass NAME from the environment (or the "
                    ".env) into the cell (repeatable)")
    sp.add_argument("--risk", metavar="LEVEL", help="low | medium | high: the default ceilings (AGENT_RISK; "
                    "default medium)")
    for flag, metavar, help_ in (("--memory", "SIZE", "memory ceiling, e.g. 4G (default: by --risk)"),
                                 ("--cpu", "PERCENT", "CPU ceiling in percent of one CPU (default: by --risk)"),
                                 ("--pids", "N", "most tasks at once (default: by --risk)"),
                                 ("--limits", "PROFILE", "ops1: OPS-1's 2G, 50%% of one CPU, 64 tasks")):
        sp.add_argument(flag, metavar=metavar, help=help_)
    sp.add_argument("--home-from", metavar="DIR", help="start the cell's fresh home as a copy of DIR (a home you "
                    "prepared once: logins, settings)")
    sp.add_argument("--ceilings", choices=("on", "off"), help="off: no memory, CPU or task ceilings at all (said in "
                    "the audit trail and the summary); without root they need a cgroup delegated to you")
    sp.add_argument("--cache", choices=("on", "off"), help="the project's pip, uv, npm, pnpm, yarn, cargo and go "
                    "caches at /cache, kept between its sessions in agentcell's store (default on; "
                    "'agentcell cache list')")
    sp.add_argument("--workspace", choices=("direct", "copy"), help="copy: the agent works in a copy-on-write view "
                    "of the project (your tree and .git are not written until 'session apply'); default direct")
    sp.add_argument("--workspace-include", metavar="PATH", action="append", dest="workspace_include",
                    help="with --workspace copy: show this ignored path in the copy too (e.g. .env); repeatable")
    sp.add_argument("--git-identity", metavar='"NAME <EMAIL>"', help="who the agent commits as (default: you, as "
                    "git knows you, marked as the agent's: NAME (agent: HARNESS))")
    sp.add_argument("--explain", action="store_true", help="print the plan and the policy; start nothing")
    sp.add_argument("--json", action="store_true", help="print the summary as one JSON object, last on stdout")
    sp.add_argument("--summary-file", metavar="FILE", help="also write the summary there, as JSON (a new file: "
                    "a caller's own channel, apart from the harness's output on stdout)")
    sp.add_argument("--id", metavar="ID", dest="session_id", help="the session's id (default: a new one): a "
                    "caller's own, e.g. a fleet's, known before the session starts; refused if it is taken")
    for name, help_ in (("list", "the sessions kept"), ("recover", "finish the teardown of sessions whose "
                                                                   "supervisor died")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--json", action="store_true")
        if name == "list":
            sp.add_argument("--unapplied", action="store_true", help="only the copy-on-write workspaces whose "
                            "change set waits for review, apply or discard")
    sp = sub.add_parser("review", help="a --workspace copy session's change set: every path it added, modified, "
                        "deleted or renamed, its commits, and what would conflict")
    sp.add_argument("id", metavar="ID")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--diff", action="store_true", help="text diffs too")
    sp = sub.add_parser("apply", help="land a --workspace copy session's change set in the project as it is now "
                        "(all of it or nothing; its commits as the branch agentcell/ID)")
    sp.add_argument("id", metavar="ID")
    sp.add_argument("--ours", metavar="PATH", action="append", default=[], help="keep your version of PATH")
    sp.add_argument("--theirs", metavar="PATH", action="append", default=[], help="take the agent's version of PATH")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("discard", help="remove a --workspace copy session's change set (what was not applied is "
                        "lost)")
    sp.add_argument("id", metavar="ID")
    for name, help_ in (("show", "a session's state"), ("stop", "stop a running session (terminated)"),
                        ("restore", "put the declared paths back as the preflight backup has them"),
                        ("diff", "what changed in the declared paths since the preflight backup")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("id", metavar="ID")
        if name in ("show", "diff"):
            sp.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args, harness_args = list(argv), []
    if "--" in args:
        i = args.index("--")
        args, harness_args = args[:i], args[i + 1:]
    ns = parser().parse_args(args)
    if harness_args and ns.cmd != "start":
        return report(PROG, AgentcellError("--", f"'session {ns.cmd}' takes no command", "remove what follows --"))
    try:
        if ns.cmd == "start":
            return _start(ns, harness_args)
        return int(globals()[f"_{ns.cmd}"](ns))
    except AgentcellError as e:
        return report(PROG, e)


# ---- start -------------------------------------------------------------------------------------

def _graph(runtime: Any = None) -> tuple[Any, Any]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from ..session import graph, state

    try:
        conn = state.connect()
    except OSError as e:
        raise AgentcellError("state", f"cannot open {state.sessions_dir()}: {e.strerror}",
                             "run through sudo (sessions are root's), or set AGENTCELL_STATE_DIR") from None
    return graph.build_graph(runtime, checkpointer=SqliteSaver(conn, serde=state.Serde())), conn


def _start(ns: Any, harness_args: list[str]) -> int:
    from ..harness import profiles, seed
    from ..session import config, graph, state

    flags = {k: getattr(ns, k) for k in ("harness", "agent", "declared_paths", "project_root", "wall_clock_limit_s",
                                         "backup_dir", "audit_log_path", "firewall_enabled", "network",
                                         *config.EGRESS_KEYS, "resolver", "api_base", "model", "env", "keep_env",
                                         "risk", "memory", "cpu", "pids", "limits", "home_from", "git_identity",
                                         "ceilings", "cache", "workspace", "workspace_include")}
    flags["harness_args"] = harness_args
    summary_fd = _new_file(ns.summary_file, "--summary-file") if ns.summary_file else None
    cfg = config.load(flags, dotenv=ns.env_file)
    _check_ceilings(cfg)
    sid = _checked_id(ns.session_id, "--id") if ns.session_id is not None else graph.new_session_id()
    from ..session.nodes import compile_policy, make_plan, session_network

    launch = profiles.launch(profiles.get(cfg.harness), cfg.harness_args, seed_dir=seed.path(sid),
                             api_base=cfg.api_base, model=cfg.model, secrets=tuple(cfg.secrets),
                             home_from=cfg.home_from is not None,
                             network=session_network(cfg.as_dict()))  # a missing harness: refused here
    if launch.renames:  # the names the cell knows them by
        from dataclasses import replace

        cfg = replace(cfg, secrets={launch.renames.get(k, k): v for k, v in cfg.secrets.items()})

    plan, _ = make_plan(cfg.as_dict(), sid, launch.as_dict())  # bad input is refused here, before a session exists
    if ns.env_file and any(w.endswith(f"(in {ns.env_file})") for k, w in cfg.sources.items()
                           if k in config.HOST_KEYS or k == "declared_paths"):
        _check_env_file_untouched(ns.env_file)
    from ..network import compile as nc

    nc.egress(plan.network, allow_domains=list(cfg.allow_domains), deny_domains=list(cfg.deny_domains),
              allow_presets=list(cfg.allow_presets), allow_ranges=list(cfg.allow_ranges), resolver=cfg.resolver,
              allow_egress=[], allow_loopback=False, names=nc.FLAGS)  # errors in the flags' own names
    policy = compile_policy(plan, dict(os.environ), cfg.project_root)
    # The harness's keys the proxy injects (the cell holds placeholders), and those that enter as they are.
    credentials, upstream_ca, cfg = _credentials(ns, cfg, launch, policy)
    if ns.explain:
        sys.stdout.write(_explain(cfg, plan, policy, launch, credentials))
        return 0
    for note in (*cfg.notes, *launch.notes):
        sys.stderr.write(_shown(f"{PROG}: note: {note}") + "\n")
    faults = state.parse_faults(os.environ.get(state.FAULTS_ENV, ""))
    # A harness that may own the terminal (its TUI, a shell) gets it alone: no status line over it.
    rt = state.Runtime(faults=faults, secrets=dict(cfg.secrets), credentials=credentials, upstream_ca=upstream_ca,
                       environ=dict(os.environ),
                       status_line=sys.stderr.isatty() and not ns.json and not launch.interactive)
    g, _conn = _graph(rt)
    if ns.session_id is not None and graph.load(g, sid) is not None:
        raise AgentcellError("--id", f"session {sid} exists", "give an id not used before")

    def stop(sig: int, _frame: object) -> None:
        rt.stop_requested[sid] = f"signal {sig}"

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, stop)
    sys.stderr.write(f"{PROG}: session {sid}: {cfg.harness} in {cfg.project_root}\n")
    final = graph.run(g, {"session_id": sid, "config": cfg.as_dict(), "argv": launch.argv,
                          "launch": launch.as_dict()})
    summary = _summary(dict(final))
    _print_end(summary)
    if ns.json:
        sys.stdout.flush()
        sys.stdout.write(json.dumps(summary) + "\n")
    if summary_fd is not None:
        with os.fdopen(summary_fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
    if summary["status"] == "aborted":
        return EXIT_ABORTED
    if summary["status"] == "terminated":
        return EXIT_TERMINATED
    code = summary.get("exit_status")
    return 0 if summary["reason"] == "timeout" or not isinstance(code, int) else code


def _check_ceilings(cfg: Any) -> None:
    """Fail closed: a session without root gets its ceilings from a cgroup delegated to its user, or runs
    without them only when told (--ceilings off); never a silent demotion."""
    from ..cell import cgroups

    if os.geteuid() == 0 or not any(cfg.limits) or cgroups.delegated() is not None:
        return
    raise AgentcellError("--ceilings", f"the session's ceilings ({cfg.sources.get('limits')}) need a cgroup, and none "
                         "is delegated to you here", "give --ceilings off to run without them (the audit trail and "
                         f"the summary say so), or {cgroups.how_to_delegate()}")


def _credentials(ns: Any, cfg: Any, launch: Any, policy: dict[str, Any]) -> tuple[Any, str | None, Any]:
    """(the keys the proxy injects, the upstream CA's PEM, the configuration without those keys' values).
    With the proxy, each of the harness's keys that has a home (its provider, --api-base's host) is bound
    there, to the hosts of it the allow-list lets through; the cell gets a placeholder. Without the proxy
    the keys enter the cell as they are (said in a note)."""
    from dataclasses import replace

    from ..harness import profiles

    pem = None
    if ns.upstream_ca:
        from ..network.tlsca import read_bundle

        pem = read_bundle(ns.upstream_ca, "--upstream-ca")
    given = _given_secrets(ns, policy)
    if not cfg.secrets and not given:
        return None, pem, cfg
    back = {cell: host for host, cell in launch.renames.items()}  # (cfg.secrets are by their names in the cell)
    renamed = {k: back.get(k, k) for k in cfg.secrets}  # name in the cell -> name on the host
    bound = profiles.key_bindings(profiles.get(cfg.harness), tuple(renamed.values()), cfg.api_base)
    if policy.get("network") != "proxy":
        if bound:
            names = ", ".join(sorted(renamed[k] for k in bound))
            notes = (*cfg.notes, f"{names} enter the cell as they are: the proxy keeps keys out of the cell "
                     "(--net proxy)")
            cfg = replace(cfg, notes=notes)
        return None, pem, cfg
    from ..network.credentials import CredentialSet
    from ..network.rules import Policy

    rules = Policy.from_rules(policy.get("egress") or ())
    gateway = launch.api_host.rsplit(":", 1)[0] if launch.api_host else None  # (on the allow-list at its port)
    allowed = {k: (tuple(h for h in hosts if h.removeprefix("http://") == gateway or rules.name_verdict(h, 443)[0]),
                   headers) for k, (hosts, headers) in bound.items()}
    allowed = {k: v for k, v in allowed.items() if v[0] and k not in given}
    values = {**{k: cfg.secrets[k] for k in allowed}, **{k: v for k, (v, _) in given.items()}}
    if not values:
        return None, pem, cfg
    creds = CredentialSet.build(values, {**allowed, **{k: b for k, (_, b) in given.items()}})
    return creds, pem, replace(cfg, secrets={k: v for k, v in cfg.secrets.items() if k not in values})


def _given_secrets(ns: Any, policy: dict[str, Any]) -> dict[str, tuple[str, tuple[tuple[str, ...], tuple[str, ...]]]]:
    """``--secret``/``--secret-host``: name -> (value, (hosts, headers)). Read on the host now (a ``cmd:``
    source as the person who ran sudo); each bound host must be on the session's allow-list."""
    if not ns.secret:
        if ns.secret_host:
            raise AgentcellError("--secret-host", "says where a --secret goes", "add --secret NAME")
        return {}
    if policy.get("network") != "proxy":
        raise AgentcellError("--secret", "credentials are injected by the egress proxy", "use --net proxy")
    from ..network.credentials import off_the_list, parse_bindings, read_values
    from ..network.rules import Policy

    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    person = (int(uid), int(gid or uid)) if uid.isdigit() and uid != "0" and (gid or uid).isdigit() else None
    values = read_values(ns.secret, run_as=person)
    bindings = parse_bindings(ns.secret_host or [])
    rules = Policy.from_rules(policy.get("egress") or ())
    out = {}
    for name, value in values.items():
        hosts, headers = bindings.get(name, ((), ()))
        if not hosts:
            raise AgentcellError("--secret", f"{name} is bound to no host", f"add --secret-host {name}=HOST")
        off = off_the_list(hosts, rules.name_verdict)
        if off is not None:
            raise AgentcellError("--secret-host", f"{off} is not on the allow-list",
                                 f"add --allow-domain {off.removeprefix('http://')}")
        out[name] = (value, (hosts, headers))
    for name in bindings:
        if name not in values:
            raise AgentcellError("--secret-host", f"{name} is bound but not given", f"add --secret {name}")
    return out


def _explain(cfg: Any, plan: Any, policy: dict[str, Any], launch: Any, credentials: Any = None) -> str:
    """What a session would be: the harness's launch, what the cell gets, where each value came from."""
    from .. import limits
    from ..policy.compile import explain
    from ..policy.models import SandboxPolicy

    lim = plan.limits
    rows = [("harness", f"{cfg.harness} ({'interactive' if launch.interactive else 'one prompt'})"),
            ("command", " ".join(a if len(a) <= 200 else f"<{len(a)} characters>" for a in launch.argv)),
            ("risk", f"{plan.risk} ({cfg.sources.get('risk', 'default')})"),
            ("ceilings", f"{limits.describe(lim.memory_bytes, lim.cpu_percent, lim.pids)} "
                         f"({cfg.sources.get('limits')})"),
            ("api base", cfg.api_base or "the harness's own"),
            ("allow-list", " ".join([*plan.allow_presets, *plan.allow_domains]) or "-"),
            ("secrets", " ".join(sorted(cfg.secrets)) or "-"),
            ("injected", "; ".join(f"{s.name} -> {','.join(s.hosts)} ({','.join(s.headers) or 'any header'})"
                                   for s in credentials.secrets.values()) if credentials else "-"),
            ("settings", " ".join(("~/" if f.home else "seed/") + f.path for f in launch.files) or "-"),
            ("home from", cfg.home_from or "-"),
            ("caches", "at /cache, the project's own in " + _cache_place(cfg) if cfg.cache else "off (--cache off)"),
            ("monitor", _monitor_sees())]
    width = max(len(k) for k, _ in rows)
    head = "".join(f"{k:>{width}}: {v}\n" for k, v in rows)
    return head + explain(SandboxPolicy.model_validate(policy)) + "".join(f"note: {n}\n" for n in
                                                                       (*cfg.notes, *launch.notes))


def _monitor_sees() -> str:
    """What the escape monitor of this session can see, as plainly as the user needs it."""
    if os.geteuid() == 0:
        return ("every source: failed calls (eBPF), Landlock denials (the audit stream), execs (the proc "
                "connector), created files (fanotify), seccomp refusals, the decoys, the proxy ('agentcell "
                "doctor' says which this host has)")
    return ("without root, only what the cell reports itself: seccomp refusals, a read of a decoy credential "
            "(inotify), each connection (the proxy); what the mounts and Landlock refuse inside the cell (a "
            "read of a path it does not have, a write outside the project, an exec) is contained but not seen: "
            "eBPF, the audit stream, the proc connector and fanotify need root")


def _cache_place(cfg: Any) -> str:
    from .. import caches

    return caches.store() + "/" + caches.key(cfg.project_root, cfg.agent)


def _summary(st: dict[str, Any]) -> dict[str, Any]:
    escape = st.get("escape")
    result = st.get("result") or {}
    return {
        "session": st.get("session_id"),
        "status": st.get("status"),
        "reason": st.get("reason", ""),
        "escape_target": escape.get("target") if escape else None,
        "escape": escape,
        "harness": (st.get("config") or {}).get("harness"),
        "declared_paths": (st.get("policy") or {}).get("rw_paths", []),
        "ceilings": _ceilings(st),
        "os_user": (st.get("account") or {}).get("name"),
        "backup_id": st.get("backup_id"),
        "workspace": st.get("workspace_dir"),
        "cell_id": st.get("cell_id"),
        "exit_status": result.get("exit_status"),
        "duration_s": result.get("duration_s"),
        "events": len(st.get("events") or []),
        "problems": st.get("problems") or [],
        "warnings": st.get("warnings") or [],
        "audit_error": st.get("audit_error"),
    }


def _ceilings(st: dict[str, Any]) -> str:
    from .. import limits

    cfg = st.get("config") or {}
    if cfg.get("ceilings") is False:
        return "off (--ceilings off)"
    return limits.describe(*(cfg.get("limits") or (None, None, None)))


def _print_end(s: dict[str, Any]) -> None:
    line = f"{PROG}: session {s['session']} {s['status']}"
    if s["reason"]:
        line += f" ({s['reason']})"
    sys.stderr.write(_shown(line) + "\n")
    if str(s.get("ceilings", "")).startswith("off"):
        sys.stderr.write(f"{PROG}: it ran without ceilings (--ceilings off): no memory, CPU or task limit held it\n")
    if s["backup_id"]:
        sys.stderr.write(f"{PROG}: backup {s['backup_id']}: 'agentcell session diff {s['session']}' shows the "
                         f"changes, 'agentcell session restore {s['session']}' undoes them\n")
    if s["workspace"]:
        sys.stderr.write(f"{PROG}: your project was not written: 'agentcell session review {s['session']}' shows "
                         f"the agent's changes, 'agentcell session apply {s['session']}' lands them, "
                         f"'agentcell session discard {s['session']}' drops them\n")
    for w in s["warnings"]:
        sys.stderr.write(_shown(f"{PROG}: warning: {w}") + "\n")
    for p in s["problems"]:
        sys.stderr.write(_shown(f"{PROG}: warning: teardown left: {p}") + "\n")
    if s["audit_error"]:
        sys.stderr.write(_shown(f"{PROG}: warning: {s['audit_error']}") + "\n")


def _shown(text: str) -> str:
    return printable(text)


# ---- list, show, stop, restore, diff, recover ---------------------------------------------------

def _new_file(path: str, field: str) -> int:
    """A file made for us now (never one that exists, never through a link), mode 0600."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise AgentcellError(field, f"cannot make {path}: {e.strerror}", "give a new file's path") from None


def _checked_id(sid: str, field: str = "ID") -> str:
    from ..hostfs import shown

    if not sid or len(sid) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in sid):
        fix = "1-64 of letters, digits, '-' and '_'" if field != "ID" else "see 'agentcell session list'"
        raise AgentcellError(field, f"'{shown(sid, 80)}' is not a session id", fix)
    return sid


def _load(sid: str) -> tuple[Any, dict[str, Any]]:
    _checked_id(sid)
    from ..session import graph

    g, _conn = _graph()
    st = graph.load(g, sid)
    if st is None:
        raise AgentcellError("ID", f"no session {sid}", "see 'agentcell session list'")
    from ..session.state import check_recorded

    check_recorded(st)
    return g, dict(st)


def _check_env_file_untouched(path: str) -> None:
    """An --env-file that decides where root writes must not lie where an earlier session's agent
    could write (its project, its declared paths): a root-owned file the agent rewrote through its
    grant and renamed there looks like root's own once the grant is gone. Checked against the
    sessions this state dir records."""
    from ..session import graph

    real = os.path.realpath(path)
    ancestors: dict[tuple[int, int], str] = {}  # by identity too: a former project renamed since
    d = os.path.dirname(real)
    while True:
        try:
            dst = os.stat(d)
            ancestors[(dst.st_dev, dst.st_ino)] = d
        except OSError:
            pass
        if d == os.path.dirname(d):
            break
        d = os.path.dirname(d)
    g, conn = _graph()
    try:
        for sid in graph.session_ids(conn):
            st = graph.load(g, sid) or {}
            cfg = st.get("config") or {}
            places = [cfg.get("project_root") or "", *(cfg.get("declared_paths") or []),
                      *((st.get("policy") or {}).get("rw_paths") or [])]
            hit = next((place for place in (os.path.realpath(p) for p in places if p)
                        if real == place or real.startswith(place.rstrip("/") + "/")), None)
            hit = hit or next((ancestors[(i[0], i[1])] for i in st.get("root_ids") or []
                               if len(i) == 2 and (i[0], i[1]) in ancestors), None)
            if hit is not None:
                raise AgentcellError("--env-file", f"{path} lies in {hit}, where the agent of session {sid} "
                                     "could write", "keep the file where no agent has worked, or give the "
                                     "values as flags")
    finally:
        conn.close()


def _list(ns: Any) -> int:
    from ..session import graph

    if ns.unapplied:
        from .. import workspace

        waiting = workspace.listing(unapplied_only=True)
        if ns.json:
            sys.stdout.write(json.dumps(waiting) + "\n")
        for w in [] if ns.json else waiting:
            sys.stdout.write(_shown(f"{w['session']}  {w['project']}  (review, apply or discard it)") + "\n")
        return 0

    g, conn = _graph()
    rows = []
    for sid in graph.session_ids(conn):
        st = graph.load(g, sid)
        if st is None:
            continue
        rows.append({**_summary(dict(st)), "needs_recover": graph.unfinished(st)})
    if ns.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    for r in rows:
        status = str(r["status"] or "?") + (" (supervisor gone: session recover)" if r["needs_recover"] else "")
        sys.stdout.write(_shown(f"{r['session']}  {r['harness'] or '?':<11} {status:<10} {r['reason']}") + "\n")
    return 0


def _show(ns: Any) -> int:
    _g, st = _load(ns.id)
    st["argv"] = [a if len(a) <= 200 else f"<{len(a)} characters>" for a in st.get("argv", [])]
    if ns.json:
        sys.stdout.write(json.dumps(st, default=str) + "\n")
    else:
        from ..monitor.lines import chain, event_kind, event_line

        for k, v in st.items():
            sys.stdout.write(_shown(f"{k}: {json.dumps(v, default=str)}") + "\n")
        for ev in st.get("events") or []:  # what the monitor saw, each with who did it
            sys.stdout.write(f"{event_kind(ev)}: {event_line(ev)}\n")
            if chain(ev):
                sys.stdout.write(f"  by: {chain(ev)}\n")
    return 0


def _stop(ns: Any) -> int:
    from ..session import state

    _g, st = _load(ns.id)
    if st.get("finished"):
        raise AgentcellError("ID", f"session {ns.id} has ended ({st.get('status')})", "nothing to stop")
    if not state.supervisor_alive(st):  # type: ignore[arg-type]
        raise AgentcellError("ID", f"session {ns.id} has no supervisor any more",
                             "'agentcell session recover' finishes its teardown")
    os.kill(int(st["supervisor"]["pid"]), signal.SIGTERM)  # it terminates the cell and tears down
    sys.stderr.write(f"{PROG}: asked the supervisor of {ns.id} (pid {st['supervisor']['pid']}) to stop it\n")
    return 0


def _ended(st: dict[str, Any], sid: str) -> None:
    from ..session import state

    if not st.get("finished") and state.supervisor_alive(st):  # type: ignore[arg-type]
        raise AgentcellError("ID", f"session {sid} is still running", f"stop it first: agentcell session stop {sid}")
    if not st.get("backup_id"):
        raise AgentcellError("ID", f"session {sid} has no backup (it {st.get('status')} before its preflight)",
                             "nothing was changed by an agent")


def _store(st: dict[str, Any]) -> Any:
    from ..snapshot.store import Store

    return Store((st.get("config") or {}).get("backup_dir"))


def _restore(ns: Any) -> int:
    from ..audit.trail import AuditLog

    _g, st = _load(ns.id)
    _ended(st, ns.id)
    n = _store(st).restore(st["backup_id"])
    AuditLog((st.get("config") or {}).get("audit_log_path")).append("session.restore", session=ns.id,
                                                                    backup_id=st["backup_id"], entries=n)
    sys.stderr.write(f"{PROG}: restored {n} entries of {', '.join(st['policy']['rw_paths'])} from backup "
                     f"{st['backup_id']}\n")
    return 0


def _diff(ns: Any) -> int:
    _g, st = _load(ns.id)
    _ended(st, ns.id)
    store = _store(st)
    changes = store.diff(st["backup_id"])
    if ns.json:
        sys.stdout.write(json.dumps(changes) + "\n")
        return 0
    for kind, mark in (("added", "A"), ("modified", "M"), ("deleted", "D")):
        for path in changes[kind]:
            sys.stdout.write(_shown(f"{mark} {path}") + "\n")
    for path in changes["modified"]:
        text = store.text_diff(st["backup_id"], path)
        if text:
            sys.stdout.write(printable(text, keep="\n\t"))
    return 0


def _review(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(_checked_id(ns.id))
    r = workspace.review(ns.id, diffs=ns.diff)
    workspace.record_review(r)
    if ns.json:
        sys.stdout.write(json.dumps(r) + "\n")
        return 0
    marks = {"added": "A", "modified": "M", "deleted": "D", "renamed": "R", "mode": "m", "type": "T"}
    base = r["base"]["commit"] or "the project's files"
    sys.stdout.write(_shown(f"session {r['session']} ({r['state']}) on {r['project']}, from {base}") + "\n")
    for c in r["changes"]:
        what = f"{c['from']} -> {c['path']}" if c["change"] == "renamed" else c["path"]
        if c.get("link") is not None:
            what += f" (a link to {c['link']})"
        if c["change"] in ("mode", "added", "type") and c.get("mode") is not None and c.get("link") is None:
            what += f" (mode {c['mode']:o})"
        notes = [n for n, on in (
            ("not a file, a link or a directory: never applied", c.get("special")),
            ("committed: in the branch", c.get("committed")),
            ("ignored by git: left out unless --theirs names it", c.get("ignored")),
            ("CONFLICT: you changed it too since the session began", c["conflict"]),
            (f"decides what runs ({c['control']}): applied only with --theirs", c.get("control")),
            (f"replaces {len(c.get('removes') or [])} file(s) of yours", c.get("removes") and not c.get("dir")))
            if on]
        if c.get("dir"):
            what += "/ (a directory)"
        sys.stdout.write(_shown(f"{marks[c['change']]} {what}" + "".join(f" ({n})" for n in notes)) + "\n")
        for f in (c.get("removes") or []) if c.get("dir") else []:
            sys.stdout.write(_shown(f"  D {f}") + "\n")
    if not r["changes"]:
        sys.stdout.write("no change to the files\n")
    for cm in r["commits"]:
        sys.stdout.write(_shown(f"commit {cm['commit'][:12]} {cm['subject']} ({cm['author']}), "
                                f"{len(cm['files'])} file(s)") + "\n")
        for f in cm["control"]:
            sys.stdout.write(_shown(f"  changes {f}, which decides what git, your shell or your agent runs") + "\n")
    if r["branch"]:
        sys.stdout.write(_shown(f"apply brings the commits as the branch {r['branch']}") + "\n")
    if r.get("git_problem"):
        sys.stdout.write(_shown(f"the agent's commits are not taken: {r['git_problem']}") + "\n")
    if ns.diff:
        for c in r["changes"]:
            if c.get("diff"):
                sys.stdout.write(printable(c["diff"], keep="\n\t"))
    return 0


def _workspace_ended(sid: str) -> None:
    """Review, apply and discard wait for the session's end (its agent may still be writing the change
    set, which is walked as root)."""
    from ..session import graph, state

    try:
        g, _conn = _graph()
        st = graph.load(g, sid)
    except AgentcellError:
        return
    if st is not None and not st.get("finished") and state.supervisor_alive(st):
        raise AgentcellError("ID", f"session {sid} is still running", f"stop it first: agentcell session stop {sid}")


def _apply(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(_checked_id(ns.id))
    try:
        r = workspace.apply(ns.id, ours=ns.ours, theirs=ns.theirs)
    except OSError as e:  # rolled back already (workspace._land)
        raise AgentcellError("apply", f"{e.filename or ''}: {e.strerror}; nothing was written (what had been was "
                             "put back)", "fix the cause and apply again") from None
    if ns.json:
        sys.stdout.write(json.dumps(r) + "\n")
        return 0
    sys.stdout.write(_shown(f"applied {len(r['landed'])} path(s) of session {ns.id}") + "\n")
    for p in r["landed"]:
        sys.stdout.write(_shown(f"  {p}") + "\n")
    if r["branch"]:
        sys.stdout.write(_shown(f"its commits: branch {r['branch']} (git merge or cherry-pick it)") + "\n")
    for w in r.get("warnings") or []:
        sys.stderr.write(_shown(f"{PROG}: warning: {w}") + "\n")
    return 0


def _discard(ns: Any) -> int:
    from .. import workspace

    _workspace_ended(_checked_id(ns.id))
    try:
        workspace.discard(ns.id)
    except OSError as e:
        raise AgentcellError("discard", f"{e.filename or ''}: {e.strerror}",
                             "fix the cause and discard again") from None
    sys.stdout.write(_shown(f"discarded session {ns.id}'s workspace") + "\n")
    return 0


def _recover(ns: Any) -> int:
    from ..session import graph

    g, conn = _graph()
    done = []
    for sid in graph.session_ids(conn):
        st = graph.load(g, sid)
        if st is None or not graph.unfinished(st):
            continue
        final = graph.recover(g, sid)
        done.append(_summary(dict(final)))
        _print_end(done[-1])
    if ns.json:
        sys.stdout.write(json.dumps(done) + "\n")
    elif not done:
        sys.stderr.write(f"{PROG}: nothing to recover\n")
    return 0
