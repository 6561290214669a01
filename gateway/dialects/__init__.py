"""The provider dialects, one module each, and the registry of them (one line per dialect).

`dialect_for_path` picks the one a request speaks: the path decides for the known routes; for any
other path the `anthropic-version` header (sent by every Anthropic SDK) tells an Anthropic caller
from an OpenAI one, so errors come back in a shape the caller's SDK parses.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.dialects.anthropic import Anthropic
from gateway.dialects.base import Accumulator, Dialect, SSEParser
from gateway.dialects.canonical import content_hash
from gateway.dialects.openai_chat import OpenAIChat
from gateway.dialects.openai_responses import OpenAIResponses

OPENAI_CHAT = OpenAIChat()
OPENAI_RESPONSES = OpenAIResponses()
ANTHROPIC = Anthropic()

DIALECTS: dict[str, Dialect] = {d.name: d for d in (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC)}


def dialect_named(name: str) -> Dialect:
    """The dialect called `name` (as stored with a conversation); KeyError for an unknown one."""
    return DIALECTS[name]


def dialect_for_upstream(name: str) -> Dialect:
    """The dialect the gateway itself speaks to `upstreams.<name>` (the summarizer's calls, the key's
    header): Anthropic for `anthropic`, every other upstream is OpenAI-compatible."""
    return ANTHROPIC if name == ANTHROPIC.upstream else OPENAI_CHAT


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
    "Accumulator", "Dialect", "SSEParser", "content_hash", "dialect_for_path", "dialect_for_upstream",
    "dialect_named",
]
