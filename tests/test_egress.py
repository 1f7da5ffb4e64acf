"""--net proxy (issue 5) against a fake internet the tests build (tests/fakenet.py): test hosts on
198.18.0.0/15 and fd00:ac::/32 in a network namespace of their own, and a DNS server for them. No
traffic leaves this machine."""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.network import rules
from conftest import AGENTCELL, User, agentcell_run, needs_root
from fakenet import DNS4, GOOD4, GOOD6, FakeInternet, leftovers

pytestmark = needs_root

RANGES = ["--allow-range", "198.18.0.0/15", "--allow-range", "fd00:ac::/32"]
BASE = ["--net", "proxy", "--resolver", DNS4, *RANGES]


@pytest.fixture(scope="module")
def inet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInternet]:
    fake = FakeInternet(tmp_path_factory.mktemp("inet"))
    try:
        yield fake
    finally:
        fake.close()
        assert leftovers(fake) == []


def proxied(user: User, *args: str, cmd: list[str]) -> tuple[int, str, str, list[dict[str, object]]]:
    r = agentcell_run(["--as", str(user.uid), *BASE, *args, "--", *cmd], timeout=60)
    return r.rc, r.out, r.err, list(r.result.get("egress_blocked", []))  # type: ignore[arg-type]


PY_CONNECT = r'''
import os, socket, sys
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
head = s.recv(4096)
print(head.split(b"\r\n")[0].decode())
if b" 200 " in head:
    s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    print(s.recv(65536).split(b"\r\n\r\n", 1)[1].decode().strip())
'''

PY_DIRECT = r'''
import socket, sys
for fam, addr in ((socket.AF_INET, ("198.18.1.10", 443)), (socket.AF_INET6, ("fd00:ac:1::10", 443))):
    try:
        socket.socket(fam).connect(addr); print("TCP", addr[0], "CONNECTED")
    except OSError as e:
        print("TCP", addr[0], "failed", e.errno)
for fam, addr in ((socket.AF_INET, ("198.18.0.53", 53)), (socket.AF_INET6, ("fd00:ac:1::10", 53))):
    try:
        socket.socket(fam, socket.SOCK_DGRAM).sendto(b"x", addr); print("UDP", addr[0], "SENT")
    except OSError as e:
        print("UDP", addr[0], "failed", e.errno)
'''


def test_an_allowed_domain_is_reachable_every_way(user: User, inet: FakeInternet) -> None:
    rc, out, err, blocked = proxied(user, "--allow-domain", "good.test:*", cmd=["sh", "-c", (
        "curl -s --max-time 10 http://good.test/ && "  # plain HTTP through HTTP_PROXY
        "curl -s --max-time 10 -p http://good.test:443/tunnel && "  # HTTPS-style CONNECT tunnel
        "curl -s --max-time 10 --socks5-hostname 127.0.0.1:3128 http://good.test:8443/ && "  # SOCKS5, remote names
        f"python3 -c '{PY_CONNECT}' good.test 443 /py && "
        "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://good.test/\", timeout=10)"
        ".read().decode().strip())'")])
    assert rc == 0, err
    assert out.split("\n") == [f"hello from {GOOD4} port 80", f"hello from {GOOD4} port 443",
                               f"hello from {GOOD4} port 8443", "HTTP/1.1 200 Connection established",
                               f"hello from {GOOD4} port 443", f"hello from {GOOD4} port 80"], out
    assert blocked == []


def test_a_denied_domain_is_refused_and_reported(user: User, inet: FakeInternet) -> None:
    rc, out, err, blocked = proxied(user, "--allow-domain", "*.test", "--deny-domain", "evil.test", cmd=[
        "sh", "-c", f"python3 -c '{PY_CONNECT}' evil.test 443 /; python3 -c '{PY_CONNECT}' other.example 443 /; "
        "curl -s -o /dev/null -w '%{http_code}\\n' http://evil.test/"])
    assert out.split("\n") == ["HTTP/1.1 403 Blocked by agentcell", "HTTP/1.1 403 Blocked by agentcell", "403"], out
    assert [(e["target"], e["protocol"]) for e in blocked] == [
        ("evil.test:443", "http-connect"), ("other.example:443", "http-connect"), ("evil.test:80", "http")]
    assert "deny-domain evil.test" in str(blocked[0]["reason"])
    assert "add --allow-domain other.example" in str(blocked[1]["reason"])
    assert "blocked: evil.test:443, other.example:443, evil.test:80" in err


