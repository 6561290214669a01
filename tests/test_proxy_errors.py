"""Errors: the gateway's own, rendered in the caller's dialect, and the upstream's, passed through."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from gateway import proxy
from gateway.app import create_app
from gateway.config import parse_settings
from gateway.testing import FakeUpstream, serve_app


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


@pytest.fixture
async def gateway(fake: FakeUpstream) -> AsyncIterator[str]:
    async with serve_app(create_app(fake.settings(server={"max_body_bytes": 4096}), memory=False)) as url:
        yield url


async def call(url: str, method: str = "POST", data: Any = None, headers: dict[str, str] | None = None,
               ) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def openai_shaped(body: Any) -> bool:
    return set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])


def anthropic_shaped(body: Any) -> bool:
    return body["type"] == "error" and {"type", "message"} <= set(body["error"])


JSON = {"Content-Type": "application/json"}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


async def test_malformed_json_openai(gateway: str, fake: FakeUpstream) -> None:
    """Malformed JSON on an OpenAI route is a 400 in OpenAI's error shape, and nothing goes upstream."""
    status, _, body = await call(gateway + "/v1/chat/completions", data=b'{"model": ', headers=JSON)
    assert status == 400 and openai_shaped(body)
    assert body["error"]["type"] == "invalid_request_error"
    assert fake.requests == []


async def test_malformed_json_anthropic(gateway: str) -> None:
    """Malformed JSON on /v1/messages is a 400 in Anthropic's error shape."""
    status, _, body = await call(gateway + "/v1/messages", data=b"[1, 2", headers=JSON)
    assert status == 400 and anthropic_shaped(body)


async def test_json_that_is_not_an_object(gateway: str) -> None:
    """A JSON body that is not an object is a 400."""
    status, _, body = await call(gateway + "/v1/responses", data=b"[]", headers=JSON)
    assert status == 400 and openai_shaped(body)


