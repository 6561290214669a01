"""What the dialects' message code shares: the canonical form a message is hashed by, and helpers.

`canonical` runs on every incoming message of every request, so each dialect has a fast path for
the common `{"role", "content": str}` message and the slow path must produce exactly the same
string for the same meaning.

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
from typing import Any

import orjson

from gateway.dialects.base import Dialect
from gateway.model import Plan

RS = "\x1e"  # between parts of a canonical form
US = "\x1f"  # between fields of one part
GS = "\x1d"  # between nested parts (a tool result's content)

_SORTED = orjson.OPT_SORT_KEYS
# Fields that never change what a block says (see module docstring).
_DROP = frozenset({"cache_control", "annotations", "citations", "logprobs", "status", "id", "signature"})


def dumps(obj: Any) -> str:
    """Sorted-key JSON; orjson for speed, json for what orjson refuses (ints beyond 64 bits)."""
    try:
        return orjson.dumps(obj, option=_SORTED).decode()
    except TypeError:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def norm_args(arguments: Any) -> str:
    """Tool-call arguments in one form whether they came as a JSON string or a parsed dict."""
    if isinstance(arguments, str):
        try:
            return dumps(orjson.loads(arguments))
        except (orjson.JSONDecodeError, RecursionError):
            # Partial or non-JSON arguments, or JSON nested past what can be written back (a string
            # is not checked for depth at the edge): compared as sent.
            return arguments
    if arguments is None:
        return ""
    return dumps(arguments)


def other(block: dict[str, Any]) -> str:
    return "o:" + dumps({k: v for k, v in block.items() if v is not None and k not in _DROP})


def string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def join(role: str, parts: list[str]) -> str:
    return role + "".join(RS + p for p in parts)


def placeholder(kind: str, name: Any) -> str:
    """Readable stand-in for a non-text part in flattened text: `[file report.pdf]`, `[image]`."""
    return f"[{kind} {name}]" if isinstance(name, str) and name else f"[{kind}]"


def flat_text(content: Any, part_text: Callable[[dict[str, Any]], str | list[str]]) -> list[str]:
    """The text pieces of a content string or part list, for tokens, search and summaries; each
    dialect's `part_text` says what one part reads as ("" or [] for nothing)."""
    if isinstance(content, str):
        return [content] if content else []
    out: list[str] = []
    if isinstance(content, list):
        for p in content:
            if isinstance(p, dict):
                got = part_text(p)
                if isinstance(got, list):
                    out.extend(got)
                else:
                    out.append(got)
    return [t for t in out if t]


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def model_of(body: dict[str, Any]) -> str | None:
    m = body.get("model")
    return m if isinstance(m, str) else None


def int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def last_turn_start(dialect: Dialect, raws: list[dict[str, Any]]) -> int | None:
    for i in range(len(raws) - 1, -1, -1):
        if dialect.is_turn_start(raws[i]):
            return i
    return None


def excerpt_notes(dialect: Dialect, plan: Plan) -> dict[int, list[str]]:
    """Window index → the excerpt blocks placed before that message: the pinned ones where earlier
    requests put them, this request's own before its newest user turn (never inside a tool group)."""
    notes: dict[int, list[str]] = {}
    for at, text in plan.pinned:
        notes.setdefault(at, []).append(text)
    if plan.excerpts_block:
        newest = last_turn_start(dialect, list(plan.window))
        notes.setdefault(newest or 0, []).append(plan.excerpts_block)
    return notes


def content_hash(dialect: Dialect, raw: dict[str, Any]) -> str:
    """blake2b-128 of the canonical form: equal for equal meaning, whatever JSON shape was used."""
    return blake2b(dialect.canonical(raw).encode(), digest_size=16).hexdigest()


def plain_canonical(raw: dict[str, Any]) -> str | None:
    """The canonical form of the most common message, `{"role", "content"}` with a string or a single
    plain text part (the same string the full path gives); None for any other message. Other fields
    (provider extras such as `reasoning_content`) are left out on purpose."""
    content = raw.get("content")
    role = raw.get("role")
    if len(raw) != 2 or type(role) is not str:
        return None
    if type(content) is str:
        return role + RS + "t:" + content if content else role
    if type(content) is list and len(content) == 1:
        part = content[0]
        if type(part) is dict and part.get("type") == "text" and len(part) == 2 and type(part["text"]) is str:
            return role + RS + "t:" + part["text"] if part["text"] else role
    return None


CHAT_TEXT = frozenset({"text"})
RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})


def canon_parts(content: Any, parts: list[str], text_kinds: frozenset[str] = CHAT_TEXT) -> None:
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
            t = string(p.get("text"))
            if t:
                parts.append("t:" + t)
        elif kind == "refusal":
            t = string(p.get("refusal"))
            if t:
                parts.append("f:" + t)
        else:
            parts.append(other(p))