def test_names_resolving_to_private_or_metadata_addresses_are_refused(user: User, inet: FakeInternet) -> None:
    rc, out, err, blocked = proxied(user, "--allow-domain", "*.test:*", "--allow-domain", "loop.test:*",
                                    "--allow-domain", "meta.test:*", "--allow-domain", "mixed.test:*", cmd=[
        "sh", "-c", f"for h in loop.test meta.test mixed.test 127.0.0.1 169.254.169.254; do python3 -c "
        f"'{PY_CONNECT}' $h 80 /; done"])
    assert out.split("\n") == ["HTTP/1.1 403 Blocked by agentcell"] * 5, out
    reasons = [str(e["reason"]) for e in blocked]
    assert "127.0.0.1" in reasons[0] and "169.254.169.254" in reasons[1] and "10.0.0.1" in reasons[2], reasons


def test_the_cell_has_no_other_way_out(user: User, inet: FakeInternet) -> None:
    probe = f"cellprobe-{secrets.token_hex(4)}.test"
    rc, out, err, blocked = proxied(user, "--allow-domain", "good.test", cmd=["sh", "-c", (
        f"python3 -c '{PY_DIRECT}'; getent hosts {probe} || echo NO-RESOLVER; "
        f"python3 -c 'import socket; socket.getaddrinfo(\"{probe}\", 80)' 2>/dev/null || echo NO-DNS; "
        "ip -o addr 2>/dev/null | grep -v ' lo ' || echo ONLY-LO")])
    lines = out.split("\n")
    assert all("failed" in line for line in lines[:4]), out  # TCP and UDP, IPv4 and IPv6
    assert lines[4:] == ["NO-RESOLVER", "NO-DNS", "ONLY-LO"], out
    assert all(name != probe for name, _peer in inet.dns_queries())  # nothing reached the DNS server


def test_ipv6_destinations_go_through_the_proxy_only(user: User, inet: FakeInternet) -> None:
    rc, out, err, blocked = proxied(user, "--allow-domain", "good6.test", cmd=[
        "python3", "-c", PY_CONNECT, "good6.test", "443", "/v6"])
    assert out.split("\n") == ["HTTP/1.1 200 Connection established", f"hello from {GOOD6} port 443"], out


def test_udp_associate_is_refused_and_reported(user: User, inet: FakeInternet) -> None:
    code = ("import socket\ns = socket.create_connection(('127.0.0.1', 3128))\ns.sendall(b'\\x05\\x01\\x00')\n"
            "s.recv(2)\ns.sendall(b'\\x05\\x03\\x00\\x01' + bytes([198, 18, 0, 53]) + (53).to_bytes(2, 'big'))\n"
            "print(s.recv(10)[1])")
    rc, out, err, blocked = proxied(user, "--allow-domain", "good.test", cmd=["python3", "-c", code])
    assert out.strip() == "7" and blocked and "UDP" in str(blocked[0]["reason"]), (out, blocked)


def test_nothing_is_left_behind(user: User, inet: FakeInternet) -> None:
    before = set(os.listdir("/proc"))
    rc, out, err, blocked = proxied(user, "--allow-domain", "good.test", cmd=["true"])
    assert rc == 0
    new = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
    procs = [Path(f"/proc/{p}/cmdline").read_bytes() for p in new if Path(f"/proc/{p}/cmdline").exists()]
    assert not any(b"agentcell.network.proxy" in c for c in procs), procs


