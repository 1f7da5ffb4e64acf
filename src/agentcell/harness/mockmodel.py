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
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

SHELL_TOOL_NAMES = ("bash", "shell", "exec_command", "run_shell_command", "shell_command", "local_shell",
                    "execute_command", "run_command", "terminal")
COMMAND_KEYS = ("command", "cmd")
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


# ---- reading a request ------------------------------------------------------------------------------

def _text_of(content: Any) -> str:
    """The text of a message's content in any of the APIs' shapes."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_of(c) for c in content)
    if isinstance(content, dict):
        for key in ("text", "content", "output", "result"):
            if key in content:
                return _text_of(content[key])
        if "response" in content:
            return json.dumps(content["response"])
    return ""


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


def _args_of(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


class Turn:
    """One assistant turn of a conversation: the commands it called its tools with, its text."""

    __slots__ = ("calls", "text")

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.text = ""

    def matches(self, step: Step, fenced: bool) -> bool:
        value = step.value.strip()  # a harness may keep the answer stripped
        if step.kind == "shell" and not fenced:
            return any(value in s for call in self.calls for s in _strings(call))
        return bool(value) and value in self.text


class Request:
    """What a request declares and carries, whatever its API: its tools, its history of assistant
    turns, the tool results in it, whether it asks for JSON (and by which schema)."""

    def __init__(self, api: str, body: dict[str, Any]) -> None:
        self.api, self.body = api, body
        self.tools: list[tuple[str, dict[str, Any]]] = []  # (name, JSON schema of its parameters)
        self.turns: list[Turn] = []
        self.results: list[str] = []
        self.user_texts: list[str] = []
        self.order: list[tuple[str, Any]] = []  # ("assistant", Turn) and ("user", text), as they came (chat)
        self.json_schema: dict[str, Any] | None = None
        getattr(self, f"_read_{api}")(body)

    def _read_anthropic(self, body: dict[str, Any]) -> None:
        for t in body.get("tools") or []:
            if isinstance(t, dict) and "name" in t:
                self.tools.append((str(t["name"]), t.get("input_schema") or {}))
        for m in body.get("messages") or []:
            content = m.get("content")
            blocks = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            if m.get("role") == "assistant":
                turn = Turn()
                for b in blocks:
                    if b.get("type") == "tool_use":
                        turn.calls.append(b.get("input"))
                    elif b.get("type") == "text":
                        turn.text += str(b.get("text", ""))
                self.turns.append(turn)
            else:
                for b in blocks:
                    if b.get("type") == "tool_result":
                        self.results.append(_text_of(b.get("content")))
                    elif b.get("type") == "text":
                        self.user_texts.append(str(b.get("text", "")))

    def _read_responses(self, body: dict[str, Any]) -> None:
        for t in body.get("tools") or []:
            if isinstance(t, dict) and t.get("type") == "function":
                self.tools.append((str(t.get("name", "")), t.get("parameters") or {}))
            elif isinstance(t, dict) and t.get("type") == "local_shell":
                self.tools.append(("local_shell", {"type": "object", "properties": {
                    "command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}))
        items = body.get("input")
        for item in items if isinstance(items, list) else [{"type": "message", "role": "user", "content": items}]:
            kind = item.get("type", "message")
            if kind in ("function_call", "local_shell_call", "custom_tool_call"):
                turn = Turn()
                turn.calls.append(_args_of(item.get("arguments", item.get("action", item.get("input")))))
                self.turns.append(turn)
            elif kind in ("function_call_output", "local_shell_call_output", "custom_tool_call_output"):
                self.results.append(_text_of(item.get("output")))
            elif kind == "message" and item.get("role") == "assistant":
                turn = Turn()
                turn.text = _text_of(item.get("content"))
                self.turns.append(turn)
            elif kind == "message" and item.get("role") == "user":
                self.user_texts.append(_text_of(item.get("content")))
        fmt = ((body.get("text") or {}).get("format") or {})
        if fmt.get("type") == "json_schema":
            self.json_schema = fmt.get("schema") or {}

    def _read_chat(self, body: dict[str, Any]) -> None:
        for t in body.get("tools") or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict):
                self.tools.append((str(fn.get("name", "")), fn.get("parameters") or {}))
        for m in body.get("messages") or []:
            role = m.get("role")
            if role == "assistant":
                turn = Turn()
                turn.text = _text_of(m.get("content"))
                for c in m.get("tool_calls") or []:
                    turn.calls.append(_args_of((c.get("function") or {}).get("arguments")))
                self.turns.append(turn)
                self.order.append(("assistant", turn))
            elif role == "tool":
                self.results.append(_text_of(m.get("content")))
            elif role == "user":
                self.user_texts.append(_text_of(m.get("content")))
                self.order.append(("user", self.user_texts[-1]))
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_schema":
            self.json_schema = (fmt.get("json_schema") or {}).get("schema") or {}
        elif fmt.get("type") == "json_object":
            self.json_schema = {"type": "object"}

    def _read_gemini(self, body: dict[str, Any]) -> None:
        for t in body.get("tools") or []:
            for fn in (t.get("functionDeclarations") or t.get("function_declarations") or []):
                schema = fn.get("parametersJsonSchema") or fn.get("parameters") or {}
                self.tools.append((str(fn.get("name", "")), schema))
        for c in body.get("contents") or []:
            parts = c.get("parts") or []
            if c.get("role") == "model":
                turn = Turn()
                for p in parts:
                    if "functionCall" in p:
                        turn.calls.append((p["functionCall"] or {}).get("args"))
                    elif "text" in p and not p.get("thought"):
                        turn.text += str(p["text"])
                self.turns.append(turn)
            else:
                for p in parts:
                    if "functionResponse" in p:
                        self.results.append(_text_of(p["functionResponse"]))
                    elif "text" in p:
                        self.user_texts.append(str(p["text"]))
        cfg = body.get("generationConfig") or body.get("generation_config") or {}
        if cfg.get("responseMimeType") == "application/json" or cfg.get("responseSchema") or \
                cfg.get("responseJsonSchema"):
            self.json_schema = cfg.get("responseJsonSchema") or cfg.get("responseSchema") or {"type": "object"}

    def shell_tool(self) -> tuple[str, dict[str, Any]] | None:
        """The harness's shell tool: by a known name, else the one tool with a command parameter."""
        for name, schema in self.tools:
            if name.lower() in SHELL_TOOL_NAMES and _command_key(schema) is not None:
                return name, schema
        for name, schema in self.tools:
            if _command_key(schema) is not None and name.lower().startswith(("bash", "shell", "exec", "run")):
                return name, schema
        return None


