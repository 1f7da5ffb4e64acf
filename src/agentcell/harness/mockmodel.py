"""A scripted model endpoint: the model API a harness talks to, playing a script instead of a model.

It is what ``agentcell check`` and the harness tests point a real agent CLI at (``--api-base``), so a
real turn runs with no model and no internet. One server speaks every API the supported harnesses use:

========================== ================================================ ===========================
API                        paths                                            harnesses
========================== ================================================ ===========================
Anthropic Messages         ``POST /v1/messages`` (SSE and JSON)             Claude Code
OpenAI Responses           ``POST /v1/responses`` (SSE)                     Codex
OpenAI Chat Completions    ``POST /v1/chat/completions`` (SSE and JSON)     OpenCode, aider, Copilot
Gemini                     ``POST /v1beta/models/M:generateContent``,       Gemini CLI
                           ``…:streamGenerateContent`` (``alt=sse`` or not)
========================== ================================================ ===========================

(with or without the ``/v1`` prefix, and model lists for the clients that ask for one).
Their wire formats, read and written, are :mod:`.mockwire`'s; here are the script, its cursor and the
server.

**The script** is a list of steps, each ``{"shell": CMD}`` (call the harness's shell tool with CMD) or
``{"text": ANSWER}`` (answer in words, which ends the harness's turn). The shell tool is found among the
tools the request declares (by name, else by a ``command``/``cmd`` parameter) and its arguments are
built from that tool's schema: the command as a string, or as ``["bash", "-lc", CMD]`` where the schema
wants an array, every other required parameter given a plain value. A harness that declares no tools
(aider) is driven in ``fenced`` mode: the shell steps up to the next text step are fenced ``bash``
blocks in one answer (aider runs them in order, and sends their output back with the next message).

Which step a request gets is read from the conversation it carries, not from a counter: the steps
already played are matched, in order, against the assistant turns in its history. A retried request
gets the same answer again, and a side request (a title, a classifier: one that declares no shell
tool) never moves the script; it gets a neutral answer (a value of its JSON schema where it asks for
JSON).

**The log** (``--log``, JSON lines) has one record per request: the API, the path, ``main`` or
``side``, the step served, and every tool result the request carried back (what the harness's shell
printed), and the credential it carried as a digest (:func:`key_digest`: never its value). With
``--tls CERT KEY`` it serves HTTPS (a test CA's leaf: the check's "public" endpoint).

    python -m agentcell.harness.mockmodel --listen 127.0.0.1:8080 --script steps.json --log requests.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .mockwire import Answer, Request, Turn, _api_of, anthropic, chat, gemini, responses, shell_args, value_for

NEUTRAL = "OK."
MODELS = ("agentcell-mock",)
MAX_BODY = 64 << 20


class Step:
    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: str) -> None:
        if kind not in ("shell", "text"):
            raise ValueError(f"a step is shell or text, not {kind!r}")
        self.kind, self.value = kind, value

    def __repr__(self) -> str:
        return f"Step({self.kind!r}, {self.value!r})"

    def played_in(self, turn: Turn, fenced: bool) -> bool:
        value = self.value.strip()  # a harness may keep the answer stripped
        if self.kind == "shell" and not fenced:
            return any(value in s for call in turn.calls for s in _strings(call))
        return bool(value) and value in turn.text


def parse_script(data: Any) -> list[Step]:
    """``[{"shell": CMD} | {"text": ANSWER}, …]`` into steps; ValueError names the bad entry."""
    if not isinstance(data, list):
        raise ValueError("the script is a JSON list of steps")
    steps = []
    for n, item in enumerate(data):
        if not isinstance(item, dict) or len(item) != 1:
            raise ValueError(f"step {n}: write it as {{\"shell\": CMD}} or {{\"text\": ANSWER}}")
        (kind, value), = item.items()
        if not isinstance(value, str):
            raise ValueError(f"step {n}: {kind} takes a string")
        steps.append(Step(kind, value))
    return steps


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            yield " ".join(value)
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


class Model:
    """The script and what was asked of it. Thread-safe: the server answers requests in threads."""

    def __init__(self, steps: list[Step], *, fenced: bool = False, log: str | None = None) -> None:
        self.steps, self.fenced, self.log_path = steps, fenced, log
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []

    def step_for(self, req: Request) -> int:
        """The index of the step to play: the steps already played, matched in order against the
        history's assistant turns (in fenced mode one answer may carry several shell steps)."""
        i = 0
        for turn in req.turns:
            while i < len(self.steps) and self.steps[i].played_in(turn, self.fenced):
                i += 1
                if not self.fenced:
                    break
        return i

    def fenced_results(self, req: Request) -> list[str]:
        """What a harness without tools carried back: the user message after an answer of ours that
        names the command (aider sends ``Output from CMD`` and the output)."""
        out: list[str] = []
        i, pending = 0, list[str]()
        for role, item in req.order:
            if role == "assistant":
                pending = []
                while i < len(self.steps) and self.steps[i].played_in(item, True):
                    if self.steps[i].kind == "shell":
                        pending.append(self.steps[i].value.strip().splitlines()[0])
                    i += 1
            elif any(cmd in item for cmd in pending):
                out.append(item)
        return out

    def record(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.records.append(rec)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")

    def answer(self, api: str, path: str, body: dict[str, Any], credential: str) -> Answer:
        req = Request(api, body)
        tool = None if self.fenced else req.shell_tool()
        # A fenced harness's side requests (aider's commit message, its history summary) are a bare
        # system and user pair; its main requests carry assistant turns (its examples, "Ok.").
        main = tool is not None or (self.fenced and req.json_schema is None and bool(req.user_texts)
                                    and bool(req.turns))
        rec: dict[str, Any] = {"ts": time.time(), "api": api, "path": path, "kind": "main" if main else "side",
                               "tools": [n for n, _ in req.tools],
                               "results": req.results or (self.fenced_results(req) if self.fenced else []),
                               "credential": credential, "stream": bool(body.get("stream"))}
        if not main:
            ans = Answer(text=json.dumps(value_for(req.json_schema)) if req.json_schema is not None else NEUTRAL)
        else:
            i = self.step_for(req)
            rec["step"] = i
            if i >= len(self.steps):
                ans = Answer(text="The script is finished.")
            elif self.steps[i].kind == "text":
                ans = Answer(text=self.steps[i].value)
            elif self.fenced:  # every shell step up to the next text, one block each: aider runs them in order
                cmds = []
                while i < len(self.steps) and self.steps[i].kind == "shell":
                    cmds.append(self.steps[i].value)
                    i += 1
                ans = Answer(text="Running it now:\n\n" + "".join(f"```bash\n{c}\n```\n\n" for c in cmds))
            else:
                assert tool is not None
                ans = Answer(tool=tool[0], args=shell_args(tool[1], self.steps[i].value))
        self.record(rec)
        return ans


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _send(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for c in chunks:
            self.wfile.write(c)
            self.wfile.flush()
        self.close_connection = True

    def _credential(self) -> str:
        """The credential the request carried, as a digest (never its value): the first 16 hex digits of
        its SHA-256 (an Authorization header's token, without its scheme); "" without one."""
        h = self.headers
        value = (h.get("x-api-key") or h.get("x-goog-api-key") or h.get("api-key") or h.get("authorization")
                 or (parse_qs(urlsplit(self.path).query).get("key") or [""])[0])
        if value and h.get("authorization") == value and " " in value:
            value = value.split(" ", 1)[1]
        return key_digest(value) if value else ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = urlsplit(self.path).path.rstrip("/")
        self.server.model.record({"ts": time.time(), "api": "http", "path": path, "kind": "get",
                                  "credential": self._credential(),
                                  "upgrade": self.headers.get("upgrade", "")})
        if self.headers.get("upgrade", "").lower() == "websocket":
            self._send(426, {"error": {"message": "this endpoint speaks HTTP only, not WebSocket"}})
        elif path.endswith("/models") and "v1beta" in path:
            self._send(200, {"models": [{"name": f"models/{m}", "supportedGenerationMethods":
                                         ["generateContent", "streamGenerateContent"]} for m in MODELS]})
        elif path.endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                         "owned_by": "agentcell", "type": "model",
                                                         "display_name": m} for m in MODELS]})
        else:
            self._send(404, {"error": {"message": f"no {path} here"}})

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            self._send(413, {"error": {"message": "request too large"}})
            return
        raw = self.rfile.read(length) if length else self._read_chunked()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._send(400, {"error": {"message": "the body is not JSON"}})
            return
        model = self.server.model
        if url.path.rstrip("/").endswith("/count_tokens") or ":countTokens" in url.path:
            model.record({"ts": time.time(), "api": "count", "path": url.path, "kind": "side",
                          "credential": self._credential()})
            self._send(200, {"input_tokens": 1, "totalTokens": 1})
            return
        api = _api_of(url.path)
        if api is None or not isinstance(body, dict):
            model.record({"ts": time.time(), "api": "unknown", "path": url.path, "kind": "unknown",
                          "credential": self._credential()})
            self._send(404, {"error": {"message": f"no {url.path} here"}})
            return
        ans = model.answer(api, url.path, body, self._credential())
        name = str(body.get("model") or MODELS[0])
        obj: Any
        if api == "anthropic":
            obj, chunks = anthropic(ans, name, bool(body.get("stream")))
        elif api == "responses":
            obj, chunks = None, responses(ans, name)
            if not body.get("stream", True):
                obj = json.loads(chunks[-1].decode().split("data: ", 1)[1])["response"]
        elif api == "chat":
            obj, chunks = chat(ans, name, bool(body.get("stream")),
                               bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            obj, chunks = gemini(ans, name), []
            if ":streamGenerateContent" in url.path:
                if parse_qs(url.query).get("alt") == ["sse"]:
                    obj, chunks = None, [f"data: {json.dumps(obj)}\r\n\r\n".encode()]
                else:
                    obj = [obj]
        if obj is not None:
            self._send(200, obj)
        else:
            self._stream(chunks)

    def _read_chunked(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            return b""
        out = b""
        while True:
            size = int(self.rfile.readline().strip().split(b";")[0] or b"0", 16)
            if size > MAX_BODY - len(out):
                return b""
            if size == 0:
                self.rfile.readline()
                return out
            out += self.rfile.read(size)
            self.rfile.readline()


def key_digest(value: str) -> str:
    """How the log names a credential: enough to tell which, nothing to use."""
    import hashlib

    return hashlib.sha256(value.strip().encode()).hexdigest()[:16]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], model: Model) -> None:
        self.model = model
        self.scheme = "http"
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        """HTTPServer's, without its reverse lookup of our own address (which waits for a resolver
        that a fake internet may not have)."""
        import socketserver

        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{self.scheme}://{host!s}:{port}"


