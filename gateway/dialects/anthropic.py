"""Anthropic Messages: `POST {base}/v1/messages`, SSE with `event:` lines.

Content blocks are rebuilt per index: text deltas merged, tool_use input rebuilt from the
`input_json_delta` fragments, thinking blocks kept with their signature (the API rejects a
thinking block sent back without it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.dialects.base import SSEParser, UpstreamName, as_int
from gateway.model import DialectName, Usage


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


class Anthropic:
    name: DialectName = "anthropic"
    upstream: UpstreamName = "anthropic"
    history_field = "messages"

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
