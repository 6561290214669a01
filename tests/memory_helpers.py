"""Shared pieces of the memory end-to-end tests: the real gateway (memory on, small thresholds) in
front of a fake upstream, the official SDK clients, and the conversation API."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway import worker
from gateway.app import HOOK, STORE, create_app, drain_background
from gateway.testing import FakeUpstream, Received, serve_app
from gateway.tokens import TokenCounter

KEY = "sk-client-alice-0001"
OTHER_KEY = "sk-client-bob-0002"
OPENAI_MODEL = "gpt-test"  # not a configured model: the default (cl100k) counting
ANTHROPIC_MODEL = "claude-test"
SYSTEM = "You are a careful assistant for the Memory Gateway project. Answer briefly."

# Folds happen every few turns: 6 messages trigger a rewrite, the last 4 stay verbatim.
# These tests are about the rewrite itself: it is not traded for a cached full history (policy cost).
# Their summaries are a few lines long: a timeline beside them (tested in test_timeline.py) would
# outweigh the handful of messages they stand for.
SMALL: dict[str, Any] = {"message_threshold": 6, "keep_recent": 4, "fold_batch": 4, "policy": "threshold",
                         "min_saving_share": 0.0, "timeline_tokens": 0}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Gateway:
    app: Any
    url: str
    fake: FakeUpstream
    http: aiohttp.ClientSession

    clients: dict[tuple[str, str], Any] = field(default_factory=dict)

    def openai(self, key: str = KEY) -> openai.AsyncOpenAI:
        if ("openai", key) not in self.clients:
            self.clients["openai", key] = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)
        return self.clients["openai", key]  # type: ignore[no-any-return]

    def anthropic(self, key: str = KEY) -> anthropic.AsyncAnthropic:
        if ("anthropic", key) not in self.clients:
            self.clients["anthropic", key] = anthropic.AsyncAnthropic(base_url=self.url, api_key=key, max_retries=0)
        return self.clients["anthropic", key]  # type: ignore[no-any-return]

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def views_live(self) -> None:
        """Wait until the memory layer follows the store's change channel (it plans warm conversations
        from what it knows only then)."""
        hook = self.app[HOOK]
        for _ in range(200):
            if hook.caches.views.live:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the memory layer never subscribed to the store's change channel")

    async def settle(self) -> None:
        """Every recording finished, then every queued fold done."""
        await drain_background(self.app)
        await worker.settle(self.app[STORE], timeout=20)

    async def api(self, method: str, path: str, key: str = KEY, **kwargs: Any) -> tuple[int, Any]:
        """Call the conversation API (`path` after /gateway/conversations/); (status, parsed JSON)."""
        headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
        async with self.http.request(method, f"{self.url}/gateway/conversations/{path}", headers=headers,
                                     **kwargs) as r:
            return r.status, await r.json(content_type=None)

    async def messages(self, conv: str, key: str = KEY) -> list[dict[str, Any]]:
        """Every stored message of `conv` (as the client sent / will send it)."""
        status, page = await self.api("GET", f"{conv}/messages?limit=1000", key)
        assert status == 200, page
        return [d["message"] for d in page["data"]]

    def last(self, path: str = "") -> Received:
        return [r for r in self.fake.requests if r.path.endswith(path)][-1]


@asynccontextmanager
async def memory_gateway(store_url: str, *, memory: dict[str, Any] | None = None, reply: str = "Noted.",
                         **sections: Any) -> AsyncIterator[Gateway]:
    """The real app with memory on over `store_url`, a fake upstream on port 0, an HTTP session."""
    async with FakeUpstream(reply=reply) as fake:
        mem = _merge({**SMALL, "worker": {"retry_base_seconds": 0}}, memory or {})
        settings = fake.settings(store={"url": store_url}, memory=mem, **sections)
        app = create_app(settings)
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            g = Gateway(app, url, fake, http)
            try:
                yield g
            finally:
                await g.close()
                await drain_background(app)


@pytest.fixture(params=["redis", "memory"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The central scenarios run on real Redis and on the in-process `memory://` store."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return "memory://"


@pytest.fixture
async def gw(store_url: str) -> AsyncIterator[Gateway]:
    async with memory_gateway(store_url) as g:
        yield g


@pytest.fixture
async def gw_redis(redis_url: str) -> AsyncIterator[Gateway]:
    async with memory_gateway(redis_url) as g:
        yield g


def conv_headers(conv: str, **extra: str) -> dict[str, str]:
    return {"X-Conversation-Id": conv, **extra}


COUNTER = TokenCounter({})


def history_tokens(texts: list[str], system: str = "") -> int:
    """What the gateway calls the original size: cl100k per message (+4 each) plus the system prompt."""
    return sum(COUNTER.count_message(t) for t in texts) + (COUNTER.count(system) if system else 0)


def user_text(i: int) -> str:
    """A distinct, wordy user turn (so that history grows and retrieval has something to find)."""
    topics = ["the Redis store", "the fold worker", "the Lua append script", "the SSE relay", "token budgets",
              "tool call groups", "prompt caching", "tenant isolation"]
    return (f"Turn {i}: let us talk about {topics[i % len(topics)]}. Please explain how it behaves when "
            f"conversation number {i} grows past its window, and list two risks for item {i * 7}.")


def reply_text(body: dict[str, Any]) -> str:
    """The fake upstream's answer: names the newest user text, so each reply is distinct."""
    msgs = body.get("messages") or []
    last = msgs[-1] if msgs else {}
    content = last.get("content")
    if isinstance(content, list):
        content = " ".join(b.get("text", "") for b in content if isinstance(b, dict))
    return f"Answer to <{str(content)[-60:]}>: it keeps the recent turns verbatim and summarises the rest."


