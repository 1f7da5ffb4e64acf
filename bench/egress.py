"""Egress benchmark: a bulk download and connection set-up through a cell's proxy, against the same
client connecting directly on loopback, in one sitting.

    .venv/bin/python bench/egress.py [--mb N] [--connects N] [--json]

A bulk server on the host's loopback (127.0.0.1, an ephemeral port) sends N MiB per connection. The
same client code runs (a) on the host, straight to the server, and (b) in a `--net proxy` cell
(`--allow-range 127.0.0.1/32`), through HTTP CONNECT to the proxy. Reported: throughput of each and
their ratio, and the median time to a usable connection (connect, or CONNECT + "200") over N
connections. Needs root (a throwaway account ac-bench<hex> is created and removed). Loopback only.
"""
from __future__ import annotations

import argparse
import json
import pwd
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

AGENTCELL = str(Path(sys.executable).parent / "agentcell")

CLIENT = r'''
import json, socket, statistics, sys, time
port, mb, connects, via = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def connect():
    if via == "direct":
        return socket.create_connection(("127.0.0.1", port))
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert b" 200 " in head.split(b"\r\n")[0], head
    return s

setup = []
for _ in range(connects):
    t = time.perf_counter(); s = connect(); setup.append(time.perf_counter() - t)
    s.sendall(b"0\n"); s.recv(1); s.close()
s = connect()
t = time.perf_counter()
s.sendall(f"{mb}\n".encode())
left = mb << 20
while left > 0:
    chunk = s.recv(1 << 20)
    if not chunk:
        break
    left -= len(chunk)
elapsed = time.perf_counter() - t
print(json.dumps({"mib_s": mb / elapsed, "setup_ms": statistics.median(setup) * 1000, "short": left}))
'''


def serve(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_send, args=(conn,), daemon=True).start()


def _send(conn: socket.socket) -> None:
    try:
        mb = int(conn.makefile().readline() or 0)
        if mb == 0:
            conn.sendall(b"k")
        block = b"x" * (1 << 20)
        for _ in range(mb):
            conn.sendall(block)
    except OSError:
        pass
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--connects", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    name = "ac-bench" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    try:
        uid = pwd.getpwnam(name).pw_uid
        argv = [str(port), str(args.mb), str(args.connects)]
        direct = subprocess.run([sys.executable, "-c", CLIENT, *argv, "direct"], capture_output=True, text=True,
                                check=True)
        cell = subprocess.run([AGENTCELL, "run", "--no-warm", "--as", str(uid), "--net", "proxy", "--allow-range",
                               "127.0.0.1/32", "--", "python3", "-c", CLIENT, *argv, "proxy"], capture_output=True,
                              text=True)
        if cell.returncode != 0:
            sys.exit(f"bench/egress.py: the cell failed: {cell.stderr.strip()}")
    finally:
        listener.close()
        subprocess.run(["userdel", name], check=False)
    d, p = json.loads(direct.stdout), json.loads(cell.stdout.strip().splitlines()[-1])
    out = {"direct": d, "proxy": p, "throughput_ratio": p["mib_s"] / d["mib_s"],
           "setup_added_ms": p["setup_ms"] - d["setup_ms"]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"bulk download of {args.mb} MiB and {args.connects} connection set-ups, loopback server")
    print(f"  direct on the host          {d['mib_s']:9.0f} MiB/s   set-up {d['setup_ms']:.3f} ms (median)")
    print(f"  from a cell, via the proxy  {p['mib_s']:9.0f} MiB/s   set-up {p['setup_ms']:.3f} ms (median)")
    print(f"  proxy/direct throughput {out['throughput_ratio']:.2f}x; added set-up {out['setup_added_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
