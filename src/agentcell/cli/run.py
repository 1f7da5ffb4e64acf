"""``agentcell run``: launch one command in a cell. The hot path: the standard library's cheap parts,
agentcell.cell, the compiler and the runner's light top (tests/test_run.py pins what it imports).

Parse (:mod:`.runargs`), compile the plan the flags fill (:func:`agentcell.policy.plan.compile_spec`),
run it (:mod:`agentcell.runner`), print.
"""
from __future__ import annotations

import os
import sys

from .. import hostfs, runner
from ..cell.spec import TYPE_CHECKING, CellSpec
from ..errors import AgentcellError, report
from ..policy.plan import compile_spec
from .runargs import PROG, Args, to_plan
from .runargs import parse as parse
from .runargs import parser as parser

if TYPE_CHECKING:
    from argparse import Namespace


def build_spec(ns: Args | Namespace) -> CellSpec:
    """The cell ``agentcell run``'s options ask for, every refusal made (a :class:`PolicyError`)."""
    try:
        here: str | None = os.getcwd()
    except OSError:
        here = None
    return compile_spec(to_plan(ns), environ=os.environ, host_cwd=here)


def main(argv: list[str]) -> int:
    return execute(parse(argv))


def execute(ns: Args | Namespace) -> int:
    command = ns.command
    try:
        spec = build_spec(ns)
        if ns.explain:
            info = runner.explain(spec, command)
            if ns.json:
                import json

                sys.stdout.write(json.dumps(info) + "\n")
            else:
                sys.stdout.write(runner.explain_text(info))
            return 0
        if not command:
            raise AgentcellError("command", "no command given", "put it after --, e.g. agentcell run -- true")
        credentials, upstream_ca = runner.credentials(spec, ns.secret, ns.secret_host, ns.upstream_ca)
        result = runner.run(spec, command, ns.timeout, monitor=ns.on_escape or "terminate" if ns.monitor else None,
                            warm=not ns.no_warm and hostfs.warm_wanted(), credentials=credentials,
                            upstream_ca=upstream_ca)
    except AgentcellError as e:
        return report(PROG, e)
    for line in runner.ended(result, ns.timeout):
        sys.stderr.write(f"{PROG}: {line}\n")
    if ns.json:
        import json

        sys.stdout.flush()
        sys.stdout.write(json.dumps({"command": command, **result}) + "\n")
    return int(result["exit_status"])
