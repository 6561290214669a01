"""Server limits (`server.*`): slow-header sockets are closed while normal requests succeed, the
connection cap holds, and a body that stalls is a 408 in the caller's dialect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from structlog.testing import capture_logs

from gateway import listener
from gateway.app import create_app
from gateway.testing import FakeUpstream

KEY = "sk-client-limits-1"


@contextlib.asynccontextmanager
async def limited(**server: Any) -> AsyncIterator[tuple[str, int]]:
    """A plain gateway (memory off) behind `listener.start` with the given server limits."""
    async with FakeUpstream() as fake:
        settings = fake.settings(server=server)
        runner, sock = await listener.start(create_app(settings, memory=False), settings.server, "127.0.0.1", 0)
        try:
            yield "127.0.0.1", listener.bound_port(sock)
        finally:
            sock.close()
            await runner.cleanup()


async def drip(host: str, port: int, stop: asyncio.Event) -> bool:
    """A slowloris socket: a request head a byte at a time; True when the server closed it."""
    reader, writer = await asyncio.open_connection(host, port)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    try:
        for byte in head:
            if stop.is_set():
                return False
            writer.write(bytes([byte]))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    if await reader.read(1) == b"":
                        return True
        return False
    except ConnectionError:
        return True
    finally:
        writer.close()


async def test_slow_header_sockets_are_closed_and_normal_requests_succeed() -> None:
    """200 sockets sending headers a byte at a time: every normal request succeeds, every slow socket is cut."""
    async with limited(header_timeout_seconds=1.0, max_connections=400) as (host, port):
        stop = asyncio.Event()
        slow = [asyncio.create_task(drip(host, port, stop)) for _ in range(200)]
        await asyncio.sleep(0.3)
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            for _ in range(20):
                async with http.post(f"http://{host}:{port}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                    assert r.status == 200
                await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(10):  # a hang guard: the limit is 1 s
                closed = await asyncio.gather(*slow)
        finally:
            stop.set()
        assert all(closed)


async def test_connections_over_the_cap_are_closed_at_once() -> None:
    """With max_connections reached, a new connection is closed; one frees a place when it goes."""
    async with limited(max_connections=3, header_timeout_seconds=30.0) as (host, port):
        held = [await asyncio.open_connection(host, port) for _ in range(3)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection(host, port)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()
        held[0][1].close()
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/healthz") as r:
            assert r.status == 200
        for _, w in held[1:]:
            w.close()


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
async def test_a_stalled_body_is_a_408_in_the_callers_dialect(path: str, anthropic: bool) -> None:
    """A body that stops arriving is answered 408 in the route's dialect once body_timeout passes."""
    async with limited(body_timeout_seconds=0.5) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(65536), timeout=10)
        writer.close()
        top, _, body = data.partition(b"\r\n\r\n")
        assert top.split()[1] == b"408", data
        err = orjson.loads(body)
        assert (err["type"] == "error") if anthropic else ("message" in err["error"])


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
async def test_a_chunked_body_that_breaks_after_its_head_is_a_prompt_400(path: str, anthropic: bool) -> None:
    """A chunk-size line that is not hex, arriving after the head and a good chunk: a 400 in the
    route's dialect at once, not a 408 once body_timeout passes (aiohttp's parser left that body
    waiting), and the connection is closed after it with no second, plain-text answer."""
    async with limited(body_timeout_seconds=30) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                     + b"9\r\n{\"model\":\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)  # the handler is reading the body by now
        writer.write(b"zz-not-a-size\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=10)  # (the hang guard: read() waits for the close)
        writer.close()
        top, _, body = data.partition(b"\r\n\r\n")
        assert top.split()[1] == b"400", data
        err = orjson.loads(body)
        assert (err["type"] == "error") if anthropic else ("message" in err["error"])
        message = err["error"]["message"]
        assert "could not be read" in message and "chunk" in message, message


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
async def test_a_broken_chunked_body_written_at_once_is_a_400_in_the_callers_format(
        path: str, anthropic: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Broken chunked framing in the same write as the head (aiohttp's parser refuses it before any
    route runs), a 150 KB body broken at its end in one write (read in several pieces, the handler
    not started when the break is met), and a header line over aiohttp's limit: a prompt 400 in the
    route's format each time, and neither the answer nor the log quotes the client's bytes. aiohttp's own
    answer was plain text quoting the client's bytes, with a traceback holding them in the log, and
    the large body waited out body_timeout for a 408."""
    secret = "sk-live-secret-in-the-body"
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": secret + " x" * 75_000}]})
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    small = b"%x\r\n%s\r\nzz\r\n" % (len(secret), secret.encode())
    long_header = head.replace(b"\r\n\r\n", f"\r\nX-Long: {secret}{'S' * 9000}\r\n\r\n".encode())
    caplog.set_level("DEBUG")
    with capture_logs() as events:
        async with limited(body_timeout_seconds=30) as (host, port):
            for sent in (head + small, head + b"%x\r\n%s\r\nzz-not-a-size\r\n\r\n" % (len(big), big),
                         long_header + small):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(sent)
                await writer.drain()
                data = await asyncio.wait_for(reader.read(), timeout=10)  # (a hang guard: body_timeout is 30 s)
                writer.close()
                top, _, answer = data.partition(b"\r\n\r\n")
                assert top.split()[1] == b"400", data[:300]
                err = orjson.loads(answer)
                assert (err["type"] == "error") if anthropic else ("message" in err["error"])
                assert "could not be read" in err["error"]["message"] and secret not in err["error"]["message"]
    assert not [r for r in caplog.records if secret in r.getMessage() or (r.exc_info and secret in str(r.exc_info[1]))]
    assert events and not [e for e in events if secret in str(e)]


async def test_a_long_request_line_reaches_the_routes() -> None:
    """A request line past aiohttp's default 8,190 bytes (GET …/search?q= with 1,000 percent-encoded
    non-Latin characters is about 9-12 KB) is routed, not answered with aiohttp's plain-text 400."""
    async with limited() as (host, port), aiohttp.ClientSession() as http:
        query = "東" * 1000  # 9 bytes each once percent-encoded
        async with http.get(f"http://{host}:{port}/healthz", params={"q": query},
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200, await r.text()


async def test_a_chunked_request_does_not_exempt_the_next_head_from_the_deadline() -> None:
    """After a chunked request is answered on a keep-alive connection, a slow next head is still cut."""
    async with limited(header_timeout_seconds=1.0, keepalive_timeout_seconds=60) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        body = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]})
        # Two data chunks (one with an extension, split across writes) and a trailer.
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        half = len(body) // 2
        writer.write(b"%x;ext=1\r\n" % half + body[:half] + b"\r\n%x\r" % (len(body) - half))
        await writer.drain()
        writer.write(b"\n" + body[half:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.split()[1] == b"200", head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        # The next request's head never finishes: the connection must be closed by the head deadline
        # (the keep-alive timeout is a minute, the guard below ten seconds).
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), timeout=10) == b""
        writer.close()