def serve_in_thread(model: Model, host: str = "127.0.0.1", port: int = 0) -> Server:
    """Start the endpoint on a thread of this process (port 0: any free one); ``shutdown()`` ends it."""
    server = Server((host, port), model)
    threading.Thread(target=server.serve_forever, name="agentcell-mockmodel", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentcell.harness.mockmodel", description=__doc__.split("\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0", metavar="ADDR:PORT")
    p.add_argument("--script", required=True, metavar="FILE", help="a JSON list of {shell: CMD} / {text: ANSWER}")
    p.add_argument("--fenced", action="store_true", help="shell steps as fenced bash blocks (harnesses without tools)")
    p.add_argument("--log", metavar="FILE", help="append one JSON line per request")
    p.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), help="serve HTTPS with this certificate chain and key")
    ns = p.parse_args(argv)
    host, _, port = ns.listen.rpartition(":")
    try:
        with open(ns.script, encoding="utf-8") as f:
            steps = parse_script(json.load(f))
        server = Server((host.strip("[]") or "127.0.0.1", int(port)), Model(steps, fenced=ns.fenced, log=ns.log))
        if ns.tls:
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*ns.tls)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
            server.scheme = "https"
    except (OSError, ValueError) as e:
        sys.stderr.write(f"mockmodel: {e}\n")
        return 2
    sys.stdout.write(f"listening {server.url}\n")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
