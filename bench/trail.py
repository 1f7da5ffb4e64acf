"""A fleet node's verdict on one session's audit records, against the node's history.

    .venv/bin/python bench/trail.py [--sessions 100,1000,2000] [--records 30]

A node's result for each session carries the verdict on its trail. Checking the whole trail for each one
costs what the node has run so far (a node of thousands of sessions reads them all per session); the node
checks the session's part (from where the trail ended as it began: ``trail.verify(path, since)``). This
builds a chained trail of ``--records`` records a session (about 300 bytes each, as a scripted session's
are), then times both for the last session at each size. Needs nothing but a temporary directory, removed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time

from agentcell.audit.trail import AuditLog, records, verify


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="100,1000,2000")
    ap.add_argument("--records", type=int, default=30)
    args = ap.parse_args()
    sizes = sorted(int(n) for n in args.sessions.split(","))
    top = tempfile.mkdtemp(prefix="agentcell-bench-trail-")
    try:
        path = os.path.join(top, "audit", "audit.jsonl")
        AuditLog(path).append("step", session="s-0")  # the first record and the anchor, as a writer makes them
        with open(path, "rb") as f:
            prev, seq = hashlib.sha256(f.read().rstrip(b"\n")).hexdigest(), 1
        print(f"{'sessions':>8} {'trail':>8} {'whole trail':>12} {'its part':>9} {'ratio':>7}")
        with open(path, "ab") as out:
            for s in range(1, sizes[-1] + 1):
                since = out.tell()
                for i in range(args.records):  # records as AuditLog writes them (canonical JSON, chained)
                    seq += 1
                    rec = {"seq": seq, "ts": 1796040000.0 + seq, "session": f"s-{s}", "event": "step",
                           "details": {"i": i, "pad": "x" * 200}, "prev": prev}
                    line = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
                    out.write(line + b"\n")
                    prev = hashlib.sha256(line).hexdigest()
                if s not in sizes:
                    continue
                out.flush()
                with open(path + ".head", "w") as h:
                    h.write(f"{seq} {prev}")
                t = time.perf_counter()
                whole = verify(path)
                got = records(path, f"s-{s}")
                t_whole = time.perf_counter() - t
                t = time.perf_counter()
                part = verify(path, since)
                got_part = records(path, f"s-{s}", since)
                t_part = time.perf_counter() - t
                assert whole.ok and part.ok and got == got_part and len(got) == args.records
                print(f"{s:>8} {os.path.getsize(path) / 1e6:>6.1f}MB {t_whole * 1000:>10.1f}ms {t_part * 1000:>7.2f}ms "
                      f"{t_whole / t_part:>6.0f}x")
    finally:
        shutil.rmtree(top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