@pytest.mark.parametrize(("args", "field"), [
    (["--net", "proxy", "--allow-domain", "bad domain"], "--allow-domain"),
    (["--net", "proxy", "--allow-domain", "example.com:99999"], "--allow-domain"),
    (["--net", "proxy", "--allow-range", "300.1.2.3/8"], "--allow-range"),
    (["--net", "proxy", "--resolver", "dns.example"], "--resolver"),
    (["--net", "proxy", "--allow-preset", "nope"], "--allow-preset"),
    (["--allow-domain", "example.com"], "--net"),
])
def test_bad_egress_input_is_one_line(user: User, args: list[str], field: str) -> None:
    r = agentcell_run(["--as", str(user.uid), *args, "--", "true"])
    assert r.rc == 125 and r.err.count("\n") == 1 and f": {field}: " in r.err, r.err


def test_rules_match_as_documented() -> None:
    pol = rules.Policy.from_rules(["allow:*.example.com", "allow:api.example.org:8443", "deny:bad.example.com",
                                   "allow:any.example.net:*", "range:198.18.0.0/15"])
    assert pol.name_verdict("a.example.com", 443)[0] and pol.name_verdict("A.Example.COM.", 80)[0]
    assert not pol.name_verdict("example.com", 443)[0]  # *.example.com is below it, not it
    assert not pol.name_verdict("a.example.com", 22)[0]  # 80 and 443 unless a port is given
    assert not pol.name_verdict("bad.example.com", 443)[0]  # deny wins
    assert pol.name_verdict("api.example.org", 8443)[0] and not pol.name_verdict("api.example.org", 443)[0]
    assert pol.name_verdict("any.example.net", 2222)[0]
    import ipaddress
    for addr in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "100.64.0.1", "::1", "fe80::1", "fc00::1",
                 "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1"):
        assert not pol.address_verdict(ipaddress.ip_address(addr))[0], addr
    assert pol.address_verdict(ipaddress.ip_address("198.18.3.4"))[0]
    assert pol.address_verdict(ipaddress.ip_address("93.184.216.34"))[0]


def test_a_rootless_cell_gets_the_proxy_too(user: User, inet: FakeInternet) -> None:
    r = agentcell_run([*BASE, "--allow-domain", "good.test", "--", "python3", "-c", PY_CONNECT, "good.test", "443",
                       "/rootless"], as_user=user, timeout=60)
    assert r.out.split("\n") == ["HTTP/1.1 200 Connection established", f"hello from {GOOD4} port 443"], r.err


def test_the_python_api_runs_a_proxy_cell(user: User, inet: FakeInternet) -> None:
    """``Cell(spec).run`` runs every spec: one with a proxy goes to a cell host the launcher forks (the
    proxy lives beside the cell there), and its allow-list holds as agentcell run's does."""
    from agentcell import Cell
    from agentcell.cli import run

    spec = run.build_spec(run.parse(["--as", str(user.uid), *BASE, "--allow-domain", "good.test", "--", "true"]))
    with Cell(spec, prewarm=False) as cell:
        good = cell.run(["python3", "-c", PY_CONNECT, "good.test", "443", "/api"], text=True, timeout=60)
        bad = cell.run(["python3", "-c", PY_CONNECT, "bad.test", "443", "/api"], text=True, timeout=60)
    assert good.returncode == 0 and str(good.stdout).split("\n")[:2] == [
        "HTTP/1.1 200 Connection established", f"hello from {GOOD4} port 443"], good.stderr
    assert bad.returncode == 0 and str(bad.stdout).startswith("HTTP/1.1 403"), (bad.stdout, bad.stderr)


# ---- --net host-firewall -------------------------------------------------------------------------

FW_PROBE = r'''
import socket, sys
for fam, host, port in ((socket.AF_INET, "198.18.1.10", 443), (socket.AF_INET, "198.18.1.10", 80),
                        (socket.AF_INET6, "fd00:ac:1::10", 443)):
    try:
        s = socket.socket(fam); s.settimeout(5); s.connect((host, port))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        print("TCP", host, port, s.recv(4096).split(b"\r\n\r\n")[1].decode().strip())
    except OSError as e:
        print("TCP", host, port, "refused", type(e).__name__)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(2)
try:
    u.sendto(b"\x00\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + sys.argv[1].encode(), ("198.18.0.53", 53))
    u.recv(512); print("UDP answered")
except OSError as e:
    print("UDP refused", type(e).__name__)
'''


