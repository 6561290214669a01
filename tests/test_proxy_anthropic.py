"""The gateway as a drop-in proxy for the official Anthropic SDK (Messages, count_tokens, models)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import pytest

from gateway.app import create_app
from gateway.testing import FakeUpstream, ToolCall, serve_app


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(reply="Bonjour, I am Claude.") as f:
        yield f


@pytest.fixture
async def gateway(fake: FakeUpstream) -> AsyncIterator[str]:
    async with serve_app(create_app(fake.settings(), memory=False)) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway, api_key="sk-ant-client-123", max_retries=0)


MESSAGES = [{"role": "user", "content": "Say hello."}]


async def test_message_round_trip(client: anthropic.AsyncAnthropic, fake: FakeUpstream) -> None:
    """A non-streamed message reaches {base}/v1/messages and its content and usage reach the SDK."""
    m = await client.messages.create(model="claude-sonnet-4", max_tokens=64, messages=MESSAGES)
    assert m.content[0].text == "Bonjour, I am Claude."
    assert m.usage.input_tokens > 0
    assert fake.requests[-1].path == "/v1/messages"
    assert fake.requests[-1].body["messages"] == MESSAGES


async def test_message_stream(client: anthropic.AsyncAnthropic) -> None:
    """A streamed message yields its text deltas and final usage through the SDK's stream helper."""
    async with client.messages.stream(model="claude-sonnet-4", max_tokens=64, messages=MESSAGES) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Bonjour, I am Claude."
    assert final.usage.output_tokens > 0 and final.stop_reason == "end_turn"


async def test_stream_event_lines_kept(gateway: str) -> None:
    """Anthropic's `event:` lines (ping included) reach the client byte for byte."""
    async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/messages", json={
            "model": "m", "max_tokens": 5, "messages": MESSAGES, "stream": True},
            headers={"anthropic-version": "2023-06-01"}) as resp:
        raw = await resp.read()
    events = [f.split(b"\n")[0] for f in raw.split(b"\n\n") if f]
    assert events[:3] == [b"event: message_start", b"event: content_block_start", b"event: ping"]
    assert events[-2:] == [b"event: message_delta", b"event: message_stop"]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_round_trip(client: anthropic.AsyncAnthropic, fake: FakeUpstream, stream: bool) -> None:
    """A tool_use block (input rebuilt from input_json_delta when streamed) reaches the SDK, and the
    client's tool_result goes back upstream."""
    fake.reply = ""
    fake.tool_calls = [ToolCall("get_weather", {"city": "Paris", "days": [1, 2]}, id="call_t1")]
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    if stream:
        async with client.messages.stream(model="m", max_tokens=64, messages=MESSAGES, tools=tools) as s:
            message = await s.get_final_message()
    else:
        message = await client.messages.create(model="m", max_tokens=64, messages=MESSAGES, tools=tools)
    block = message.content[0]
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris", "days": [1, 2]}
    assert message.stop_reason == "tool_use"
    fake.tool_calls, fake.reply = [], "Sunny."
    history = [*MESSAGES, {"role": "assistant", "content": [
        {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "22C"}]}]
    again = await client.messages.create(model="m", max_tokens=64, messages=history, tools=tools)
    assert again.content[0].text == "Sunny."
    assert fake.requests[-1].body["messages"] == history


async def test_count_tokens(client: anthropic.AsyncAnthropic, fake: FakeUpstream) -> None:
    """count_tokens passes through to {base}/v1/messages/count_tokens."""
    r = await client.messages.count_tokens(model="m", messages=MESSAGES)
    assert r.input_tokens > 0
    assert fake.requests[-1].path == "/v1/messages/count_tokens"


async def test_models_goes_to_anthropic_with_version_header(client: anthropic.AsyncAnthropic,
                                                            fake: FakeUpstream) -> None:
    """GET /v1/models with anthropic-version is answered by the Anthropic upstream."""
    page = await client.models.list()
    assert [m.id for m in page.data] == ["claude-sonnet-4-20250514"]
    assert fake.requests[-1].path == "/v1/models"
    assert "anthropic-version" in fake.requests[-1].headers


async def test_anthropic_base_url_keeps_its_own_path(fake: FakeUpstream) -> None:
    """The Anthropic base_url has no /v1: the gateway appends the incoming /v1/... path to it."""
    settings = fake.settings(upstreams={"anthropic": {"base_url": fake.url + "/"}})
    async with serve_app(create_app(settings, memory=False)) as url:
        c = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        await c.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    assert fake.requests[-1].path == "/v1/messages"


async def test_betas_and_version_headers_forwarded(client: anthropic.AsyncAnthropic, fake: FakeUpstream) -> None:
    """anthropic-version and anthropic-beta reach the upstream unchanged."""
    await client.beta.messages.create(model="m", max_tokens=8, messages=MESSAGES, betas=["files-api-2025-04-14"])
    headers = fake.requests[-1].headers
    assert headers["anthropic-beta"] == "files-api-2025-04-14"
    assert headers["anthropic-version"]


async def test_sdk_raises_when_upstream_drops_mid_stream(client: anthropic.AsyncAnthropic,
                                                         fake: FakeUpstream) -> None:
    """An upstream cut mid-stream ends the stream with an `event: error` that the SDK raises."""
    fake.reply = "one two three four five"
    fake.drop_after = 4
    with pytest.raises(anthropic.APIStatusError, match="interrupted"):
        async with asyncio.timeout(10):
            async with client.messages.stream(model="m", max_tokens=64, messages=MESSAGES) as stream:
                async for _ in stream:
                    pass
