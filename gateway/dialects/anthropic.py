"""Anthropic Messages: `POST {base}/v1/messages`, SSE with `event:` lines.

Content blocks are rebuilt per index: text deltas merged, tool_use input rebuilt from the
`input_json_delta` fragments, thinking blocks kept with their signature (the API rejects a
thinking block sent back without it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import repeat
from typing import Any

import orjson

from gateway.dialects.base import SSEParser, UpstreamName, as_int
from gateway.dialects.canonical import (
    GS,
    US,
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
    text_block,
)
from gateway.model import DialectName, Plan, Usage


def anthropic_usage(usage: Mapping[str, Any] | None) -> Usage:
    if not usage:
        return Usage()
    read = as_int(usage.get("cache_read_input_tokens"))
    write = as_int(usage.get("cache_creation_input_tokens"))
    return Usage(
        input_tokens=as_int(usage.get("input_tokens")) + read + write,
        output_tokens=as_int(usage.get("output_tokens")),
        cache_read_tokens=read,
        cache_write_tokens=write,
    )


def request_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """A response content block in the form a request accepts (citations etc. dropped)."""
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    if kind == "tool_use":
        return {"type": "tool_use", "id": block.get("id", ""), "name": block.get("name", ""),
                "input": block.get("input") or {}}
    if kind == "thinking":
        out = {"type": "thinking", "thinking": block.get("thinking", "")}
        if block.get("signature"):
            out["signature"] = block["signature"]
        return out
    return dict(block)


class MessagesAccumulator:
    __slots__ = ("_blocks", "_json", "_parser", "_usage")

    def __init__(self) -> None:
        self._parser = SSEParser()
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}
        self._usage: dict[str, Any] = {}

    def feed(self, chunk: bytes) -> None:
        for obj in self._parser.objects(chunk):
            kind = obj.get("type")
            if kind == "content_block_delta":
                self._delta(obj.get("index", 0), obj.get("delta") or {})
            elif kind == "content_block_start":
                block = dict(obj.get("content_block") or {})
                if block.get("type") == "tool_use":
                    self._json[obj.get("index", 0)] = []
                self._blocks[obj.get("index", 0)] = block
            elif kind == "message_start":
                self._usage = dict((obj.get("message") or {}).get("usage") or {})
            elif kind == "message_delta":
                # Running totals: later values replace earlier ones, absent keys keep theirs.
                for key, value in (obj.get("usage") or {}).items():
                    if value is not None:
                        self._usage[key] = value

    def _delta(self, index: int, delta: Mapping[str, Any]) -> None:
        block = self._blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta.get("text", "")
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(delta.get("partial_json", ""))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif kind == "signature_delta":
            block["signature"] = block.get("signature", "") + delta.get("signature", "")

    def result(self) -> tuple[list[dict[str, Any]], Usage]:
        content = []
        for index in sorted(self._blocks):
            block = self._blocks[index]
            if index in self._json:
                text = "".join(self._json[index])
                try:
                    block["input"] = orjson.loads(text) if text else (block.get("input") or {})
                except orjson.JSONDecodeError:
                    block["input"] = {}
            content.append(request_block(block))
        return [{"role": "assistant", "content": content}], anthropic_usage(self._usage)


# ---------------------------------------------------------------- messages


# Anthropic needs a user message first and alternating roles; when a window has to start at an
# assistant message and there is no omitted-marker to carry, this is the user text put before it.
CONTINUE_TEXT = "[the conversation continues from the summary above]"


def _an_parts(content: Any, parts: list[str]) -> None:
    if isinstance(content, str):
        if content:
            parts.append("t:" + content)
        return
    if not isinstance(content, list):
        return
    for b in content:
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            t = string(b.get("text"))
            if t:
                parts.append("t:" + t)
        elif kind == "tool_use":
            parts.append("c:" + US.join((string(b.get("id")), string(b.get("name")), norm_args(b.get("input")))))
        elif kind == "tool_result":
            nested: list[str] = []
            _an_parts(b.get("content"), nested)
            error = US + "e" if b.get("is_error") else ""
            parts.append("r:" + string(b.get("tool_use_id")) + US + GS.join(nested) + error)
        elif kind in ("thinking", "redacted_thinking"):
            # Left out: some clients strip earlier thinking blocks before sending history back, and
            # the API ignores them outside the current tool loop anyway.
            continue
        else:
            parts.append(other(b))


def _an_part(b: dict[str, Any]) -> str | list[str]:
    kind = b.get("type")
    if kind == "text":
        return string(b.get("text"))
    if kind == "tool_use":
        return f"{string(b.get('name'))}({norm_args(b.get('input'))})"
    if kind == "tool_result":
        return _an_text(b.get("content"))
    if kind == "image":
        return "[image]"
    if kind == "document":
        return placeholder("document", b.get("title"))
    return ""


def _an_text(content: Any) -> list[str]:
    return flat_text(content, _an_part)


def _blocks(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [text_block(content)] if content else []
    return list(content) if isinstance(content, list) else []


_REMINDER_OPEN = re.compile(r"<system-reminder>", re.IGNORECASE)
_REMINDER_CLOSE = re.compile(r"</system-reminder>", re.IGNORECASE)


def _without_reminders(text: str) -> str:
    """`text` less its <system-reminder> sections: notes Claude Code adds to user messages and tool
    results (file contents, tool lists, "you MUST refuse ..."), not words of the user's. The same
    object when it has none.

    Everything from the first opening tag to the last closing tag goes: a note quotes files, and a
    file may hold a closing tag of its own, after which its text would pass for the user's (words of
    the user's between two notes of one block go too; Claude Code gives its notes blocks of their
    own). A tag never closed is kept as written: Claude Code closes its notes, so it is someone
    writing about the tag. Tags in any case. Linear: one search forward, one pass over the closings."""
    start = _REMINDER_OPEN.search(text)
    if start is None:
        return text
    end = -1
    for m in _REMINDER_CLOSE.finditer(text, start.end()):
        end = m.end()
    if end < 0:
        return text
    return (text[:start.start()] + text[end:]).strip()


def _is_result(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_result"


def _with_notes(msg: dict[str, Any], notes: list[dict[str, Any]], *, first: bool) -> dict[str, Any]:
    """A copy of user message `msg` with text blocks added: before its own content but after its
    tool_result blocks (`first`), or at its end. Tool results must open a user message."""
    blocks = _blocks(msg.get("content"))
    if first:
        k = max((i + 1 for i, b in enumerate(blocks) if _is_result(b)), default=0)
        blocks = blocks[:k] + notes + blocks[k:]
    else:
        blocks = blocks + notes
    new = dict(msg)
    new["content"] = blocks
    return new


def _merge_users(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    blocks = _blocks(a.get("content")) + _blocks(b.get("content"))
    # Stable partition: tool results first, as the API requires (only `a` can have any here).
    blocks = [x for x in blocks if _is_result(x)] + [x for x in blocks if not _is_result(x)]
    new = dict(a)
    new["content"] = blocks
    return new


def _breakpoints(value: Any) -> list[str]:
    """The cache lifetime of each cache_control breakpoint in `value` (blocks, tools or messages), in
    the order Anthropic reads them: "1h", or "5m" (the default)."""
    if isinstance(value, list):
        return [ttl for v in value for ttl in _breakpoints(v)]
    if isinstance(value, dict):
        mark = value.get("cache_control")
        found = [] if mark is None else [_ttl(mark)]
        content = value.get("content")
        if isinstance(content, list):
            found += _breakpoints(content)
        return found
    return []


def _ttl(mark: Any) -> str:
    return "1h" if isinstance(mark, dict) and mark.get("ttl") == "1h" else "5m"


class Anthropic:
    """`/v1/messages`: `system` apart, `messages` alternate user/assistant; tool results are
    `tool_result` blocks at the start of the next user message."""

    name: DialectName = "anthropic"
    upstream: UpstreamName = "anthropic"
    history_field = "messages"
    base_has_v1 = False  # `upstreams.anthropic.base_url` is what the Anthropic SDK is given: no /v1

    def auth_headers(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key}

    def is_stream(self, body: Mapping[str, Any]) -> bool:
        return body.get("stream") is True

    def error_body(self, status: int, type_: str, message: str) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})

    def stream_error_frame(self, message: str) -> bytes:
        # The SDK only sees events that carry their `event:` line.
        return b"event: error\ndata: " + orjson.dumps(
            {"type": "error", "error": {"type": "api_error", "message": message}}) + b"\n\n"

    def accumulator(self) -> MessagesAccumulator:
        return MessagesAccumulator()

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
        content = [request_block(b) for b in body.get("content") or () if isinstance(b, dict)]
        return [{"role": "assistant", "content": content}], anthropic_usage(body.get("usage"))

    # -- messages --------------------------------------------------------------------------------

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        messages = body.get("messages")
        # The type check runs in C (map): it passes over every message of every request.
        if not isinstance(messages, list) or not all(map(isinstance, messages, repeat(dict))):
            return None
        return messages

    def system_text(self, body: dict[str, Any]) -> str:
        system = body.get("system")
        if isinstance(system, str):
            return system
        return "\n\n".join(_an_text(system)) if isinstance(system, list) else ""

    def role(self, raw: dict[str, Any]) -> str:
        role = string(raw.get("role"))
        content = raw.get("content")
        if role == "user" and type(content) is list and content and all(map(_is_result, content)):
            # Only tool results: what a tool returned, not what the user said (the other dialects'
            # "tool"), so the state, timeline and speaker prior do not take a file's text as the user's.
            return "tool"
        return role

    def text(self, raw: dict[str, Any]) -> str:
        return "\n".join(_an_text(raw.get("content")))

    def spoken(self, raw: dict[str, Any]) -> tuple[str, str] | None:
        content = raw.get("content")
        if string(raw.get("role")) == "assistant" and type(content) is list and any(
                isinstance(b, dict) and b.get("type") == "tool_use" for b in content):
            # A call's input is for the tool (a commit message, a prompt), not the model's statement: its name stays.
            said = _an_text([b for b in content if isinstance(b, dict) and b.get("type") == "text"])
            said += [f"[called {string(b.get('name'))}]" for b in content
                     if isinstance(b, dict) and b.get("type") == "tool_use"]
            return "assistant", "\n".join(said)
        if string(raw.get("role")) != "user":
            return None
        if type(content) is str:
            own = _without_reminders(content)
            return None if own is content else ("user", own) if own else ("system", "")
        if type(content) is not list:
            return None
        results = [b for b in content if _is_result(b)]
        # Block by block: a note is a block of its own (or ends a tool result's text).
        texts = [t for t in map(_without_reminders, _an_text([b for b in content if not _is_result(b)])) if t]
        returned = [t for t in map(_without_reminders, _an_text(results)) if t]
        if texts:
            role, text = "user", "\n".join(texts)
        elif results:
            role, text = "tool", "\n".join(returned)
        else:
            role, text = "system", ""
        return role, text  # (the caller keeps the message as it is when these equal it)

    def canonical(self, raw: dict[str, Any]) -> str:
        plain = plain_canonical(raw)
        if plain is not None:
            return plain
        parts: list[str] = []
        _an_parts(raw.get("content"), parts)
        return join(string(raw.get("role")), parts)

    def tool_calls(self, raw: dict[str, Any]) -> tuple[str, ...]:
        content = raw.get("content")
        if type(content) is not list or raw.get("role") != "assistant":
            return ()
        return tuple(b["id"] for b in content
                     if isinstance(b, dict) and b.get("type") == "tool_use" and isinstance(b.get("id"), str))

    def tool_results(self, raw: dict[str, Any]) -> tuple[str, ...]:
        content = raw.get("content")
        if type(content) is not list or raw.get("role") != "user":
            return ()
        return tuple(b["tool_use_id"] for b in content
                     if _is_result(b) and isinstance(b.get("tool_use_id"), str))

    def binds_next(self, raw: dict[str, Any]) -> bool:
        return False

    def is_turn_start(self, raw: dict[str, Any]) -> bool:
        if raw.get("role") != "user":
            return False
        content = raw.get("content")
        if isinstance(content, str):
            return True
        return isinstance(content, list) and any(not _is_result(b) for b in content)

    def render(self, body: dict[str, Any], plan: Plan, *, cache_control: bool) -> dict[str, Any]:
        new = dict(body)
        new["messages"] = self._messages(plan)
        injected = [text_block(b) for b in (plan.state_block, plan.summary_block) if b]
        if injected:
            system = body.get("system")
            blocks: list[Any]
            if isinstance(system, str):
                blocks = [text_block(system)] if system else []  # an empty text block is rejected
            elif isinstance(system, list):
                blocks = list(system)
            else:
                blocks = []
            if cache_control:
                # Anthropic takes at most 4 breakpoints, the request's top-level one (automatic
                # caching, at the end) counted, and a 1-hour one never after a 5-minute one.
                before = _breakpoints(body.get("tools")) + _breakpoints(blocks)
                after = _breakpoints(new["messages"])
                if body.get("cache_control") is not None:
                    after.append(_ttl(body["cache_control"]))
                long = "1h" in after
                if len(before) + len(after) < 4 and not (long and "5m" in before):
                    # After the summary: the client's system, state and summary are one cached prefix.
                    injected[-1]["cache_control"] = {"type": "ephemeral", **({"ttl": "1h"} if long else {})}
            new["system"] = blocks + injected
        return new

    def _messages(self, plan: Plan) -> list[dict[str, Any]]:
        head, window = plan.head, plan.window
        notes_at: dict[int, list[dict[str, Any]]] = {}
        if plan.omitted_marker:
            notes_at[0] = [text_block(plan.omitted_marker)]
        for at, texts in excerpt_notes(self, plan).items():
            notes_at.setdefault(at, []).extend(text_block(t) for t in texts)
        out: list[dict[str, Any]] = list(head)
        join = len(out)
        for i, msg in enumerate(window):
            notes = notes_at.get(i)
            if notes:
                if msg.get("role") == "user":
                    msg = _with_notes(msg, notes, first=True)
                elif out and out[-1].get("role") == "user":
                    out[-1] = _with_notes(out[-1], notes, first=False)
                else:
                    out.append({"role": "user", "content": notes})
            out.append(msg)
        # The head/window join is the one place where this rewrite can put two same-role messages
        # side by side (the client's own sequence is forwarded as it came).
        if 0 < join < len(out):
            a, b = out[join - 1], out[join]
            if a.get("role") == b.get("role") == "user":
                out[join - 1:join + 1] = [_merge_users(a, b)]
            elif a.get("role") == b.get("role") == "assistant":
                out.insert(join, {"role": "user", "content": [text_block(CONTINUE_TEXT)]})
        if out and out[0].get("role") != "user":
            out.insert(0, {"role": "user", "content": [text_block(CONTINUE_TEXT)]})
        return out

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return int_field(body, "max_tokens")

    def caches_full_history(self, raw: bytes) -> bool:
        """Anthropic caches a prefix only up to a breakpoint the client set."""
        return b"cache_control" in raw

    def model(self, body: dict[str, Any]) -> str | None:
        return model_of(body)

    # -- the summarizer's request ------------------------------------------------------------------

    def summary_request(self, model: str, system: str, user: str, *, max_tokens: int,
                        json_mode: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
        """(path, body, extra headers) of one completion the summarizer asks of this API (no JSON mode)."""
        body = {"model": model, "max_tokens": max_tokens, "system": system,
                "messages": [{"role": "user", "content": user}]}
        return "/v1/messages", body, {"anthropic-version": "2023-06-01"}

    def summary_answer(self, data: dict[str, Any]) -> tuple[str, int, int]:
        """(text, input tokens, output tokens) of the answer; KeyError and the like on another shape."""
        text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
        usage = data.get("usage") or {}
        return text, int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