def tables() -> list[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if "agentcell_" in line]


def test_host_firewall_allows_exactly_what_is_configured(user: User, inet: FakeInternet) -> None:
    probe = f"fwprobe-{secrets.token_hex(4)}"
    r = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--allow-egress", "198.18.0.0/15:443", "--",
                       "python3", "-c", FW_PROBE, probe], timeout=60)
    assert r.out.split("\n") == [f"TCP 198.18.1.10 443 hello from {GOOD4} port 443",
                                 "TCP 198.18.1.10 80 refused ConnectionRefusedError",
                                 "TCP fd00:ac:1::10 443 refused ConnectionRefusedError",
                                 "UDP refused PermissionError"], r.out + r.err
    assert all(probe not in name for name, _peer in inet.dns_queries())
    assert tables() == []
    blocked = r.result["egress_blocked"]
    assert {(e["target"], e["protocol"], e["uid"]) for e in blocked} >= {  # type: ignore[index]
        ("198.18.1.10:80", "tcp", user.uid), ("[fd00:ac:1::10]:443", "tcp", user.uid),
        ("198.18.0.53:53", "udp", user.uid)}, blocked
    assert "add --allow-egress 198.18.1.10:80" in r.err, r.err


def test_host_firewall_leaves_other_users_alone_and_is_gone_after(user: User, inet: FakeInternet,
                                                                   tmp_path: Path) -> None:
    flag = tmp_path / "go"
    tmp_path.chmod(0o777)  # the agent signals from inside the cell that it runs
    p = subprocess.Popen([AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--net", "host-firewall",
                          "--allow-egress", "seed", "--rw", str(tmp_path), "--", "sh", "-c",
                          f"touch {flag}; sleep 3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists()
        [table] = tables()
        listing = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True).stdout
        assert "jump agent" in listing and (f"skuid {user.uid} " in listing or f'skuid "{user.name}"' in listing)
        assert " group " in listing and "tcp dport 443 accept" in listing, listing
        with socket.create_connection((GOOD4, 80), timeout=5) as s:  # root, meanwhile: untouched
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert b"hello from" in s.recv(4096)
    finally:
        assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    assert tables() == []


def test_a_crashed_supervisors_table_is_swept(user: User, inet: FakeInternet, tmp_path: Path) -> None:
    flag = tmp_path / "up"
    tmp_path.chmod(0o777)
    p = subprocess.Popen([AGENTCELL, "run", "--no-warm", "--as", str(user.uid), "--net", "host-firewall",
                          "--rw", str(tmp_path), "--", "sh", "-c", f"touch {flag}; sleep 60"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists() and len(tables()) == 1
    p.kill()  # the supervisor dies without cleaning up (its cell dies with it: PDEATHSIG)
    p.wait()
    r = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--", "true"])
    assert r.rc == 0 and tables() == [], r.err


def test_host_firewall_needs_an_account(user: User) -> None:
    r = agentcell_run(["--net", "host-firewall", "--", "true"], as_user=user)
    assert r.rc == 125 and "uid" in r.err and r.err.count("\n") == 1, r.err


# ---- what a red-team pass found (each fails on the first version) --------------------------------

@pytest.fixture
def host_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """An HTTP server of the test's own on an address of this host (a parameter: loopback, or the
    fake internet's host side, which an --allow-range covers)."""
    addr = request.param
    srv = socket.create_server((addr, 0))
    port = srv.getsockname()[1]
    stop = False

    def serve() -> None:
        while not stop:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"HTTP/1.0 200 OK\r\n\r\nthe host's own service\n")
            c.close()
    import threading

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield addr, port
    finally:
        stop = True
        srv.close()


@pytest.mark.parametrize("host_server", ["198.18.0.1"], indirect=True)
def test_the_proxy_never_connects_to_the_host_itself(user: User, inet: FakeInternet,
                                                     host_server: tuple[str, int]) -> None:
    addr, port = host_server
    rc, out, err, blocked = proxied(user, cmd=["python3", "-c", PY_CONNECT, addr, str(port), "/"])
    assert out.split("\n") == ["HTTP/1.1 403 Blocked by agentcell"], out
    assert "address of the host itself" in str(blocked[0]["reason"]), blocked


@pytest.mark.parametrize("host_server", ["127.0.0.1"], indirect=True)
def test_host_firewall_keeps_the_host_closed_unless_allowed(user: User, inet: FakeInternet,
                                                            host_server: tuple[str, int]) -> None:
    addr, port = host_server
    code = (f"import socket\ntry:\n    s = socket.create_connection(('{addr}', {port}), timeout=5); "
            "print(s.recv(100).decode().split('\\n')[-2])\nexcept OSError as e:\n    print('refused')")
    for extra, want in (([], "refused"), (["--allow-loopback"], "the host's own service")):
        r = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--allow-egress", f"*:{port}", *extra,
                           "--", "python3", "-c", code], timeout=60)
        assert r.out.strip() == want, (extra, r.out, r.err)


