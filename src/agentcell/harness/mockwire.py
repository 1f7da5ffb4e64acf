"""The model APIs' wire formats, for the scripted endpoint (:mod:`.mockmodel`): a request read whatever
its API (the tools it declares, its assistant turns, the tool results it carries back, the JSON it asks
for), a tool's arguments built from its schema, and an answer written as each API streams or returns it."""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

SHELL_TOOL_NAMES = ("bash", "shell", "exec_command", "run_shell_command", "shell_command", "local_shell",
                    "execute_command", "run_command", "terminal")
COMMAND_KEYS = ("command", "cmd")


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


class Answer:
    __slots__ = ("text", "tool", "args", "call_id")

    def __init__(self, *, text: str = "", tool: str | None = None, args: dict[str, Any] | None = None) -> None:
        self.text, self.tool, self.args = text, tool, args or {}
        self.call_id = secrets.token_hex(8)


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
