"""OpenAI Responses: `POST {base}/responses`, SSE of typed events ending in `response.completed`.

The reply is rebuilt from the final response's `output` items, converted to *input* items (what a
stateless client appends to its next `input` list): ids and statuses are response-side only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.dialects.base import SSEParser, as_int
from gateway.dialects.openai_chat import OpenAIWire
from gateway.model import DialectName, Usage


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


class OpenAIResponses(OpenAIWire):
    name: DialectName = "openai_responses"
    history_field = "input"

    def accumulator(self) -> ResponsesAccumulator:
        return ResponsesAccumulator()

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
        return input_items(body.get("output") or []), responses_usage(body.get("usage"))
