"""Streamed requests count the usage the provider really reported, also when the client did not ask for
it; metrics carry provider and model labels from a bounded set."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from memory_helpers import Gateway, anthropic_turn, memory_gateway, openai_turn, user_text

from gateway import logs
from gateway.app import METRICS, create_app, drain_background
from gateway.stream_usage import UsageTap, ask_for_usage
from gateway.testing import FakeUpstream, serve_app

MESSAGES = [{"role": "user", "content": "What is the answer?"}]


def _samples(app: Any, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for metric in app[METRICS].registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture
async def plain() -> AsyncIterator[tuple[Any, FakeUpstream, openai.AsyncOpenAI]]:
    async with FakeUpstream(reply="The answer is forty-two.") as fake:
        app = create_app(fake.settings(), memory=False)
        async with serve_app(app) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-client-123", max_retries=0)
            yield app, fake, client
            await client.close()


async def test_a_stream_without_include_usage_is_counted_and_relayed_as_asked(
        plain: tuple[Any, FakeUpstream, openai.AsyncOpenAI]) -> None:
    """For a conversation the gateway asks OpenAI for the stream's usage, counts it, and the client (which
    did not ask) gets no usage-only chunk."""
    app, fake, client = plain
    stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True,
                                                  extra_headers={"X-Conversation-Id": "counted"})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The answer is forty-two."
    assert all(c.choices for c in chunks)  # a client indexing choices[0] of every chunk keeps working
    assert all("usage" not in c.model_dump(exclude_unset=True) for c in chunks)  # as if never asked
    sent = fake.requests[-1].body
    assert sent["stream_options"] == {"include_usage": True} and sent["messages"] == MESSAGES
    prompt = max(1, len(fake.requests[-1].raw) // 4)  # what the fake upstream reports as prompt_tokens
    usage = _samples(app, "gateway_usage_tokens_total")
    assert usage[(("kind", "input"), ("model", "gpt-4o-mini"), ("provider", "openai"))] == prompt
    assert usage[(("kind", "output"), ("model", "gpt-4o-mini"), ("provider", "openai"))] > 0


async def test_a_stream_without_a_conversation_goes_byte_for_byte(
        plain: tuple[Any, FakeUpstream, openai.AsyncOpenAI]) -> None:
    """Without a conversation id a stream's body reaches the upstream exactly as sent (nothing is asked
    for), and no usage is made up for it."""
    app, fake, client = plain
    stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "The answer is forty-two."
    assert b"stream_options" not in fake.requests[-1].raw
    assert _samples(app, "gateway_usage_tokens_total") == {}


async def test_a_stream_that_asked_for_usage_is_untouched(plain: tuple[Any, FakeUpstream, openai.AsyncOpenAI]) -> None:
    """A client that set include_usage itself gets its usage chunk, and its body goes upstream unchanged."""
    app, fake, client = plain
    stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert fake.requests[-1].raw.count(b"stream_options") == 1
    usage = _samples(app, "gateway_usage_tokens_total")
    reported = chunks[-1].usage.prompt_tokens
    assert usage[(("kind", "input"), ("model", "gpt-4o-mini"), ("provider", "openai"))] == reported


def test_usage_tap_reads_and_strips_a_usage_frame_split_across_chunks() -> None:
    """The usage-only frame is found and removed even when it arrives in pieces; other frames pass whole."""
    frame = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
    usage = (b'data: {"id":"x","choices": [],"usage":{"prompt_tokens":12,"completion_tokens":3,'
             b'"prompt_tokens_details":{"cached_tokens":5}}}\n\n')
    stream = frame + usage + b"data: [DONE]\n\n"
    tap = UsageTap(strip=True)
    out = b"".join(tap.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + tap.flush()
    # Also without the "usage":null that include_usage added: the chunk as it would have come.
    assert out == frame.replace(b',"usage":null', b"") + b"data: [DONE]\n\n"
    assert tap.usage is not None and (tap.usage.input_tokens, tap.usage.output_tokens,
                                      tap.usage.cache_read_tokens) == (12, 3, 5)
    keep = UsageTap(strip=False)
    assert keep.feed(stream) + keep.flush() == stream and keep.usage == tap.usage


def test_ask_for_usage_keeps_the_rest_of_the_body() -> None:
    """The option is added in front of the client's own bytes; bodies that set stream_options are left alone."""
    raw = b' {"model": "m", "stream": true, "messages": []}'
    added = ask_for_usage(orjson.loads(raw), raw)
    assert added == b' {"stream_options":{"include_usage":true},"model": "m", "stream": true, "messages": []}'
    assert orjson.loads(added) == {"stream_options": {"include_usage": True}, **orjson.loads(raw)}
    assert ask_for_usage({"stream": True, "stream_options": {}}, b'{"stream": true, "stream_options": {}}') is None
    assert ask_for_usage({"stream": False}, b'{"stream": false}') is None


