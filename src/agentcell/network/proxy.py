"""The egress proxy: the only way out of a ``--net proxy`` cell.

One listening socket serves HTTP CONNECT, plain HTTP with an absolute URI (one request per
connection: ``Connection: close``), and SOCKS5 CONNECT with names resolved here (``socks5h``); the
first byte tells which (0x05 is SOCKS). The socket was made *inside* the cell's network namespace
(127.0.0.1:3128, whose only interface is ``lo``) and handed to this process, which lives in the
host's network namespace: the cell reaches nothing but this listener, with no link, route or
firewall rule to get wrong.

Every destination is checked by name first (:mod:`.rules`), resolved here only (the host's resolver,
``/etc/hosts`` included, or ``--resolver``), and every address it resolves to is checked again (no
private, loopback or metadata address unless an --allow-range covers it); the connection goes to
that checked address, so a second resolution cannot rebind it. Each refusal is written as one JSON
line to the events fd (what the escape monitor consumes, and what ``agentcell run`` summarises).

Credentials (``--secrets-fd N``: a memfd the supervisor wrote, read and closed before anything is
served): the hosts a secret is bound to are intercepted (:mod:`.intercept`: the session CA's leaves,
made by the supervisor, which keeps the CA's key); every other destination stays a tunnel. A
placeholder seen where the proxy can see it and it does not belong (a plain-HTTP request, a
destination's name, a request to a bound host outside its bound header) is refused and acts.

Run as ``python -m agentcell.network.proxy --listen-fd N --events-fd M --rules JSON``; as root it
first becomes ``nobody`` with no_new_privs: it parses what the agent sends. Holding credentials, it
is not dumpable either (no ptrace, no /proc/PID/mem, no core: not even by another ``nobody``).
"""
from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import json
import os
import socket
import struct
import sys
import time
import typing
from collections.abc import Awaitable, Callable

from .rules import Address, Policy, host_name_fault

if typing.TYPE_CHECKING:
    from .credentials import CredentialSet
    from .intercept import Interceptor

CONNECT_TIMEOUT_S = 10.0
HEADER_TIMEOUT_S = 30.0  # to send a request's head (slowloris)
MAX_CONNECTIONS = 512  # open at once, per cell
# Distinct allowed names that did not resolve, per cell, before a new one is refused without a lookup and
# held against the cell: made-up names under an allowed wildcard would carry data to that zone's DNS.
MAX_UNRESOLVED = 32
MAX_EVENTS = 10_000
MAX_EVENT_BYTES = 1 << 20  # all events together: an agent's names are long and many
MAX_TARGET = 255  # characters of a destination kept in an event
# A refused client waits this long for its answer: the supervisor, rung by the event, finds the process
# that holds the connection in the cell (it may exit the moment it has its answer).
HOLD_S = 0.2
_peer: contextvars.ContextVar[int] = contextvars.ContextVar("peer", default=0)  # the client's port in the cell
HEADER_LIMIT = 64 * 1024
READ = 1024 * 1024  # bytes per read; the stream's own buffer stays at LIMIT
LIMIT = 128 * 1024

Resolve = Callable[[str, int], Awaitable[list[Address]]]


class Refused(Exception):
    def __init__(self, why: str, code: int = 403) -> None:
        super().__init__(why)
        self.why, self.code = why, code


async def system_resolve(host: str, port: int) -> list[Address]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))


def dns_resolver(server: tuple[str, int]) -> Resolve:
    """Resolve A and AAAA records with one DNS server (dnspython), never the host's configuration."""
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [server[0]]
    resolver.port = server[1]
    resolver.lifetime = 5.0

    async def resolve(host: str, port: int) -> list[Address]:
        out: list[Address] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await resolver.resolve(host, rdtype)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.resolver.NoNameservers,
                    dns.exception.Timeout):
                continue
            out += [ipaddress.ip_address(r.to_text()) for r in answer]
        return out
    return resolve


