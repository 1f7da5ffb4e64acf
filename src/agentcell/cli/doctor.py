"""``agentcell doctor``: what this machine supports, and whether the modes you need work here."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from .. import doctor
from .common import Parser

PROG = "agentcell doctor"

EXIT_OK = 0
EXIT_NOT_READY = 1

EPILOG = """exit status:
  0    every needed mode works here (without --need: the defaults for this user,
       root: agent, uid and none; anyone else: self and none)
  1    some needed mode does not work (each check says how to fix it)
  125  bad flag
"""


def parser() -> Parser:
    p = Parser(
        prog=PROG,
        description="Probe the kernel and tools agentcell relies on (Landlock, seccomp, namespaces, cgroups, "
        "audit, nftables) and report which identity and network modes work for the current user. "
        "Read-only: changes nothing on the machine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--need", action="append", default=[], choices=doctor.NEEDABLE_MODES, metavar="MODE",
                   help="exit 1 unless MODE works here (repeatable; one of: "
                   + ", ".join(doctor.NEEDABLE_MODES) + ")")
    return p


LABEL = {"ok": "ok", "warn": "warn", "missing": "MISSING"}


def _rows(out: TextIO, title: str, rows: list[tuple[str, str, str, str]]) -> None:
    width = max(len(name) for _, name, _, _ in rows)
    out.write(f"{title}\n")
    for status, name, detail, fix in rows:
        out.write(f"  {LABEL[status]:<8} {name:<{width}}  {detail}\n")
        if status != "ok" and fix:
            out.write(f"  {'':<8} {'':<{width}}  fix: {fix}\n")


def render(report: doctor.Report, needs: list[str], ready: bool, out: TextIO) -> None:
    who = f"{report.user} (uid {report.uid}{', root' if report.root else ''})"
    out.write(f"agentcell doctor — running as {who}\n\n")
    _rows(out, "checks", [(c.status, c.name, c.detail, c.fix) for c in report.checks])
    out.write("\n")
    _rows(out, "modes", [(m.status, f"{m.kind} {m.name}", m.detail, m.fix) for m in report.modes])
    verdict = "ready" if ready else "NOT ready"
    out.write(f"\n{verdict} for: {', '.join(needs)}\n")


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    needs: list[str] = list(dict.fromkeys(ns.need))
    report = doctor.run()
    explicit = bool(needs)
    if not needs:
        needs = report.default_needs
    ready = report.satisfies(needs)
    if ns.json:
        obj = report.to_dict()
        obj.update(needs=needs, needs_explicit=explicit, ready=ready)
        sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    else:
        render(report, needs, ready, sys.stdout)
    sys.stdout.flush()
    return EXIT_OK if ready else EXIT_NOT_READY
