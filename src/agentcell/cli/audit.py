"""``agentcell audit``: check and read the audit trail.

    agentcell audit verify [FILE]                 exit 0 if the trail is whole, 1 with where it is not
    agentcell audit show [FILE] [--session ID] [--json]
    agentcell audit tail [FILE] [-f]
"""
from __future__ import annotations

import json
import time

from ..errors import AgentcellError, printable, report
from .common import Parser

PROG = "agentcell audit"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Check and read agentcell's hash-chained audit trail.")
    sub = p.add_subparsers(dest="cmd", metavar="verify|show|tail", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("verify", help="check the chain: edits, insertions, removals, reordering, truncation; "
                        "and that every session's trail ends")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--running", action="store_true", help="accept sessions with no session.end record yet "
                    "(running ones)")
    sp = sub.add_parser("show", help="the records as a table")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp.add_argument("--session", metavar="ID")
    sp.add_argument("--json", action="store_true")
    sp = sub.add_parser("tail", help="the last records; -f to follow")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp.add_argument("-f", "--follow", action="store_true")
    sp.add_argument("-n", type=int, default=10)
    return p


def _shown(text: str) -> str:
    return printable(text)


def _row(rec: dict[str, object]) -> str:
    ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("ts", 0))))  # type: ignore[arg-type]
    details = json.dumps(rec.get("details", {}), ensure_ascii=True, sort_keys=True)
    if len(details) > 100:
        details = details[:97] + "..."
    session, event = _shown(str(rec.get("session", "")))[:20], _shown(str(rec.get("event", "")))[:16]
    return f"{rec.get('seq', '?'):>6}  {ts}  {session:<20}  {event:<16}  {details}"


def main(argv: list[str]) -> int:
    from .. import audit

    ns = parser().parse_args(argv)
    try:
        path = ns.file or audit.default_path()
        if ns.cmd == "verify":
            v = audit.verify(path)
            complete = ns.running or not v.unfinished
            if ns.json:
                print(json.dumps({"path": v.path, "records": v.records, "ok": v.ok and complete, "chain_ok": v.ok,
                                  "problems": [{"line": n, "problem": p} for n, p in v.problems],
                                  "unfinished_sessions": v.unfinished}))
            else:
                for n, problem in v.problems:
                    print(f"{v.path}:{n}: {problem}")
                for sid in [] if ns.running else v.unfinished:
                    print(f"{v.path}: session {_shown(sid)} has no session.end record: it is running, or it ended "
                          "unrecorded (a supervisor killed: 'agentcell session recover'; a full log); --running "
                          "accepts running sessions")
                if v.ok and complete:
                    print(f"{v.path}: {v.records} records, chain intact" +
                          (f", {len(v.unfinished)} session(s) not ended yet" if v.unfinished else ""))
                elif v.ok:
                    print(f"{v.path}: {v.records} records, chain intact, trail incomplete")
            return 0 if v.ok and complete else 1
        if ns.cmd == "show":
            recs = audit.records(path, ns.session)
            if ns.json:
                print(json.dumps(recs))
            else:
                print(f"{'seq':>6}  {'time':<19}  {'session':<20}  {'event':<16}  details")
                for rec in recs:
                    print(_row(rec))
            return 0
        recs = audit.records(path)
        for rec in recs[-ns.n:] if ns.n > 0 else []:
            print(_row(rec), flush=True)
        if not ns.follow:
            return 0
        seen = len(recs)
        while True:  # tail -f: new records as they are appended (Ctrl-C to stop)
            time.sleep(0.5)
            recs = audit.records(path)
            for rec in recs[seen:]:
                print(_row(rec), flush=True)
            seen = len(recs)
    except AgentcellError as e:
        return report(PROG, e)
    except KeyboardInterrupt:
        return 0
    return 0

