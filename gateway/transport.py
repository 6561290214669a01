"""The HTTP/1.1 client the gateway forwards with: pooled, streaming, and lean, because every request uses it.

aiohttp's client spent about 165 µs of CPU per call on the 2-core machine this was built on; this
one, an asyncio protocol over llhttp (httptools), about 40 µs. It does what a reverse proxy needs
and no more: keep-alive pools per endpoint with a size limit, TCP or TLS, bodies framed by
Content-Length, chunked or connection close, read as they arrive with backpressure, gzip/deflate
decoded (the gateway asks for identity, but a server may not listen), and three timeouts. No
redirects, cookies or proxies; a call that failed is never sent again here (the caller's SDK
retries on the gateway's 502/504).

    client = HTTPClient()
    endpoint = Endpoint.of("https://api.openai.com/v1", Timeouts(10, 600, 900))
    resp = await client.request(endpoint, "POST", "/v1/chat/completions", headers, body)
    try:
        while chunk := await resp.readany(): ...
    finally:
        resp.release()          # back to the pool if the body was read to its end, else closed

Errors (the proxy answers 502 for the first, 504 for the second):

    UpstreamError           could not connect, the connection broke, or the answer was not HTTP
     └── UpstreamTimeout    (also a TimeoutError) no connection, no byte, or no end in time
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import httptools
from multidict import CIMultiDict
from yarl import URL

# An idle pooled connection older than this is closed rather than reused: servers drop idle
# keep-alive connections (uvicorn after 5 s, nginx after 75 s) and a reuse racing their close fails.
KEEPALIVE_SECONDS = 15.0
# Unread body bytes at which the upstream socket stops being read (the client downstream is slow).
_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 18
# Small bodies go out in one write with the head: one syscall, one TCP segment.
_COALESCE_BYTES = 1 << 16
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_NO_BODY_STATUS = frozenset({204, 304})
_DECODED = frozenset({"gzip", "x-gzip", "deflate"})


class UpstreamError(Exception):
    """The upstream could not be reached, broke the connection, or did not answer in HTTP."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """No connection, no byte, or no end of the answer within the configured time."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float  # TCP and TLS set-up, and waiting for a free connection of a full pool
    read: float  # longest silence while an answer is awaited or streamed
    total: float  # the whole call, from sending to the last byte of the body


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where calls go and how: one pool per distinct endpoint."""

    host: str
    port: int
    tls: bool
    host_header: str
    timeouts: Timeouts
    pool_size: int = 100

    @classmethod
    def of(cls, url: str, timeouts: Timeouts, pool_size: int = 100) -> Endpoint:
        u = URL(url)
        if u.scheme not in ("http", "https") or not u.raw_host:
            raise ValueError(f"not an http(s) URL: {url!r}")
        host = u.raw_host
        authority = f"[{host}]" if ":" in host else host
        if not u.is_default_port():
            authority += f":{u.port}"
        return cls(host, u.port or (443 if u.scheme == "https" else 80), u.scheme == "https", authority,
                   timeouts, pool_size)


class Response:
    """Status and headers of an answer; its body is read with `readany` / `read`, then `release`."""

    __slots__ = ("_conn", "_decoder", "_done", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDict[str]) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self._done = False
        self._decoder: zlib._Decompress | None = None
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding in _DECODED:
            # MAX_WBITS | 32: zlib or gzip framing, detected from the first bytes.
            self._decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)
            del headers["Content-Encoding"]
            headers.popall("Content-Length", None)

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (`text/event-stream`)."""
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response was released")
        while True:
            chunk = await conn.next_chunk()
            if self._decoder is None:
                if not chunk:
                    self._done = True
                return chunk
            try:
                if not chunk:
                    tail = self._decoder.flush()
                    self._decoder = None
                    if not tail:
                        self._done = True
                    return tail
                chunk = self._decoder.decompress(chunk)
            except zlib.error as exc:
                conn.abort()
                raise UpstreamError(f"upstream sent a body that does not decode ({exc})") from None
            if chunk:
                return chunk

    @property
    def arrived(self) -> bool:
        """The whole answer has arrived: reading the rest of it will not wait."""
        conn = self._conn
        return conn is not None and conn.complete and conn.error is None

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back: to the pool when the body was read to its end, else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reuse=self._done)

    def close(self) -> None:
        """Close the connection now (the upstream stops sending: the client went away)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
            conn.finish(reuse=False)


class _Connection(asyncio.Protocol):
    """One upstream connection: the protocol, the llhttp callbacks and the state of the call on it."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False
        self.expires = 0.0
        self._begin(head_only=False)
        self.busy = False

    def _begin(self, *, head_only: bool) -> None:
        self.busy = True
        self.head_only = head_only
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.interim = False
        self.head_done = False
        self.until_close = False
        self.complete = False
        self.keep_alive = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last = 0.0
        self.deadline = 0.0

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its interface.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            # Bytes nobody asked for: the next answer on this connection could not be trusted.
            self.abort()
            return
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"upstream sent a malformed HTTP answer ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.lost(self)
        if self.busy and not self.complete and self.error is None:
            if self.head_done and self.until_close:
                self.complete = True  # a body delimited by the close of the connection
            else:
                where = "mid-answer" if self.head_done else "before answering"
                self.error = UpstreamError(f"upstream closed the connection {where}")
        self._stop_timer()
        self._wake()

    def pause_writing(self) -> None:  # the request body is written whole; the kernel buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- llhttp callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            # 100 Continue, 103 Early Hints: the real answer follows on the same connection.
            self.interim = True
            self.raw_headers = []
            return
        self.status = status
        self.head_done = True
        if self.head_only:
            # llhttp would wait for the body a HEAD answer never has: end here, and do not reuse.
            self.complete = True
            self._stop_timer()
        elif status not in _NO_BODY_STATUS:
            self.until_close = not any(n.lower() in (b"content-length", b"transfer-encoding")
                                       for n, _ in self.raw_headers)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.head_only:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._stop_timer()
        self._wake()

    # -- the call ---------------------------------------------------------------------------

    def send(self, method: str, target: str, host: str, headers: Iterable[tuple[str, str]], body: bytes,
             timeouts: Timeouts) -> None:
        parts = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
        for name, value in headers:
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError(f"header {name!r} contains a line break")
            parts.append(f"{name}: {value}\r\n")
        if body or method in _BODY_METHODS:
            parts.append(f"Content-Length: {len(body)}\r\n")
        parts.append("\r\n")
        # Header values came from aiohttp's parser as UTF-8 with surrogateescape: the same bytes go out.
        head = "".join(parts).encode("utf-8", "surrogateescape")
        self._begin(head_only=method == "HEAD")
        now = self.loop.time()
        self.last = now
        self.deadline = now + timeouts.total
        self.read_timeout = timeouts.read
        self.total_timeout = timeouts.total
        self.timer = self.loop.call_at(min(self.deadline, now + timeouts.read), self._on_timer)
        assert self.transport is not None
        if not body:
            self.transport.write(head)
        elif len(body) <= _COALESCE_BYTES:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def head(self) -> tuple[int, CIMultiDict[str]]:
        """Wait for the status line and headers of the final answer."""
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()
        headers: CIMultiDict[str] = CIMultiDict(
            (n.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for n, v in self.raw_headers)
        return self.status, headers

    async def next_chunk(self) -> bytes:
        while True:
            if self.chunks:
                if len(self.chunks) == 1:
                    chunk = self.chunks.popleft()
                else:  # several arrived since the last read: one write downstream, not several
                    chunk = b"".join(self.chunks)
                    self.chunks.clear()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self._wait()

    def finish(self, *, reuse: bool) -> None:
        """The caller is done with this call: pool the connection, or close it."""
        self._stop_timer()
        self.busy = False
        if reuse and self.complete and self.keep_alive and self.error is None and not self.closed:
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    # -- internals --------------------------------------------------------------------------

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()
        self.abort()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        # One timer per call, re-armed from the last byte seen: cheaper than one per chunk.
        self.timer = None
        if not self.busy or self.complete or self.error is not None:
            return
        now = self.loop.time()
        if now >= self.deadline:
            self._fail(UpstreamTimeout(f"upstream did not finish within {self.total_timeout:g} s"))
            return
        if self.paused:
            self.last = now  # the silence is the downstream client's, not the upstream's
        elif now - self.last >= self.read_timeout:
            self._fail(UpstreamTimeout(f"upstream sent nothing for {self.read_timeout:g} s"))
            return
        self.timer = self.loop.call_at(min(self.deadline, self.last + self.read_timeout), self._on_timer)


class _Pool:
    """Connections to one endpoint: idle ones to reuse (newest first), at most `pool_size` open."""

    def __init__(self, endpoint: Endpoint, ssl_context: ssl.SSLContext | None) -> None:
        self.endpoint = endpoint
        self.ssl = ssl_context
        self.loop = asyncio.get_running_loop()
        self.idle: deque[_Connection] = deque()
        self.open: set[_Connection] = set()
        self.connecting = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> _Connection:
        conn = self._idle()
        if conn is not None:
            return conn
        timeout = self.endpoint.timeouts.connect
        deadline = self.loop.time() + timeout
        while len(self.open) + self.connecting >= self.endpoint.pool_size:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken as it gave up: pass the free place on, or it is lost
                if isinstance(exc, TimeoutError):
                    raise UpstreamTimeout(f"no free upstream connection within {timeout:g} s "
                                          f"(pool_size {self.endpoint.pool_size})") from None
                raise
            conn = self._idle()
            if conn is not None:
                return conn
        return await self._connect(max(deadline - self.loop.time(), 0.001))

    def _idle(self) -> _Connection | None:
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now < conn.expires:
                return conn
            conn.abort()
        return None

    async def _connect(self, within: float) -> _Connection:
        ep = self.endpoint
        self.connecting += 1
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), ep.host, ep.port,
                                            ssl=self.ssl if ep.tls else None,
                                            server_hostname=ep.host if ep.tls else None),
                within)
        except TimeoutError:
            raise UpstreamTimeout(f"could not connect to {ep.host_header} within {within:g} s") from None
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            raise UpstreamError(f"could not connect to {ep.host_header} ({exc.strerror or exc})") from None
        finally:
            self.connecting -= 1
            self._wake_one()
        self.open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        conn.expires = self.loop.time() + KEEPALIVE_SECONDS
        self.idle.append(conn)
        self._wake_one()

    def lost(self, conn: _Connection) -> None:
        self.open.discard(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self.open):
            conn.abort()
        self.idle.clear()


class HTTPClient:
    """Pools by endpoint. Create and use it inside the running event loop; `close` at shutdown."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._pools: dict[Endpoint, _Pool] = {}

    def _pool(self, endpoint: Endpoint) -> _Pool:
        pool = self._pools.get(endpoint)
        if pool is None:
            if endpoint.tls and self._ssl is None:
                # The system's CA store (SSL_CERT_FILE / SSL_CERT_DIR are honoured), as aiohttp did.
                self._ssl = ssl.create_default_context()
            pool = self._pools[endpoint] = _Pool(endpoint, self._ssl)
        return pool

    async def request(self, endpoint: Endpoint, method: str, target: str,
                      headers: Iterable[tuple[str, str]], body: bytes = b"") -> Response:
        """Send one call and wait for its status and headers; the body is read from the `Response`.

        `target` is the path and query as they go on the request line; `headers` must not hold
        Host or Content-Length (both are set here).
        """
        pool = self._pool(endpoint)
        conn = await pool.acquire()
        try:
            conn.send(method, target, endpoint.host_header, headers, body, endpoint.timeouts)
            status, response_headers = await conn.head()
        except BaseException:
            conn.finish(reuse=False)
            raise
        return Response(conn, status, response_headers)

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost
