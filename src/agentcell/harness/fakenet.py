"""A fake internet: a network namespace of our own behind a veth pair, holding the hosts a check (or a
test) needs on a benchmark range, and a DNS server that answers for them and logs every question.

Nothing here reaches beyond this machine: the host routes only the fake internet's range to the
namespace, which has no other link. Every object is named ``agentcell-inet-<tag>`` / ``ac-h<tag>`` /
``ac-n<tag>``, recorded under ``/run/agentcell/fakenet`` before it is made, and removed by
:meth:`FakeInternet.close`.

    host  ac-h<tag> LINK4[0] (LINK6[0])   <-veth->   ac-n<tag> LINK4[1] (LINK6[1])
    in the namespace: every address the records name inside ROUTE4/ROUTE6, and the DNS server

Needs root (``ip netns``) and iproute2. ``agentcell check`` makes one with a /24 of 198.19.0.0/16 of
its own (so two checks do not collide); the tests make theirs on 198.18.0.0/15.
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from .. import hostfs

RECORDS_DIR = f"{hostfs.RUN}/fakenet"
NOBODY = 65534


def _ip(*args: str, check: bool = True) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {p.stderr.strip()}")


class FakeInternet:
    def __init__(self, workdir: str, records: dict[str, list[str]], *, route4: str = "198.18.0.0/15",
                 link4: tuple[str, str] = ("198.18.0.1/30", "198.18.0.2/30"), dns: str = "198.18.0.53",
                 route6: str | None = None, link6: tuple[str, str] | None = None, extra: Sequence[str] = ()) -> None:
        tag = secrets.token_hex(3)
        self.ns, self.host_if, self.ns_if = f"agentcell-inet-{tag}", f"ac-h{tag}", f"ac-n{tag}"
        self.records, self.dns = records, dns
        self.route4, self.link4, self.route6, self.link6 = route4, link4, route6, link6
        self.extra = tuple(extra)  # more addresses of the namespace (no name)
        self.dns_log = os.path.join(workdir, f"dns-{tag}.log")
        self.record = os.path.join(RECORDS_DIR, self.ns)
        self.procs: list[subprocess.Popen[bytes]] = []
        with open(self.dns_log, "w"):
            pass
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _addresses(self) -> list[str]:
        nets = [ipaddress.ip_network(r) for r in (self.route4, self.route6) if r]
        out = [self.dns, *self.extra]
        for addrs in self.records.values():
            out += [a for a in addrs if any(ipaddress.ip_address(a) in n for n in nets if
                                            n.version == ipaddress.ip_address(a).version)]
        return list(dict.fromkeys(out))

    def _build(self) -> None:
        hostfs.run_dir("fakenet")
        sweep()
        with open(self.record, "w") as f:  # before anything is made: a crash leaves a name to clean up
            json.dump({"ns": self.ns, "veth": self.host_if, "pid": os.getpid(), "start": _started(os.getpid())}, f)
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.ns)
        inside = ["netns", "exec", self.ns, "ip"]
        _ip("addr", "add", self.link4[0], "dev", self.host_if)
        _ip(*inside, "addr", "add", self.link4[1], "dev", self.ns_if)
        if self.link6:
            _ip("-6", "addr", "add", self.link6[0], "dev", self.host_if, "nodad")
            _ip(*inside, "-6", "addr", "add", self.link6[1], "dev", self.ns_if, "nodad")
        _ip("link", "set", self.host_if, "up")
        _ip(*inside, "link", "set", "lo", "up")
        for a in self._addresses():
            six = ":" in a
            _ip(*inside, *(["-6"] if six else []), "addr", "add", f"{a}/{128 if six else 32}", "dev", self.ns_if,
                *(["nodad"] if six else []))
        _ip(*inside, "link", "set", self.ns_if, "up")
        # Its servers run as nobody: ports below 1024 (DNS) are theirs to bind in this namespace alone.
        sysctl = shutil.which("sysctl", path="/usr/sbin:/sbin:/usr/bin:/bin") or "sysctl"
        p = subprocess.run(["ip", "netns", "exec", self.ns, sysctl, "-qw", "net.ipv4.ip_unprivileged_port_start=0"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise OSError(f"sysctl in {self.ns}: {p.stderr.strip()}")
        os.chown(self.dns_log, NOBODY, NOBODY)
        _ip(*inside, "route", "add", "default", "via", self.link4[0].split("/")[0])
        _ip("route", "add", self.route4, "via", self.link4[1].split("/")[0], "dev", self.host_if)
        if self.route6 and self.link6:
            _ip(*inside, "-6", "route", "add", "default", "via", self.link6[0].split("/")[0])
            _ip("-6", "route", "add", self.route6, "via", self.link6[1].split("/")[0], "dev", self.host_if)
        self.start([sys.executable, "-m", "agentcell.harness.fakenet", "dns", self.dns, json.dumps(self.records),
                    self.dns_log], ready=b"ready")

    def start(self, argv: list[str], *, ready: bytes | None = None, timeout: float = 10,
              as_nobody: bool = True) -> subprocess.Popen[bytes]:
        """Run ``argv`` inside the namespace (ended by :meth:`close`, or killed by the kernel when this
        process ends however it ends), as nobody unless told (it parses what a cell sends); with ``ready``,
        wait for a first line of output that starts with it."""
        who = ["setpriv", "--pdeathsig=KILL", *([f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
                                                if as_nobody else []), "--"]
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *who, *argv], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
        self.procs.append(proc)  # ip netns exec and setpriv exec in place: this pid is the program's
        if ready is not None:
            import select

            assert proc.stdout is not None
            if not select.select([proc.stdout], [], [], timeout)[0] or not proc.stdout.readline().startswith(ready):
                raise OSError(f"{argv[0]} did not start in {self.ns}")
        return proc

    def wait_tcp(self, host: str, port: int, timeout: float = 10) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise OSError(f"{host}:{port} does not answer in {self.ns}") from None
                time.sleep(0.05)

    def clear_dns_log(self) -> None:
        with open(self.dns_log, "w"):
            pass

    def dns_queries(self) -> list[tuple[str, str]]:
        with open(self.dns_log) as f:
            return [tuple(json.loads(line)) for line in f if line.strip()]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        _ip("link", "del", self.host_if, check=False)  # takes its peer and the routes along
        _ip("netns", "del", self.ns, check=False)
        try:
            os.unlink(self.record)
        except OSError:
            pass

    def leftovers(self) -> list[str]:
        left = []
        if subprocess.run(["ip", "link", "show", self.host_if], capture_output=True).returncode == 0:
            left.append(self.host_if)
        if self.ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            left.append(self.ns)
        left += [f"pid {p.pid}" for p in self.procs if p.poll() is None]
        return left


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): None if there is none, -1 if unreadable."""
    try:
        return hostfs.start_time(pid)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        return -1


def sweep() -> list[str]:
    """Fake internets whose maker has gone (killed before :meth:`FakeInternet.close`): their namespace
    and link, by the names recorded before they were made. Their servers died with their maker."""
    gone: list[str] = []
    try:
        names = os.listdir(RECORDS_DIR)
    except OSError:
        return gone
    for name in names:
        path = os.path.join(RECORDS_DIR, name)
        try:
            with open(path) as f:
                rec = json.load(f)
            pid, start, ns, veth = int(rec["pid"]), rec.get("start"), str(rec["ns"]), str(rec["veth"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        now = _started(pid)
        if now == -1 or now is not None and (start is None or now == start):
            continue  # its maker runs (the same process: its pid and its start), or one cannot tell
        if not ns.startswith("agentcell-inet-") or not veth.startswith("ac-h"):
            continue
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", ns, check=False)
        try:
            os.unlink(path)
        except OSError:
            pass
        gone.append(ns)
    return gone


def serve_dns(address: str, records: dict[str, list[str]], log: str) -> None:
    """A DNS server (UDP and TCP, port 53) that answers A and AAAA for ``records`` and NXDOMAIN else,
    and appends [name, client] to ``log`` for every question."""
    import socket
    import threading

    import dns.message
    import dns.rcode
    import dns.rdatatype
    import dns.rrset

    def answer(data: bytes, peer: str) -> bytes:
        q = dns.message.from_wire(data)
        r = dns.message.make_response(q)
        name = str(q.question[0].name).rstrip(".").lower()
        want = q.question[0].rdtype
        with open(log, "a") as f:
            f.write(json.dumps([name, peer]) + "\n")
        if name not in records:
            r.set_rcode(dns.rcode.NXDOMAIN)
        for a in records.get(name, []):
            if (":" in a) == (want == dns.rdatatype.AAAA) and want in (dns.rdatatype.A, dns.rdatatype.AAAA):
                r.answer.append(dns.rrset.from_text(q.question[0].name, 60, "IN", want, a))
        return bytes(r.to_wire())

    def udp() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((address, 53))
        while True:
            data, peer = s.recvfrom(4096)
            s.sendto(answer(data, peer[0]), peer)

    def tcp() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, 53))
        s.listen(16)
        while True:
            c, peer = s.accept()
            try:
                n = int.from_bytes(c.recv(2), "big")
                data = b""
                while len(data) < n:
                    chunk = c.recv(n - len(data))
                    if not chunk:
                        break
                    data += chunk
                out = answer(data, peer[0])
                c.sendall(len(out).to_bytes(2, "big") + out)
            except (OSError, ValueError):
                pass
            finally:
                c.close()

    threading.Thread(target=tcp, daemon=True).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    udp()


if __name__ == "__main__":  # inside the namespace: python -m agentcell.harness.fakenet dns ADDR RECORDS LOG
    if sys.argv[1:2] == ["dns"] and len(sys.argv) == 5:
        serve_dns(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
