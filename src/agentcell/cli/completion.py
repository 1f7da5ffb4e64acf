"""``agentcell completion bash|zsh|fish``: a shell completion script written from the commands' own parsers
(by shtab), so it offers exactly the commands and options their ``--help`` lists.

    agentcell completion bash > /etc/bash_completion.d/agentcell
"""
from __future__ import annotations

import sys

from .common import Parser, commands, walk

PROG = "agentcell completion"
SHELLS = ("bash", "zsh", "fish")
# Metavars that name a path on the host: the shell offers its files (or directories) there.
FILES = ("PATH", "FILE", "PEM", "SOURCE", "TARGET", "PLANS.jsonl", "ARCHIVE")
DIRECTORIES = ("DIR",)


def parser() -> Parser:
    p = Parser(prog=PROG, description="Print a completion script for agentcell's commands and options.",
               epilog="bash: agentcell completion bash > /etc/bash_completion.d/agentcell (or source it from "
               "~/.bashrc); zsh: agentcell completion zsh > \"${fpath[1]}/_agentcell\"; fish: agentcell completion "
               "fish > ~/.config/fish/completions/agentcell.fish")
    p.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    return p


def tree() -> Parser:
    """All of agentcell's command line as one parser: each command's ``parser()`` is a subcommand."""
    p = Parser(prog="agentcell", description="Run AI coding agents in a least-privilege Linux cell.")
    p.add_argument("--version", "-V", action="store_true", help="print agentcell's version")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary, own in commands():
        if own is None:
            sub.add_parser(name, help=summary)
        else:
            sub.add_parser(name, help=summary, parents=[own], add_help=False)
    return p


def _with_paths(p: Parser, shtab: object) -> None:
    """Mark the options and arguments that take a host path, so the shell completes them as files."""
    for _words, each in walk(p, []):
        for action in each._actions:  # noqa: SLF001 - argparse keeps a parser's arguments here, and only here
            if action.metavar in FILES:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
            elif action.metavar in DIRECTORIES:
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    import shtab

    whole = tree()
    _with_paths(whole, shtab)
    sys.stdout.write(shtab.complete(whole, shell=ns.shell))
    return 0
