"""``agentcell`` entry point: parse only the subcommand, then import just what it needs.

``agentcell run`` is called once per agent tool call, so nothing heavy (pydantic, LangGraph, rich,
pyroute2) is imported on its path.
"""
from __future__ import annotations

import sys

COMMANDS = {
    "run": ("agentcell.cli.run", "launch a command in a cell"),
    "agent": ("agentcell.cli.agent", "agent accounts: a UNIX user per agent, folders shared through ACLs"),
    "audit": ("agentcell.cli.audit", "verify and read the hash-chained audit trail"),
    "doctor": ("agentcell.cli.doctor", "report what this machine supports"),
    "check": ("agentcell.cli.check", "prove a harness works in a session here (a scripted model, a fake internet)"),
    "session": ("agentcell.cli.session", "run an agent in a planned, backed-up, watched and audited session"),
    "cache": ("agentcell.cli.cache", "list and clear the toolchain caches a project's sessions keep"),
    "snapshot": ("agentcell.cli.snapshot", "take, verify, restore and diff snapshots of a project"),
    "warm": ("agentcell.cli.warm", "start/stop the warm launcher that makes agentcell run fast"),
    "cell": ("agentcell.cli.cell", "a live cell: start it once, exec many commands in it, stop it"),
    "mcp": ("agentcell.cli.mcp", "an MCP server (stdio) whose tools run in one live cell"),
    "fleet": ("agentcell.cli.fleet", "run session plans on the nodes of a Ray cluster (agentcell[ray])"),
    "k8s": ("agentcell.cli.k8s", "session plans as Kubernetes agent-sandbox resources, and their image"),
    "completion": ("agentcell.cli.completion", "print a shell completion script (bash, zsh, fish)"),
}

USAGE = "usage: agentcell [--version] COMMAND [ARGS...]\n\ncommands:\n" + "".join(
    f"  {name:<12}{help_}\n" for name, (_, help_) in COMMANDS.items()
) + "\n'agentcell COMMAND --help' for a command's options.\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    if args[0] in ("--version", "-V"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            sys.stdout.write(f"agentcell {version('agentcell')}\n")
        except PackageNotFoundError:  # (run from a checkout that was never installed)
            sys.stdout.write("agentcell (not installed: no version recorded)\n")
        return 0
    entry = COMMANDS.get(args[0])
    if entry is None:
        from ..errors import EXIT_USAGE

        sys.stderr.write(f"agentcell: unknown command '{args[0]}' (one of: {', '.join(COMMANDS)})\n")
        return EXIT_USAGE
    from ..errors import Terminated, raise_on_termination, report_notes

    raise_on_termination()  # (a command that handles them itself, as run and session start do, sets its own)
    try:
        return int(__import__(entry[0], fromlist=["main"]).main(args[1:]))  # not importlib: ~0.6 ms
    except Terminated as e:
        report_notes("agentcell", e)
        return 128 + e.signum
    except BrokenPipeError:  # `agentcell doctor | head`: the reader left; not an error worth a traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt as e:
        report_notes("agentcell", e)
        return 130


if __name__ == "__main__":
    sys.exit(main())
