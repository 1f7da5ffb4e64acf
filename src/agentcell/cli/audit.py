"""``agentcell audit``: check and read the audit trail; seal it to a witness off the host.

    agentcell audit verify [FILE] [--witness W --key K]   exit 0 if the trail is whole (and matches what the
                                                          witness holds), 1 with where it is not
    agentcell audit show [FILE] [--session ID] [--json]
    agentcell audit tail [FILE] [-f]
    agentcell audit init [FILE] --witness W [--every N] [--interval S]   seal the trail; prints its key once
    agentcell audit seal [FILE]                           seal now; deliver what the witness lacks
    agentcell audit witness serve --listen ADDR --store FILE              a reference witness (HTTP)
"""
from __future__ import annotations

import json
import time
from typing import Any

from ..errors import AgentcellError, printable, report
from .common import Parser

PROG = "agentcell audit"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Check and read agentcell's hash-chained audit trail.")
    sub = p.add_subparsers(dest="cmd", metavar="verify|show|tail|init|seal|witness", parser_class=Parser)
    sub.required = True
    sp = sub.add_parser("verify", help="check the chain: edits, insertions, removals, reordering, truncation; "
                        "and that every session's trail ends; with --witness, against the signed heads sent "
                        "off the host (what a later root changed)")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--running", action="store_true", help="accept sessions with no session.end record yet "
                    "(running ones), and their latest records not witnessed yet")
    sp.add_argument("--witness", metavar="W", help="where the trail's heads were sent: file:PATH (a syslog "
                    "server's file too), http(s)://HOST[:PORT][/BASE]")
    sp.add_argument("--key", metavar="KEY", help="the trail's key as 'audit init' printed it (ed25519:…), or a "
                    "file holding it: kept off this host")
    sp = sub.add_parser("init", help="seal the trail: signed tree heads, by a key that moves forward each "
                        "epoch, sent to a witness off this host; prints the key 'verify --key' needs")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp.add_argument("--witness", metavar="W", required=True, help="file:PATH (e.g. on another host's mount), "
                    "http(s)://HOST[:PORT][/BASE] (POST BASE/heads), syslog://HOST[:PORT] (UDP), "
                    "syslog+tcp://HOST[:PORT]")
    sp.add_argument("--every", type=int, default=None, metavar="N", help="a head every N records at most "
                    "(default 64)")
    sp.add_argument("--interval", type=float, default=None, metavar="S", help="and once S seconds have "
                    "passed, at the next record (default 30; a session records a tick every 15 s)")
    sp = sub.add_parser("seal", help="seal the records not sealed yet now, and send the witness every head it "
                        "lacks; says what it did not take")
    sp.add_argument("file", nargs="?", metavar="FILE")
    sp = sub.add_parser("witness", help="a reference witness: keeps the heads it is sent, serves them back")
    wsub = sp.add_subparsers(dest="wcmd", metavar="serve", parser_class=Parser)
    wsub.required = True
    sp = wsub.add_parser("serve", help="serve the witness protocol over HTTP: POST /heads appends a head to "
                         "the store, GET /heads lists them")
    sp.add_argument("--listen", required=True, metavar="HOST:PORT")
    sp.add_argument("--store", required=True, metavar="FILE", help="the heads, one a line, only ever appended")
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
        path = (getattr(ns, "file", None) or audit.default_path())
        if ns.cmd == "verify":
            return _verify(ns, path)
        if ns.cmd in ("init", "seal"):
            return _seal(ns, path)
        if ns.cmd == "witness":
            from ..audit.witness import serve

            return serve(ns.listen, ns.store)
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


def _verify(ns: Any, path: str) -> int:
    from .. import audit

    if bool(ns.witness) != bool(ns.key):
        given, missing = ("--witness", "--key") if ns.witness else ("--key", "--witness")
        raise AgentcellError(missing, f"{given} needs {missing}", "give both: the witness the trail was sealed to, "
                             "and the key 'agentcell audit init' printed")
    v = audit.verify(path)
    complete = ns.running or not v.unfinished
    w = None
    if ns.witness:
        from ..audit.witnessed import check

        w = check(path, ns.witness, ns.key, running=ns.running)
    ok = v.ok and complete and (w is None or w.ok)
    if ns.json:
        out: dict[str, Any] = {"path": v.path, "records": v.records, "ok": ok, "chain_ok": v.ok,
                               "problems": [{"line": n, "problem": p} for n, p in v.problems],
                               "unfinished_sessions": v.unfinished}
        if w is not None:
            out["witness"] = {"witness": w.witness, "log": w.log, "ok": w.ok, "heads": len(w.heads),
                              "sealed_records": w.sealed, "last_head_ts": w.heads[-1]["ts"] if w.heads else None,
                              "problems": [{"line": n, "problem": p} for n, p in w.problems], "notes": w.notes}
        print(json.dumps(out))
        return 0 if ok else 1
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
    if w is None:
        print(f"{v.path}: the chain shows records edited, inserted, removed or cut off by anyone but root; a root "
              "can rewrite the file and recompute the chain and its anchor unseen. " + _unwitnessed(path))
        return 0 if ok else 1
    for n, problem in w.problems:
        print(f"{v.path}:{n}: {_shown(problem)}" if n else f"{v.path}: {_shown(problem)}")
    for note in w.notes:
        print(f"{v.path}: {note}")
    if w.heads:
        from ..audit.witnessed import when

        last = w.heads[-1]
        print(f"{v.path}: {w.witness} holds {len(w.heads)} signed head(s) of this trail (epochs 0-{last['epoch']}, "
              f"the last of {when(last['ts'])}); records 1-{w.sealed} " +
              ("match them" if w.ok else "checked against them"))
    return 0 if ok else 1


def _unwitnessed(path: str) -> str:
    from ..audit import seal

    try:
        st = seal.status(path)
    except (OSError, AgentcellError):
        st = None
    if st is None:
        return "'agentcell audit init --witness W' seals it to a witness off this host."
    return (f"It is sealed to {st.witness} (records 1-{st.sealed} in {st.epoch} head(s)): 'agentcell audit "
            "verify --witness W --key K' checks it against what the witness holds.")


def _seal(ns: Any, path: str) -> int:
    import os

    from ..audit import AuditLog, seal

    log = AuditLog(os.path.abspath(path))
    if ns.cmd == "init":
        every = ns.every if ns.every is not None else seal.DEFAULT_EVERY
        interval = ns.interval if ns.interval is not None else seal.DEFAULT_INTERVAL_S
        key, problem = log.seal_to(ns.witness, every, interval)
        st = seal.status(log.path)
        assert st is not None
        print(f"{log.path}: sealed to {st.witness}: a signed head every {every} records or {interval:g} s, and at "
              "each session's end")
        print(f"its key (keep it off this host; 'agentcell audit verify --witness W --key KEY' needs it): {key}")
    else:
        if not seal.is_sealed(log.path):
            raise AgentcellError("FILE", f"{log.path} is not sealed", "'agentcell audit init --witness W' seals it")
        problem = log.seal()
        st = seal.status(log.path)
        assert st is not None
        print(f"{log.path}: records 1-{st.sealed} sealed in {st.epoch} head(s) for {st.witness}")
    if problem:
        left = len(st.undelivered)
        print(f"{log.path}: {_shown(problem)}; {left} head(s) wait here and go first at the next seal "
              "('agentcell audit seal' retries)")
        return 1
    return 0