def test_names_the_agent_chooses_stay_small_and_harmless(user: User, inet: FakeInternet) -> None:
    code = ("import socket\nfor host in ('\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2K\\rdone', 'a' * 60000, "
            "'good.test:99999'):\n    s = socket.create_connection(('127.0.0.1', 3128))\n"
            "    s.sendall(f'CONNECT {host}:443 HTTP/1.1\\r\\n\\r\\n'.encode('latin-1'))\n"
            "    print(s.recv(100).split(b'\\r\\n')[0].decode())")
    r = agentcell_run(["--as", str(user.uid), *BASE, "--allow-domain", "good.test:*", "--", "python3", "-c", code],
                      timeout=60)
    assert "\x1b" not in r.err and "Traceback" not in r.err and "Task exception" not in r.err, r.err
    assert len(r.err) < 4000 and len(json.dumps(r.result)) < 4000, (len(r.err), len(json.dumps(r.result)))


BAD_NAMES = r'''
import socket
names = [b"good.test\x00.evil.test", b"evil.test\x00good.test", b"good.test\n", b"go od.test", b"good.t\x7fest",
         b"g\xc3\xb6od.test", b"-good.test", b"good..test", b"a" * 64 + b".good.test",
         b"fe80::1%lo"]
for name in names:  # by SOCKS5 (a name of any bytes), then by CONNECT
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"\x05\x01\x00")
    s.recv(2)
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + (443).to_bytes(2, "big"))
    print("socks", s.recv(10)[1])
for name in names[:5]:
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"CONNECT " + name + b":443 HTTP/1.1\r\n\r\n")
    print("connect", s.recv(100).split(b"\r\n")[0].decode())
s = socket.create_connection(("127.0.0.1", 3128))  # an allowed name still goes
s.sendall(b"CONNECT good.test:443 HTTP/1.1\r\n\r\n")
print("good", s.recv(100).split(b"\r\n")[0].decode())
'''


def test_a_name_that_is_not_a_host_name_is_refused_before_the_allow_list_with_an_event(
        user: User, inet: FakeInternet) -> None:
    rc, out, err, blocked = proxied(user, "--allow-domain", "*.test", "--allow-domain", "good.test",
                                    cmd=["python3", "-c", BAD_NAMES])
    lines = out.splitlines()
    assert lines[:10] == ["socks 2"] * 10 and lines[10:15] == ["connect HTTP/1.1 403 Blocked by agentcell"] * 5, out
    assert lines[15] == "good HTTP/1.1 200 Connection established", out
    faults = {str(b["target"]) for b in blocked if "not a host name" in str(b["reason"])}
    assert len(faults) == 10 and all(t.isprintable() for t in faults), blocked  # (shown escaped)
    assert rules.host_name_fault("good.test") == rules.host_name_fault("[fd00:ac::1]") == ""
    assert rules.host_name_fault("_dmarc.good.test.") == "" and rules.host_name_fault("a" * 254)
    assert rules.host_name_fault("[fe80::1%eth0]") and rules.host_name_fault("fe80::1%25eth0")


