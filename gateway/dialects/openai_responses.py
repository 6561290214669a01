"""OpenAI Responses: `POST {base}/responses`, SSE of typed events ending in `response.completed`.

The reply is rebuilt from the final response's `output` items, converted to *input* items (what a
stateless client appends to its next `input` list): ids and statuses are response-side only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.dialects.base import SSEParser, as_int
from gateway.dialects.canonical import (
    GS,
    RESPONSES_TEXT,
    RS,
    US,
    canon_parts,
    excerpt_notes,
    flat_text,
    int_field,
    join,
    model_of,
    norm_args,
    other,
    placeholder,
    string,
)
from gateway.dialects.openai_chat import OpenAIWire
from gateway.model import DialectName, Plan, Usage


def responses_usage(usage: Mapping[str, Any] | None) -> Usage:
    if not usage:
        return Usage()
    details = usage.get("input_tokens_details") or {}
    return Usage(
        input_tokens=as_int(usage.get("input_tokens")),
        output_tokens=as_int(usage.get("output_tokens")),
        cache_read_tokens=as_int(details.get("cached_tokens")),
    )


def input_items(output: list[Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for out in output:
        if not isinstance(out, dict):
            continue
        kind = out.get("type")
        if kind == "message":
            parts = [
                {"type": "output_text", "text": p.get("text", "")}
                for p in out.get("content") or ()
                if isinstance(p, dict) and p.get("type") == "output_text"
            ]
            items.append({"type": "message", "role": "assistant", "content": parts})
        elif kind == "function_call":
            items.append({
                "type": "function_call",
                "call_id": out.get("call_id", ""),
                "name": out.get("name", ""),
                "arguments": out.get("arguments", ""),
            })
        else:
            # Reasoning and built-in tool items go back as they came; the API accepts them as input.
            items.append(dict(out))
    return items


class ResponsesAccumulator:
    __slots__ = ("_completed", "_parser", "_text")

    def __init__(self) -> None:
        self._parser = SSEParser()
        self._completed: dict[str, Any] | None = None
        self._text: list[str] = []

    def feed(self, chunk: bytes) -> None:
        for obj in self._parser.objects(chunk):
            kind = obj.get("type")
            if kind == "response.output_text.delta":
                self._text.append(obj.get("delta") or "")
            elif kind == "response.completed":
                self._completed = obj.get("response") or {}

    def result(self) -> tuple[list[dict[str, Any]], Usage]:
        if self._completed is not None:
            return input_items(self._completed.get("output") or []), responses_usage(
                self._completed.get("usage"))
        # No final event (the stream was cut): the text seen so far is all there is.
        text = "".join(self._text)
        return [{"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": text}]}], Usage()


# ---------------------------------------------------------------- messages


def _rs_part(p: dict[str, Any]) -> str:
    kind = p.get("type")
    if kind in RESPONSES_TEXT:
        return string(p.get("text"))
    if kind == "refusal":
        return string(p.get("refusal"))
    if kind == "input_image":
        return "[image]"
    if kind == "input_file":
        return placeholder("file", p.get("filename"))
    return ""


def _rs_text(content: Any) -> list[str]:
    return flat_text(content, _rs_part)


def _item(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def _developer_item(text: str) -> dict[str, Any]:
    return _item("developer", text)


class OpenAIResponses(OpenAIWire):
    """`/v1/responses` with a stateless `input` list; server-side state (`previous_response_id`,
    `conversation`) is the provider's memory, so such requests pass through untouched."""

    name: DialectName = "openai_responses"
    history_field = "input"

    def accumulator(self) -> ResponsesAccumulator:
        return ResponsesAccumulator()

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
        return input_items(body.get("output") or []), responses_usage(body.get("usage"))

    # -- messages --------------------------------------------------------------------------------

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        if body.get("previous_response_id") is not None or body.get("conversation") is not None:
            return None
        items = body.get("input")
        if isinstance(items, str):
            # A string is one user message (the API reads it so): a client that sends only its new
            # turn this way has its history in the gateway alone, and gets it.
            return [{"role": "user", "content": items}]
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return None
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
            return string(raw.get("role"))
        if not isinstance(kind, str):
            return "assistant"
        if kind.endswith("_output") or kind == "mcp_approval_response":
            return "tool"
        return "assistant"  # function_call, reasoning, *_call, item_reference: model output

    def spoken(self, raw: dict[str, Any]) -> tuple[str, str] | None:
        # Tool output comes in items of its own; a call's arguments are input to a tool, not the
        # model's statement.
        kind = raw.get("type")
        if not isinstance(kind, str) or not kind.endswith("_call"):
            return None
        return "assistant", f"[called {string(raw.get('name')) or kind}]"

    def text(self, raw: dict[str, Any]) -> str:
        kind = raw.get("type")
        if kind is None or kind == "message":
            return "\n".join(_rs_text(raw.get("content")))
        if kind == "function_call" or kind == "custom_tool_call":
            args = raw.get("arguments") if kind == "function_call" else raw.get("input")
            return f"{string(raw.get('name'))}({norm_args(args)})"
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
            canon_parts(content, parts, RESPONSES_TEXT)
            return join(string(raw.get("role")), parts)
        if kind == "function_call":
            return join("assistant", ["c:" + US.join(
                (string(raw.get("call_id")), string(raw.get("name")), norm_args(raw.get("arguments"))))])
        if kind == "custom_tool_call":
            return join("assistant", ["c:" + US.join(
                (string(raw.get("call_id")), string(raw.get("name")), norm_args(raw.get("input"))))])
        if kind in ("function_call_output", "custom_tool_call_output"):
            out = raw.get("output")
            nested: list[str] = []
            canon_parts(out, nested, RESPONSES_TEXT)
            return join("tool", ["r:" + string(raw.get("call_id")) + US + GS.join(nested)])
        if kind == "reasoning":
            # The id ties a reasoning item to its response; the summary is what it says.
            summary = [string(s.get("text")) for s in raw.get("summary") or () if isinstance(s, dict)]
            return join("assistant", ["k:" + string(raw.get("id")) + US + GS.join(summary)])
        return join(self.role(raw), [other(raw)])

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
        notes = excerpt_notes(self, plan)
        for i, msg in enumerate(plan.window):
            # Excerpts quote anyone, tool output included: a user item, not the developer's voice.
            out.extend(_item("user", text) for text in notes.get(i, ()))
            out.append(msg)
        new = dict(body)
        new["input"] = out
        return new

    def max_output_tokens(self, body: dict[str, Any]) -> int | None:
        return int_field(body, "max_output_tokens")

    def caches_full_history(self, raw: bytes) -> bool:
        """OpenAI caches long prompt prefixes by itself."""
        return True

    def model(self, body: dict[str, Any]) -> str | None:
        return model_of(body)
