"""The proxy's intercepting path, on loopback: a client trusting only the session's CA, an HTTPS
upstream of the test's own (a test CA standing in for the public ones), the Interceptor between them."""
from __future__ import annotations

import asyncio
import http.client
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.network.credentials import CredentialSet, parse_bindings
from agentcell.network.intercept import Interceptor, server_context, upstream_context
from agentcell.network.tlsca import SessionCA

KEY = "sk-ant-api03-" + "Zq7_w-" * 12 + "AA"
HOST = "api.example.test"


class Upstream:
    """An HTTPS server for HOST on 127.0.0.1: records each request; /stream sends two events, the
    second only once the test says the first arrived."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.go_on = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import h11

        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                body, request = b"", None
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        data = await reader.read(65536)
                        conn.receive_data(data)
                        continue
                    if isinstance(ev, h11.Request):
                        request = ev
                    elif isinstance(ev, h11.Data):
                        body += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                headers = {n.decode(): v.decode() for n, v in request.headers.raw_items()}
                self.seen.append((request.method.decode(), request.target.decode(), headers, body))
                if request.target == b"/stream":
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])))
                    writer.write(conn.send(h11.Data(data=b"data: one\n\n")))
                    await writer.drain()
                    await asyncio.wait_for(self.go_on.wait(), 10)
                    writer.write(conn.send(h11.Data(data=b"data: two\n\n")))
                else:
                    text = f"hello {request.method.decode()} {len(body)}\n".encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("content-length", str(len(text)))])))
                    writer.write(conn.send(h11.Data(data=text)))
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            writer.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The loop in a thread: the upstream and a CONNECT front with the Interceptor behind it."""
    public = SessionCA("test-public-ca", (HOST,))  # (stands in for the public CAs)
    creds = CredentialSet.build({"ANTHROPIC_API_KEY": KEY}, parse_bindings([f"ANTHROPIC_API_KEY={HOST}:x-api-key"]))
    session = SessionCA("s1", creds.hosts())
    for name, (chain, key) in (("up", public.leaf(HOST)), ("leaf", session.leaf(HOST))):
        (tmp_path / f"{name}.pem").write_bytes(chain)
        (tmp_path / f"{name}.key").write_bytes(key)
    loop = asyncio.new_event_loop()
    upstream = Upstream()
    refused: list[str] = []
    started = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        up_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        up_ctx.load_cert_chain(tmp_path / "up.pem", tmp_path / "up.key")
        up_server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0, ssl=up_ctx)
        up_port = up_server.sockets[0].getsockname()[1]

        async def opener(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            assert (host, port) == (HOST, 443)
            return await asyncio.open_connection("127.0.0.1", up_port)

        icpt = Interceptor(creds, {HOST: server_context(str(tmp_path / "leaf.pem"), str(tmp_path / "leaf.key"))},
                           upstream_context(public.pem.decode()), lambda host, port, why: refused.append(why), opener)

        async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ")[1].decode()
            host, _, port = target.rpartition(":")
            assert icpt.wants(host) and (host, port) == (HOST, "443")
            up_r, up_w = await asyncio.open_connection("127.0.0.1", up_port)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            try:
                await icpt.serve(host, int(port), reader, writer, up_r, up_w)
            finally:
                writer.close()

        front_server = await asyncio.start_server(front, "127.0.0.1", 0)
        state.update(port=front_server.sockets[0].getsockname()[1], servers=(up_server, front_server))
        started.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    t.start()
    assert started.wait(10)
    trust = ssl.create_default_context(cadata=session.pem.decode())
    try:
        yield {"port": state["port"], "trust": trust, "upstream": upstream, "refused": refused,
               "placeholder": creds.cell_env()["ANTHROPIC_API_KEY"], "loop": loop}
    finally:
        async def stop() -> None:
            for s in state.get("servers", ()):
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def client(rig: dict[str, Any]) -> http.client.HTTPSConnection:
    c = http.client.HTTPSConnection("127.0.0.1", rig["port"], context=rig["trust"], timeout=20)
    c.set_tunnel(HOST, 443)
    return c


def test_the_bound_host_gets_the_real_key_and_the_cell_only_the_placeholder(rig: dict[str, Any]) -> None:
    c = client(rig)
    for i in range(2):  # two requests, one connection
        c.request("POST", f"/v1/messages?n={i}", body=b"x" * 1000, headers={"x-api-key": rig["placeholder"],
                                                                              "Expect": "100-continue"})
        r = c.getresponse()
        assert (r.status, r.read()) == (200, b"hello POST 1000\n")
    c.close()
    seen = rig["upstream"].seen
    assert [(m, t, h["x-api-key"], len(b)) for m, t, h, b in seen] == [
        ("POST", "/v1/messages?n=0", KEY, 1000), ("POST", "/v1/messages?n=1", KEY, 1000)]
    assert all("expect" not in {k.lower() for k in h} for _, _, h, _ in seen)
    assert rig["refused"] == []


@pytest.mark.parametrize("target, headers, why", [
    ("/v1/messages?key={ph}", {}, "in the URL"),
    ("/v1/messages", {"authorization": "Bearer {ph}"}, "in the header authorization"),
])
def test_the_placeholder_where_it_is_not_bound_is_refused_and_never_sent(rig: dict[str, Any], target: str,
                                                                         headers: dict[str, str], why: str) -> None:
    c = client(rig)
    ph = rig["placeholder"]
    c.request("GET", target.format(ph=ph), headers={k: v.format(ph=ph) for k, v in headers.items()})
    r = c.getresponse()
    assert r.status == 403 and why in r.read().decode()
    c.close()
    assert rig["upstream"].seen == [] and len(rig["refused"]) == 1 and why in rig["refused"][0]


def test_a_streamed_response_is_not_held(rig: dict[str, Any]) -> None:
    c = client(rig)
    c.request("GET", "/stream", headers={"x-api-key": rig["placeholder"], "accept": "text/event-stream"})
    r = c.getresponse()
    assert r.status == 200
    assert r.readline() == b"data: one\n"  # before the upstream has sent the second
    rig["loop"].call_soon_threadsafe(rig["upstream"].go_on.set)
    assert r.read() == b"\ndata: two\n\n"
    c.close()



def test_http2_streams_at_once_each_get_the_key_and_the_placeholder_elsewhere_is_refused(rig: dict[str, Any]) -> None:
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("h2")
    ph = rig["placeholder"]
    with httpx.Client(http2=True, proxy=f"http://127.0.0.1:{rig['port']}", verify=rig["trust"], timeout=20) as c:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: c.post(f"https://{HOST}/v1/messages?i={i}", content=b"y" * (i * 5000),
                                                     headers={"x-api-key": ph}), range(4)))
        assert [(a.http_version, a.status_code, a.text) for a in answers] == [
            ("HTTP/2", 200, f"hello POST {i * 5000}\n") for i in range(4)]
        bad = c.get(f"https://{HOST}/v1/messages?key={ph}")
        assert bad.status_code == 403 and "in the URL" in bad.text
        with c.stream("GET", f"https://{HOST}/stream", headers={"x-api-key": ph}) as r:
            lines = r.iter_lines()
            assert next(lines) == "data: one"  # before the upstream sends the second
            rig["loop"].call_soon_threadsafe(rig["upstream"].go_on.set)
            assert [line for line in lines if line] == ["data: two"]
    seen = sorted((t, h["x-api-key"], len(b)) for _, t, h, b in rig["upstream"].seen)
    assert seen == sorted([(f"/v1/messages?i={i}", KEY, i * 5000) for i in range(4)] + [("/stream", KEY, 0)])
    assert len(rig["refused"]) == 1 and "in the URL" in rig["refused"][0]
