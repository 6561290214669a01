"""Provider wire formats. `dialect_for_path` picks the one a request speaks.

The path decides for the known routes; for any other path the `anthropic-version` header (sent by
every Anthropic SDK) tells an Anthropic caller from an OpenAI one, so errors come back in a shape
the caller's SDK parses.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.dialects.anthropic import Anthropic
from gateway.dialects.base import Accumulator, Dialect, SSEParser
from gateway.dialects.openai_chat import OpenAIChat
from gateway.dialects.openai_responses import OpenAIResponses

OPENAI_CHAT = OpenAIChat()
OPENAI_RESPONSES = OpenAIResponses()
ANTHROPIC = Anthropic()

DIALECTS: dict[str, Dialect] = {d.name: d for d in (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC)}


def dialect_for_path(path: str, headers: Mapping[str, str]) -> Dialect:
    if path == "/v1/chat/completions":
        return OPENAI_CHAT
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return OPENAI_RESPONSES
    if path.startswith("/v1/messages") or "anthropic-version" in headers:
        return ANTHROPIC
    return OPENAI_CHAT


__all__ = [
    "ANTHROPIC", "DIALECTS", "OPENAI_CHAT", "OPENAI_RESPONSES",
    "Accumulator", "Dialect", "SSEParser", "dialect_for_path",
]