async def openai_turn(g: Gateway, client: openai.AsyncOpenAI, conv: str, messages: list[dict[str, Any]], *,
                      stream: bool = False, model: str = OPENAI_MODEL, **kwargs: Any) -> tuple[Any, str]:
    """One chat completion through the SDK; (response headers, reply text), recording drained."""
    headers = {**conv_headers(conv), **kwargs.pop("extra_headers", {})}
    if stream:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True},
            extra_headers=headers, **kwargs)
        parts = [c.choices[0].delta.content or "" async for c in raw.parse() if c.choices]
        text = "".join(parts)
    else:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, extra_headers=headers, **kwargs)
        text = raw.parse().choices[0].message.content or ""
    await drain_background(g.app)
    return raw.headers, text


async def anthropic_turn(g: Gateway, client: anthropic.AsyncAnthropic, conv: str, messages: list[dict[str, Any]],
                         *, stream: bool = False, model: str = ANTHROPIC_MODEL, **kwargs: Any) -> tuple[Any, Any]:
    """One Messages call through the SDK; (response headers, the final Message), recording drained."""
    headers = {**conv_headers(conv), **kwargs.pop("extra_headers", {})}
    kwargs.setdefault("max_tokens", 256)
    if stream:
        async with client.messages.stream(model=model, messages=messages, extra_headers=headers, **kwargs) as s:
            message = await s.get_final_message()
            out_headers = s.response.headers
    else:
        raw = await client.messages.with_raw_response.create(model=model, messages=messages, extra_headers=headers,
                                                           **kwargs)
        message, out_headers = raw.parse(), raw.headers
        if inspect.isawaitable(message):  # anthropic's raw response parses asynchronously
            message = await message
    await drain_background(g.app)
    return out_headers, message


def token_headers(headers: Any) -> tuple[str, int, int, int]:
    """(context, original, forwarded, saved) from a memory response's x-gateway-* headers."""
    return (headers["x-gateway-context"], int(headers["x-gateway-tokens-original"]),
            int(headers["x-gateway-tokens-forwarded"]), int(headers["x-gateway-tokens-saved"]))


def block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")


def count_breakpoints(value: Any) -> int:
    """cache_control markers anywhere in an Anthropic body part."""
    if isinstance(value, list):
        return sum(count_breakpoints(v) for v in value)
    if isinstance(value, dict):
        return (1 if value.get("cache_control") is not None else 0) + sum(
            count_breakpoints(v) for v in value.values() if isinstance(v, list | dict))
    return 0


class Chat:
    """One conversation driven through either SDK with plain-text history `[{"role", "content"}]`."""

    def __init__(self, g: Gateway, dialect: str, conv: str, *, key: str = KEY, system: str = SYSTEM) -> None:
        self.g, self.dialect, self.conv, self.key, self.system = g, dialect, conv, key, system

    async def send(self, msgs: list[dict[str, Any]], *, stream: bool = False, **kwargs: Any) -> tuple[Any, str]:
        """(response headers, reply text) for the history `msgs` (recording drained)."""
        if self.dialect == "openai":
            full = [{"role": "system", "content": self.system}, *msgs]
            return await openai_turn(self.g, self.g.openai(self.key), self.conv, full, stream=stream, **kwargs)
        headers, message = await anthropic_turn(self.g, self.g.anthropic(self.key), self.conv, msgs,
                                                system=self.system, stream=stream, **kwargs)
        return headers, "".join(b.text for b in message.content if b.type == "text")

    @property
    def path(self) -> str:
        return "/chat/completions" if self.dialect == "openai" else "/messages"

    def forwarded(self, request: Received | None = None) -> list[dict[str, Any]]:
        """The history of the last (or given) forwarded request, without the chat system messages."""
        body = (request or self.g.last(self.path)).body
        msgs = body["messages"]
        return [m for m in msgs if m["role"] != "system"] if self.dialect == "openai" else msgs

    def injected(self, request: Received | None = None) -> str:
        """What the gateway put in the system voice (chat system messages / Anthropic system blocks)."""
        body = (request or self.g.last(self.path)).body
        if self.dialect == "openai":
            return "\n".join(block_text(m["content"]) for m in body["messages"] if m["role"] == "system")
        system = body.get("system")
        return system if isinstance(system, str) else block_text(system or [])

    async def stored(self) -> list[dict[str, Any]]:
        return await self.g.messages(self.conv, self.key)


EXCERPTS_HEADER = "## Relevant earlier excerpts"


def plain(msgs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages reduced to role + text, whatever block shape they use."""
    return [{"role": m["role"], "content": block_text(m["content"])} for m in msgs]


def without_excerpts(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """`plain` OpenAI messages less the excerpt messages the gateway adds (user messages of their own;
    Anthropic's are text blocks inside the newest user message)."""
    return [m for m in msgs if not m["content"].startswith(EXCERPTS_HEADER)]


class Lines:
    """Stands in for a structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _keep(self, level: str, event: str, **fields: Any) -> None:
        self.lines.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._keep("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._keep("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._keep("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._keep("error", event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._keep("error", event, **fields)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [f for _, e, f in self.lines if e == name]


@asynccontextmanager
async def loop_turns() -> AsyncIterator[list[int]]:
    """How many turns another task gets on the event loop while the block runs: [turns]. (A step
    that holds the loop throughout leaves it at 0 or 1.)"""
    turns = [0]
    done = False

    async def other() -> None:
        while not done:
            await asyncio.sleep(0)
            turns[0] += 1

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    turns[0] = 0
    try:
        yield turns
    finally:
        done = True
        await task

