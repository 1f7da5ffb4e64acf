"""``agentcell fleet``: run session plans on the nodes of a Ray cluster (the ``agentcell[ray]`` extra).

    agentcell fleet run PLANS.jsonl [--address HOST:6379] [--owner USER] [--out RESULTS.jsonl] [--json]
    agentcell fleet recover RUN --node NAME [--address HOST:6379] [--json]
    agentcell fleet plans PLANS.jsonl        check a plans file; print each plan's session start line

A plan (one JSON object per line) names the session and its project, and says what ``session start``
would be told: see :mod:`agentcell.fleet.plan`. Results: one JSON object per plan (the session's summary,
its audit records and verdict, its diff), in ``--out``; a table on stdout.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from ..errors import AgentcellError, printable, report
from .caps import cap_args, caps
from .common import Parser

PROG = "agentcell fleet"
EPILOG = """a plan's fields (JSON; only name and project are required):
  name            1-36 of a-z, 0-9, '-': the session is RUN-NAME on its node
  project         {"files": {PATH: TEXT}} | {"path": DIR on every node} | {"git": URL, "ref": REF}
  harness         as session start --harness (default shell)
  args | script | prompt
                  the harness's arguments; the scripted harness's steps; a one-prompt harness's prompt
  wall_clock_s, risk, memory, cpu, pids, network, allow_domains, deny_domains, allow_presets,
  allow_ranges, resolver, api_base, model, env, keep_env
                  as session start's flags of those names (keep_env: names whose values the nodes'
                  --node-env-file holds)
nodes: ray start --resources '{"agentcell_cells": N}' [--labels agentcell.node=NAME], as root
exit status: 0 every session ran to its end and its audit trail verified; 1 some did not (lost, failed,
  refused, trail not whole); 125 bad input (nothing was sent)