class Proxy:
    def __init__(self, policy: Policy, events: Callable[[dict[str, object]], None],
                 resolve: Resolve | None = None, creds: CredentialSet | None = None,
                 interceptor: Interceptor | None = None) -> None:
        self.policy, self.events, self.creds, self.interceptor = policy, events, creds, interceptor
        self.resolve = resolve or (dns_resolver(policy.resolver) if policy.resolver else system_resolve)
        self.open_connections = 0
        self.unresolved: set[str] = set()

    # ---- the decision ----------------------------------------------------------------------------

    async def open(self, host: str, port: int, how: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Check, resolve, check again, connect to the checked address; Refused otherwise."""
        fault = host_name_fault(host)
        if fault:  # (before the allow-list and the resolver, which could each read it another way)
            raise self._refuse(host, port, how, fault)
        ok, why = self.policy.name_verdict(host, port)
        if not ok:
            raise self._refuse(host, port, how, why)
        literal = _literal(host)
        name = host.rstrip(".").lower()
        if literal is None and len(self.unresolved) >= MAX_UNRESOLVED and name not in self.unresolved:
            raise self._refuse(host, port, how, f"more than {MAX_UNRESOLVED} allowed names did not resolve: no "
                               "lookup of another (made-up names carry data to a zone's DNS servers)")
        # An allowed name that does not resolve (a typo, a resolver down for a moment) is refused
        # like any failed lookup, and only noted: it was on the list, nothing was tried beyond it.
        try:
            addrs = [literal] if literal is not None else await self.resolve(name, port)
        except (OSError, UnicodeError) as e:
            self.unresolved.add(name)
            raise self._refuse(host, port, how, f"cannot resolve: {e}", 502, note=True) from None
        if not addrs:
            self.unresolved.add(name)
            raise self._refuse(host, port, how, "the name does not resolve", 502, note=True)
        allowed = []
        for addr in addrs:
            good, bad = self.policy.address_verdict(addr)
            if not good:
                raise self._refuse(host, port, how, bad)  # any bad address refuses the name: no rebinding
            allowed.append(addr)
        last: OSError | None = None
        for addr in allowed:
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(str(addr), port, limit=LIMIT),
                                              CONNECT_TIMEOUT_S)
            except OSError as e:  # TimeoutError included
                last = e
                continue
            local, peer = w.get_extra_info("sockname"), w.get_extra_info("peername")
            if local and peer and local[0] == peer[0]:  # routed locally: one of this host's own addresses
                w.close()
                raise self._refuse(host, port, how, f"{addr} is an address of the host itself")
            return r, w
        raise Refused(f"{host}:{port} unreachable ({last})", 502)

    def refuse_plain(self, host: str, port: int, why: str) -> None:
        """A plain-HTTP request refused (a placeholder where its secret is not bound): an event that acts."""
        self._refuse(host, port, "http", why)

    def refuse_request(self, host: str, port: int, why: str) -> None:
        """An intercepted request refused (a placeholder where its secret is not bound): an event that acts."""
        self._refuse(host, port, "https", why)

    def _refuse(self, host: str, port: int, how: str, why: str, code: int = 403, *, note: bool = False) -> Refused:
        shown = _printable(host)
        self.events({"ts": time.time(), "operation": "network", "source": "proxy", "target": f"{shown}:{port}",
                     "protocol": how, "reason": _printable(why.replace(host, shown)), "note": note,
                     "peer_port": _peer.get()})
        return Refused(why if why.isprintable() and len(why) < 512 else "refused", code)

    # ---- the protocols -----------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= MAX_CONNECTIONS:
            writer.close()
            return
        self.open_connections += 1
        peer = writer.get_extra_info("peername")
        _peer.set(peer[1] if isinstance(peer, tuple) and len(peer) >= 2 else 0)
        try:
            first = await asyncio.wait_for(reader.readexactly(1), HEADER_TIMEOUT_S)
            if first == b"\x05":
                await self._socks5(reader, writer)
            else:
                await self._http(first, reader, writer)
        except Exception:  # noqa: BLE001 - one bad client closes its connection, never the proxy
            pass
        finally:
            self.open_connections -= 1
            writer.close()

    async def _http(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
        if len(head) > HEADER_LIMIT:
            return
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target, _, version = rest.partition(" ")
        if method == "CONNECT":
            host, port = _split_hostport(target, 443)
            try:
                self._placeholders(host, port, "http-connect", head)
                up_r, up_w = await self.open(host, port, "http-connect")
            except Refused as e:
                await _blocked(writer, e)
                return
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await self._tunnel(host, port, reader, writer, up_r, up_w)
            return
        if not target.lower().startswith("http://"):
            writer.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\nagentcell: use an absolute URI or "
                         b"CONNECT\n")
            await writer.drain()
            return
        hostport, _, path = target[7:].partition("/")
        host, port = _split_hostport(hostport, 80)
        # The Host header is the checked destination's (no fronting another name on a shared CDN).
        headers = [h for h in lines[1:] if h and not h.lower().startswith(
            ("proxy-", "connection:", "keep-alive:", "host:"))]
        try:
            self._placeholders(host, port, "http", hostport.encode("latin-1"))
            for sec in self.creds.found(head) if self.creds is not None else ():  # (before any lookup)
                if host.lower().rstrip(".") not in sec.to(plain=True):
                    raise self._refuse(host, port, "http", f"the placeholder of {sec.name} sent over plain HTTP to "
                                       f"{host} (bound to {', '.join(sec.hosts)})")
            up_r, up_w = await self.open(host, port, "http")
        except Refused as e:
            await _blocked(writer, e)
            return
        if self.creds is not None:  # parsed whole, request by request: what goes up is what was checked
            from .intercept import relay

            try:
                await relay(self.creds, self.refuse_plain, host, port, reader, writer, up_r, up_w, plain=True,
                            data=head)
            finally:
                up_w.close()
            return
        up_w.write((f"{method} /{path} {version}\r\nHost: {hostport}\r\n" + "".join(f"{h}\r\n" for h in headers)
                    + "Connection: close\r\n\r\n").encode("latin-1"))
        await _pipe(reader, writer, up_r, up_w)

    async def _socks5(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = (await _timed(reader, 1))[0]
        methods = await _timed(reader, n)
        if 0 not in methods:
            writer.write(b"\x05\xff")
            return
        writer.write(b"\x05\x00")
        ver, cmd, _rsv, atyp = await _timed(reader, 4)
        if atyp == 1:
            host = str(ipaddress.IPv4Address(await _timed(reader, 4)))
        elif atyp == 4:
            host = str(ipaddress.IPv6Address(await _timed(reader, 16)))
        elif atyp == 3:  # as sent: any byte that is not a host name's is refused in open(), with an event
            host = (await _timed(reader, (await _timed(reader, 1))[0])).decode("latin-1")
        else:
            writer.write(b"\x05\x08\x00\x01" + bytes(6))
            return
        port = struct.unpack("!H", await _timed(reader, 2))[0]
        if ver != 5 or cmd != 1:  # only CONNECT: no BIND, no UDP ASSOCIATE
            self._refuse(host, port, "socks5", "only TCP CONNECT goes through the proxy (no UDP, no BIND)")
            await asyncio.sleep(HOLD_S)
            writer.write(b"\x05\x07\x00\x01" + bytes(6))
            return
        try:
            self._placeholders(host, port, "socks5", host.encode("latin-1", "replace"))
            up_r, up_w = await self.open(host, port, "socks5")
        except Refused as e:
            await asyncio.sleep(HOLD_S)
            writer.write((b"\x05\x02" if e.code == 403 else b"\x05\x04") + b"\x00\x01" + bytes(6))
            return
        writer.write(b"\x05\x00\x00\x01" + bytes(6))
        await writer.drain()
        await self._tunnel(host, port, reader, writer, up_r, up_w)

    async def _tunnel(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
        """A connection made: a bound host's is intercepted (its credential goes in there), any other
        is piped as it is."""
        if self.interceptor is not None and self.interceptor.wants(host):
            await self.interceptor.serve(host, port, reader, writer, up_r, up_w)
        else:
            await _pipe(reader, writer, up_r, up_w)

    def _placeholders(self, host: str, port: int, how: str, head: bytes) -> None:
        """A placeholder in a destination's name: Refused, with an event that acts."""
        for s in self.creds.found(head) if self.creds is not None else ():
            raise self._refuse(host, port, how, f"the placeholder of {s.name} in the destination's name (it goes "
                               f"only to {', '.join(s.hosts)}, in a header)")




async def _blocked(writer: asyncio.StreamWriter, e: Refused) -> None:
    await asyncio.sleep(HOLD_S)
    writer.write(f"HTTP/1.1 {e.code} Blocked by agentcell\r\nContent-Type: text/plain\r\n"
                 f"Connection: close\r\n\r\nagentcell: {e.why}\n".encode())
    await writer.drain()


async def _timed(reader: asyncio.StreamReader, n: int) -> bytes:
    """Read n bytes of a request's head, in HEADER_TIMEOUT_S at most."""
    return await asyncio.wait_for(reader.readexactly(n), HEADER_TIMEOUT_S)


def _printable(text: str) -> str:
    """What an event may say of a name the agent chose: no control characters, not too long."""
    shown = text if text.isprintable() else text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return shown if len(shown) <= MAX_TARGET else shown[:MAX_TARGET] + "..."


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _split_hostport(text: str, default: int) -> tuple[str, int]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad port in {text!r}")
    return host, int(port) if port else default


async def _pipe(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, ur: asyncio.StreamReader,
                uw: asyncio.StreamWriter) -> None:
    async def one_way(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while chunk := await r.read(READ):
                w.write(chunk)
                await w.drain()
            if w.can_write_eof():
                w.write_eof()
        except (ConnectionError, OSError):
            pass

    try:
        await asyncio.gather(one_way(cr, uw), one_way(ur, cw))
    finally:
        uw.close()


# ---- the process ----------------------------------------------------------------------------------

def _become_nobody() -> None:
    if os.geteuid() != 0:
        return
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)


async def serve(listen_fd: int, policy: Policy, events_fd: int, bell_fd: int = -1,
                creds: CredentialSet | None = None, icpt: Interceptor | None = None) -> None:
    out = os.fdopen(events_fd, "w", buffering=1)
    if bell_fd >= 0:
        os.set_blocking(bell_fd, False)
    # Notes (allowed names that did not resolve) and refusals that act have budgets of their own: a flood
    # of notes never keeps a refusal that acts out of the record; each kind says once that it is full.
    written = {True: 0, False: 0}
    size = {True: 0, False: 0}
    full = {True: False, False: False}

    def record(event: dict[str, object]) -> None:
        kind = bool(event.get("note"))
        if full[kind]:  # refused in a loop: the record says so once, and the disk is not filled
            return
        line = json.dumps(event) + "\n"
        written[kind] += 1
        if written[kind] > MAX_EVENTS // 2 or size[kind] + len(line) > MAX_EVENT_BYTES // 2:
            full[kind] = True
            line = json.dumps({**event, "target": "...", "reason": f"later {'notes' if kind else 'refusals'} "
                               "were not recorded (too many)"}) + "\n"
        size[kind] += len(line)
        try:
            out.write(line)
            if bell_fd >= 0:
                os.write(bell_fd, b"!")  # the supervisor reads at once (a full pipe: it will anyway)
        except OSError:
            pass

    proxy = Proxy(policy, record, creds=creds, interceptor=icpt)
    if icpt is not None:
        icpt.refuse = proxy.refuse_request
        icpt.opener = lambda host, port: proxy.open(host, port, "https")  # (HTTP/2's streams at once)
    listener = socket.socket(fileno=listen_fd)
    server = await asyncio.start_server(proxy.handle, sock=listener, limit=LIMIT)
    async with server:
        await server.serve_forever()


def load_secrets(fd: int) -> tuple[CredentialSet, dict[str, typing.Any], str | None]:
    """The supervisor's memfd: the credentials, each bound host's leaf (chain and key, PEM), and the CA
    the real hosts are verified against (None: the host's trust store). Read and closed."""
    from .credentials import CredentialSet

    with os.fdopen(fd, "rb") as f:
        config = json.loads(f.read())
    creds = CredentialSet.from_wire(config["secrets"])
    return creds, config["leaves"], config.get("upstream_ca")


def interceptor(creds: CredentialSet, leaves: dict[str, typing.Any], upstream_ca: str | None) -> Interceptor:
    """The TLS contexts, built while the leaves' keys are in memory only (a memfd each, closed after),
    before the proxy gives up root (as nobody, not dumpable, it could not open /proc/self/fd)."""
    from .intercept import Interceptor, server_context, upstream_context

    contexts = {}
    for host, (chain, key) in leaves.items():
        fds = [os.memfd_create("agentcell-leaf", os.MFD_CLOEXEC) for _ in range(2)]
        try:
            for fd, pem in zip(fds, (chain, key), strict=True):
                os.write(fd, pem.encode())
            contexts[host] = server_context(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
        finally:
            for fd in fds:
                os.close(fd)
    return Interceptor(creds, contexts, upstream_context(upstream_ca), lambda host, port, why: None)


def main(argv: list[str]) -> None:
    import ctypes

    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    libc = ctypes.CDLL(None, use_errno=True)
    parent = int(opts["--parent"])
    creds = icpt = None
    if "--secrets-fd" in opts:
        creds, leaves, upstream_ca = load_secrets(int(opts["--secrets-fd"]))
        icpt = interceptor(creds, leaves, upstream_ca) if leaves else None
        del leaves  # (the keys live in the contexts now)
    _become_nobody()
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: what it holds is not read through ptrace or /proc
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL (after the uid change, which clears it)
    if os.getppid() != parent:
        sys.exit(0)  # the agentcell that started us is already gone
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    policy = Policy.from_rules(json.loads(opts["--rules"]))
    asyncio.run(serve(int(opts["--listen-fd"]), policy, int(opts["--events-fd"]), int(opts.get("--bell-fd", -1)),
                      creds, icpt))


if __name__ == "__main__":
    main(sys.argv[1:])