async def test_memory_metrics_are_labelled_by_provider_and_configured_model(redis_url: str) -> None:
    """Token metrics carry the provider and the configured model name a dated model id falls under;
    an unknown model is "other", so clients cannot grow the label set."""
    async with memory_gateway(redis_url) as g:
        await _turns(g)
        tokens = _samples(g.app, "gateway_tokens_original_total")
        assert tokens[(("model", "gpt-4o-mini"), ("provider", "openai"))] > 0
        assert tokens[(("model", "claude-sonnet-4"), ("provider", "anthropic"))] > 0
        assert tokens[(("model", "other"), ("provider", "openai"))] > 0
        requests = _samples(g.app, "gateway_requests_total")
        labels = {dict(k)["model"] for k in requests}
        assert labels == {"gpt-4o-mini", "claude-sonnet-4", "other"}
        assert not any("conv" in str(k) or "tenant" in str(k) for k in requests)
        usage = _samples(g.app, "gateway_usage_tokens_total")
        assert usage[(("kind", "input"), ("model", "claude-sonnet-4"), ("provider", "anthropic"))] > 0


async def _turns(g: Gateway) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    await openai_turn(g, g.openai(), "m1", msgs, model="gpt-4o-mini-2024-07-18", stream=True)
    await anthropic_turn(g, g.anthropic(), "m2", msgs, model="claude-sonnet-4-6", stream=True)
    await openai_turn(g, g.openai(), "m3", msgs, model="some-model-of-a-client")
    await drain_background(g.app)


async def test_request_log_line_has_model_decision_and_savings(redis_url: str) -> None:
    """Each request's log line names the model, the context decision (and a reason field), the tokens
    saved, and the real input tokens of a stream whose client did not ask for usage."""
    out = io.BytesIO()
    logs.configure("json", "info", stream=out)
    try:
        async with memory_gateway(redis_url) as g:
            client, msgs = g.openai(), [{"role": "system", "content": "Be brief."}]
            for i in range(8):
                msgs.append({"role": "user", "content": user_text(i)})
                stream = await client.chat.completions.create(
                    model="gpt-4o-mini", messages=msgs, stream=True, extra_headers={"X-Conversation-Id": "logged"})
                text = "".join([c.choices[0].delta.content or "" async for c in stream])
                msgs.append({"role": "assistant", "content": text})
                await g.settle()
    finally:
        logs.flush()
        logs.configure("json", "info")
    lines = [orjson.loads(x) for x in out.getvalue().splitlines() if b'"event":"request"' in x]
    turns = [x for x in lines if x["route"] == "/v1/chat/completions"]
    assert len(turns) == 8
    last = turns[-1]
    assert last["model"] == "gpt-4o-mini" and last["context"] == "rewritten" and last["stream"] is True
    assert "reason" in last  # filled from x-gateway-reason once the memory path gives one
    assert last["tokens_saved"] == last["tokens_original"] - last["tokens_forwarded"] > 0
    assert all(x["input_tokens"] > 0 and x["output_tokens"] > 0 for x in turns)
