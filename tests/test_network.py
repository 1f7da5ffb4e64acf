"""Network modes against a test host this test creates in its own network namespace.

Traffic goes only to 198.18.0.0/15 (the benchmark range) inside a namespace made here, and to loopback.
"""
from __future__ import annotations

import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from conftest import User, agentcell_run, needs_root

pytestmark = needs_root

SERVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 8080)); s.listen(8); s.settimeout(1.0)
    print("ready", flush=True)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            c, _ = s.accept()
        except socket.timeout:
            continue
        c.sendall(b"hello from the test host\\n"); c.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], 8080), timeout=3)
        print("CONNECTED", c.recv(100).decode().strip())
    except OSError as e:
        print("BLOCKED", e.__class__.__name__, e.errno)
""")


@dataclass
class PeerHost:
    addr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def test_host() -> Iterator[PeerHost]:
    tag = secrets.token_hex(3)
    ns, host_if, peer_if = f"agentcell-t{tag}", f"ac-t{tag}a", f"ac-t{tag}b"
    octet = int(tag[:2], 16)
    host_addr, peer_addr = f"198.18.{octet}.1", f"198.18.{octet}.2"
    server = None
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", ns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{peer_addr}/30", "dev", peer_if)
        _ip("-n", ns, "link", "set", peer_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, peer_addr],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield PeerHost(peer_addr)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_the_test_host_is_reachable_from_outside_a_cell(test_host: PeerHost) -> None:
    p = subprocess.run([sys.executable, "-c", CLIENT, test_host.addr], capture_output=True, text=True)
    assert p.stdout.startswith("CONNECTED"), p.stdout + p.stderr


@pytest.mark.parametrize("mode", ["none", "loopback"])
def test_cell_cannot_reach_the_test_host(user: User, test_host: PeerHost, mode: str) -> None:
    r = agentcell_run(["--as", str(user.uid), "--net", mode, "--", "python3", "-c", CLIENT, test_host.addr])
    assert r.rc == 0, r.err
    assert r.out.startswith("BLOCKED"), r.out


LOOPBACK = textwrap.dedent("""
    import socket
    try:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
        c = socket.create_connection(s.getsockname(), timeout=2); a, _ = s.accept()
        c.sendall(b"ping"); print("LOOPBACK", a.recv(4).decode())
    except OSError as e:
        print("NOLOOP", e.errno)
""")


def test_loopback_works_inside_loopback_mode_only(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--net", "loopback", "--", "python3", "-c", LOOPBACK])
    assert r.out.strip() == "LOOPBACK ping", r.out + r.err
    r = agentcell_run(["--as", str(user.uid), "--net", "none", "--", "python3", "-c", LOOPBACK])
    assert r.out.startswith("NOLOOP"), r.out + r.err


def test_net_none_denies_tcp_twice(user: User) -> None:
    # The namespace has no interface up; Landlock (ABI >= 4) refuses TCP bind/connect before routing.
    from agentcell.cell import landlock

    if landlock.abi() < 4:
        pytest.skip(f"Landlock ABI {landlock.abi()} has no TCP rules (needs 4, Linux 6.7)")
    r = agentcell_run(["--as", str(user.uid), "--net", "none", "--", "python3", "-c", LOOPBACK])
    assert r.out.strip() == "NOLOOP 13", r.out + r.err  # EACCES from Landlock, not ENETUNREACH


def test_cell_sees_no_interface_but_lo(user: User) -> None:
    r = agentcell_run(["--as", str(user.uid), "--net", "loopback", "--", "cat", "/proc/net/dev"])
    names = {line.split(":")[0].strip() for line in r.out.splitlines()[2:]}
    assert names == {"lo"}, names
