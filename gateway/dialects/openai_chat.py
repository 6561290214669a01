"""OpenAI Chat Completions: `POST {base}/chat/completions`, SSE of `data:` chunks ending in `[DONE]`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.dialects.base import SSEParser, UpstreamName, as_int
from gateway.model import DialectName, Usage


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
    """What every OpenAI route shares: `stream: true` in the body, and the error shapes."""

    upstream: UpstreamName = "openai"

    def is_stream(self, body: Mapping[str, Any]) -> bool:
        return body.get("stream") is True

    def error_body(self, status: int, type_: str, message: str) -> bytes:
        return openai_error_body(status, type_, message)

    def stream_error_frame(self, message: str) -> bytes:
        return openai_stream_error_frame(message)


class OpenAIChat(OpenAIWire):
    name: DialectName = "openai_chat"
    history_field = "messages"

    def accumulator(self) -> ChatAccumulator:
        return ChatAccumulator()

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]:
        choices = body.get("choices") or [{}]
        message = choices[0].get("message") or {}
        calls = [_tool_call(tc) for tc in message.get("tool_calls") or ()]
        return [assistant_item(message.get("content"), calls)], openai_usage(body.get("usage"))
