"""Provider-native messages: where the history lives in a body, what a message says, how it hashes,
which tool calls it opens or answers, and how a Plan is rendered back into a body.

One class per dialect behind the `Shape` protocol; pure, no I/O. `canonical` runs on every incoming
message of every request, so each dialect has a fast path for the common `{"role", "content": str}`
message and the slow path must produce exactly the same string for the same meaning.

Canonical form: the role, then one part per meaningful element, each joined by RS (\\x1e):
`t:` text, `f:` refusal, `n:` name, `c:` tool call (id US name US arguments, JSON re-dumped with sorted
keys), `r:` tool result (id US its nested parts), `k:` reasoning, `o:` anything else as sorted JSON.
Null fields, empty texts, `cache_control`, annotations, citations, item ids and statuses are left
out: they differ between the message the gateway rebuilds from a response and the one the client's
SDK sends back, without changing what the message says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from hashlib import blake2b
from typing import Any, Protocol

import orjson

from gateway.model import Plan

RS = "\x1e"  # between parts of a canonical form
US = "\x1f"  # between fields of one part
GS = "\x1d"  # between nested parts (a tool result's content)

# Anthropic needs a user message first and alternating roles; when a window has to start at an
# assistant message and there is no omitted-marker to carry, this is the user text put before it.
CONTINUE_TEXT = "[the conversation continues from the summary above]"

_SORTED = orjson.OPT_SORT_KEYS
# Fields that never change what a block says (see module docstring).
_DROP = frozenset({"cache_control", "annotations", "citations", "logprobs", "status", "id", "signature"})


class Shape(Protocol):
    dialect: str  # "openai_chat" | "openai_responses" | "anthropic"

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None: ...
    def system_text(self, body: dict[str, Any]) -> str: ...
    def role(self, raw: dict[str, Any]) -> str: ...
    def text(self, raw: dict[str, Any]) -> str: ...
    def canonical(self, raw: dict[str, Any]) -> str: ...
    def tool_calls(self, raw: dict[str, Any]) -> tuple[str, ...]: ...
    def tool_results(self, raw: dict[str, Any]) -> tuple[str, ...]: ...
    def binds_next(self, raw: dict[str, Any]) -> bool: ...
    def is_turn_start(self, raw: dict[str, Any]) -> bool: ...
    def render(self, body: dict[str, Any], plan: Plan, *, cache_control: bool) -> dict[str, Any]: ...
    def max_output_tokens(self, body: dict[str, Any]) -> int | None: ...
    def model(self, body: dict[str, Any]) -> str | None: ...


# ---------------------------------------------------------------- helpers shared by the dialects


def _dumps(obj: Any) -> str:
    """Sorted-key JSON; orjson for speed, json for what orjson refuses (ints beyond 64 bits)."""
    try:
        return orjson.dumps(obj, option=_SORTED).decode()
    except TypeError:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _args(arguments: Any) -> str:
    """Tool-call arguments in one form whether they came as a JSON string or a parsed dict."""
    if isinstance(arguments, str):
        try:
            return _dumps(orjson.loads(arguments))
        except orjson.JSONDecodeError:
            return arguments  # partial or non-JSON arguments: compare them as sent
    if arguments is None:
        return ""
    return _dumps(arguments)


def _other(block: dict[str, Any]) -> str:
    return "o:" + _dumps({k: v for k, v in block.items() if v is not None and k not in _DROP})


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _join(role: str, parts: list[str]) -> str:
    return role + "".join(RS + p for p in parts)


def _placeholder(kind: str, name: Any) -> str:
    """Readable stand-in for a non-text part in flattened text: `[file report.pdf]`, `[image]`."""
    return f"[{kind} {name}]" if isinstance(name, str) and name else f"[{kind}]"


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _model(body: dict[str, Any]) -> str | None:
    m = body.get("model")
    return m if isinstance(m, str) else None


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _last_turn_start(shape: Shape, raws: list[dict[str, Any]]) -> int | None:
    for i in range(len(raws) - 1, -1, -1):
        if shape.is_turn_start(raws[i]):
            return i
    return None


def content_hash(shape: Shape, raw: dict[str, Any]) -> str:
    """blake2b-128 of the canonical form: equal for equal meaning, whatever JSON shape was used."""
    return blake2b(shape.canonical(raw).encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------- OpenAI Chat Completions

_CHAT_TEXT = frozenset({"text"})
_RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})


def _canon_parts(content: Any, parts: list[str], text_kinds: frozenset[str] = _CHAT_TEXT) -> None:
    """Canonical form of a content string or part list (Chat and Responses differ only in which
    part types carry text): text and refusals by value, any other part by its sorted JSON."""
    if isinstance(content, str):
        if content:
            parts.append("t:" + content)
        return
    if not isinstance(content, list):
        return
    for p in content:
        if not isinstance(p, dict):
            continue
        kind = p.get("type")
        if kind in text_kinds:
            t = _str(p.get("text"))
            if t:
                parts.append("t:" + t)
        elif kind == "refusal":
            t = _str(p.get("refusal"))
            if t:
                parts.append("f:" + t)
        else:
            parts.append(_other(p))


def _oa_text(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    out: list[str] = []
    if isinstance(content, list):
        for p in content:
            if not isinstance(p, dict):
                continue
            kind = p.get("type")
            if kind == "text":
                out.append(_str(p.get("text")))
            elif kind == "refusal":
                out.append(_str(p.get("refusal")))
            elif kind == "image_url":
                out.append("[image]")
            elif kind == "input_audio":
                out.append("[audio]")
            elif kind == "file":
                f = p.get("file") or {}
                out.append(_placeholder("file", f.get("filename")))
    return [t for t in out if t]


def _oa_call(tc: dict[str, Any]) -> tuple[str, str, str]:
    """(id, name, normalised arguments) of a function or custom tool call."""
    fn = tc.get("function")
    if isinstance(fn, dict):
        return _str(tc.get("id")), _str(fn.get("name")), _args(fn.get("arguments"))
    custom = tc.get("custom")
    if isinstance(custom, dict):
        return _str(tc.get("id")), _str(custom.get("name")), _args(custom.get("input"))
    return _str(tc.get("id")), "", _dumps(tc)


class OpenAIChatShape:
    """`/v1/chat/completions`: `messages`, leading system/developer messages are the system prompt."""

    dialect = "openai_chat"

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
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        return messages[self._lead(messages):]

    def system_text(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "\n\n".join(self.text(m) for m in messages[: self._lead(messages)])

    def role(self, raw: dict[str, Any]) -> str:
        return _str(raw.get("role"))

    def text(self, raw: dict[str, Any]) -> str:
        out = _oa_text(raw.get("content"))
        refusal = raw.get("refusal")
        if isinstance(refusal, str) and refusal:
            out.append(refusal)
        for tc in raw.get("tool_calls") or ():
            if isinstance(tc, dict):
                _, name, args = _oa_call(tc)
                out.append(f"{name}({args})")
        fc = raw.get("function_call")
        if isinstance(fc, dict):
            out.append(f"{_str(fc.get('name'))}({_args(fc.get('arguments'))})")
        return "\n".join(out)

    def canonical(self, raw: dict[str, Any]) -> str:
        content = raw.get("content")
        role = raw.get("role")
        if type(content) is str and len(raw) == 2 and type(role) is str:
            # Fast path: most messages are {"role", "content": str}; same string as the slow path.
            # Other fields (provider extras such as `reasoning_content`) are left out on purpose.
            return role + RS + "t:" + content if content else role
        if type(content) is list and len(content) == 1 and len(raw) == 2 and type(role) is str:
            part = content[0]
            if type(part) is dict and part.get("type") == "text" and len(part) == 2 and type(part["text"]) is str:
                return role + RS + "t:" + part["text"] if part["text"] else role
        parts: list[str] = []
        name = raw.get("name")
        if isinstance(name, str) and name:
            parts.append("n:" + name)
        call_id = raw.get("tool_call_id")
        if isinstance(call_id, str):
            parts.append("r:" + call_id)
        _canon_parts(content, parts)
        refusal = raw.get("refusal")
        if isinstance(refusal, str) and refusal:
            parts.append("f:" + refusal)
        for tc in raw.get("tool_calls") or ():
            if isinstance(tc, dict):
                parts.append("c:" + US.join(_oa_call(tc)))
        fc = raw.get("function_call")
        if isinstance(fc, dict):
            parts.append("c:" + US + _str(fc.get("name")) + US + _args(fc.get("arguments")))
        audio = raw.get("audio")
        if isinstance(audio, dict):
            parts.append(_other(audio))
        return _join(_str(raw.get("role")), parts)

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
        window = list(plan.window)
        if plan.excerpts_block:
            # Before the newest user turn: a user message never sits inside a tool-call group.
            at = _last_turn_start(self, window)
            window.insert(at or 0, {"role": voice, "content": plan.excerpts_block})
        out.extend(window)
        new = dict(body)
        new["messages"] = out
        return new

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return _int_field(body, "max_completion_tokens", "max_tokens")

    def model(self, body: dict[str, Any]) -> str | None:
        return _model(body)


# ---------------------------------------------------------------- OpenAI Responses


def _rs_text(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    out: list[str] = []
    if isinstance(content, list):
        for p in content:
            if not isinstance(p, dict):
                continue
            kind = p.get("type")
            if kind in ("input_text", "output_text", "text"):
                out.append(_str(p.get("text")))
            elif kind == "refusal":
                out.append(_str(p.get("refusal")))
            elif kind == "input_image":
                out.append("[image]")
            elif kind == "input_file":
                out.append(_placeholder("file", p.get("filename")))
    return [t for t in out if t]


def _developer_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text}]}


class ResponsesShape:
    """`/v1/responses` with a stateless `input` list; server-side state (`previous_response_id`,
    `conversation`) is the provider's memory, so such requests pass through untouched."""

    dialect = "openai_responses"

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        if body.get("previous_response_id") is not None or body.get("conversation") is not None:
            return None
        items = body.get("input")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return None  # a string input is a single short turn: nothing to rewrite
        return items

    def system_text(self, body: dict[str, Any]) -> str:
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            return instructions
        if isinstance(instructions, list):
            return "\n\n".join(self.text(i) for i in instructions if isinstance(i, dict))
        return ""

    def role(self, raw: dict[str, Any]) -> str:
        kind = raw.get("type")
        if kind is None or kind == "message":
            return _str(raw.get("role"))
        if not isinstance(kind, str):
            return "assistant"
        if kind.endswith("_output") or kind == "mcp_approval_response":
            return "tool"
        return "assistant"  # function_call, reasoning, *_call, item_reference: model output

    def text(self, raw: dict[str, Any]) -> str:
        kind = raw.get("type")
        if kind is None or kind == "message":
            return "\n".join(_rs_text(raw.get("content")))
        if kind == "function_call" or kind == "custom_tool_call":
            args = raw.get("arguments") if kind == "function_call" else raw.get("input")
            return f"{_str(raw.get('name'))}({_args(args)})"
        if isinstance(kind, str) and kind.endswith("_output"):
            out = raw.get("output")
            if isinstance(out, str):
                return out
            return "\n".join(_rs_text(out)) if isinstance(out, list) else ""
        return ""  # reasoning and hosted-tool items: no readable text worth searching or counting

    def canonical(self, raw: dict[str, Any]) -> str:
        kind = raw.get("type")
        content = raw.get("content")
        role = raw.get("role")
        if type(content) is str and type(role) is str and (len(raw) == 2 or (len(raw) == 3 and kind == "message")):
            return role + RS + "t:" + content if content else role
        if kind is None or kind == "message":
            parts: list[str] = []
            _canon_parts(content, parts, _RESPONSES_TEXT)
            return _join(_str(raw.get("role")), parts)
        if kind == "function_call":
            return _join("assistant", ["c:" + US.join(
                (_str(raw.get("call_id")), _str(raw.get("name")), _args(raw.get("arguments"))))])
        if kind == "custom_tool_call":
            return _join("assistant", ["c:" + US.join(
                (_str(raw.get("call_id")), _str(raw.get("name")), _args(raw.get("input"))))])
        if kind in ("function_call_output", "custom_tool_call_output"):
            out = raw.get("output")
            nested: list[str] = []
            _canon_parts(out, nested, _RESPONSES_TEXT)
            return _join("tool", ["r:" + _str(raw.get("call_id")) + US + GS.join(nested)])
        if kind == "reasoning":
            # The id ties a reasoning item to its response; the summary is what it says.
            summary = [_str(s.get("text")) for s in raw.get("summary") or () if isinstance(s, dict)]
            return _join("assistant", ["k:" + _str(raw.get("id")) + US + GS.join(summary)])
        return _join(self.role(raw), [_other(raw)])

    def tool_calls(self, raw: dict[str, Any]) -> tuple[str, ...]:
        kind = raw.get("type")
        if not isinstance(kind, str):
            return ()
        if kind.endswith("_call"):
            call_id = raw.get("call_id")
            return (call_id,) if isinstance(call_id, str) else ()
        if kind == "mcp_approval_request":
            rid = raw.get("id")
            return (rid,) if isinstance(rid, str) else ()
        return ()

    def tool_results(self, raw: dict[str, Any]) -> tuple[str, ...]:
        kind = raw.get("type")
        if not isinstance(kind, str):
            return ()
        if kind.endswith("_call_output"):
            call_id = raw.get("call_id")
            return (call_id,) if isinstance(call_id, str) else ()
        if kind == "mcp_approval_response":
            rid = raw.get("approval_request_id")
            return (rid,) if isinstance(rid, str) else ()
        return ()

    def binds_next(self, raw: dict[str, Any]) -> bool:
        # The API rejects a reasoning item "without its required following item".
        return raw.get("type") == "reasoning"

    def is_turn_start(self, raw: dict[str, Any]) -> bool:
        kind = raw.get("type")
        return (kind is None or kind == "message") and raw.get("role") == "user"

    def render(self, body: dict[str, Any], plan: Plan, *, cache_control: bool) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        layers = "\n\n".join(b for b in (plan.state_block, plan.summary_block) if b)
        if layers:
            # In `input`, not `instructions`: the client's system prompt bytes stay identical.
            out.append(_developer_item(layers))
        out.extend(plan.head)
        if plan.omitted_marker:
            out.append(_developer_item(plan.omitted_marker))
        window = list(plan.window)
        if plan.excerpts_block:
            at = _last_turn_start(self, window)
            window.insert(at or 0, _developer_item(plan.excerpts_block))
        out.extend(window)
        new = dict(body)
        new["input"] = out
        return new

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return _int_field(body, "max_output_tokens")

    def model(self, body: dict[str, Any]) -> str | None:
        return _model(body)


