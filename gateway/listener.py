"""The listening socket's limits: header read timeout, connection cap, keep-alive (`server.*`).

aiohttp waits for a request head as long as its sender takes: a thousand sockets sending their
headers a byte at a time hold a thousand file descriptors for ever, and normal requests then fail
to connect. `Guarded` wraps aiohttp's protocol for each connection: the head of every request must
arrive within `header_timeout_seconds` of its first byte (or of the connection's opening), and past
`max_connections` a new connection is closed at once. The body read timeout is the request path's
(`proxy.py`, `api.py`): a body is read there.

Request boundaries are followed on the raw bytes: a head ends at a blank line, a body of known
`Content-Length` is skipped, and a chunked body is followed chunk by chunk (size line, data,
trailers) so the next request's head on the same connection is timed too. Framing this follower
cannot read (an over-long or malformed size line) ends the head timing for that connection;
aiohttp's own parser refuses such a request anyway.
"""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from gateway.config import ServerSettings
from gateway.dialects import dialect_for_path
from gateway.logs import get_logger

_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,18})", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r\n]*chunked", re.IGNORECASE)
_MAX_HEAD = 64 * 1024  # aiohttp refuses longer heads itself; past this the head is not followed
_MAX_LINE = 8 * 1024  # a chunk-size line (with extensions) or a trailer line
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")
_ANTHROPIC = re.compile(rb"\r\nanthropic-version:", re.IGNORECASE)

log = get_logger("gateway.listener")


class Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the head deadline and the connection count."""

    def __init__(self, inner: Any, limits: ServerSettings, open_count: list[int]) -> None:
        self.inner = inner
        self.limits = limits
        self.open = open_count
        self.transport: Any = None
        self.counted = False
        self.head = bytearray()  # the current request's head so far
        self.body_left = 0  # body bytes of the current request still to come
        self.untracked = False  # framing not followed: heads are no longer timed on this connection
        self.chunked: bytes | None = None  # in a chunked body: b"size" or b"trailer" lines are read
        self.line = bytearray()  # the chunk-size or trailer line so far
        self.deadline: asyncio.TimerHandle | None = None
        # The newest request's path and dialect hint, for a 400 aiohttp answers before any route runs.
        self.path = "/"
        self.anthropic = False
        # The body aiohttp's parser is filling: it hands the request to a task that may not have
        # started yet when the body's framing breaks (Python 3.11 starts tasks on the next turn).
        self.filling: Any = None

    # -- connection -------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses
        if self.open[0] >= self.limits.max_connections:
            transport.abort()  # over the cap: refused before aiohttp spends anything on it
            return
        self.open[0] += 1
        self.counted = True
        self._arm()
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.filling = None
        if isinstance(self.inner, _Handler):
            self.inner.conn = None  # (the two refer to each other: freed now, not by the cyclic GC)
        if self.counted:
            self.open[0] -= 1
            self.counted = False
            self.inner.connection_lost(exc)

    def _arm(self) -> None:
        if self.deadline is None:
            loop = asyncio.get_running_loop()
            self.deadline = loop.call_later(self.limits.header_timeout_seconds, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport is not None:
            self.transport.abort()  # a head this slow is not a client waiting for an answer

    # -- bytes ------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not self.untracked:
            self._follow(data)
        # (aiohttp's private queue of parsed requests: a version without it keeps the old 408.)
        queue = getattr(self.inner, "_messages", None)
        queued = len(queue) if queue is not None else 0
        self.inner.data_received(data)
        if queue is not None and len(queue) > queued:
            for message, payload in list(queue)[queued:]:
                if not isinstance(message, _ErrInfo):
                    # (Kept until the next request or the connection's end; checked for eof before use.)
                    self.filling = payload
            _report_broken_framing(self, queue)

    def _follow(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            if self.body_left:
                n = min(self.body_left, len(view))
                self.body_left -= n
                view = view[n:]
                continue
            if self.chunked is not None:
                view = self._chunk_line(view)
                continue
            if not self.head:
                self._arm()
            before = len(self.head)
            self.head += view[:_MAX_HEAD]
            end = self.head.find(b"\r\n\r\n", max(before - 3, 0))
            if end < 0:
                if len(self.head) >= _MAX_HEAD:
                    self._stop_following()
                return
            consumed = end + 4 - before  # bytes of `view` that belong to this head
            head = bytes(self.head[:end + 4])
            self.head.clear()
            target = head.split(b" ", 2)[1:2]
            self.path = target[0].split(b"?", 1)[0].decode("latin-1") if target else "/"
            self.anthropic = _ANTHROPIC.search(head) is not None
            self._disarm()
            view = view[consumed:]
            if _CHUNKED.search(head):
                self.chunked = b"size"
                continue
            length = _LENGTH.search(head)
            self.body_left = int(length.group(1)) if length else 0

    def _chunk_line(self, view: memoryview) -> memoryview:
        """Read up to one line of a chunked body's framing from `view`; what is left of it."""
        before = len(self.line)
        self.line += view[:_MAX_LINE]
        end = self.line.find(b"\r\n", max(before - 1, 0))
        if end < 0:
            if len(self.line) >= _MAX_LINE:
                self._stop_following()
                return view[:0]
            return view[len(view):]
        rest = view[end + 2 - before:]
        line = bytes(self.line[:end])
        self.line.clear()
        if self.chunked == b"trailer":
            if not line:  # the blank line after the trailers: the request is over
                self.chunked = None
            return rest
        size = _HEX.match(line)
        if size is None:
            self._stop_following()
            return view[:0]
        n = int(size.group(), 16)
        if n:
            self.body_left = n + 2  # the data and its CRLF
        else:
            self.chunked = b"trailer"
        return rest

    def _stop_following(self) -> None:
        self.untracked = True
        self.chunked = None
        self.head.clear()
        self.line.clear()
        self._disarm()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _report_broken_framing(conn: Guarded, queue: Any) -> None:
    """Tell the body being read that its framing broke (a bad chunk-size line after the head).

    aiohttp's parser then queues a 400 for a next request and leaves the body it was filling
    waiting: the handler reading it sat out `body_timeout_seconds` for a 408. Its reader now fails
    as a corrupt Content-Encoding's does (a 400 in the caller's format), and aiohttp closes the
    connection after that answer, the queued 400 unsent."""
    error = queue[-1][0]
    if not isinstance(error, _ErrInfo):
        return
    request = getattr(conn.inner, "_current_request", None)
    waiting = [conn.filling] + ([request.content] if request is not None else [])
    waiting += [payload for _, payload in list(queue)[:-1]]
    conn.filling = None
    # (The reason only: aiohttp's message goes on to quote the bytes it choked on.)
    broken = f"broken chunked encoding: {_reason(str(error.message))}"
    for payload in waiting:
        if isinstance(payload, StreamReader) and not payload.is_eof() and payload.exception() is None:
            payload.set_exception(RequestPayloadError(broken))