def test_ipv6_forms_of_private_addresses_are_refused() -> None:
    import ipaddress

    pol = rules.Policy.from_rules([])
    for addr in ("64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "::7f00:1", "::a9fe:a9fe", "fec0::1", "64:ff9b:1::1",
                 "::ffff:0:a00:1"):
        assert not pol.address_verdict(ipaddress.ip_address(addr))[0], addr
    assert pol.address_verdict(ipaddress.ip_address("64:ff9b::5db8:d822"))[0]  # NAT64 of a public address


def test_multicast_and_the_hosts_loopback_stay_closed(user: User, inet: FakeInternet) -> None:
    # A '*' UDP rule does not open multicast (the local network); joining a group is refused outright
    # (the kernel's IGMP reports have no owner a uid rule could match). Multicast here is routed to the
    # fake internet's veth only.
    code = ("import socket, struct\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "try:\n    u.sendto(b'x', ('239.255.1.1', 59999)); print('SENT')\nexcept OSError as e:\n"
            "    print('refused', e.errno)\n"
            "try:\n    u.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton('239.255.1.1') + "
            "socket.inet_aton('127.0.0.1')); print('JOINED')\nexcept OSError as e:\n    print('join refused', e.errno)")
    r = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--allow-egress", "udp:*:59999", "--",
                       "python3", "-c", code], timeout=60)
    assert r.out.split("\n") == ["refused 1", "join refused 1"], r.out + r.err


def test_an_allow_range_never_opens_the_hosts_loopback() -> None:
    import ipaddress

    pol = rules.Policy.from_rules(["range:127.0.0.0/8", "range:::/0", "range:0.0.0.0/0"])
    for addr in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.2", "::127.0.0.2", "64:ff9b::7f00:2"):
        assert not pol.address_verdict(ipaddress.ip_address(addr))[0], addr


def test_the_monitor_ends_a_cell_at_its_first_refused_destination(user: User, inet: FakeInternet) -> None:
    code = (f"{PY_CONNECT}\nimport time; time.sleep(5); print('still running')")
    r = agentcell_run(["--as", str(user.uid), *BASE, "--allow-domain", "good.test", "--monitor", "--", "python3",
                       "-c", code, "evil.test", "443", "/"], timeout=60)
    assert r.rc == 137 and r.result["terminated_by_monitor"] is True and "still running" not in r.out, r.err
    assert [(e["operation"], e["target"], e["source"]) for e in r.result["events"]] == [  # type: ignore[union-attr]
        ("network", "evil.test:443", "proxy")]
    # An agent's own account: what its uid does on the network is the cell's.
    fw = agentcell_run(["--as", f"agent:{user.name}", "--net", "host-firewall", "--allow-egress", "198.18.0.0/15:443",
                        "--monitor", "--", "python3", "-c",
                        "import socket, time\ntry:\n    socket.create_connection(('198.18.1.10', 80), timeout=5)\n"
                        "except OSError:\n    pass\ntime.sleep(5)\nprint('still running')"], timeout=60)
    assert fw.rc == 137 and [e["source"] for e in fw.result["events"]] == ["nftables"], fw.err  # type: ignore[union-attr]
    assert fw.result["egress_blocked"], fw.result
    # A uid given as a number may be a person's, running elsewhere too: the firewall matches the uid,
    # so its refusals are recorded, not pinned on the cell (it runs on).
    outside = subprocess.Popen([*user.prefix(), "sleep", "60"])
    try:
        shared = agentcell_run(["--as", str(user.uid), "--net", "host-firewall", "--allow-egress", "198.18.0.0/15:443",
                                "--monitor", "--", "python3", "-c",
                                "import socket\ntry:\n    socket.create_connection(('198.18.1.10', 80), timeout=5)\n"
                                "except OSError:\n    pass\nprint('still running')"], timeout=60)
    finally:
        outside.kill()
        outside.wait()
    assert shared.rc == 0 and shared.out == "still running", shared.err
    assert len(shared.result["events"]) == 1, shared.result  # type: ignore[arg-type]
    ev = shared.result["events"][0]  # type: ignore[index]
    assert ev["source"] == "nftables" and "not held against it" in ev["reason"] and ev["acts"] is False, ev
