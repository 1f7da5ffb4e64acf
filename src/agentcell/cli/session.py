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
import sys

from ..errors import AgentcellError, report
from ..session.report import EXIT_ABORTED, EXIT_TERMINATED, PROG
from ..session.request import StartRequest
from .common import Parser

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
    sp.add_argument("--audit-witness", metavar="W", dest="audit_witness", help="seal the trail to this witness off "
                    "the host, if it is not sealed yet (AUDIT_WITNESS; file:PATH, http(s)://HOST[:PORT][/BASE], "
                    "syslog://HOST[:PORT]): signed heads as the session runs and at its end (prints the key once)")
    sp.add_argument("--audit-witness-required", action="store_true", dest="audit_witness_required",
                    help="stop the session when the witness does not take a head (default: go on, and say so)")
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
            return _start(StartRequest.of(ns, harness_args))
        from ..session import commands

        return commands.run(ns.cmd, ns)
    except AgentcellError as e:
        return report(PROG, e)


def _start(req: StartRequest) -> int:
    from ..session import report as said
    from ..session import start

    prepared = start.prepare(req)
    if req.explain:
        sys.stdout.write(said.explain(prepared.config, prepared.plan, prepared.policy, prepared.launch,
                                      prepared.credentials))
        return 0
    summary = start.run(prepared)
    said.print_end(summary)
    if req.json:
        sys.stdout.flush()
        sys.stdout.write(json.dumps(summary) + "\n")
    if prepared.summary_fd is not None:
        with os.fdopen(prepared.summary_fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
    return said.exit_code(summary)