async def test_wrong_content_type(gateway: str) -> None:
    """A body that is not declared as JSON is a 415 in the caller's dialect."""
    status, _, body = await call(gateway + "/v1/messages", data=b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415 and anthropic_shaped(body)


async def test_body_too_large(gateway: str, fake: FakeUpstream) -> None:
    """A body over server.max_body_bytes is a 413 in the caller's dialect and is not forwarded."""
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 8000 + b'"}]}'
    status, _, body = await call(gateway + "/v1/chat/completions", data=big, headers=JSON)
    assert status == 413 and openai_shaped(body)
    status, _, body = await call(gateway + "/v1/messages", data=big, headers=JSON)
    assert status == 413 and anthropic_shaped(body)
    assert fake.requests == []


async def test_a_chunked_body_over_the_limit_is_a_413_too(gateway: str, fake: FakeUpstream) -> None:
    """Without a Content-Length the limit holds as the body arrives: a 413, nothing forwarded."""
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    status, _, body = await call(gateway + "/v1/chat/completions", data=chunks(), headers=JSON)
    assert status == 413 and openai_shaped(body)
    assert fake.requests == []


async def test_a_long_body_in_many_pieces_is_forwarded_byte_for_byte(fake: FakeUpstream) -> None:
    """A 6 MB body sent in 64 KB pieces (joined in a thread) reaches the upstream as it was sent."""
    text = "".join(f"line {i}: value_{i} = compute({i})\\n" for i in range(200_000))
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + text.encode() + b'"}]}'
    assert len(big) > 6_000_000

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    async with serve_app(create_app(fake.settings(), memory=False)) as url:
        status, _, body = await call(url + "/v1/chat/completions", data=chunks(), headers=JSON)
    assert status == 200, body
    assert fake.requests[0].raw == big


async def test_a_body_of_too_many_json_values_is_a_400_in_the_callers_dialect(fake: FakeUpstream) -> None:
    """A long body of more JSON values than 100 x memory.max_parts (an attack's millions of tiny
    values took 20 s of CPU to read) is refused, in the caller's dialect, and not forwarded."""
    big = b'{"model": "m", "max_tokens": 5, "messages": [' + b"[]," * 400_000 + b"[]]}"
    async with serve_app(create_app(fake.settings(memory={"max_parts": 100}), memory=False)) as url:
        status, _, body = await call(url + "/v1/chat/completions", data=big, headers=JSON)
        assert status == 400 and openai_shaped(body) and "more than 10,000 JSON values" in body["error"]["message"]
        status, _, body = await call(url + "/v1/messages", data=big, headers=JSON)
        assert status == 400 and anthropic_shaped(body)
    assert fake.requests == []


async def test_unknown_route_in_callers_dialect(gateway: str) -> None:
    """A path outside /v1 is a 404, shaped by anthropic-version when present."""
    status, _, body = await call(gateway + "/v2/whatever", "GET")
    assert status == 404 and openai_shaped(body)
    status, _, body = await call(gateway + "/nope", "GET", headers=ANTHROPIC)
    assert status == 404 and anthropic_shaped(body)


async def test_wrong_method(gateway: str) -> None:
    """A wrong method on a known route is a 405 with Allow, in that route's dialect."""
    status, headers, body = await call(gateway + "/v1/messages", "GET")
    assert status == 405 and anthropic_shaped(body) and headers["Allow"] == "POST"
    status, headers, body = await call(gateway + "/v1/chat/completions", "DELETE")
    assert status == 405 and openai_shaped(body)


async def test_429_passes_through_with_retry_headers(gateway: str, fake: FakeUpstream) -> None:
    """An upstream 429 reaches the client with its status, body and retry / rate-limit / request-id headers."""
    fake.error_status = 429
    fake.error_headers = {"retry-after": "1", "retry-after-ms": "1000", "x-should-retry": "true"}
    c = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    resp = info.value.response
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "1" and resp.headers["retry-after-ms"] == "1000"
    assert resp.headers["x-should-retry"] == "true"
    assert resp.headers["x-request-id"].startswith("req_fake")
    assert resp.headers["x-ratelimit-limit-requests"] == "1000"
    assert info.value.body["code"] == "rate_limit_error"


async def test_sdk_retries_honour_passed_through_headers(gateway: str, fake: FakeUpstream) -> None:
    """With its default retries the SDK retries a relayed 429 (after retry-after-ms) and then succeeds."""
    fake.error_status, fake.error_count = 429, 2
    fake.error_headers = {"retry-after-ms": "10"}
    c = anthropic.AsyncAnthropic(base_url=gateway, api_key="k")
    m = await c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert m.content[0].text == fake.reply
    assert len(fake.requests) == 3


async def test_500_passes_through_in_anthropic_shape(gateway: str, fake: FakeUpstream) -> None:
    """An upstream 500 reaches the Anthropic SDK unchanged, request-id included."""
    fake.error_status = 500
    fake.error_headers = {"x-should-retry": "false"}
    c = anthropic.AsyncAnthropic(base_url=gateway, api_key="k")
    with pytest.raises(anthropic.InternalServerError) as info:
        await c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 500
    assert info.value.body["error"]["message"] == "fake upstream error 500"
    assert info.value.response.headers["request-id"].startswith("req_fake")
    assert len(fake.requests) == 1  # x-should-retry: false reached the SDK


async def test_hop_by_hop_headers_dropped_both_ways(gateway: str, fake: FakeUpstream) -> None:
    """Hop-by-hop headers (and those named in Connection) are not forwarded in either direction."""
    fake.extra_headers = {"Proxy-Authenticate": "Basic", "Keep-Alive": "timeout=5", "X-Upstream-Kept": "yes"}
    headers = {**JSON, "Connection": "keep-alive, X-Private-Hop", "X-Private-Hop": "1", "TE": "trailers",
               "Proxy-Authorization": "Basic abc", "Accept-Encoding": "gzip, br", "X-Client-Kept": "yes"}
    status, resp_headers, _ = await call(gateway + "/v1/chat/completions", data=b'{"messages": []}',
                                         headers=headers)
    assert status == 200
    got = fake.requests[-1].headers
    assert "X-Private-Hop" not in got and "TE" not in got and "Proxy-Authorization" not in got
    assert got["Accept-Encoding"] == "identity"
    assert got["X-Client-Kept"] == "yes"
    assert "Proxy-Authenticate" not in resp_headers and "Keep-Alive" not in resp_headers
    assert resp_headers["X-Upstream-Kept"] == "yes"


async def test_upstream_unreachable_is_502(fake: FakeUpstream) -> None:
    """An upstream nobody listens on is a 502 in the caller's dialect."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = fake.settings(upstreams={"anthropic": {"base_url": f"http://127.0.0.1:{port}"}})
    async with serve_app(create_app(settings, memory=False)) as url:
        status, _, body = await call(url + "/v1/messages", data=b"{}", headers=JSON)
    assert status == 502 and anthropic_shaped(body)


async def test_upstream_timeout_is_504(fake: FakeUpstream) -> None:
    """An upstream silent for longer than read_timeout is a 504 in the caller's dialect."""
    fake.latency = 2.0
    settings = fake.settings(upstreams={"openai": {"read_timeout": 0.2}})
    async with serve_app(create_app(settings, memory=False)) as url:
        status, _, body = await call(url + "/v1/chat/completions", data=b"{}", headers=JSON)
    assert status == 504 and openai_shaped(body)
    assert body["error"]["type"] == "timeout_error"


async def test_client_disconnect_cancels_upstream(gateway: str, fake: FakeUpstream) -> None:
    """A client that hangs up mid-stream makes the gateway close its upstream stream too."""
    fake.reply = " ".join(["word"] * 400)
    fake.chunk_delay = 0.02
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gateway + "/v1/chat/completions", json={"messages": [], "stream": True})
        assert (await resp.content.readany()).startswith(b"data: ")
        resp.close()
    await asyncio.wait_for(fake.disconnected.wait(), timeout=5)
    assert fake.disconnects == 1


