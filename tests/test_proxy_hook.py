"""The memory hook seam: prepare → forward the hook's body, add its headers → on_success in the background;
and the app's health, readiness and metrics routes."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway.app import BACKGROUND, METRICS, create_app, drain_background
from gateway.model import Usage
from gateway.proxy import Call, Prepared
from gateway.testing import FakeUpstream, ToolCall, serve_app


class RecordingHook:
    """Rewrites the last user message, tags the response, and records what on_success receives."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.calls: list[Call] = []
        self.successes: list[tuple[list[dict[str, Any]], Usage]] = []
        self.delay = delay

    async def prepare(self, call: Call) -> Prepared | None:
        self.calls.append(call)
        if "X-Conversation-Id" not in call.headers:
            return None
        body = dict(call.body)
        body["rewritten"] = True

        async def on_success(items: list[dict[str, Any]], usage: Usage) -> None:
            await asyncio.sleep(self.delay)
            self.successes.append((items, usage))

        return Prepared(body=json.dumps(body).encode(), on_success=on_success,
                        headers={"x-gateway-context": "rewritten", "x-gateway-tokens-saved": "7"})


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(reply="Rebuilt reply.") as f:
        yield f


@pytest.fixture
def hook() -> RecordingHook:
    return RecordingHook()


@pytest.fixture
async def app_url(fake: FakeUpstream, hook: RecordingHook) -> AsyncIterator[tuple[Any, str]]:
    app = create_app(fake.settings(), hook=hook)
    async with serve_app(app) as url:
        yield app, url


CONV = {"X-Conversation-Id": "c-1"}
# Not streamed; streamed and arrived whole with its headers (written at once); streamed slowly
# (relayed chunk by chunk while the reply is rebuilt from a copy of what was relayed).
STREAMS = [(False, 0.0), (True, 0.0), (True, 0.01)]
TOOL = ToolCall("get_weather", {"city": "Oslo"}, id="call_h1")


@pytest.mark.parametrize(("stream", "chunk_delay"), STREAMS)
async def test_openai_chat_hook(app_url: tuple[Any, str], fake: FakeUpstream, hook: RecordingHook,
                                stream: bool, chunk_delay: float) -> None:
    """The hook's body goes upstream, its headers reach the client, and on_success gets the reply in
    request shape (text and tool calls) with usage."""
    fake.chunk_delay = chunk_delay
    app, url = app_url
    fake.tool_calls = [TOOL]
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=CONV)
    kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        raw = await c.chat.completions.with_raw_response.create(**kwargs, stream=True,
                                                                stream_options={"include_usage": True})
        async for _ in raw.parse():
            pass
    else:
        raw = await c.chat.completions.with_raw_response.create(**kwargs)
    assert raw.headers["x-gateway-context"] == "rewritten"
    assert fake.requests[-1].body["rewritten"] is True
    assert hook.calls[-1].stream is stream and hook.calls[-1].dialect.name == "openai_chat"
    await drain_background(app)
    items, usage = hook.successes[-1]
    assert items == [{"role": "assistant", "content": "Rebuilt reply.", "tool_calls": [
        {"id": "call_h1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}]
    assert usage.input_tokens > 0 and usage.output_tokens > 0


@pytest.mark.parametrize(("stream", "chunk_delay"), STREAMS)
async def test_responses_hook(app_url: tuple[Any, str], fake: FakeUpstream, hook: RecordingHook,
                              stream: bool, chunk_delay: float) -> None:
    """Responses replies are handed to on_success as input items (message and function_call)."""
    fake.chunk_delay = chunk_delay
    app, url = app_url
    fake.tool_calls = [TOOL]
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=CONV)
    if stream:
        async for _ in await c.responses.create(model="m", input="hi", stream=True):
            pass
    else:
        await c.responses.create(model="m", input="hi")
    await drain_background(app)
    items, usage = hook.successes[-1]
    assert items == [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rebuilt reply."}]},
        {"type": "function_call", "call_id": "call_h1", "name": "get_weather", "arguments": '{"city":"Oslo"}'}]
    assert usage.input_tokens > 0


@pytest.mark.parametrize(("stream", "chunk_delay"), STREAMS)
async def test_anthropic_hook(app_url: tuple[Any, str], fake: FakeUpstream, hook: RecordingHook,
                              stream: bool, chunk_delay: float) -> None:
    """Anthropic replies are handed to on_success as one assistant message of request-shaped blocks."""
    fake.chunk_delay = chunk_delay
    app, url = app_url
    fake.tool_calls = [TOOL]
    c = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, default_headers=CONV)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        async with c.messages.stream(**kwargs) as s:
            await s.get_final_message()
    else:
        await c.messages.create(**kwargs)
    await drain_background(app)
    items, usage = hook.successes[-1]
    assert items == [{"role": "assistant", "content": [
        {"type": "text", "text": "Rebuilt reply."},
        {"type": "tool_use", "id": "toolu_h1", "name": "get_weather", "input": {"city": "Oslo"}}]}]
    assert usage.output_tokens > 0


async def test_no_prepared_forwards_original(app_url: tuple[Any, str], fake: FakeUpstream,
                                             hook: RecordingHook) -> None:
    """A hook returning None leaves the body untouched and adds no headers."""
    _, url = app_url
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert "x-gateway-context" not in raw.headers
    assert "rewritten" not in fake.requests[-1].body
    assert len(hook.calls) == 1


async def test_on_success_not_called_on_error(app_url: tuple[Any, str], fake: FakeUpstream,
                                              hook: RecordingHook) -> None:
    """A non-2xx upstream answer is relayed and nothing is recorded."""
    app, url = app_url
    fake.error_status = 400
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=CONV)
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    await drain_background(app)
    assert hook.successes == []


async def test_on_success_not_called_when_stream_breaks(app_url: tuple[Any, str], fake: FakeUpstream,
                                                        hook: RecordingHook) -> None:
    """A stream cut by the upstream is not recorded as a turn."""
    app, url = app_url
    fake.reply, fake.drop_after = "a b c d", 2
    c = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, default_headers=CONV)
    with pytest.raises(anthropic.APIStatusError):
        async with c.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as s:
            await s.get_final_message()
    await drain_background(app)
    assert hook.successes == []


