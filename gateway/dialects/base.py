"""The interface every provider dialect implements, and the SSE frame splitter they share.

A dialect is one provider API (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages) in
one module: its wire format (whether a request body asks for a stream, how that provider renders
an error as a JSON body and as a stream frame, how to rebuild the assistant's reply and the usage
from a response, streamed or not), its message shape (where the history lives in a body, what a
message says, how it hashes, which tool calls it opens or answers, how a Plan is rendered back
into a body) and the summarizer's request to it. It does no I/O.

`Usage.input_tokens` is always the *whole* prompt as the provider counted it, cached parts
included (OpenAI's `prompt_tokens`; Anthropic's `input_tokens + cache_read + cache_creation`), so
it compares directly with the gateway's own estimate of the forwarded request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import orjson

from gateway.model import DialectName, Plan, Usage

UpstreamName = Literal["openai", "anthropic"]


class Accumulator(Protocol):
    """Fed the raw bytes of a stream as they arrive; rebuilds the reply once the stream ends."""

    def feed(self, chunk: bytes) -> None: ...

    def result(self) -> tuple[list[dict[str, Any]], Usage]: ...


class Dialect(Protocol):
    name: DialectName
    upstream: UpstreamName  # the `upstreams.<name>` a call in this dialect goes to
    history_field: str  # the body's member that carries the conversation ("messages", "input")

    # -- wire format
    def is_stream(self, body: Mapping[str, Any]) -> bool: ...
    def error_body(self, status: int, type_: str, message: str) -> bytes: ...
    def stream_error_frame(self, message: str) -> bytes: ...
    def accumulator(self) -> Accumulator: ...
    def parse_response(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Usage]: ...

    # -- messages (pure: the rewrite rules and the store see messages only through these)
    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None: ...
    def system_text(self, body: dict[str, Any]) -> str: ...
    def role(self, raw: dict[str, Any]) -> str: ...
    def text(self, raw: dict[str, Any]) -> str: ...
    # (role, text) as the summary and state read the message, when they differ from role() and text():
    # only its author's words (not a tool's output beside them, nor a client's notes such as Claude
    # Code's <system-reminder>, nor the arguments of a tool call); "tool" with the tool's output when
    # nothing is the author's; ("system", "") for a note alone. None (or role() and text() themselves):
    # they stand.
    def spoken(self, raw: dict[str, Any]) -> tuple[str, str] | None: ...
    def canonical(self, raw: dict[str, Any]) -> str: ...
    def tool_calls(self, raw: dict[str, Any]) -> tuple[str, ...]: ...
    def tool_results(self, raw: dict[str, Any]) -> tuple[str, ...]: ...
    def binds_next(self, raw: dict[str, Any]) -> bool: ...
    def is_turn_start(self, raw: dict[str, Any]) -> bool: ...
    def render(self, body: dict[str, Any], plan: Plan, *, cache_control: bool) -> dict[str, Any]: ...
    def max_output_tokens(self, body: dict[str, Any]) -> int | None: ...
    def model(self, body: dict[str, Any]) -> str | None: ...
    def caches_full_history(self, raw: bytes) -> bool: ...

    # -- the upstream: its key's header, its base URL's form, the summarizer's call to it
    base_has_v1: bool  # the configured base_url ends in /v1 (the incoming path's /v1 is dropped)
    def auth_headers(self, api_key: str) -> dict[str, str]: ...
    def summary_request(self, model: str, system: str, user: str, *, max_tokens: int,
                        json_mode: bool) -> tuple[str, dict[str, Any], dict[str, str]]: ...
    def summary_answer(self, data: dict[str, Any]) -> tuple[str, int, int]: ...


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