async def test_mid_stream_drop_ends_with_error_frame(gateway: str, fake: FakeUpstream) -> None:
    """An upstream cut mid-stream ends the relayed stream with an OpenAI error frame, then closes."""
    fake.reply = "a b c d e"
    fake.drop_after = 2
    async with aiohttp.ClientSession() as s, s.post(gateway + "/v1/chat/completions",
                                                    json={"messages": [], "stream": True}) as resp:
        raw = await asyncio.wait_for(resp.read(), timeout=10)
    frames = [f for f in raw.split(b"\n\n") if f]
    assert len(frames) == 3
    assert frames[-1].startswith(b'data: {"error":')


async def test_stream_that_arrived_undecodable_is_502() -> None:
    """A whole SSE answer whose gzip body does not decode is a 502 in the caller's dialect, not a 500."""

    async def broken(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"not gzip at all", headers={"Content-Type": "text/event-stream",
                                                             "Content-Encoding": "gzip"})

    upstream = web.Application()
    upstream.router.add_post("/v1/messages", broken)
    async with serve_app(upstream) as up:
        settings = parse_settings({"upstreams": {"anthropic": {"base_url": up}}})
        async with serve_app(create_app(settings, memory=False)) as url:
            status, _, body = await call(url + "/v1/messages", data=b'{"stream": true}', headers=JSON)
    assert status == 502 and anthropic_shaped(body)
    assert "does not decode" in body["error"]["message"]


async def test_upstream_unreachable_still_says_what_memory_would_have_forwarded(fake: FakeUpstream) -> None:
    """A request naming a conversation gets the memory headers on the gateway's own 502 too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = fake.settings(upstreams={"openai": {"base_url": f"http://127.0.0.1:{port}/v1"}})
    body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}'
    async with serve_app(create_app(settings)) as url:
        status, headers, err = await call(url + "/v1/chat/completions", data=body,
                                          headers={**JSON, "Authorization": "Bearer sk-test", "X-Conversation-Id": "c"})
    assert status == 502 and openai_shaped(err)
    assert headers["x-gateway-context"] == "full" and headers["x-gateway-reason"] == "under-threshold"
    assert int(headers["x-gateway-tokens-original"]) > 0


@pytest.mark.parametrize(("path", "headers", "shaped"), [
    ("/v1/chat/completions", {}, openai_shaped), ("/v1/messages", ANTHROPIC, anthropic_shaped)])
async def test_a_corrupt_compressed_body_is_a_400(gateway: str, fake: FakeUpstream, path: str,
                                                 headers: dict[str, str], shaped: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A body whose gzip cannot be decoded is the client's mistake: a 400 in its dialect, not a 500, and
    no traceback in the log (aiohttp's own, as it drains the body after the answer)."""
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        status, _, body = await call(gateway + path, data=b"\x1f\x8b\x08\x00" + b"garbage-not-deflate" * 10,
                                     headers={**JSON, **headers, "Content-Encoding": "gzip", "X-Conversation-Id": "gz"})
        await asyncio.sleep(0.1)
    assert status == 400 and shaped(body), body
    assert body["error"]["message"] == "the request body could not be read: Can not decode content-encoding: gzip"
    assert fake.requests == []
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_a_reset_that_is_not_the_client_leaving_is_a_logged_500(fake: FakeUpstream,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ConnectionResetError while the client is still connected (a backend's, unwrapped) is the
    gateway's error: a 500 in the caller's format, not the silent answer kept for a client that left."""
    async def reset(*_: Any, **__: Any) -> bytes:
        raise ConnectionResetError("a backend reset")

    monkeypatch.setattr(proxy, "read_body", reset)
    async with serve_app(create_app(fake.settings(), memory=False)) as url:
        status, _, body = await call(url + "/v1/chat/completions", data=b"{}", headers=JSON)
    assert status == 500 and openai_shaped(body)
