"""The HTTP/1.1 client the gateway forwards with: pooled, streaming, and lean, because every request uses it.

An asyncio protocol over llhttp (httptools): a fraction of a general-purpose client's CPU per call
(measured in docs/architecture.md). It does what a reverse proxy needs and no more: keep-alive
pools per endpoint with a size limit, TCP or TLS, bodies framed by Content-Length, chunked or
connection close, read as they arrive with backpressure, gzip/deflate decoded (the gateway asks
for identity, but a server may not listen), and three timeouts. No redirects or cookies; a call
that failed is never sent again here (the caller's SDK retries on the gateway's 502/504).

Egress proxies are honoured as the SDKs and HTTP tools do: `HTTPS_PROXY` for https upstreams (a
CONNECT tunnel through the proxy, TLS to the upstream inside it), `HTTP_PROXY` for http ones
(requests in absolute form), `ALL_PROXY` for either when that one is unset, and `NO_PROXY` for
the hosts that bypass them (upper or lower case, read by the standard library; entries are
hosts, domain suffixes, `*`, IP addresses or CIDR networks, each with an optional port). An
`http://user:password@` proxy gets Basic credentials. The environment is read once per upstream
endpoint, when its pool is created.

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
import base64
import ipaddress
import socket
import ssl
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote
from urllib.request import getproxies

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


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP proxy the calls to one endpoint go through."""

    host: str
    port: int
    authorization: str | None = None  # Proxy-Authorization value

    @classmethod
    def of(cls, url: str) -> Proxy:
        u = URL(url if "://" in url else "http://" + url)
        if u.scheme != "http" or not u.raw_host:
            # Named without its credentials: this message reaches logs and `check-config`'s output.
            shown = str(u.with_user("***").with_password(None)) if u.raw_user is not None else str(u)
            raise ValueError(f"unsupported proxy URL {shown!r}: an http:// proxy is needed")
        auth = None
        if u.raw_user is not None:
            pair = f"{unquote(u.raw_user)}:{unquote(u.raw_password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(u.raw_host, u.port or 80, auth)


def bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether NO_PROXY (`no_proxy`: comma-separated entries) exempts `host`:`port` from the proxy."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if entry == "*":
            return True
        if not entry:
            continue
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 or "]:" in entry else ("", "", "")
        if name and entry_port.isdigit():
            if int(entry_port) != port:
                continue
            entry = name
        entry = entry.strip("[]").lstrip("*").lstrip(".")
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if host == entry or host.endswith("." + entry):
            return True
    return False


def proxy_for(endpoint: Endpoint) -> Proxy | None:
    """The proxy the environment names for `endpoint` (HTTPS_PROXY / HTTP_PROXY, minus NO_PROXY)."""
    proxies = getproxies()
    url = proxies.get("https" if endpoint.tls else "http") or proxies.get("all")
    if not url or bypassed(endpoint.host, endpoint.port, proxies.get("no", "")):
        return None
    return Proxy.of(url)


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

    def __init__(self, endpoint: Endpoint, ssl_context: ssl.SSLContext | None, proxy: Proxy | None = None) -> None:
        self.endpoint = endpoint
        self.ssl = ssl_context
        self.proxy = proxy
        # Through an HTTP proxy, a plain-HTTP call names its whole URL and carries the proxy's credentials.
        plain = proxy is not None and not endpoint.tls
        self.target_prefix = f"http://{endpoint.host_header}" if plain else ""
        self.proxy_headers: tuple[tuple[str, str], ...] = (
            (("Proxy-Authorization", proxy.authorization),) if plain and proxy and proxy.authorization else ())
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
            _, conn = await asyncio.wait_for(self._open(), within)
        except TimeoutError:
            raise UpstreamTimeout(f"could not connect to {ep.host_header} within {within:g} s") from None
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            raise UpstreamError(f"could not connect to {ep.host_header} ({exc.strerror or exc})") from None
        finally:
            self.connecting -= 1
            self._wake_one()
        self.open.add(conn)
        return conn

    async def _open(self) -> tuple[asyncio.BaseTransport, _Connection]:
        ep, proxy = self.endpoint, self.proxy
        tls = self.ssl if ep.tls else None
        server_hostname = ep.host if ep.tls else None
        if proxy is None:
            return await self.loop.create_connection(lambda: _Connection(self), ep.host, ep.port, ssl=tls,
                                                     server_hostname=server_hostname)
        if not ep.tls:  # requests in absolute form to the proxy itself
            return await self.loop.create_connection(lambda: _Connection(self), proxy.host, proxy.port)
        sock = await self._tunnel(proxy)
        try:
            return await self.loop.create_connection(lambda: _Connection(self), sock=sock, ssl=tls,
                                                     server_hostname=server_hostname)
        except BaseException:
            sock.close()
            raise

    async def _tunnel(self, proxy: Proxy) -> socket.socket:
        """A socket to the proxy, through which the proxy relays bytes to the endpoint (CONNECT)."""
        ep, loop = self.endpoint, self.loop
        error: OSError = OSError(f"no address for proxy {proxy.host}")
        for family, kind, proto, _, address in await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
                break
            except OSError as exc:
                sock.close()
                error = exc
        else:
            raise error
        try:
            authority = f"[{ep.host}]:{ep.port}" if ":" in ep.host else f"{ep.host}:{ep.port}"
            head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
            if proxy.authorization:
                head += f"Proxy-Authorization: {proxy.authorization}\r\n"
            await loop.sock_sendall(sock, (head + "\r\n").encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = await loop.sock_recv(sock, 4096)
                if not chunk or len(answer) > 65536:
                    raise OSError(f"proxy {proxy.host}:{proxy.port} did not answer CONNECT")
                answer += chunk
            status = answer.split(b"\r\n", 1)[0].split(b" ", 2)
            if len(status) < 2 or status[1] != b"200" or not answer.endswith(b"\r\n\r\n"):
                # (Bytes after the answer would be the upstream speaking before TLS began: not HTTPS.)
                line = answer.split(b"\r\n", 1)[0].decode("latin-1")
                raise OSError(f"proxy {proxy.host}:{proxy.port} refused the tunnel to {authority}: {line}")
        except BaseException:
            sock.close()
            raise
        return sock

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
            pool = self._pools[endpoint] = _Pool(endpoint, self._ssl, proxy_for(endpoint))
        return pool

    async def request(self, endpoint: Endpoint, method: str, target: str,
                      headers: Iterable[tuple[str, str]], body: bytes = b"") -> Response:
        """Send one call and wait for its status and headers; the body is read from the `Response`.

        `target` is the path and query as they go on the request line; `headers` must not hold
        Host or Content-Length (both are set here).
        """
        pool = self._pool(endpoint)
        if pool.proxy_headers:
            headers = [*headers, *pool.proxy_headers]
        conn = await pool.acquire()
        try:
            conn.send(method, pool.target_prefix + target, endpoint.host_header, headers, body, endpoint.timeouts)
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
