"""The gateway as a drop-in proxy for the official OpenAI SDK (Chat Completions and Responses)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from gateway.app import create_app
from gateway.testing import FakeUpstream, ToolCall, serve_app


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(reply="The answer is forty-two.") as f:
        yield f


@pytest.fixture
async def gateway(fake: FakeUpstream) -> AsyncIterator[str]:
    async with serve_app(create_app(fake.settings(), memory=False)) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="sk-client-123", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the answer?"}]


async def test_chat_completion_round_trip(client: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    """A non-streamed chat completion reaches {base}/chat/completions and its answer and usage reach the SDK."""
    r = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert r.choices[0].message.content == "The answer is forty-two."
    assert r.usage is not None and r.usage.prompt_tokens > 0
    assert fake.requests[-1].path == "/v1/chat/completions"
    assert fake.requests[-1].body["messages"] == MESSAGES


async def test_chat_body_is_forwarded_byte_for_byte(gateway: str, fake: FakeUpstream) -> None:
    """Without a memory hook the upstream receives exactly the bytes the client sent."""
    raw = b'{"model":  "gpt-4o-mini",\n "messages": [{"role": "user", "content": "caf\\u00e9"}] }'
    async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/chat/completions", data=raw, headers={
            "Content-Type": "application/json", "Authorization": "Bearer sk-x"}) as resp:
        assert resp.status == 200
    assert fake.requests[-1].raw == raw


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    """A streamed completion with include_usage yields every delta and a final usage-only chunk."""
    stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True})
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        else:
            usage = chunk.usage
    assert "".join(text) == "The answer is forty-two."
    assert usage is not None and usage.completion_tokens > 0


async def test_stream_bytes_relayed_unchanged(gateway: str, fake: FakeUpstream) -> None:
    """The SSE bytes reach the client as the upstream sent them, `data: [DONE]` included."""
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True})
    async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json"}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        relayed = await resp.read()
    frames = relayed.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    assert b"".join(json.loads(f[6:])["choices"][0]["delta"].get("content", "").encode()
                    for f in frames[:-2] if json.loads(f[6:])["choices"]) == b"The answer is forty-two."


async def test_stream_is_not_buffered(gateway: str, fake: FakeUpstream) -> None:
    """The first SSE event reaches the client long before a slow upstream finishes its stream."""
    fake.reply = "one two three four five six"
    fake.chunk_delay = 0.25
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True})
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json"}) as resp:
        first = await resp.content.readany()
        t_first = time.monotonic() - t0
        await resp.read()
        t_all = time.monotonic() - t0
    assert first.startswith(b"data: ")
    assert t_all > 1.5
    assert t_first < 0.8


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_tool_calls_round_trip(client: openai.AsyncOpenAI, fake: FakeUpstream, stream: bool) -> None:
    """Tool calls reach the SDK intact and the client's tool result goes back upstream."""
    fake.reply = ""
    fake.tool_calls = [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"}, id="call_abc")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    if stream:
        calls: dict[int, dict[str, str]] = {}
        async for chunk in await client.chat.completions.create(model="m", messages=MESSAGES, tools=tools,
                                                                 stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += tc.id or ""
                c["name"] += (tc.function.name or "") if tc.function else ""
                c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        call = calls[0]
    else:
        r = await client.chat.completions.create(model="m", messages=MESSAGES, tools=tools)
        tc = r.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["id"] == "call_abc" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    fake.tool_calls = []
    fake.reply = "It is sunny."
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call["id"], "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]}}]},
               {"role": "tool", "tool_call_id": call["id"], "content": "22C, sunny"}]
    r = await client.chat.completions.create(model="m", messages=history, tools=tools)
    assert r.choices[0].message.content == "It is sunny."
    assert fake.requests[-1].body["messages"] == history


async def test_responses_round_trip(client: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    """A non-streamed Responses call reaches {base}/responses and output_text reaches the SDK."""
    r = await client.responses.create(model="gpt-4o-mini", input="What is the answer?")
    assert r.output_text == "The answer is forty-two."
    assert r.usage is not None and r.usage.input_tokens > 0
    assert fake.requests[-1].path == "/v1/responses"


async def test_responses_stream(client: openai.AsyncOpenAI) -> None:
    """A streamed Responses call yields its typed events, text deltas and response.completed."""
    kinds, deltas = [], []
    async for event in await client.responses.create(model="m", input="hi", stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(deltas) == "The answer is forty-two."


async def test_responses_function_call(client: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    """A function_call output item of the Responses API reaches the SDK with its call id and arguments."""
    fake.reply = ""
    fake.tool_calls = [ToolCall("lookup", {"q": "x"}, id="call_r1")]
    async with client.responses.stream(model="m", input="hi") as stream:
        final = await stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    assert call.call_id == "call_r1" and json.loads(call.arguments) == {"q": "x"}


async def test_models_goes_to_openai_without_anthropic_version(client: openai.AsyncOpenAI,
                                                               fake: FakeUpstream) -> None:
    """GET /v1/models without anthropic-version is OpenAI's model list."""
    page = await client.models.list()
    assert [m.id for m in page.data] == ["gpt-4o-mini"]
    assert fake.requests[-1].path == "/v1/models"


async def test_other_v1_paths_pass_through_with_query(gateway: str, fake: FakeUpstream) -> None:
    """Any other /v1 path goes to the OpenAI upstream with its query string."""
    async with aiohttp.ClientSession() as s, s.get(gateway + "/v1/files?limit=2&after=f_1") as resp:
        assert resp.status == 404  # the fake has no /v1/files: its own 404 passes through
        assert (await resp.json())["error"]["code"] == "unknown_url"
    assert fake.requests[-1].path == "/v1/files"
    assert fake.requests[-1].query == "limit=2&after=f_1"


async def test_base_url_with_path_prefix(fake: FakeUpstream) -> None:
    """An OpenAI-compatible base_url (e.g. vLLM's http://host:8000/v1) is joined, not replaced."""
    settings = fake.settings(upstreams={"openai": {"base_url": fake.url + "/v1"}})
    async with serve_app(create_app(settings, memory=False)) as url:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        await c.chat.completions.create(model="m", messages=MESSAGES)
    assert fake.requests[-1].path == "/v1/chat/completions"


async def test_sdk_raises_when_upstream_drops_mid_stream(client: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    """An upstream that drops mid-stream ends the client's stream with an error the SDK raises, not a hang."""
    fake.reply = "a b c d e f g h"
    fake.drop_after = 3
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    seen = []
    with pytest.raises(openai.APIError, match="interrupted"):
        async with asyncio.timeout(10):
            async for chunk in stream:
                seen.append(chunk)
    assert len(seen) == 3
