"""OpenAI Chat Completions: `POST {base}/chat/completions`, SSE of `data:` chunks ending in `[DONE]`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any

import orjson

from gateway.dialects.base import SSEParser, UpstreamName, as_int
from gateway.dialects.canonical import (
    US,
    canon_parts,
    dumps,
    excerpt_notes,
    flat_text,
    int_field,
    join,
    model_of,
    norm_args,
    other,
    placeholder,
    plain_canonical,
    string,
)
from gateway.model import DialectName, Plan, Usage


def openai_error_body(status: int, type_: str, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}})


def openai_stream_error_frame(message: str) -> bytes:
    # The OpenAI SDK raises APIError on any `data:` frame carrying an "error" key.
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "api_error", "code": None}}) + b"\n\n"


def openai_usage(usage: Mapping[str, Any] | None) -> Usage:
    if not usage:
        return Usage()
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=as_int(usage.get("prompt_tokens")),
        output_tokens=as_int(usage.get("completion_tokens")),
        cache_read_tokens=as_int(details.get("cached_tokens")),
    )


def assistant_item(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply in the shape the client sends it back as history."""
    item: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        item["tool_calls"] = tool_calls
    return item


def _tool_call(tc: Mapping[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    return {
        "id": tc.get("id") or "",
        "type": "function",
        "function": {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
    }


class ChatAccumulator:
    """Rebuilds choice 0 of a streamed completion: text deltas, tool-call deltas by index, usage."""

    __slots__ = ("_calls", "_parser", "_text", "_usage")

    def __init__(self) -> None:
        self._parser = SSEParser()
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage = Usage()

    def feed(self, chunk: bytes) -> None:
        for obj in self._parser.objects(chunk):
            if obj.get("usage"):
                self._usage = openai_usage(obj["usage"])
            for choice in obj.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self._text.append(delta["content"])
                for tc in delta.get("tool_calls") or ():
                    call = self._calls.setdefault(
                        tc.get("index", 0),
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    if tc.get("id"):
                        call["id"] = tc["id"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        call["function"]["name"] += fn["name"]
                    if fn.get("arguments"):
                        call["function"]["arguments"] += fn["arguments"]

    def result(self) -> tuple[list[dict[str, Any]], Usage]:
        calls = [self._calls[i] for i in sorted(self._calls)]
        return [assistant_item("".join(self._text) or None, calls)], self._usage


class OpenAIWire:
    """What every OpenAI route shares: `stream: true` in the body, the error shapes, the key's header."""

    upstream: UpstreamName = "openai"
    base_has_v1 = True  # `upstreams.openai.base_url` is what the OpenAI SDK is given: it ends in /v1

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    # -- the summarizer's request ------------------------------------------------------------------

    def summary_request(self, model: str, system: str, user: str, *, max_tokens: int,
                        json_mode: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(path, body, extra headers) of one completion the summarizer asks (Chat Completions)."""
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        return "/v1/chat/completions", body, {}

    def summary_answer(self, data: dict[str, Any]) -> tuple[str, int, int]:
        """(text, input tokens, output tokens) of the answer; KeyError and the like on another shape."""
        text = data["choices"][0]["message"]["content"] or ""
        usage = data.get("usage") or {}
        return text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))

    def is_stream(self, body: Mapping[str, Any]) -> bool:
        return body.get("stream") is True

    def error_body(self, status: int, type_: str, message: str) -> bytes:
        return openai_error_body(status, type_, message)

    def stream_error_frame(self, message: str) -> bytes:
        return openai_stream_error_frame(message)


# ---------------------------------------------------------------- messages


def _oa_part(p: dict[str, Any]) -> str:
    kind = p.get("type")
    if kind == "text":
        return string(p.get("text"))
    if kind == "refusal":
        return string(p.get("refusal"))
    if kind == "image_url":
        return "[image]"
    if kind == "input_audio":
        return "[audio]"
    if kind == "file":
        return placeholder("file", (p.get("file") or {}).get("filename"))
    return ""


def _oa_text(content: Any) -> list[str]:
    return flat_text(content, _oa_part)


def _with_calls(raw: dict[str, Any], call: Callable[[str, str], str]) -> str:
    """A chat message's text, refusal and tool calls (each as `call(name, normalised arguments)`)."""
    out = _oa_text(raw.get("content"))
    refusal = raw.get("refusal")
    if isinstance(refusal, str) and refusal:
        out.append(refusal)
    for tc in raw.get("tool_calls") or ():
        if isinstance(tc, dict):
            _, name, args = _oa_call(tc)
            out.append(call(name, args))
    fc = raw.get("function_call")
    if isinstance(fc, dict):
        out.append(call(string(fc.get("name")), norm_args(fc.get("arguments"))))
    return "\n".join(out)


def _oa_call(tc: dict[str, Any]) -> tuple[str, str, str]:
    """(id, name, normalised arguments) of a function or custom tool call."""
    fn = tc.get("function")
    if isinstance(fn, dict):
        return string(tc.get("id")), string(fn.get("name")), norm_args(fn.get("arguments"))
    custom = tc.get("custom")
    if isinstance(custom, dict):
        return string(tc.get("id")), string(custom.get("name")), norm_args(custom.get("input"))
    return string(tc.get("id")), "", dumps(tc)


class OpenAIChat(OpenAIWire):
    """`/v1/chat/completions`: `messages`, leading system/developer messages are the system prompt."""

    name: DialectName = "openai_chat"
    history_field = "messages"

    def accumulator(self) -> ChatAccumulator:
        return ChatAccumulator()

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
        choices = body.get("choices") or [{}]
        message = choices[0].get("message") or {}
        calls = [_tool_call(tc) for tc in message.get("tool_calls") or ()]
        return [assistant_item(message.get("content"), calls)], openai_usage(body.get("usage"))

    # -- messages --------------------------------------------------------------------------------

    @staticmethod
    def _lead(messages: list[Any]) -> int:
        n = 0
        for m in messages:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                n += 1
            else:
                break
        return n

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        messages = body.get("messages")
        # The type check runs in C (map): it passes over every message of every request.
        if not isinstance(messages, list) or not all(map(isinstance, messages, repeat(dict))):
            return None
        return messages[self._lead(messages):]

    def system_text(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "\n\n".join(self.text(m) for m in messages[: self._lead(messages)])

    def role(self, raw: dict[str, Any]) -> str:
        return string(raw.get("role"))

    def spoken(self, raw: dict[str, Any]) -> tuple[str, str] | None:
        # Tool output comes in messages of its own. A call's arguments are the model's input to a
        # tool (a commit message, a prompt), not a statement of its own: its text and the call's name are.
        if raw.get("tool_calls") or raw.get("function_call"):
            return self.role(raw), _with_calls(raw, lambda name, args: f"[called {name}]")
        return None

    def text(self, raw: dict[str, Any]) -> str:
        return _with_calls(raw, lambda name, args: f"{name}({args})")

    def canonical(self, raw: dict[str, Any]) -> str:
        plain = plain_canonical(raw)  # the fast path: most messages
        if plain is not None:
            return plain
        content = raw.get("content")
        parts: list[str] = []
        name = raw.get("name")
        if isinstance(name, str) and name:
            parts.append("n:" + name)
        call_id = raw.get("tool_call_id")
        if isinstance(call_id, str):
            parts.append("r:" + call_id)
        canon_parts(content, parts)
        refusal = raw.get("refusal")
        if isinstance(refusal, str) and refusal:
            parts.append("f:" + refusal)
        for tc in raw.get("tool_calls") or ():
            if isinstance(tc, dict):
                parts.append("c:" + US.join(_oa_call(tc)))
        fc = raw.get("function_call")
        if isinstance(fc, dict):
            parts.append("c:" + US + string(fc.get("name")) + US + norm_args(fc.get("arguments")))
        audio = raw.get("audio")
        if isinstance(audio, dict):
            parts.append(other(audio))
        return join(string(raw.get("role")), parts)

    def tool_calls(self, raw: dict[str, Any]) -> tuple[str, ...]:
        calls = raw.get("tool_calls")
        if not calls:
            return ()
        return tuple(tc["id"] for tc in calls if isinstance(tc, dict) and isinstance(tc.get("id"), str))

    def tool_results(self, raw: dict[str, Any]) -> tuple[str, ...]:
        call_id = raw.get("tool_call_id")
        return (call_id,) if isinstance(call_id, str) and raw.get("role") == "tool" else ()

    def binds_next(self, raw: dict[str, Any]) -> bool:
        return False

    def is_turn_start(self, raw: dict[str, Any]) -> bool:
        return raw.get("role") == "user"

    def render(self, body: dict[str, Any], plan: Plan, *, cache_control: bool) -> dict[str, Any]:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        lead = messages[: self._lead(messages)]
        # Injected notes speak with the client's own system voice (o-series clients use developer).
        voice = "developer" if any(m.get("role") == "developer" for m in lead) else "system"
        out: list[dict[str, Any]] = list(lead)
        layers = "\n\n".join(b for b in (plan.state_block, plan.summary_block) if b)
        if layers:
            out.append({"role": voice, "content": layers})
        out.extend(plan.head)
        if plan.omitted_marker:
            out.append({"role": voice, "content": plan.omitted_marker})
        notes = excerpt_notes(self, plan)
        for i, msg in enumerate(plan.window):
            # Excerpts quote anyone, tool output included: carried as a user message (as Anthropic's
            # are), never with the system voice's authority.
            out.extend({"role": "user", "content": text} for text in notes.get(i, ()))
            out.append(msg)
        new = dict(body)
        new["messages"] = out
        return new

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return int_field(body, "max_completion_tokens", "max_tokens")

    def caches_full_history(self, raw: bytes) -> bool:
        """OpenAI caches long prompt prefixes by itself."""
        return True

    def model(self, body: dict[str, Any]) -> str | None:
        return model_of(body)