def _command_key(schema: dict[str, Any]) -> str | None:
    props = schema.get("properties") or {}
    return next((k for k in COMMAND_KEYS if k in props), None)


def _type_of(schema: dict[str, Any]) -> str:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    return str(t or "string").lower()


def value_for(schema: dict[str, Any]) -> Any:
    """A plain value that satisfies ``schema`` (first enum value, empty string, 0, the required
    properties of an object): the neutral answer to a JSON question, and a tool's other arguments."""
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return value_for(schema[key][0])
    t = _type_of(schema)
    if t == "object":
        props = schema.get("properties") or {}
        return {k: value_for(props.get(k) or {}) for k in schema.get("required") or []}
    if t == "array":
        return []
    if t == "integer":  # a score or a count: Gemini CLI's router asks for complexity_score and wants >= 1
        return schema.get("minimum", 1)
    if t == "number":  # a confidence: 0 (Gemini CLI's loop check takes >= 0.9 for a loop)
        return schema.get("minimum", 0)
    if t == "boolean":
        return False
    return "agentcell scripted step"


def shell_args(schema: dict[str, Any], command: str) -> dict[str, Any]:
    """The shell tool's arguments for ``command``, built from its schema."""
    props = schema.get("properties") or {}
    key = _command_key(schema) or "command"
    args: dict[str, Any] = {k: value_for(props.get(k) or {}) for k in schema.get("required") or [] if k != key}
    if _type_of(props.get(key) or {}) == "array":
        args[key] = ["bash", "-lc", command]
    else:
        args[key] = command
    return args


# ---- the script's cursor -------------------------------------------------------------------------

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
            while i < len(self.steps) and turn.matches(self.steps[i], self.fenced):
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
                while i < len(self.steps) and item.matches(self.steps[i], True):
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


class Answer:
    __slots__ = ("text", "tool", "args", "call_id")

    def __init__(self, *, text: str = "", tool: str | None = None, args: dict[str, Any] | None = None) -> None:
        self.text, self.tool, self.args = text, tool, args or {}
        self.call_id = secrets.token_hex(8)


# ---- the wire formats ----------------------------------------------------------------------------

