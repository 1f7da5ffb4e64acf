"""A fake internet for egress tests: a network namespace of our own behind a veth pair, holding test
hosts on the benchmark range 198.18.0.0/15 and a ULA IPv6 prefix, and a DNS server for them.

Nothing here reaches beyond this machine: the host routes only 198.18.0.0/15 and fd00:ac::/32 to the
namespace, which has no other link. Everything is named ac-/agentcell and removed by ``close()``.

    host  ac-h<hex> 198.18.0.1/30, fd00:ac::1/64   <-veth->   ac-n<hex> 198.18.0.2/30, fd00:ac::2/64
    in the namespace:  198.18.1.10 good.test (HTTP on 80, 443, 8443), 198.18.1.20 evil.test,
                       198.18.1.30 api.test (for a test's own server), fd00:ac:1::10 good6.test,
                       DNS 198.18.0.53 (UDP and TCP)
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

GOOD4, EVIL4, GOOD6, DNS4 = "198.18.1.10", "198.18.1.20", "fd00:ac:1::10", "198.18.0.53"
API4 = "198.18.1.30"  # api.test: nothing listens there but what a test starts itself (run_in)
RECORDS = {
    "good.test": [GOOD4, GOOD6], "www.good.test": [GOOD4], "evil.test": [EVIL4], "good6.test": [GOOD6],
    "api.test": [API4], "loop.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"], "mixed.test": [GOOD4, "10.0.0.1"],
}

SERVERS = r'''
import json, socket, sys, threading
import dns.message, dns.rrset, dns.rdatatype

records, log = json.loads(sys.argv[1]), sys.argv[2]

def http(addr, family):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(addr); s.listen(64)
    while True:
        c, peer = s.accept()
        threading.Thread(target=serve, args=(c, addr), daemon=True).start()

def serve(c, addr):
    try:
        data = c.recv(65536)
        path = data.split(b" ")[1].decode() if data.count(b" ") > 1 else "/"
        if path.startswith("/bulk/"):
            n = int(path.split("/")[2])
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
            chunk = b"x" * 65536
            while n > 0:
                c.sendall(chunk[:min(n, 65536)]); n -= 65536
        else:
            body = ("hello from %s port %d\n" % (addr[0], addr[1])).encode()
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        c.close()

def answer(data, peer):
    q = dns.message.from_wire(data)
    r = dns.message.make_response(q)
    name = str(q.question[0].name).rstrip(".").lower()
    want = q.question[0].rdtype
    with open(log, "a") as f:
        f.write(json.dumps([name, peer[0]]) + "\n")
    for a in records.get(name, []):
        if (":" in a) == (want == dns.rdatatype.AAAA) and want in (dns.rdatatype.A, dns.rdatatype.AAAA):
            r.answer.append(dns.rrset.from_text(q.question[0].name, 60, "IN", want, a))
    return r.to_wire()

def dns_udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[3], 53))
    while True:
        data, peer = s.recvfrom(4096)
        s.sendto(answer(data, peer), peer)

for addr, fam in ((("198.18.1.10", 80), socket.AF_INET), (("198.18.1.10", 443), socket.AF_INET),
                  (("198.18.1.10", 8443), socket.AF_INET), (("198.18.1.20", 443), socket.AF_INET),
                  (("198.18.1.20", 80), socket.AF_INET), (("fd00:ac:1::10", 443), socket.AF_INET6)):
    threading.Thread(target=http, args=(addr, fam), daemon=True).start()
threading.Thread(target=dns_udp, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


class FakeInternet:
    def __init__(self, workdir: Path) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.host_if, self.ns_if = f"agentcell-inet-{tag}", f"ac-h{tag}", f"ac-n{tag}"
        self.dns_log = workdir / f"dns-{tag}.log"
        self.dns_log.write_text("")
        self.proc: subprocess.Popen[str] | None = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.ns)
        _ip("addr", "add", "198.18.0.1/30", "dev", self.host_if)
        _ip("-6", "addr", "add", "fd00:ac::1/64", "dev", self.host_if, "nodad")
        _ip("link", "set", self.host_if, "up")
        inside = ["netns", "exec", self.ns, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", "198.18.0.2/30", "dev", self.ns_if)
        for a in ("198.18.1.10/32", "198.18.1.20/32", f"{API4}/32", f"{DNS4}/32"):
            _ip(*inside, "addr", "add", a, "dev", self.ns_if)
        _ip(*inside, "-6", "addr", "add", "fd00:ac::2/64", "dev", self.ns_if, "nodad")
        _ip(*inside, "-6", "addr", "add", f"{GOOD6}/128", "dev", self.ns_if, "nodad")
        _ip(*inside, "link", "set", self.ns_if, "up")
        _ip(*inside, "route", "add", "default", "via", "198.18.0.1")
        _ip(*inside, "-6", "route", "add", "default", "via", "fd00:ac::1")
        _ip("route", "add", "198.18.0.0/15", "via", "198.18.0.2", "dev", self.host_if)
        _ip("-6", "route", "add", "fd00:ac::/32", "via", "fd00:ac::2", "dev", self.host_if)
        _ip("route", "add", "239.255.0.0/16", "dev", self.host_if)  # test multicast stays on the veth
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-c", SERVERS,
                                      json.dumps(RECORDS), str(self.dns_log), DNS4],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 5
        while True:  # the servers answer through the veth: the fake internet is up
            try:
                socket.create_connection((GOOD4, 80), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the fake internet does not answer") from None
                time.sleep(0.05)

    def run_in(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        """A process of the test's own in the namespace (a server on api.test); the caller kills it by PID."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], text=True, **kwargs)  # type: ignore[call-overload]

    def dns_queries(self) -> list[tuple[str, str]]:
        return [tuple(json.loads(line)) for line in self.dns_log.read_text().splitlines()]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # the PID we started: ip netns exec execs python in place
            self.proc.wait()
        _ip("link", "del", self.host_if, check=False)  # takes its peer and the routes along
        _ip("netns", "del", self.ns, check=False)


def leftovers(fake: FakeInternet) -> list[str]:
    left = []
    if subprocess.run(["ip", "link", "show", fake.host_if], capture_output=True).returncode == 0:
        left.append(fake.host_if)
    if fake.ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
        left.append(fake.ns)
    if fake.proc is not None and fake.proc.poll() is None:
        left.append(f"pid {fake.proc.pid}")
    return left


if __name__ == "__main__":  # by hand: python tests/fakenet.py, Ctrl-C to tear down
    f = FakeInternet(Path(os.environ.get("TMPDIR", "/tmp")))
    print(f.ns, f.host_if)
    try:
        time.sleep(3600)
    finally:
        f.close()