class _Handler(RequestHandler):
    """aiohttp's protocol, answering a request its parser refused (a head or chunked framing it cannot
    read, met before any route runs) in the caller's format. aiohttp's own answer is plain text that
    quotes the bytes it choked on, and it logs a traceback holding them: a body's worth, tens of KB of
    a client's message in the log. Other errors are aiohttp's to answer."""

    conn: Guarded | None = None

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        conn = self.conn
        if (conn is None or not isinstance(exc, HttpProcessingError) or not 400 <= status < 500
                or request.writer.output_size > 0):
            return super().handle_error(request, status, exc, message)
        reason = _reason(str(message or exc.message))
        # (At info, as any 4xx: scanners sending TLS to a plain port make these all day.)
        log.info("http.unreadable_request", status=status, reason=reason, path=conn.path[:200])
        dialect = dialect_for_path(conn.path, {"anthropic-version": ""} if conn.anthropic else {})
        body = dialect.error_body(status, "invalid_request_error", f"the request could not be read: {reason}")
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


def _reason(text: str) -> str:
    """What an aiohttp parser error says, without the client's bytes it goes on to quote ("Invalid
    character in chunk size:\n\n  b'zz'", "Got more than 8190 bytes when reading: b'SSS…'")."""
    first = text.split("\n", 1)[0]
    quoted = [i for i in (first.find("'"), first.find('"')) if i >= 0]
    if quoted:
        first = first[:min(quoted)].removesuffix("b")
    return first.rstrip(" :")[:200]


_plain_handlers = False  # logged once: this aiohttp's Server could not be copied (see _connection)


def _connection(factory: Any, limits: ServerSettings, open_count: list[int]) -> Guarded:
    global _plain_handlers
    try:
        # What aiohttp's Server() does, with the subclass (its own attributes: a version without them
        # gets aiohttp's plain-text answers).
        inner = _Handler(factory, loop=factory._loop, **factory._kwargs)
    except (AttributeError, TypeError) as exc:
        if not _plain_handlers:
            _plain_handlers = True
            log.warning("http.plain_error_answers", error=type(exc).__name__,
                        detail="requests aiohttp cannot parse get its plain-text 400")
        return Guarded(factory(), limits, open_count)
    conn = Guarded(inner, limits, open_count)
    inner.conn = conn
    return conn


MAX_REQUEST_LINE = 32 << 10


def runner_timeout(grace: float) -> float:
    """aiohttp's `shutdown_timeout` for a grace period of `grace`: it waits that long for a request in
    flight, then cancels it and waits as long again, and a handler waiting on its upstream does not see
    that cancel (it cancels the request's body, already read), so requests were cut at twice the grace."""
    return grace / 2


async def start(app: web.Application, limits: ServerSettings, host: str, port: int,
                *, handler_cancellation: bool = True) -> tuple[web.AppRunner, asyncio.Server]:
    """Serve `app` on host:port with `limits`; the caller cleans up the runner and closes the server."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation,
                           keepalive_timeout=limits.keepalive_timeout_seconds,
                           # A search of 1,000 non-Latin characters is a 9-12 KB request line once
                           # percent-encoded: past aiohttp's 8,190 bytes it got a plain-text 400.
                           max_line_size=MAX_REQUEST_LINE,
                           # SIGTERM: in-flight requests and streams get the grace period (gateway/shutdown.py).
                           shutdown_timeout=runner_timeout(limits.shutdown_grace_seconds))
    await runner.setup()
    factory = runner.server
    assert factory is not None
    open_count = [0]
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(lambda: _connection(factory, limits, open_count), host, port,
                                          reuse_address=True, backlog=min(limits.max_connections, socket.SOMAXCONN))
    except BaseException:
        await runner.cleanup()  # the app started (fold workers included): stop it, or the process hangs
        raise
    return runner, server


def bound_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])
