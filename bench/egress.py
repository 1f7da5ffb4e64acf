"""Egress benchmark: a bulk download and connection set-up through a cell's proxy, against the same
client connecting directly, in one sitting.

    .venv/bin/python bench/egress.py [--mb N] [--connects N] [--json]

The server is a test host of the benchmark's own: the fake internet of the tests (tests/fakenet.py:
a network namespace behind a veth pair, 198.18.1.10 serving GET /bulk/<bytes>). The proxy refuses
the host's own addresses (loopback included), so the comparison is on the same path: the client
(a) on the host, straight to 198.18.1.10:80, and (b) in a `--net proxy` cell (`--allow-range
198.18.0.0/15`), through HTTP CONNECT. Reported: throughput of each and their ratio, and the median
time to a usable connection (connect, or CONNECT + "200") over N connections. Needs root (a
throwaway account and the namespace are created and removed). No traffic leaves the machine.
"""
from __future__ import annotations

import argparse
import json
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

AGENTCELL = str(Path(sys.executable).parent / "agentcell")

CLIENT = r'''
import json, socket, statistics, sys, time
mb, connects, via = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
HOST, PORT = "198.18.1.10", 80

def connect():
    if via == "direct":
        return socket.create_connection((HOST, PORT))
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT {HOST}:{PORT} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert b" 200 " in head.split(b"\r\n")[0], head
    return s

setup = []
for _ in range(connects):
    t = time.perf_counter(); s = connect(); setup.append(time.perf_counter() - t)
    s.close()
s = connect()
t = time.perf_counter()
s.sendall(f"GET /bulk/{mb << 20} HTTP/1.0\r\n\r\n".encode())
got = 0
while chunk := s.recv(1 << 20):
    got += len(chunk)
elapsed = time.perf_counter() - t
print(json.dumps({"mib_s": got / (1 << 20) / elapsed, "setup_ms": statistics.median(setup) * 1000,
                  "bytes": got}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--connects", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fakenet import FakeInternet

    work = Path(tempfile.mkdtemp(prefix="agentcell-bench-"))
    inet = FakeInternet(work)
    name = "ac-bench" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        uid = pwd.getpwnam(name).pw_uid
        argv = [str(args.mb), str(args.connects)]
        direct = subprocess.run([sys.executable, "-c", CLIENT, *argv, "direct"], capture_output=True, text=True,
                                check=True)
        cell = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(uid), "--net", "proxy", "--allow-range",
                               "198.18.0.0/15", "--", "python3", "-c", CLIENT, *argv, "proxy"], capture_output=True,
                              text=True)
        if cell.returncode != 0:
            sys.exit(f"bench/egress.py: the cell failed: {cell.stderr.strip()}")
    finally:
        inet.close()
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["userdel", name], check=False)
    d, p = json.loads(direct.stdout), json.loads(cell.stdout.strip().splitlines()[-1])
    out = {"direct": d, "proxy": p, "throughput_ratio": p["mib_s"] / d["mib_s"],
           "setup_added_ms": p["setup_ms"] - d["setup_ms"]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"bulk download of {args.mb} MiB and {args.connects} connection set-ups, a test host behind a veth")
    print(f"  direct from the host         {d['mib_s']:9.0f} MiB/s   set-up {d['setup_ms']:.3f} ms (median)")
    print(f"  from a cell, via the proxy  {p['mib_s']:9.0f} MiB/s   set-up {p['setup_ms']:.3f} ms (median)")
    print(f"  proxy/direct throughput {out['throughput_ratio']:.2f}x; added set-up {out['setup_added_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
