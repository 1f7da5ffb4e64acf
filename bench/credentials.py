"""Credential injection benchmark: the intercepting path against a plain CONNECT tunnel, side by side.

    .venv/bin/python bench/credentials.py [--rounds N] [--events N] [--mib N] [--json]

One proxy process, as a cell gets it (``egress.ProxyProcess`` with a credential bound to one host),
and two HTTPS servers on a fake internet of the bench's own (a network namespace, 198.18.0.0/15, a
test CA): ``inject.test``, whose requests the proxy terminates and puts the key into, and
``tunnel.test``, the same server, piped through untouched. From the host's side, through the proxy:

* time to the first byte of a streamed response (server-sent events, the first sent at once): the
  median over the rounds, per path, and the intercepting path's extra milliseconds;
* throughput of a bulk response (--mib MiB): median MiB/s per path and the ratio.

Every round opens a new connection (CONNECT, TLS, one request) on each path, interleaved. Needs root
(the namespace). No traffic leaves the machine: the proxy may reach only the bench's own range.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import ssl
import statistics
import sys
import tempfile
import time

from agentcell.harness.fakenet import FakeInternet
from agentcell.network import egress
from agentcell.network.credentials import CredentialSet, parse_bindings
from agentcell.network.tlsca import SessionCA

INJECT, TUNNEL = "198.18.7.10", "198.18.7.20"
DNS = "198.18.7.53"
KEY = "sk-bench-" + "k" * 40

SERVER = r'''
import socket, ssl, sys, threading
addr, cert, key = sys.argv[1:4]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv = socket.create_server((addr, 443))

def serve(c):
    try:
        s = ctx.wrap_socket(c, server_side=True)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)
        path = head.split(b" ")[1].decode()
        if path.startswith("/events/"):
            n = int(path.split("/")[2])
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(n):
                event = b"data: %d\n\n" % i
                s.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            s.sendall(b"0\r\n\r\n")
        else:
            size = int(path.split("/")[2])
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            chunk = b"x" * 262144
            while size > 0:
                s.sendall(chunk[:min(size, len(chunk))])
                size -= len(chunk)
        s.close()
    except OSError:
        pass

print("ready", flush=True)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
'''


def fetch(proxy: tuple[str, int], host: str, path: str, trust: ssl.SSLContext, headers: str) -> tuple[float, float]:
    """(seconds to the first byte of the body, seconds to its end) for one new connection."""
    with socket.create_connection(proxy, timeout=30) as raw:
        raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += raw.recv(4096)
        assert b" 200 " in answer.split(b"\r\n")[0], answer
        with trust.wrap_socket(raw, server_hostname=host) as s:
            t = time.perf_counter()
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
            data = b""
            while b"\r\n\r\n" not in data:
                more = s.recv(262144)
                if not more:
                    raise RuntimeError(f"{host}: closed before the body: {data[:200]!r}")
                data += more
            body = len(data.split(b"\r\n\r\n", 1)[1])
            while not body:
                more = s.recv(262144)
                if not more:
                    raise RuntimeError(f"{host}: closed before the first byte of the body: {data[:200]!r}")
                body += len(more)
            first = time.perf_counter() - t
            while s.recv(262144):
                pass
            return first, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/credentials.py: needs root (a network namespace)")
    work = tempfile.mkdtemp(prefix="agentcell-bench-secrets-")
    os.chmod(work, 0o755)
    public = SessionCA("bench public CA", ("inject.test", "tunnel.test"))
    for name in ("inject.test", "tunnel.test"):
        chain, key = public.leaf(name)
        for ext, data in (("pem", chain), ("key", key)):
            with open(os.path.join(work, f"{name}.{ext}"), "wb") as f:
                f.write(data)
            os.chmod(os.path.join(work, f"{name}.{ext}"), 0o644)
    net = proxy = None
    try:
        net = FakeInternet(work, {"inject.test": [INJECT], "tunnel.test": [TUNNEL]}, dns=DNS)
        for name, addr in (("inject.test", INJECT), ("tunnel.test", TUNNEL)):
            net.start([sys.executable, "-c", SERVER, addr, os.path.join(work, f"{name}.pem"),
                       os.path.join(work, f"{name}.key")], ready=b"ready")
        creds = CredentialSet.build({"BENCH_KEY": KEY}, parse_bindings(["BENCH_KEY=inject.test:x-api-key"]))
        session = SessionCA("bench", creds.hosts())
        listener = socket.create_server(("127.0.0.1", 0))
        address = listener.getsockname()
        rules = ("allow:inject.test:443", "allow:tunnel.test:443", "range:198.18.0.0/15", f"resolver:{DNS}:53")
        proxy = egress.ProxyProcess(os.dup(listener.fileno()), rules,
                                    egress.secrets_memfd(creds, session, public.pem.decode()))
        listener.close()
        time.sleep(0.5)  # (its interpreter starting)
        trust = {"inject.test": ssl.create_default_context(cadata=session.pem.decode()),
                 "tunnel.test": ssl.create_default_context(cadata=public.pem.decode())}
        header = f"x-api-key: {creds.cell_env()['BENCH_KEY']}\r\n"
        ttfb: dict[str, list[float]] = {"inject.test": [], "tunnel.test": []}
        rate: dict[str, list[float]] = {"inject.test": [], "tunnel.test": []}
        size = args.mib << 20
        for _ in range(args.rounds):
            for host in ("inject.test", "tunnel.test"):
                ttfb[host].append(fetch(address, host, f"/events/{args.events}", trust[host], header)[0])
                _, whole = fetch(address, host, f"/bulk/{size}", trust[host], header)
                rate[host].append(args.mib / whole)
        events, proxy = proxy.stop(), None
        if events:
            raise SystemExit(f"bench/credentials.py: the proxy refused something: {events}")
    finally:
        try:
            if proxy is not None:
                proxy.stop()
        finally:
            if net is not None:
                net.close()
            shutil.rmtree(work, ignore_errors=True)
    med = {h: (statistics.median(ttfb[h]) * 1000, statistics.median(rate[h])) for h in ttfb}
    res = {"rounds": args.rounds, "ttfb_ms": {"intercepted": med["inject.test"][0], "tunnel": med["tunnel.test"][0]},
           "mib_s": {"intercepted": med["inject.test"][1], "tunnel": med["tunnel.test"][1]}}
    res["ttfb_extra_ms"] = med["inject.test"][0] - med["tunnel.test"][0]
    res["throughput_ratio"] = med["inject.test"][1] / med["tunnel.test"][1]
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"time to first byte of a streamed response ({args.rounds} new connections each, median): "
          f"{med['inject.test'][0]:.2f} ms intercepted, {med['tunnel.test'][0]:.2f} ms tunnelled "
          f"({res['ttfb_extra_ms']:+.2f} ms)")
    print(f"throughput of a {args.mib} MiB response (median): {med['inject.test'][1]:.0f} MiB/s intercepted, "
          f"{med['tunnel.test'][1]:.0f} MiB/s tunnelled (ratio {res['throughput_ratio']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
