"""The interface every provider dialect implements, and the SSE frame splitter they share.

A dialect knows one wire format: whether a request body asks for a stream, how that provider
renders an error (as a JSON body and as a stream frame), and how to rebuild the assistant's reply
and the usage from a response, streamed or not. It does no I/O.

`Usage.input_tokens` is always the *whole* prompt as the provider counted it, cached parts
included (OpenAI's `prompt_tokens`; Anthropic's `input_tokens + cache_read + cache_creation`), so
it compares directly with the gateway's own estimate of the forwarded request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import orjson

from gateway.model import DialectName, Usage

UpstreamName = Literal["openai", "anthropic"]


class Accumulator(Protocol):
    """Fed the raw bytes of a stream as they arrive; rebuilds the reply once the stream ends."""

    def feed(self, chunk: bytes) -> None: ...

    def result(self) -> tuple[list[dict[str, Any]], Usage]: ...


class Dialect(Protocol):
    name: DialectName
    upstream: UpstreamName
    history_field: str  # the body's member that carries the conversation ("messages", "input")

    def is_stream(self, body: Mapping[str, Any]) -> bool: ...

    def error_body(self, status: int, type_: str, message: str) -> bytes: ...

    def stream_error_frame(self, message: str) -> bytes: ...

    def accumulator(self) -> Accumulator: ...

    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]: ...


class SSEParser:
    """Splits a byte stream into complete SSE events `(event name or None, data)`.

    Frames may be cut anywhere by the network, so an incomplete tail is kept for the next feed.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[str | None, bytes]]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        frames = buf.split(b"\n\n")
        self._buf = frames.pop()
        out: list[tuple[str | None, bytes]] = []
        for frame in frames:
            event: str | None = None
            data: list[bytes] = []
            for line in frame.split(b"\n"):
                if line.startswith(b"data:"):
                    value = line[5:]
                    data.append(value[1:] if value.startswith(b" ") else value)
                elif line.startswith(b"event:"):
                    event = line[6:].strip().decode("utf-8", "replace")
            if data:
                out.append((event, b"\n".join(data)))
        return out

    def objects(self, chunk: bytes) -> list[dict[str, Any]]:
        """The JSON objects carried by the complete events in `chunk` (`[DONE]` and junk skipped)."""
        out: list[dict[str, Any]] = []
        for _event, data in self.feed(chunk):
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue  # "[DONE]", or a frame we cannot read: the relay already passed it on
            if isinstance(obj, dict):
                out.append(obj)
        return out


def as_int(value: Any) -> int:
    """Provider usage fields may be absent or null; both mean zero."""
    return value if isinstance(value, int) else 0