async def test_on_success_does_not_delay_the_response(fake: FakeUpstream) -> None:
    """The client has its answer while a slow on_success is still running in app[BACKGROUND]."""
    hook = RecordingHook(delay=1.0)
    app = create_app(fake.settings(), hook=hook)
    async with serve_app(app) as url:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=CONV)
        await asyncio.wait_for(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]),
                               timeout=0.8)
        assert len(app[BACKGROUND]) == 1 and hook.successes == []
        await drain_background(app)
        assert len(hook.successes) == 1


async def test_metrics_count_requests_by_context(app_url: tuple[Any, str]) -> None:
    """/metrics exposes every DESIGN.md metric and counts requests by route, context, status, provider and
    model (an unconfigured model name is "other": the label set stays bounded)."""
    app, url = app_url
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=CONV)
    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    app[METRICS].summarizer_tokens.labels(kind="input").inc(3)
    app[METRICS].folds.labels(result="ok").inc()
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    assert r.headers["Content-Type"].startswith("text/plain")
    assert ('gateway_requests_total{context="rewritten",model="other",provider="openai",'
            'route="/v1/chat/completions",status="200"} 1.0') in text
    for name in ("gateway_tokens_original_total", "gateway_tokens_forwarded_total", "gateway_tokens_saved_total",
                 "gateway_summarizer_tokens_total", "gateway_overhead_seconds_bucket",
                 "gateway_upstream_seconds_bucket", "gateway_folds_total", "gateway_fold_seconds_bucket",
                 "gateway_store_errors_total",
                 "gateway_cost_saved_usd_total"):
        assert name in text
    assert 'gateway_overhead_seconds_bucket{le="0.0001"}' in text


def _gc_pauses(text: str, series: str = "count") -> dict[str, float]:
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(f"gateway_gc_pause_seconds_{series}{{")}


async def test_metrics_time_the_garbage_collectors_pauses(fake: FakeUpstream) -> None:
    """A collection holds the event loop like any CPU work: /metrics times each one by generation
    while the app runs, and the app stops timing them when it is cleaned up."""
    app = create_app(fake.settings(), memory=False)
    async with serve_app(app) as url:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            before = _gc_pauses(await r.text())
        gc.collect()
        gc.collect(0)
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
    after, seconds = _gc_pauses(text), _gc_pauses(text, "sum")
    assert set(after) == {"0", "1", "2"}
    assert after["2"] >= before["2"] + 1 and after["0"] >= before["0"] + 1
    assert seconds["2"] > 0
    # Cumulative buckets, each at most the next, the last (+Inf) the count; a pause lands in the
    # bucket its length falls in.
    full = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith('gateway_gc_pause_seconds_bucket{generation="2"')]
    assert full == sorted(full) and full[-1] == after["2"]
    if seconds["2"] / after["2"] > 0.0005:  # the mean is past the first bound: one pause is too
        assert full[0] < after["2"]
    seen = dict(after)
    gc.collect()
    assert _gc_pauses(app[METRICS].render()[0].decode())["2"] == seen["2"]


class Store:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    async def ping(self) -> bool:
        return self.ok


@pytest.mark.parametrize(("store", "status"), [(None, 200), (Store(True), 200), (Store(False), 503)])
async def test_health_and_readiness(fake: FakeUpstream, store: Store | None, status: int) -> None:
    """/healthz is always ok; /readyz is 503 when the store does not answer its ping."""
    async with serve_app(create_app(fake.settings(), store=store, memory=False)) as url, \
            aiohttp.ClientSession() as s:
        async with s.get(url + "/healthz") as r:
            assert r.status == 200
        async with s.get(url + "/readyz") as r:
            assert r.status == status