# ---------------------------------------------------------------- Anthropic Messages


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
            t = _str(b.get("text"))
            if t:
                parts.append("t:" + t)
        elif kind == "tool_use":
            parts.append("c:" + US.join((_str(b.get("id")), _str(b.get("name")), _args(b.get("input")))))
        elif kind == "tool_result":
            nested: list[str] = []
            _an_parts(b.get("content"), nested)
            error = US + "e" if b.get("is_error") else ""
            parts.append("r:" + _str(b.get("tool_use_id")) + US + GS.join(nested) + error)
        elif kind in ("thinking", "redacted_thinking"):
            # Left out: some clients strip earlier thinking blocks before sending history back, and
            # the API ignores them outside the current tool loop anyway.
            continue
        else:
            parts.append(_other(b))


def _an_text(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    out: list[str] = []
    if isinstance(content, list):
        for b in content:
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            if kind == "text":
                out.append(_str(b.get("text")))
            elif kind == "tool_use":
                out.append(f"{_str(b.get('name'))}({_args(b.get('input'))})")
            elif kind == "tool_result":
                out.extend(_an_text(b.get("content")))
            elif kind == "image":
                out.append("[image]")
            elif kind == "document":
                out.append(_placeholder("document", b.get("title")))
    return [t for t in out if t]


def _blocks(content: Any) -> list[Any]:
    if isinstance(content, str):
        return [_text_block(content)] if content else []
    return list(content) if isinstance(content, list) else []


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


def _count_breakpoints(value: Any) -> int:
    if isinstance(value, list):
        return sum(_count_breakpoints(v) for v in value)
    if isinstance(value, dict):
        n = 1 if value.get("cache_control") is not None else 0
        content = value.get("content")
        if isinstance(content, list):
            n += _count_breakpoints(content)
        return n
    return 0


class AnthropicShape:
    """`/v1/messages`: `system` apart, `messages` alternate user/assistant; tool results are
    `tool_result` blocks at the start of the next user message."""

    dialect = "anthropic"

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        return messages

    def system_text(self, body: dict[str, Any]) -> str:
        system = body.get("system")
        if isinstance(system, str):
            return system
        return "\n\n".join(_an_text(system)) if isinstance(system, list) else ""

    def role(self, raw: dict[str, Any]) -> str:
        return _str(raw.get("role"))

    def text(self, raw: dict[str, Any]) -> str:
        return "\n".join(_an_text(raw.get("content")))

    def canonical(self, raw: dict[str, Any]) -> str:
        content = raw.get("content")
        role = raw.get("role")
        if type(content) is str and len(raw) == 2 and type(role) is str:
            return role + RS + "t:" + content if content else role
        if type(content) is list and len(content) == 1 and len(raw) == 2 and type(role) is str:
            block = content[0]
            if type(block) is dict and block.get("type") == "text" and len(block) == 2 and type(block["text"]) is str:
                return role + RS + "t:" + block["text"] if block["text"] else role
        parts: list[str] = []
        _an_parts(content, parts)
        return _join(_str(raw.get("role")), parts)

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
        injected = [_text_block(b) for b in (plan.state_block, plan.summary_block) if b]
        if injected:
            system = body.get("system")
            blocks: list[Any]
            if isinstance(system, str):
                blocks = [_text_block(system)] if system else []  # an empty text block is rejected
            elif isinstance(system, list):
                blocks = list(system)
            else:
                blocks = []
            if cache_control:
                used = (_count_breakpoints(body.get("tools")) + _count_breakpoints(blocks)
                        + _count_breakpoints(new["messages"]))
                if used < 4:
                    # After the summary: the client's system, state and summary are one cached prefix.
                    injected[-1]["cache_control"] = {"type": "ephemeral"}
            new["system"] = blocks + injected
        return new

    def _messages(self, plan: Plan) -> list[dict[str, Any]]:
        head, window = plan.head, plan.window
        notes_at: dict[int, list[dict[str, Any]]] = {}
        if plan.omitted_marker:
            notes_at[0] = [_text_block(plan.omitted_marker)]
        if plan.excerpts_block:
            at = _last_turn_start(self, list(window))
            notes_at.setdefault(at or 0, []).append(_text_block(plan.excerpts_block))
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
                out.insert(join, {"role": "user", "content": [_text_block(CONTINUE_TEXT)]})
        if out and out[0].get("role") != "user":
            out.insert(0, {"role": "user", "content": [_text_block(CONTINUE_TEXT)]})
        return out

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return _int_field(body, "max_tokens")

    def model(self, body: dict[str, Any]) -> str | None:
        return _model(body)


_SHAPES: dict[str, Callable[[], Shape]] = {
    "openai_chat": OpenAIChatShape,
    "openai_responses": ResponsesShape,
    "anthropic": AnthropicShape,
}


def shape_for(dialect: str) -> Shape:
    """The shape of `dialect`; raises KeyError for an unknown one (a programming error)."""
    return _SHAPES[dialect]()
