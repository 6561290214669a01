"""The request's history checked at the edge, per dialect, before the memory path reads it.

The memory path hashes, counts and rewrites every message; it trusts that a field holds the JSON
type its provider documents. Valid JSON of another type (a content part whose `type` is a list,
`tool_calls: 5`, `content: 5`, content nested hundreds of levels deep) is answered here with a 400
that names the field, the way the provider itself would, and never reaches the store.
(A history that is not an array of objects, `messages: {}` or `["hello"]`, is no history the gateway
can rewrite: it goes upstream as sent, `not-rewritable`, for the provider to judge.)

Only what the memory path reads is checked, and only its type: values and unknown fields are the
provider's to judge. `problem(dialect_name, body, skip)` is pure and bounded by the body's size.
A full-history client resends every earlier message on every turn: the memory path passes as
`skip` the positions of the messages equal to those its previous request sent (checked then), so
a turn's check reads only what is new.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

# Deeper than any real message (a tool result holding blocks holding text is 4 levels); orjson
# cannot write back a value nested past 255, so a deep history could be stored but never replayed.
MAX_DEPTH = 64

Types = tuple[type, ...]
_S: Types = (str,)
_S_N: Types = (str, type(None))
_L_N: Types = (list, type(None))
_D_N: Types = (dict, type(None))
_S_L: Types = (str, list)
_S_L_N: Types = (str, list, type(None))

CHAT_MESSAGE: dict[str, Types] = {
    "role": _S, "content": _S_L_N, "name": _S_N, "tool_call_id": _S_N, "refusal": _S_N,
    "tool_calls": _L_N, "function_call": _D_N, "audio": _D_N,
}
CHAT_PART: dict[str, Types] = {"type": _S, "text": _S, "refusal": _S, "file": (dict,), "input_audio": (dict,),
                               "image_url": (dict, str)}
CHAT_CALL: dict[str, Types] = {"id": _S_N, "type": _S_N, "function": _D_N, "custom": _D_N}
CHAT_FUNCTION: dict[str, Types] = {"name": _S_N}

ANTHROPIC_MESSAGE: dict[str, Types] = {"role": _S, "content": _S_L}
ANTHROPIC_BLOCK: dict[str, Types] = {
    "type": _S, "text": _S, "id": _S, "name": _S, "tool_use_id": _S, "content": _S_L_N, "thinking": _S,
    "signature": _S, "data": _S, "source": (dict,), "is_error": (bool, type(None)), "citations": _L_N,
    "cache_control": _D_N, "title": _S_N,
}

RESPONSES_ITEM: dict[str, Types] = {
    "type": _S_N, "role": _S_N, "content": _S_L_N, "call_id": _S_N, "name": _S_N, "output": _S_L_N,
    "id": _S_N, "status": _S_N, "summary": _L_N,
}
RESPONSES_PART: dict[str, Types] = {"type": _S, "text": _S, "refusal": _S, "filename": _S_N}


def parts_over(items: Any, limit: int, levels: int = 3) -> bool:
    """Do `items` (messages, or input items) hold more than `limit` parts: the entries of every array
    in them (content, tool_calls, a Responses output), of every array in those entries (a tool
    result's content), and so on `levels` deep? Every part costs the event loop microseconds to
    check, hash, read and remember, so one message of a million parts would stall every other request
    for seconds. Stops once past `limit`: reads at most `limit` parts and the items themselves."""
    return _left(items, limit, levels) < 0


def string_bytes(value: Any, nodes: int = 256) -> int:
    """About the bytes a JSON value's strings hold (characters: a byte each for ASCII), reading at
    most `nodes` of its dicts, lists and strings: what decides whether work over a message (its
    hash, its record) goes to a thread. A picture as a data URL is megabytes in one string. A value
    of more nodes than that is taken for a long one (at least a megabyte)."""
    total = 0
    stack = [value]
    while stack:
        if nodes == 0:
            return max(total, 1 << 20)
        nodes -= 1
        v = stack.pop()
        if type(v) is str:
            total += len(v)
        elif type(v) is dict:
            stack.extend(islice(v.values(), nodes + 1))  # (one more than can be read: enough to run out)
        elif type(v) is list:
            stack.extend(v[:nodes + 1])
    return total


def body_parts_over(body: dict[str, Any], history_field: str, limit: int, history: Any = None) -> bool:
    """`parts_over` for a whole request: its history's parts (or those of `history`, the messages not
    counted before), and the entries of its other arrays (system blocks, instructions, tools) with
    their own parts, against one limit."""
    left = limit
    others: list[Any] = []
    for name, value in body.items():
        if name != history_field and type(value) is list:
            left -= len(value)
            if left < 0:
                return True
            others.extend(value)
    left = _left(others, left, 2)
    return left < 0 or _left(body.get(history_field) if history is None else history, left, 3) < 0


def _left(items: Any, left: int, levels: int) -> int:
    """`left` less the parts in `items`, `levels` deep; negative (and no further read) once past it."""
    frontier = items if type(items) is list else []
    for level in range(levels):
        deeper: list[Any] = []
        for obj in frontier:
            if type(obj) is not dict:
                continue
            for value in obj.values():
                if type(value) is list:
                    left -= len(value)
                    if left < 0:
                        return left
                    if level + 1 < levels:
                        deeper.extend(value)
        frontier = deeper
    return left


class Invalid(Exception):
    """Where the body departs from its dialect's shape (the 400's message)."""


def _names(types: Types) -> str:
    names = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _fields(obj: Any, spec: dict[str, Types], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise Invalid(f"{where} must be an object")
    for name, types in spec.items():
        if name in obj:
            value = obj[name]
            # bool is an int in Python, and no field here takes an int.
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise Invalid(f"{where}.{name} must be {_names(types)}")
    return obj


def _parts(content: Any, spec: dict[str, Types], where: str, field: str = "content") -> None:
    if isinstance(content, list):
        for i, part in enumerate(content):
            _fields(part, spec, f"{where}.{field}[{i}]")


def _depth(value: Any, where: str, level: int = 1) -> None:
    """Raise when `value` nests deeper than MAX_DEPTH (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, level)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            raise Invalid(f"{where} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((v, level + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, level + 1) for v in node if isinstance(v, dict | list))


def _items(items: list[Any], name: str, skip: range) -> Iterator[tuple[int, Any, str]]:
    """(index, item, where) of the items outside `skip`, each checked for depth (the list is level 1)."""
    for i in (*range(min(skip.start, len(items))), *range(skip.stop, len(items))):
        where = f"{name}[{i}]"
        _depth(items[i], where, 2)
        yield i, items[i], where


def _messages(body: dict[str, Any]) -> list[Any]:
    """The body's `messages` (absent: none); anything but an array is the caller's mistake."""
    messages = body.get("messages")
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise Invalid("messages must be an array")
    return messages


def _chat(body: dict[str, Any], skip: range) -> None:
    messages = _messages(body)
    for _, m, where in _items(messages, "messages", skip):
        _fields(m, CHAT_MESSAGE, where)
        _parts(m.get("content"), CHAT_PART, where)
        for j, call in enumerate(m.get("tool_calls") or ()):
            _fields(call, CHAT_CALL, f"{where}.tool_calls[{j}]")
            if isinstance(call.get("function"), dict):
                _fields(call["function"], CHAT_FUNCTION, f"{where}.tool_calls[{j}].function")
        if isinstance(m.get("function_call"), dict):
            _fields(m["function_call"], CHAT_FUNCTION, f"{where}.function_call")


def _blocks(content: Any, where: str) -> None:
    """Anthropic content: a string, or blocks; a tool result's content holds blocks again."""
    stack = [(content, where)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, list):
            continue
        for i, block in enumerate(node):
            _fields(block, ANTHROPIC_BLOCK, f"{at}[{i}]")
            if isinstance(block.get("content"), list):
                stack.append((block["content"], f"{at}[{i}].content"))


def _anthropic(body: dict[str, Any], skip: range) -> None:
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str | list):
            raise Invalid("system must be a string or an array")
        _depth(system, "system")
        _blocks(system, "system")
    for _, m, where in _items(_messages(body), "messages", skip):
        _fields(m, ANTHROPIC_MESSAGE, where)
        _blocks(m.get("content"), f"{where}.content")


def _responses(body: dict[str, Any], skip: range) -> None:
    for name in ("input", "instructions"):
        items = body.get(name)
        if items is None or isinstance(items, str):
            continue
        if not isinstance(items, list):
            raise Invalid(f"{name} must be a string or an array")
        for _, item, where in _items(items, name, skip if name == "input" else _NONE):
            _fields(item, RESPONSES_ITEM, where)
            _parts(item.get("content"), RESPONSES_PART, where)
            _parts(item.get("output"), RESPONSES_PART, where, "output")
            _parts(item.get("summary"), RESPONSES_PART, where, "summary")  # a reasoning item's


_NONE = range(0)
_CHECKS = {"openai_chat": _chat, "anthropic": _anthropic, "openai_responses": _responses}


def problem(dialect: str, body: dict[str, Any], skip: range = _NONE) -> str | None:
    """Why `body`'s history does not have its dialect's shape, or None when it does. `skip`: positions
    in the history's list (`messages`, or `input` for Responses) already checked, not read again."""
    check = _CHECKS.get(dialect)
    if check is None:
        return None
    try:
        check(body, skip)
    except Invalid as exc:
        return str(exc)
    return None