def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def anthropic(ans: Answer, model: str, stream: bool) -> tuple[dict[str, Any] | None, list[bytes]]:
    mid = "msg_" + ans.call_id
    usage = {"input_tokens": 1, "output_tokens": 1}
    if ans.tool:
        block: dict[str, Any] = {"type": "tool_use", "id": "toolu_" + ans.call_id, "name": ans.tool,
                                 "input": ans.args}
        stop = "tool_use"
    else:
        block, stop = {"type": "text", "text": ans.text}, "end_turn"
    msg = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [block],
           "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not stream:
        return msg, []
    start = dict(msg, content=[], stop_reason=None)
    empty = dict(block, input={}) if ans.tool else dict(block, text="")
    delta = ({"type": "input_json_delta", "partial_json": json.dumps(ans.args)} if ans.tool else
             {"type": "text_delta", "text": ans.text})
    return None, [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": empty}),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
        _sse("message_stop", {"type": "message_stop"}),
    ]


def responses(ans: Answer, model: str) -> list[bytes]:
    rid = "resp_" + ans.call_id
    if ans.tool:
        item: dict[str, Any] = {"type": "function_call", "id": "fc_" + ans.call_id, "call_id": "call_" + ans.call_id,
                                "name": ans.tool, "arguments": json.dumps(ans.args), "status": "completed"}
    else:
        item = {"type": "message", "id": "msg_" + ans.call_id, "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": ans.text, "annotations": []}]}
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "output": [],
            "status": "in_progress"}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    events: list[tuple[str, dict[str, Any]]] = [("response.created", {"response": base}),
                                                ("response.in_progress", {"response": base})]
    if ans.tool:
        events += [("response.output_item.added", {"output_index": 0, "item": dict(item, arguments="",
                                                                                   status="in_progress")}),
                   ("response.function_call_arguments.delta", {"output_index": 0, "item_id": item["id"],
                                                               "delta": item["arguments"]}),
                   ("response.function_call_arguments.done", {"output_index": 0, "item_id": item["id"],
                                                              "arguments": item["arguments"]})]
    else:
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"output_index": 0, "item_id": item["id"], "content_index": 0}
        events += [("response.output_item.added", {"output_index": 0, "item": dict(item, content=[],
                                                                                   status="in_progress")}),
                   ("response.content_part.added", dict(ids, part=part)),
                   ("response.output_text.delta", dict(ids, delta=ans.text)),
                   ("response.output_text.done", dict(ids, text=ans.text)),
                   ("response.content_part.done", dict(ids, part=dict(part, text=ans.text)))]
    events += [("response.output_item.done", {"output_index": 0, "item": item}),
               ("response.completed", {"response": dict(base, status="completed", output=[item], usage=usage)})]
    return [_sse(name, {"type": name, "sequence_number": n, **data}) for n, (name, data) in enumerate(events)]


def chat(ans: Answer, model: str, stream: bool, usage_chunk: bool) -> tuple[dict[str, Any] | None, list[bytes]]:
    cid, created = "chatcmpl-" + ans.call_id, int(time.time())
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    call = {"id": "call_" + ans.call_id, "type": "function",
            "function": {"name": ans.tool, "arguments": json.dumps(ans.args)}}
    finish = "tool_calls" if ans.tool else "stop"
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": None if ans.tool else ans.text}
        if ans.tool:
            message["tool_calls"] = [call]
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}, []

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> bytes:
        return _sse(None, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    out = [chunk({"role": "assistant", "content": ""}, None)]
    out.append(chunk({"tool_calls": [dict(call, index=0)]} if ans.tool else {"content": ans.text}, None))
    out.append(chunk({}, finish))
    if usage_chunk:
        out.append(_sse(None, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage}))
    out.append(_sse(None, "[DONE]"))
    return None, out


def gemini(ans: Answer, model: str) -> dict[str, Any]:
    part: dict[str, Any] = ({"functionCall": {"name": ans.tool, "args": ans.args}} if ans.tool else
                            {"text": ans.text})
    return {"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2},
            "modelVersion": model, "responseId": ans.call_id}


# ---- HTTP ------------------------------------------------------------------------------------------

def _api_of(path: str) -> str | None:
    p = path.rstrip("/")
    if p.endswith("/messages") and "/count_tokens" not in p:
        return "anthropic"
    if p.endswith("/responses"):
        return "responses"
    if p.endswith("/chat/completions"):
        return "chat"
    if ":generateContent" in p or ":streamGenerateContent" in p:
        return "gemini"
    return None


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
