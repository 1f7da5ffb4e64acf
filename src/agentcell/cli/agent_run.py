"""``agentcell agent run``: a command as an agent account, in a cell with its home and shares. It runs once
per tool call: well-formed options are parsed without argparse, and only the account's record is loaded."""
from __future__ import annotations

import sys

from ..errors import AgentcellError

TYPE_CHECKING = False  # see cell/spec.py
if TYPE_CHECKING:
    from argparse import Namespace

PROG = "agentcell agent"
DEFAULT = "agent"  # the agent a command means when it names none


class RunArgs:
    """``agent run``'s options, parsed without argparse when they are well formed (it runs per command)."""

    cmd, agent, json, verbose = "run", DEFAULT, False, False
    directory: str | None = None

    def __init__(self) -> None:
        self.env: list[str] = []
        self.command: list[str] = []


_VALUES = {"--agent": "agent", "-a": "agent", "--env": "env", "-e": "env", "-d": "directory",
           "--directory": "directory"}


def fast_parse(argv: list[str]) -> RunArgs | None:
    """None for anything unusual (help, an unknown option, no ``--``): argparse then explains it."""
    if argv[:1] != ["run"]:
        return None
    ns, i = RunArgs(), 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            ns.command = argv[i + 1:]
            return ns
        if arg in ("--json", "--verbose", "-v"):
            setattr(ns, "json" if arg == "--json" else "verbose", True)
        elif arg in _VALUES and i + 1 < len(argv):
            i += 1
            if _VALUES[arg] == "env":
                ns.env.append(argv[i])
            else:
                setattr(ns, _VALUES[arg], argv[i])
        else:
            return None
        i += 1
    return None



def run_as_agent(ns: Namespace | RunArgs) -> int:
    from ..accounts.running import run_argv
    from . import run

    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise AgentcellError("command", "no command given", "put it after --, e.g. agentcell agent run -- true")
    rec, argv = run_argv(ns.agent, command, env=ns.env, directory=ns.directory, json=ns.json)
    if ns.verbose:
        import shlex

        sys.stderr.write(f"+ agentcell run {shlex.join(argv)}\n")
    args = run.parse(argv)
    args.agent_home = rec.home
    try:
        return run.execute(args)
    finally:  # what it planted in its home for the host's own services, whatever the run's end
        from ..accounts.accounts import defuse_home

        for line in defuse_home(rec.home, rec.uid, rec.gid):
            sys.stderr.write(f"{PROG}: warning: {line}\n")
