"""``agentcell cache``: the toolchain caches sessions keep per project (:mod:`agentcell.caches`).

    agentcell cache list [--json]
    agentcell cache clear (--project DIR [--agent NAME] | --all)
"""
from __future__ import annotations

import json
import os
import time

from ..errors import AgentcellError, printable, report
from .common import Parser

PROG = "agentcell cache"


def parser() -> Parser:
    p = Parser(prog=PROG, description="The pip, uv, npm, pnpm, yarn, cargo and go caches a project's sessions "
               "keep in agentcell's store (at /cache in the cell).")
    sub = p.add_subparsers(dest="cmd", metavar="list|clear", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("list", help="each project's cache: where, whose, how big, last used")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("clear", help="remove a project's cache (the next session starts cold)")
    sp.add_argument("--project", metavar="DIR", help="the project whose cache goes")
    sp.add_argument("--agent", metavar="NAME", help="the cache of this persistent agent on --project")
    sp.add_argument("--all", action="store_true", help="every cache in the store")
    return p


def _size(n: int) -> str:
    if n < 1024:
        return f"{n}B"
    size, unit = n / 1024, "K"
    for bigger in ("M", "G"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f}{unit}"


def main(argv: list[str]) -> int:
    from .. import caches

    ns = parser().parse_args(argv)
    try:
        if ns.cmd == "list":
            found = caches.entries()
            if ns.json:
                print(json.dumps(found))
                return 0
            if not found:
                print(f"no caches in {caches.store()}")
                return 0
            for e in found:
                used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) if e["last_used"] else "-"
                who = f" (agent {e['agent']})" if e["agent"] else ""
                size = "size unknown" if e["bytes"] is None else _size(e["bytes"])
                print(f"{printable(str(e['project']))}{printable(who)}: {size}, "
                      f"{', '.join(e['tools']) or 'empty'}; last used {used}\n"
                      f"    {printable(e['path'])} (owner {e['owner']})")
            return 0
        if ns.all == bool(ns.project):
            raise AgentcellError("clear", "say which cache" if not ns.all else "--all and --project contradict",
                                 "give --project DIR (and --agent NAME for an agent's), or --all")
        if ns.agent and not ns.project:
            raise AgentcellError("--agent", "names an agent's cache on a project", "add --project DIR")
        found = caches.entries()
        if ns.project:
            want = caches.key(os.path.abspath(ns.project), ns.agent)
            found = [e for e in found if e["key"] == want]
            if not found:
                raise AgentcellError("--project", f"{printable(ns.project)} has no cache"
                                     + (f" of agent {printable(ns.agent)}" if ns.agent else ""),
                                     "'agentcell cache list' shows the caches there are")
        for path in caches.clear(found):
            print(f"removed {printable(path)}")
        return 0
    except OSError as e:
        return report(PROG, AgentcellError("cache", f"{printable(e.filename or '')}: {e.strerror}",
                                           "run as the user whose sessions made it (root's: through sudo)"))
    except AgentcellError as e:
        return report(PROG, e)
