"""The pooled HTTP/1.1 client the gateway forwards with, against real servers on port 0.

Well-behaved upstreams are aiohttp apps; misbehaving ones (close-delimited bodies, drops, garbage,
silence) are raw asyncio servers that write exactly the bytes a test scripts.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trustme
from aiohttp import web

from gateway.testing import serve_app
from gateway.transport import Endpoint, HTTPClient, Timeouts, UpstreamError, UpstreamTimeout

FAST = Timeouts(connect=2, read=5, total=10)
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[str]:
    """A TCP server on port 0 that runs `script` for each connection; yields its base URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await script(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


@asynccontextmanager
async def app_server(app: web.Application, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    async with serve_app(app, ssl_context=ssl_context) as base:
        yield base


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    c = HTTPClient()
    yield c
    await c.close()


def peer_app(seen: list[object]) -> web.Application:
    """Answers every call with the client's port, so a test can tell connections apart."""

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen.append(peer)
        return web.json_response({"peer": list(peer or ()), "echo": body.decode(),
                                  "host": request.headers.get("Host"), "ua": request.headers.get("User-Agent")})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


async def test_keep_alive_reuses_one_connection(client: HTTPClient) -> None:
    """Sequential calls to one endpoint go over one pooled connection, with Host and the body as given."""
    seen: list[object] = []
    async with app_server(peer_app(seen)) as base:
        ep = Endpoint.of(base, FAST)
        for i in range(3):
            resp = await client.request(ep, "POST", f"/v1/x?i={i}", [("User-Agent", "sdk/1")], b'{"n": 1}')
            assert resp.status == 200
            body = json.loads(await resp.read())
            resp.release()
            assert body["echo"] == '{"n": 1}' and body["ua"] == "sdk/1" and body["host"] == ep.host_header
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]


async def test_unread_body_is_not_reused(client: HTTPClient) -> None:
    """A response released before its body was read closes its connection; the next call opens a new one."""
    seen: list[object] = []
    async with app_server(peer_app(seen)) as base:
        ep = Endpoint.of(base, FAST)
        resp = await client.request(ep, "GET", "/a", [])
        resp.release()
        resp = await client.request(ep, "GET", "/b", [])
        await resp.read()
        resp.release()
    assert seen[0] != seen[1]


async def test_stream_chunks_arrive_before_the_end(client: HTTPClient) -> None:
    """A chunked body is handed over piece by piece as it arrives, not after the upstream finished."""
    go_on = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: one\n\n")
        await go_on.wait()
        await out.write(b"data: two\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_get("/s", handler)
    async with app_server(app) as base:
        resp = await client.request(Endpoint.of(base, FAST), "GET", "/s", [])
        assert resp.content_type == "text/event-stream"
        assert await resp.readany() == b"data: one\n\n"
        go_on.set()
        assert await resp.read() == b"data: two\n\n"
        resp.release()


async def test_close_delimited_body(client: HTTPClient) -> None:
    """A body with neither length nor chunking ends when the upstream closes the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"world")
        await writer.drain()

    async with raw_server(script) as base:
        resp = await client.request(Endpoint.of(base, FAST), "POST", "/v1/x", [], b"{}")
        assert await resp.read() == b"hello, world"
        resp.release()


@pytest.mark.parametrize("answer, error", [
    (b"", "before answering"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "mid-answer"),
    (b"SMTP ready\r\n\r\n", "malformed"),
])
async def test_broken_answers_raise_upstream_error(client: HTTPClient, answer: bytes, error: str) -> None:
    """A connection closed before or during the answer, or an answer that is not HTTP, is an UpstreamError."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_server(script) as base:
        with pytest.raises(UpstreamError, match=error) as info:
            resp = await client.request(Endpoint.of(base, FAST), "POST", "/v1/x", [], b"{}")
            await resp.read()
        assert not isinstance(info.value, UpstreamTimeout)


async def test_refused_connection_is_upstream_error(client: HTTPClient) -> None:
    """Nobody listening is an UpstreamError that names the endpoint, not a timeout."""
    async with raw_server(read_request) as base:
        pass  # closed: the port is free again
    with pytest.raises(UpstreamError, match=r"could not connect to 127\.0\.0\.1") as info:
        await client.request(Endpoint.of(base, FAST), "GET", "/", [])
    assert not isinstance(info.value, UpstreamTimeout)


async def test_read_timeout_on_silence(client: HTTPClient) -> None:
    """An upstream that sends the head and then nothing for longer than the read timeout times out."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async with raw_server(script) as base:
        resp = await client.request(Endpoint.of(base, Timeouts(connect=2, read=0.2, total=10)), "GET", "/", [])
        assert await resp.readany() == b"hello"
        with pytest.raises(UpstreamTimeout, match=r"sent nothing for 0\.2 s"):
            await resp.readany()
        resp.release()


async def test_total_timeout_on_a_trickle(client: HTTPClient) -> None:
    """A body that keeps trickling in still ends at the total timeout."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)

    async with raw_server(script) as base:
        resp = await client.request(Endpoint.of(base, Timeouts(connect=2, read=1, total=0.3)), "GET", "/", [])
        with pytest.raises(UpstreamTimeout, match=r"did not finish within 0\.3 s"):
            await resp.read()
        resp.release()


async def test_pool_limit_bounds_open_connections(client: HTTPClient) -> None:
    """More concurrent calls than `pool_size` all complete, over at most `pool_size` connections."""
    seen: list[object] = []
    async with app_server(peer_app(seen)) as base:
        ep = Endpoint.of(base, FAST, pool_size=2)

        async def call(i: int) -> int:
            resp = await client.request(ep, "POST", "/", [], str(i).encode())
            await resp.read()
            resp.release()
            return resp.status

        assert await asyncio.gather(*(call(i) for i in range(8))) == [200] * 8
    assert len(seen) == 8 and len(set(map(str, seen))) <= 2


async def test_full_pool_wait_times_out(client: HTTPClient) -> None:
    """When every pooled connection stays busy past the connect timeout, the next call times out."""
    hold = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await hold.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/", handler)
    async with app_server(app) as base:
        ep = Endpoint.of(base, Timeouts(connect=0.2, read=5, total=10), pool_size=1)
        first = asyncio.create_task(client.request(ep, "GET", "/", []))
        await asyncio.sleep(0.05)
        with pytest.raises(UpstreamTimeout, match="no free upstream connection"):
            await client.request(ep, "GET", "/", [])
        hold.set()
        resp = await first
        assert await resp.read() == b"late"
        resp.release()


async def test_gzip_body_is_decoded(client: HTTPClient) -> None:
    """A gzip body (sent although identity was asked for) is decoded and its Content-Encoding removed."""
    payload = b'{"id": "x"}' * 100

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(payload), headers={"Content-Encoding": "gzip"},
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/", handler)
    async with app_server(app) as base:
        resp = await client.request(Endpoint.of(base, FAST), "GET", "/", [])
        assert await resp.read() == payload
        assert "Content-Encoding" not in resp.headers
        resp.release()


async def test_interim_answer_is_skipped(client: HTTPClient) -> None:
    """A 100 Continue before the real answer is not mistaken for it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with raw_server(script) as base:
        resp = await client.request(Endpoint.of(base, FAST), "POST", "/", [], b"{}")
        assert resp.status == 201
        assert await resp.read() == b"ok"
        resp.release()


async def test_head_answer_does_not_wait_for_a_body(client: HTTPClient) -> None:
    """A HEAD answer with a Content-Length completes at its headers."""
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="x" * 50)

    app = web.Application()
    app.router.add_get("/", handler)
    async with app_server(app) as base:
        resp = await client.request(Endpoint.of(base, FAST), "HEAD", "/", [])
        assert resp.status == 200 and resp.headers["Content-Length"] == "50"
        assert await asyncio.wait_for(resp.read(), 2) == b""
        resp.release()


async def test_header_with_line_break_is_refused(client: HTTPClient) -> None:
    """A header value that would split the request head is refused before anything is sent."""
    async with app_server(peer_app([])) as base:
        with pytest.raises(ValueError, match="line break"):
            await client.request(Endpoint.of(base, FAST), "GET", "/", [("X-Key", "a\r\nInjected: 1")])


async def test_large_body_both_ways_with_a_slow_reader(client: HTTPClient) -> None:
    """A 6 MB request and a 6 MB streamed answer read slowly (reading pauses upstream) arrive intact."""
    big = bytes(range(256)) * (6 * 4096)

    async def handler(request: web.Request) -> web.StreamResponse:
        got = await request.read()
        out = web.StreamResponse()
        await out.prepare(request)
        for i in range(0, len(got), 1 << 16):
            await out.write(got[i:i + (1 << 16)])
        await out.write_eof()
        return out

    app = web.Application(client_max_size=len(big) + 1)
    app.router.add_post("/", handler)
    async with app_server(app) as base:
        resp = await client.request(Endpoint.of(base, FAST), "POST", "/", [], big)
        parts = []
        while chunk := await resp.readany():
            parts.append(chunk)
            await asyncio.sleep(0.002)
        assert b"".join(parts) == big
        resp.release()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_tls_upstream(ca: trustme.CA) -> None:
    """An https upstream works with a trusted certificate and is refused with an untrusted one."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    async with app_server(peer_app([]), ssl_context=server_ctx) as base:
        url = base.replace("http://", "https://")
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        good = HTTPClient(ssl_context=trusting)
        try:
            resp = await good.request(Endpoint.of(url, FAST), "POST", "/v1/x", [], b"{}")
            assert resp.status == 200 and json.loads(await resp.read())["echo"] == "{}"
            resp.release()
        finally:
            await good.close()
        default = HTTPClient()
        try:
            with pytest.raises(UpstreamError, match="could not connect"):
                await default.request(Endpoint.of(url, FAST), "GET", "/", [])
        finally:
            await default.close()


async def test_cancelled_waiter_passes_its_place_on(client: HTTPClient) -> None:
    """A call that gives up while waiting for a full pool does not swallow the free place meant for it."""
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        if request.path == "/hold":
            await release.wait()
        return web.Response(text=request.path)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    async with app_server(app) as base:
        ep = Endpoint.of(base, Timeouts(connect=5, read=5, total=10), pool_size=1)
        holder = asyncio.create_task(client.request(ep, "GET", "/hold", []))
        await asyncio.sleep(0.05)
        quitter = asyncio.create_task(client.request(ep, "GET", "/quit", []))
        patient = asyncio.create_task(client.request(ep, "GET", "/patient", []))
        await asyncio.sleep(0.05)
        release.set()
        resp = await holder
        await resp.read()
        resp.release()  # wakes the first waiter, the quitter ...
        quitter.cancel()  # ... which gives up in the same tick
        with pytest.raises(asyncio.CancelledError):
            await quitter
        resp = await asyncio.wait_for(patient, 2)
        assert await resp.read() == b"/patient"
        resp.release()
