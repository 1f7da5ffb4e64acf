"""The proxy's intercepting path: TLS terminated for the hosts a secret is bound to, and nothing else.

A CONNECT to a bound host (:mod:`agentcell.network.credentials`) is answered, then the cell's TLS is
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
import functools
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import h11

from .credentials import CredentialSet

READ = 256 * 1024
HANDSHAKE_S = 15.0
IDLE_S = 300.0  # a kept-alive connection with no request for this long is closed
HOLD_S = 0.2  # a refused request's answer waits this long, as the proxy's own refusals do
HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"te", b"trailer", b"upgrade",
       b"expect"}

Refuse = Callable[[str, int, str], None]
Opener = Callable[[str, int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class Interceptor:
    """``leaves``: host -> server context with its leaf; ``upstream``: the client context that verifies
    the real hosts; ``refuse(host, port, why)``: records an event that acts."""

    def __init__(self, creds: CredentialSet, leaves: dict[str, ssl.SSLContext], upstream: ssl.SSLContext,
                 refuse: Refuse, opener: Opener | None = None) -> None:
        self.creds, self.leaves, self.upstream, self.refuse = creds, leaves, upstream, refuse
        self.opener = opener  # more connections to a host, checked as the first (HTTP/2's streams at once)

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
            tls = writer.get_extra_info("ssl_object")
            if tls is not None and tls.selected_alpn_protocol() == "h2":
                await self._relay_h2(host, port, reader, writer, (up_r, up_w))
            else:
                await self._relay(host, port, reader, writer, up_r, up_w)
        finally:
            up_w.close()

    async def _relay(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
        await relay(self.creds, self.refuse, host, port, reader, writer, up_r, up_w)


    async def _more(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Another connection to the real host, checked by the proxy's policy as the first was, and TLS."""
        if self.opener is None:
            raise OSError(95, "no second connection to the host can be made")
        up_r, up_w = await self.opener(host, port)
        try:
            await asyncio.wait_for(up_w.start_tls(self.upstream, server_hostname=host), HANDSHAKE_S)
        except BaseException:
            up_w.close()
            raise
        return up_r, up_w

    async def _relay_h2(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        first: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        """HTTP/2 from the cell, each stream a request of its own upstream over HTTP/1.1 (on the connection
        the proxy made, then on more it opens, checked the same way, as streams run at once)."""
        import h2.config
        import h2.connection
        import h2.events
        import h2.exceptions

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        spare = [first]
        bodies: dict[int, asyncio.Queue[bytes | None]] = {}
        tasks: dict[int, asyncio.Task[None]] = {}
        window = asyncio.Event()  # set when the client gives more room to send

        def flush() -> None:
            data = conn.data_to_send()
            if data:
                writer.write(data)

        async def send_data(sid: int, data: bytes) -> None:
            while data:
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room <= 0:
                    window.clear()
                    await window.wait()
                    continue
                conn.send_data(sid, data[:room])
                data = data[room:]
                flush()
                await writer.drain()

        async def respond(sid: int, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> None:
            conn.send_headers(sid, [(b":status", str(status).encode()), *headers], end_stream=not body)
            flush()
            if body:
                await send_data(sid, body)
                conn.end_stream(sid)
                flush()
            await writer.drain()

        async def stream(sid: int, raw: list[tuple[bytes, bytes]]) -> None:
            pseudo = {n: v for n, v in raw if n.startswith(b":")}
            authority = pseudo.get(b":authority", b"").decode("latin-1").lower()
            target = pseudo.get(b":path", b"/").decode("latin-1")
            method = pseudo.get(b":method", b"GET")
            headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in raw
                       if not n.startswith(b":") and n.lower() != b"host"]
            named = authority.rsplit(":", 1)[0] if ":" in authority and not authority.endswith("]") else authority
            if named.rstrip(".") not in ("", host) or not target.startswith("/"):
                await respond(sid, 421, [(b"content-type", b"text/plain")],
                              f"agentcell: a request for {authority}{target[:200]} on the connection to {host}\n"
                              .encode())
                return
            injected, why = self.creds.inject(host, target, headers)
            if why:
                self.refuse(host, port, why)
                await asyncio.sleep(HOLD_S)
                await respond(sid, 403, [(b"content-type", b"text/plain")], f"agentcell: {why}\n".encode())
                return
            first = await bodies[sid].get()  # (None: the request had no body)
            forward = [("Host", host if port == 443 else f"{host}:{port}"),
                       *((n, v) for n, v in injected if n.lower().encode() not in HOP
                         and n.lower() != "transfer-encoding")]
            if first is not None and not any(n.lower() == "content-length" for n, _ in forward):
                forward.append(("Transfer-Encoding", "chunked"))  # (HTTP/2 frames its body; HTTP/1.1 must be told)
            up_r, up_w = spare.pop() if spare else await self._more(host, port)
            up = h11.Connection(h11.CLIENT)
            reuse, echo = False, Echoes(self.creds, self.refuse, host, port)

            def leaked(chunk: bytes) -> bool:
                if not echo.seen(chunk):
                    return False
                conn.reset_stream(sid)
                flush()
                return True

            try:
                up_w.write(up.send(h11.Request(method=method, target=target, headers=forward)))
                chunk = first
                while chunk is not None:
                    up_w.write(up.send(h11.Data(data=chunk)))
                    await up_w.drain()
                    chunk = await bodies[sid].get()
                up_w.write(up.send(h11.EndOfMessage()))
                await up_w.drain()
                while True:
                    ev = await _next(up, up_r)
                    if isinstance(ev, h11.InformationalResponse):
                        continue
                    if isinstance(ev, h11.Response):
                        kept = [(n.lower(), v) for n, v in ev.headers.raw_items()
                                if n.lower() not in HOP and n.lower() != b"transfer-encoding"]
                        if leaked(b"\n".join(n + b": " + v for n, v in kept)):
                            await asyncio.sleep(HOLD_S)
                            return
                        conn.send_headers(sid, [(b":status", str(ev.status_code).encode()), *kept])
                        flush()
                        await writer.drain()
                    elif isinstance(ev, h11.Data):
                        if leaked(bytes(ev.data)):
                            await asyncio.sleep(HOLD_S)
                            return
                        await send_data(sid, bytes(ev.data))
                    elif isinstance(ev, h11.EndOfMessage):
                        conn.end_stream(sid)
                        flush()
                        await writer.drain()
                        reuse = up.our_state is h11.DONE and up.their_state is h11.DONE
                        break
                    else:
                        conn.reset_stream(sid)
                        flush()
                        break
            finally:
                if reuse:  # (a fresh h11 state for it next time: the connection is what is kept)
                    spare.append((up_r, up_w))
                else:
                    up_w.close()

        def forget(sid: int, _task: object = None) -> None:
            tasks.pop(sid, None)
            bodies.pop(sid, None)

        try:
            while True:
                data = await asyncio.wait_for(reader.read(READ), IDLE_S)
                if not data:
                    return
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    flush()
                    return
                for ev in events:
                    if isinstance(ev, h2.events.RequestReceived):
                        sid = ev.stream_id
                        bodies[sid] = asyncio.Queue()
                        tasks[sid] = asyncio.ensure_future(stream(sid, list(ev.headers)))
                        tasks[sid].add_done_callback(functools.partial(forget, sid))
                    elif isinstance(ev, h2.events.DataReceived):
                        if ev.stream_id in bodies:
                            bodies[ev.stream_id].put_nowait(ev.data)
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        if ev.stream_id in bodies:
                            bodies[ev.stream_id].put_nowait(None)
                    elif isinstance(ev, h2.events.StreamReset):
                        task = tasks.pop(ev.stream_id, None)
                        if task is not None:
                            task.cancel()
                    elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                        window.set()
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        return
                flush()
                await writer.drain()
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            for _, w in spare:
                w.close()


class Echoes:
    """What comes back from ``host``, looked at for the real values (as they are, or base64): ``seen``
    is True, and an event that acts is recorded, when one is there. The end of what came so far is
    kept, so a value split between two reads is still seen."""

    def __init__(self, creds: CredentialSet, refuse: Refuse, host: str, port: int) -> None:
        self.creds, self.refuse, self.host, self.port = creds, refuse, host, port
        self.window = 2 * max((len(s.value) for s in creds.secrets.values()), default=0) + 8
        self._tail = b""

    def seen(self, chunk: bytes) -> bool:
        found = self.creds.leaked(self._tail + chunk)
        self._tail = (self._tail + chunk)[-self.window:]
        if found is not None:
            self.refuse(self.host, self.port, f"the real value of {found.name} came back from {self.host} (an "
                        "endpoint that echoes what it got): it was cut there")
        return found is not None


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
    echo = Echoes(creds, refuse, host, port)
    window = echo.window
    # A host no secret is bound to (plain HTTP elsewhere): its request bodies are looked at too.
    unbound = not any(host in s.to(plain) for s in creds.secrets.values())

    async def refused(code: int, why: str, *, event: bool = True) -> None:
        if event:
            refuse(host, port, why)
            await asyncio.sleep(HOLD_S)  # (the supervisor finds who holds the connection meanwhile)
        if down.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await _send(writer, down, h11.Response(status_code=code, headers=[
                ("content-type", "text/plain"), ("connection", "close")]),
                h11.Data(data=f"agentcell: {why}\n".encode()), h11.EndOfMessage())

    leaked = echo.seen

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
        # (the head goes with the body's first piece: one looked at before anything of the request leaves)
        head = up.send(h11.Request(method=request.method, target=target, headers=forward))
        # the request's body (as it comes), then the response (as it comes)
        sent = b""
        while not isinstance(ev := await _next(down, reader), h11.EndOfMessage):
            if not isinstance(ev, h11.Data):
                return
            if unbound and (found := creds.found(sent + bytes(ev.data))):
                await refused(403, f"the placeholder of {found[0].name} in a request body to {host} (bound to "
                              f"{', '.join(found[0].hosts)})")
                return
            sent = (sent + bytes(ev.data))[-window:]
            up_w.write(head + up.send(ev))
            head = b""
            await up_w.drain()
        if head:
            up_w.write(head)
        up_w.write(up.send(h11.EndOfMessage()))
        await up_w.drain()
        while True:
            ev = await _next(up, up_r)
            if isinstance(ev, h11.InformationalResponse):
                continue  # (the 100 was given already; others are the upstream's business with us)
            if isinstance(ev, h11.Response):
                kept = [(n, v) for n, v in ev.headers.raw_items() if n.lower() not in HOP]
                if leaked(b"\n".join(n + b": " + v for n, v in kept)):
                    await asyncio.sleep(HOLD_S)  # (the cell is frozen before the client hears of it)
                    return
                await _send(writer, down, h11.Response(status_code=ev.status_code, headers=kept, reason=ev.reason))
            elif isinstance(ev, h11.Data):
                if leaked(bytes(ev.data)):
                    await asyncio.sleep(HOLD_S)
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
    """The cell-facing side for one bound host (its leaf): HTTP/2 (when ``h2`` is there) or HTTP/1.1."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(chain_path, key_path)
    try:
        import h2  # noqa: F401
        ctx.set_alpn_protocols(["h2", "http/1.1"])
    except ImportError:
        ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def upstream_context(cadata: str | None = None) -> ssl.SSLContext:
    """The real hosts' side: the host's trust store (or ``cadata``: a test's own CA), names checked."""
    ctx = ssl.create_default_context(cadata=cadata) if cadata else ssl.create_default_context()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
