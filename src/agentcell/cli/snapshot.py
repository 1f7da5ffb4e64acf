"""``agentcell snapshot``: take, list, verify, restore, diff and prune snapshots.

    agentcell snapshot take PATH... [--store DIR] [--json]     the new id alone on the last line
    agentcell snapshot list [--store DIR] [--json]
    agentcell snapshot verify ID [--store DIR]                exit 1 if damaged
    agentcell snapshot restore ID [PATH...] [--to DIR] [--store DIR]
    agentcell snapshot diff ID [--store DIR] [--json]
    agentcell snapshot prune --keep N [--store DIR]

The store: --store DIR, else $BACKUP_DIR, else <state dir>/snapshots.
"""
from __future__ import annotations

import json
import sys
import time

from ..errors import AgentcellError, printable, report
from .common import Parser

PROG = "agentcell snapshot"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Snapshots of the paths an agent may change: exact restores, diffs.")
    sub = p.add_subparsers(dest="cmd", metavar="take|list|verify|restore|diff|prune", parser_class=Parser)
    sub.required = True

    def store(sp: Parser) -> None:
        sp.add_argument("--store", metavar="DIR", help="the store (default: $BACKUP_DIR, else the state dir)")

    sp = sub.add_parser("take", help="snapshot directories; prints the id last")
    sp.add_argument("paths", nargs="+", metavar="PATH")
    sp.add_argument("--json", action="store_true")
    store(sp)
    sp = sub.add_parser("list", help="the snapshots in the store")
    sp.add_argument("--json", action="store_true")
    store(sp)
    sp = sub.add_parser("verify", help="re-read every stored content and check its hash")
    sp.add_argument("id", metavar="ID")
    store(sp)
    sp = sub.add_parser("restore", help="make the paths exactly as they were (in place unless --to)")
    sp.add_argument("id", metavar="ID")
    sp.add_argument("paths", nargs="*", metavar="PATH")
    sp.add_argument("--to", metavar="DIR", help="restore under DIR instead of in place")
    store(sp)
    sp = sub.add_parser("diff", help="what changed since the snapshot")
    sp.add_argument("id", metavar="ID")
    sp.add_argument("--json", action="store_true")
    store(sp)
    sp = sub.add_parser("prune", help="keep the newest N snapshots, drop the rest and what only they used")
    sp.add_argument("--keep", type=int, required=True, metavar="N")
    store(sp)
    return p


class Bar:
    """A progress line on stderr when it is a terminal (for long work), nothing otherwise."""

    def __init__(self, what: str) -> None:
        self.what, self.on, self.last = what, sys.stderr.isatty(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.on or now - self.last < 0.2:
            return
        self.last = now
        text = f"{done / 1e6:.0f} MB" if total == 0 else f"{100 * done // max(total, 1)}%"
        sys.stderr.write(f"\r{self.what}: {text} ")
        sys.stderr.flush()

    def end(self) -> None:
        if self.on and self.last:
            sys.stderr.write("\r\033[K")


def _shown(text: str) -> str:
    """Names and text come from the agent: control characters are escaped, never sent to the terminal."""
    return printable(text, keep="\t")


def main(argv: list[str]) -> int:
    from ..snapshot import Store

    ns = parser().parse_args(argv)
    try:
        st = Store(ns.store)
        if ns.cmd == "take":
            bar = Bar("snapshot")
            sid = st.take(ns.paths, progress=bar)
            bar.end()
            print(json.dumps({"id": sid, "store": st.path}) if ns.json else sid)
            return 0
        if ns.cmd == "list":
            snaps = st.snapshots()
            if ns.json:
                print(json.dumps(snaps))
            for s in [] if ns.json else snaps:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["created"]))
                print(f"{s['id']}  {when}  {s['entries']:>7} entries  {s['bytes'] / 1e6:9.1f} MB  "
                      + " ".join(s["roots"]))
            return 0
        if ns.cmd == "verify":
            bar = Bar("verify")
            problems = st.verify(ns.id, progress=bar)
            bar.end()
            for p in problems:
                print(f"damaged: {p}")
            if not problems:
                print(f"{ns.id}: every stored content is there and intact")
            return 1 if problems else 0
        if ns.cmd == "restore":
            bar = Bar("restore")
            n = st.restore(ns.id, ns.paths or None, ns.to, progress=bar)
            bar.end()
            print(f"restored {ns.id}: {n} entries written" + (f" under {ns.to}" if ns.to else ""))
            return 0
        if ns.cmd == "diff":
            d = st.diff(ns.id)
            if ns.json:
                print(json.dumps(d))
                return 0
            for kind, sign in (("added", "+"), ("modified", "~"), ("deleted", "-")):
                for path in d[kind]:
                    print(f"{sign} {_shown(path)}")
            for path in d["modified"]:
                sys.stdout.write("".join(_shown(line.rstrip("\n")) + "\n" for line in
                                         st.text_diff(ns.id, path).splitlines(True)))
            return 0
        gone, removed = st.prune(ns.keep)
        print(f"removed {len(gone)} snapshots and {removed} stored contents no snapshot needs")
        return 0
    except AgentcellError as e:
        return report(f"{PROG} {ns.cmd}", e)
    except OSError as e:  # the file system refused (no space, permissions, I/O): one line, nothing half-done
        where = f"{e.filename}: " if e.filename else ""
        sys.stderr.write(f"{PROG} {ns.cmd}: {where}{e.strerror or e} (nothing was recorded as done)\n")
        return 1