"""


def parser() -> Parser:
    import argparse

    p = Parser(prog=PROG, description="Run session plans on the nodes of a Ray cluster.", epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="run|recover|plans", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("run", help="run every plan of a file on the cluster")
    sp.add_argument("plans", metavar="PLANS.jsonl")
    _cluster_args(sp)
    sp.add_argument("--owner", metavar="USER", help="the account each node gives the projects to (it must exist on "
                    "every node; default: the person behind sudo)")
    cap_args(sp)
    sp.add_argument("--node-env-file", metavar="PATH", help="a .env file on every node (root's, mode 0600) with the "
                    "harnesses' keys: each session reads it there (session start --env-file); plans carry none")
    sp.add_argument("--recover-wait", type=float, default=300.0, metavar="S", help="how long to wait for a lost "
                    "node to come back before leaving its sessions lost (default 300)")
    sp.add_argument("--out", metavar="FILE", help="write each plan's whole result, one JSON object a line")
    sp.add_argument("--json", action="store_true", help="print the results as one JSON array, last on stdout")
    sp = sub.add_parser("recover", help="finish a run's sessions on a node that came back")
    sp.add_argument("run_id", metavar="RUN")
    sp.add_argument("--node", required=True, metavar="NAME")
    _cluster_args(sp)
    sp.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait this long for the node")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("plans", help="check a plans file and print each plan's session start line")
    sp.add_argument("plans", metavar="PLANS.jsonl")
    return p


def _cluster_args(sp: Any) -> None:
    sp.add_argument("--address", metavar="HOST:PORT", help="the Ray cluster's GCS address (default: RAY_ADDRESS, "
                    "or the cluster this node is part of)")
    sp.add_argument("--base", metavar="DIR", help="where each node keeps its sessions, projects and ledger "
                    "(default /var/lib/agentcell-fleet; BASE/NODE on each node)")


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    try:
        return int(globals()[f"_{ns.cmd}"](ns))
    except AgentcellError as e:
        return report(PROG, e)


def _plans(ns: Any) -> int:
    from ..fleet import plan

    for p in plan.read(ns.plans):
        line = shlex.join(["agentcell", "session", "start", *p.start_args(f"<{p.name}>")])
        sys.stdout.write(printable(f"{p.name}: {line}") + "\n")
    return 0


def _own_stdout() -> Any:
    """Our stdout, kept for the table and the JSON; what Ray prints there itself (a node marked dead,
    from C++ or Python) goes to stderr from now on."""
    ours = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return ours


def _run(ns: Any) -> int:
    from ..fleet import node, plan, ray_cluster

    plans = plan.read(ns.plans)  # every line checked before anything is sent
    owner, base, held = node.owner_of(ns.owner), node.base_dir(ns.base), caps(ns, keys=bool(ns.node_env_file))
    if ns.node_env_file and not os.path.isabs(ns.node_env_file):
        raise AgentcellError("--node-env-file", f"{ns.node_env_file} is not an absolute path",
                             "give the file's full path on the nodes")
    for p in plans:
        held.check(p, f"{ns.plans}: {p.name}")
    if ns.out:
        out = open(ns.out, "x", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run
    stdout = _own_stdout()
    cluster = ray_cluster()
    cluster.connect(ns.address)
    run_id = node.new_run_id()
    progress = Progress(len(plans))
    sys.stderr.write(f"{PROG}: run {run_id}: {len(plans)} sessions\n")
    results = cluster.run(plans, run_id=run_id, base=base, owner=owner, recover_wait_s=ns.recover_wait, caps=held,
                          env_file=ns.node_env_file, on_result=progress.add)
    progress.end()
    if ns.out:
        with out:
            for r in results:
                out.write(json.dumps(r) + "\n")
    return _report(stdout, results, ns.json)


def _recover(ns: Any) -> int:
    from ..fleet import node, ray_cluster

    base = node.base_dir(ns.base)
    stdout = _own_stdout()
    cluster = ray_cluster()
    cluster.connect(ns.address)
    got = cluster.recover_on(ns.run_id, base, ns.node, None, ns.wait)
    if got is None:
        raise AgentcellError("--node", f"no live node {ns.node} offers agentcell_cells",
                             "start it again, or give --wait S")
    return _report(stdout, got, ns.json)


def _report(stdout: Any, results: list[dict[str, Any]], as_json: bool) -> int:
    """The table (and the JSON) on our stdout; 0 if every session ran to its end, its trail verified."""
    from ..fleet.node import whole

    stdout.write(table(results))
    if as_json:
        stdout.write(json.dumps(results) + "\n")
    stdout.flush()
    return 0 if all(whole(r) for r in results) else 1


class Progress:
    """A bar on a terminal; a line per session otherwise (a log)."""

    def __init__(self, total: int) -> None:
        self.total, self.tty = total, sys.stderr.isatty()
        self.counts: dict[str, str] = {}
        self.done: set[str] = set()

    def add(self, r: dict[str, Any]) -> None:
        self.done.add(r["name"])
        self.counts[r["name"]] = r["status"]
        if not self.tty:
            sys.stderr.write(printable(f"{PROG}: {len(self.done)}/{self.total} {r['name']} {r['status']} on "
                                       f"{r['node']}" + (f" ({r['reason']})" if r["reason"] else "")) + "\n")
            return
        width = 30
        filled = width * len(self.done) // max(self.total, 1)
        tally: dict[str, int] = {}
        for status in self.counts.values():
            tally[status] = tally.get(status, 0) + 1
        parts = "  ".join(f"{k} {v}" for k, v in sorted(tally.items()))
        sys.stderr.write(f"\r{PROG}: [{'#' * filled}{'.' * (width - filled)}] {len(self.done)}/{self.total}  {parts}"
                         "\033[K")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def table(results: list[dict[str, Any]]) -> str:
    rows = [("NAME", "NODE", "STATUS", "EXIT", "AUDIT", "CHANGES", "REASON")]
    for r in results:
        diff = r.get("diff") or {}
        changes = "-" if not diff else "+{} ~{} -{}".format(*(len(diff.get(k, [])) for k in ("added", "modified",
                                                                                             "deleted")))
        audit = "-" if r.get("audit") is None else ("ok" if r["audit"]["verified"] else "NOT OK")
        status = r["status"] + (" (recovered)" if r.get("recovered") else "")
        rows.append((r["name"], r["node"], status, "-" if r["exit_status"] is None else str(r["exit_status"]), audit,
                     changes, r["reason"][:60]))
    widths = [max(len(printable(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(printable(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n"
                   for row in rows)
