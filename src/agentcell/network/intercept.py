"""The proxy's intercepting path: TLS terminated for the hosts a secret is bound to, and nothing else.

A CONNECT to a bound host (:mod:`agentcell.policy.credentials`) is answered, then the cell's TLS is
terminated here with the leaf the session's CA made for that host (:mod:`.tlsca`); a new TLS
connection goes to the real host, verified against the host's trust store (never the session's CA).
In between, HTTP/1.1 (``h11``: framing, keep-alive, chunked bodies) request by request:

* each request's head is checked (:meth:`CredentialSet.inject`): a placeholder in a header the secret
  is bound to becomes the real value; a placeholder in the URL, in another header, or of a secret bound
  elsewhere refuses the request (403, and an event that acts);
* bodies pass as they are (a conversation may quote the placeholder; it is worth nothing);
* the response streams back as it comes (server-sent events are not held), and a request waiting on
  ``Expect: 100-continue`` is told to go on here (the upstream is asked without it).

Only HTTP/1.1 is offered in ALPN: a client that would speak HTTP/2 speaks HTTP/1.1 here. Every other
host is a plain tunnel: its TLS is the client's and the server's, never opened.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import h11

from ..policy.credentials import CredentialSet

READ = 256 * 1024
HANDSHAKE_S = 15.0
IDLE_S = 300.0  # a kept-alive connection with no request for this long is closed
HOLD_S = 0.2  # a refused request's answer waits this long, as the proxy's own refusals do
HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"te", b"trailer", b"upgrade",
       b"expect"}

Refuse = Callable[[str, int, str], None]


class Interceptor:
    """``leaves``: host -> server context with its leaf; ``upstream``: the client context that verifies
    the real hosts; ``refuse(host, port, why)``: records an event that acts."""

    def __init__(self, creds: CredentialSet, leaves: dict[str, ssl.SSLContext], upstream: ssl.SSLContext,
                 refuse: Refuse) -> None:
        self.creds, self.leaves, self.upstream, self.refuse = creds, leaves, upstream, refuse

    def wants(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.leaves

    async def serve(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
        """After the CONNECT was answered (``up_*``: the TCP connection to the real host, checked and
        made by the proxy's policy): the cell's TLS, the host's, then requests until either side closes."""
        host = host.lower().rstrip(".")
        try:
            await asyncio.wait_for(writer.start_tls(self.leaves[host]), HANDSHAKE_S)
            await asyncio.wait_for(up_w.start_tls(self.upstream, server_hostname=host), HANDSHAKE_S)
            await self._relay(host, port, reader, writer, up_r, up_w)
        finally:
            up_w.close()

    async def _relay(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
        await relay(self.creds, self.refuse, host, port, reader, writer, up_r, up_w)


async def relay(creds: CredentialSet, refuse: Refuse, host: str, port: int, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter, up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter, *,
                plain: bool = False, data: bytes = b"") -> None:
    """Requests from the cell to ``host`` (``plain``: over plain HTTP; ``data``: what was read of the
    first already), each parsed by h11 and written anew upstream: what the upstream reads is what was
    checked (no bare LF, folded line or second request rides along unseen). Each request:
    * its target in origin form; an absolute one names ``host`` or is refused; ``Host`` is the
      connection's own (never the client's word: a shared front end would route by it);
    * a body framed twice (Content-Length and chunked) is refused (a smuggled request);
    * its headers through :meth:`CredentialSet.inject`;
    * the response back as it comes, unless it carries a real value (an endpoint that echoes what it
      got): then the connection ends there, with an event that acts."""
    down, up = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    if data:
        down.receive_data(data)
    authority = host if port == (80 if plain else 443) else f"{host}:{port}"
    tail = b""  # the end of what came back so far: a value split between two reads is still seen
    window = 2 * max((len(s.value) for s in creds.secrets.values()), default=0) + 8

    async def refused(code: int, why: str, *, event: bool = True) -> None:
        if event:
            refuse(host, port, why)
            await asyncio.sleep(HOLD_S)  # (the supervisor finds who holds the connection meanwhile)
        if down.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await _send(writer, down, h11.Response(status_code=code, headers=[
                ("content-type", "text/plain"), ("connection", "close")]),
                h11.Data(data=f"agentcell: {why}\n".encode()), h11.EndOfMessage())

    def leaked(chunk: bytes) -> bool:
        nonlocal tail
        found = creds.leaked(tail + chunk)
        tail = (tail + chunk)[-window:]
        if found is not None:
            refuse(host, port, f"the real value of {found.name} came back from {host} (an endpoint that echoes "
                   "what it got): the connection was ended there")
        return found is not None

    while True:
        request = await _next(down, reader, IDLE_S)
        if not isinstance(request, h11.Request):
            return  # closed (or a protocol error h11 refused)
        target = request.target.decode("latin-1")
        if not target.startswith("/"):
            scheme, sep, rest = target.partition("://")
            named, _, path = rest.partition("/")
            if not sep or scheme.lower() not in ("http", "https") or named.lower().rstrip(".") not in (
                    host, authority):
                await refused(421, f"a request for {target[:200]} on the connection to {authority}", event=False)
                return
            target = "/" + path
        raw = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in request.headers.raw_items()]
        names = {n.lower() for n, _ in raw}
        if "transfer-encoding" in names and "content-length" in names:
            await refused(400, "a body framed twice (Content-Length and Transfer-Encoding)", event=False)
            return
        headers = [(n, v) for n, v in raw if n.lower() != "host"]
        injected, why = creds.inject(host, target, headers, plain=plain)
        if why:
            await refused(403, why)
            return
        forward = [("Host", authority), *((n, v) for n, v in injected if n.lower().encode() not in HOP)]
        if down.client_is_waiting_for_100_continue:
            await _send(writer, down, h11.InformationalResponse(status_code=100, headers=[]))
        up_w.write(up.send(h11.Request(method=request.method, target=target, headers=forward)))
        # the request's body (as it comes), then the response (as it comes)
        while not isinstance(ev := await _next(down, reader), h11.EndOfMessage):
            if not isinstance(ev, h11.Data):
                return
            up_w.write(up.send(ev))
            await up_w.drain()
        up_w.write(up.send(h11.EndOfMessage()))
        await up_w.drain()
        while True:
            ev = await _next(up, up_r)
            if isinstance(ev, h11.InformationalResponse):
                continue  # (the 100 was given already; others are the upstream's business with us)
            if isinstance(ev, h11.Response):
                kept = [(n, v) for n, v in ev.headers.raw_items() if n.lower() not in HOP]
                if leaked(b"\n".join(n + b": " + v for n, v in kept)):
                    return
                await _send(writer, down, h11.Response(status_code=ev.status_code, headers=kept, reason=ev.reason))
            elif isinstance(ev, h11.Data):
                if leaked(bytes(ev.data)):
                    return
                await _send(writer, down, ev)
            elif isinstance(ev, h11.EndOfMessage):
                await _send(writer, down, ev)
                break
            else:
                return
        if down.our_state is not h11.DONE or up.their_state is not h11.DONE:
            return  # one side asked to close
        down.start_next_cycle()
        up.start_next_cycle()


async def _next(conn: h11.Connection, reader: asyncio.StreamReader, timeout: float | None = None) -> Any:
    """The connection's next event, reading as much as it needs; ConnectionClosed on a protocol error."""
    while True:
        try:
            ev = conn.next_event()
        except h11.RemoteProtocolError:
            return h11.ConnectionClosed()
        if ev is not h11.NEED_DATA:
            return ev
        data = await asyncio.wait_for(reader.read(READ), timeout) if timeout else await reader.read(READ)
        conn.receive_data(data)


async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, *events: Any) -> None:
    for ev in events:
        data = conn.send(ev)
        if data:
            writer.write(data)
    await writer.drain()


def server_context(chain_path: str, key_path: str) -> ssl.SSLContext:
    """The cell-facing side for one bound host (its leaf), HTTP/1.1 only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(chain_path, key_path)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def upstream_context(cadata: str | None = None) -> ssl.SSLContext:
    """The real hosts' side: the host's trust store (or ``cadata``: a test's own CA), names checked."""
    ctx = ssl.create_default_context(cadata=cadata) if cadata else ssl.create_default_context()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
