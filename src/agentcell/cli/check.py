"""``agentcell check --harness H``: run the installed harness through a real session against the bundled
scripted model endpoint on a fake internet made for the check (:mod:`agentcell.harness.check`).

    sudo agentcell check --harness claude_code [--json] [-- SESSION FLAGS]

Exit status: 0 if the edit landed and the credential read was caught and ended the session; 1 if not;
125 if the check cannot run here (not root, harness not installed).
"""
from __future__ import annotations

import json
import subprocess
import sys

from ..errors import AgentcellError, report
from .common import Parser

PROG = "agentcell check"


def parser() -> Parser:
    p = Parser(prog=PROG, usage="%(prog)s --harness H [--json] [-- SESSION FLAGS]",
               description="Prove a harness works in a session here: one turn edits a file, one reads a "
               "credential, against a scripted model endpoint on a fake internet.",
               epilog="What follows -- goes to the session as 'agentcell session start' flags.")
    p.add_argument("--harness", required=True, help="claude_code, codex, opencode, gemini, aider, copilot")
    p.add_argument("--json", action="store_true", help="print the details as one JSON object, last on stdout")
    return p


def main(argv: list[str]) -> int:
    args, extra = list(argv), []
    if "--" in args:  # the session's flags: not ours to parse
        i = args.index("--")
        args, extra = args[:i], args[i + 1:]
    ns = parser().parse_args(args)
    from ..harness import check

    def say(line: str) -> None:
        sys.stderr.write(f"{PROG}: {line}\n")
        sys.stderr.flush()

    try:
        passed, details = check.run(ns.harness, out=say, extra=extra)
    except AgentcellError as e:
        return report(PROG, e)
    except (OSError, subprocess.SubprocessError) as e:  # the machine could not make the check's parts
        return report(PROG, AgentcellError("check", f"could not set it up: {e}", "see 'agentcell doctor'"))
    sys.stderr.write(f"{PROG}: {ns.harness} {'passed' if passed else 'FAILED'}\n")
    if ns.json:
        sys.stdout.write(json.dumps({"passed": passed, **details}) + "\n")
    return 0 if passed else 1
