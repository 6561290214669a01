"""Real usage for OpenAI Chat Completions streams whose client did not ask for it.

OpenAI sends a stream's token usage only when the request sets `stream_options.include_usage`,
and the OpenAI SDK does not set it by default: such streams were counted as 0 input tokens. For a
request that names a conversation (one without is forwarded byte for byte) the gateway asks for it
on the client's behalf (`ask_for_usage`, the body's other bytes unchanged)
and removes the usage-only frame (`"choices": []`) from what the client receives, since a client
that did not ask may index `choices[0]` of every chunk, and the `"usage":null` that OpenAI then adds
to every other chunk: the client gets the stream it would have had without the gateway. The frame
it removes, or the one the client asked for, is where the usage is read from (`UsageTap.usage`).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.model import Usage

MAX_PENDING = 1 << 20  # bytes of an unfinished frame held back; past it, relayed as is
# The member include_usage adds to every chunk before the last. Inside a JSON string its quotes would
# be escaped (preceded by a backslash), so this matches the member only.
_NULL_USAGE = re.compile(rb',[ \t]*"usage"[ \t]*:[ \t]*null(?=[ \t]*[,}])')


def ask_for_usage(body: dict[str, Any], raw: bytes) -> bytes | None:
    """`raw` with `"stream_options": {"include_usage": true}` added, or None when it cannot or need not be."""
    if "stream_options" in body or body.get("stream") is not True:
        return None
    start = raw.find(b"{")
    if start < 0 or raw[:start].strip():
        return None
    return raw[:start + 1] + b'"stream_options":{"include_usage":true},' + raw[start + 1:]


def _usage(frame: bytes) -> Usage | None:
    data = b"".join(line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:"))
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    use = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(use, dict):
        return None
    details = use.get("prompt_tokens_details") or {}
    return Usage(input_tokens=int(use.get("prompt_tokens") or 0), output_tokens=int(use.get("completion_tokens") or 0),
                 cache_read_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0)


class UsageTap:
    """Reads the usage frame of a chat stream as it is relayed; drops it when `strip`."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` to relay now (whole frames; the unfinished rest waits for the next chunk)."""
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_PENDING:
                self._pending = b""
                return data
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        frames = data[:end + 2]
        if self.strip:
            frames = _NULL_USAGE.sub(b"", frames)
        if b'"choices":[]' not in frames.replace(b" ", b""):
            return frames
        out = []
        for frame in frames.split(b"\n\n"):
            if not frame:
                continue
            if b'"choices":[]' in frame.replace(b" ", b"") and b'"usage"' in frame:
                self.usage = _usage(frame) or self.usage
                if self.strip:
                    continue
            out.append(frame + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
