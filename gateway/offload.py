"""The offload process: large requests are served by a sibling, so they never hold this process's loop.

A request of tens of megabytes costs the memory path tens of milliseconds of CPU that cannot be cut
into small steps: one JSON string of 30 MB is built by one parser call, and the threads that take
the rest of the work hold the interpreter lock while they run. Every other conversation would wait.
So `gateway serve` on a shared store (Redis) starts a second `gateway serve` on a private Unix
socket, at a lower CPU priority, and the edge middleware hands it each request whose body is over
`server.offload_body_bytes`: the bytes go through as they arrive, the answer comes back as it is
made (streams too). The serving process only copies bytes, a chunk per turn of its loop.

The sibling is the same app on the same store: it records turns, queues folds (the serving
process's workers run them) and notes activity exactly as the serving process would; its log lines
carry `process_role: "offload"`. `/metrics` adds its samples to the serving process's own. While it
is not running (starting, or restarting after a crash) large requests are served in the serving
process, as they are with `server.offload: false` or the embedded `memory://` store, which another
process cannot share. It leaves when the serving process does: it watches its stdin, a pipe from
that process, and stops at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict
from yarl import URL

from gateway.logs import get_logger
from gateway.metrics import SiblingSamples
from gateway.upstream import HOP_BY_HOP

log = get_logger("gateway.offload")

PROCESS_LABEL = "offload"  # the sibling's log lines carry process_role=<this>
# Headers about this hop only (RFC 9110 7.6.1), and ones each side sets for itself. `Expect`: this
# process has already answered `100 Continue` to the client. `Content-Encoding`: aiohttp has decoded
# the body this process relays.
_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                  "upgrade", "expect", "content-length", "content-encoding", "x-gateway-offload-call"))
# The relay names each request it hands the sibling and creates `pending-<name>` in the socket's
# directory; the sibling removes that file before it calls the upstream, and calls only when it did.
# A relay whose sibling died before answering serves the request itself only when the file is still
# there: a POST the provider may have run is never sent twice (nginx's proxy_next_upstream does not
# retry a non-idempotent request either), and a file lost any other way (the directory removed)
# errs on that side too.
CALL_HEADER = "X-Gateway-Offload-Call"
_CALL_NAME = re.compile(r"[0-9a-f]{32}")
# (app key: the directory the sibling's call marks go to; set in the offload process only)
MARKS: web.AppKey[str] = web.AppKey("offload_marks", str)
_OWN = frozenset(("date", "server"))
# The answer's headers about this hop. Not its Content-Encoding: the relay passes the body as it came
# (a provider that compressed it despite being asked not to), so the client must still be told.
_HOP_RESPONSE = HOP_BY_HOP | {"content-length"}
_RESTART_DELAYS = (0.5, 2.0, 10.0)  # seconds before each restart after a crash (then the last, again)
_READY_SECONDS = 60.0
_WATCH_MISSES = 3  # unanswered in a row: the sibling is killed and another started
NICE = 10  # the sibling's niceness (it sets it itself: cli._serve_offloaded)


class NotRelayed(Exception):
    """The sibling failed before its answer began, and before it called the upstream: serve the
    request here, its body's chunks read so far (`prelude`) first."""

    def __init__(self, reason: str, prelude: list[bytes]) -> None:
        super().__init__(reason)
        self.prelude = prelude


class Offload:
    """The sibling process and the relay to it."""

    def __init__(self, threshold: int, max_body: int, config: str | None, grace: float,
                 log_format: str | None = None, watch_seconds: float = 5.0) -> None:
        self.threshold = threshold
        self.watch_seconds = watch_seconds  # /healthz asked this often, given this long to answer
        self.max_body = max_body
        self.config = config
        self.log_format = log_format
        self.grace = grace
        self.dir = tempfile.mkdtemp(prefix="gateway-offload-")  # 0700: only this user may connect
        self.path = os.path.join(self.dir, "gateway.sock")
        self.proc: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ready = False
        self.samples = SiblingSamples()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    # -- which requests --------------------------------------------------------------------------

    def wants(self, request: web.Request) -> bool:
        """A body over the threshold, of a declared length (within max_body_bytes: a larger one is
        refused here, unread) or chunked (measured as it arrives: `take`). The caller (app.edge) has
        refused a path that climbs above the root; an absolute-form target is served here."""
        if not self.ready or not request.raw_path.startswith("/"):
            return False
        length = self.declared(request)
        if length is None:
            return request.body_exists
        return self.threshold < length <= self.max_body

    @staticmethod
    def declared(request: web.Request) -> int | None:
        """The body's length as this process reads it, when the head says it: not for a compressed
        body (aiohttp decodes it as it reads; its Content-Length is the compressed size)."""
        return None if "Content-Encoding" in request.headers else request.content_length

    # -- the sibling's lifetime ------------------------------------------------------------------

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "gateway", "serve", "--offload-socket", self.path]
        if self.log_format:
            args += ["--log-format", self.log_format]
        return args + (["--config", self.config] if self.config else [])

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(self.path, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            # The memory path's x-gateway-* headers can be long; the client's limits are the listener's.
            max_line_size=64 << 10, max_field_size=64 << 10)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)  # (a tmp cleaner may have taken it)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.proc = await asyncio.create_subprocess_exec(*self.argv(), stdin=asyncio.subprocess.PIPE,
                                                             start_new_session=True)
            if await self._wait_ready():
                self.ready = True
                failures = 0
                log.info("offload.ready", pid=self.proc.pid, threshold_bytes=self.threshold)
                await self._watch()
            elif self.proc.returncode is None:
                log.error("offload.not_ready", seconds=_READY_SECONDS, message="the offload process never "
                          "answered; it is restarted")
            self.kill()  # (a no-op when it has exited)
            code = await self.proc.wait()
            self.ready = False
            if self._closing:
                return
            delay = _RESTART_DELAYS[min(failures, len(_RESTART_DELAYS) - 1)]
            failures += 1
            log.error("offload.exited", code=code, restart_in_s=delay,
                      message="the offload process exited; large requests are served here until it is back")
            await asyncio.sleep(delay)

    async def _wait_ready(self) -> bool:
        assert self.session is not None and self.proc is not None
        deadline = asyncio.get_running_loop().time() + _READY_SECONDS
        while self.proc.returncode is None and asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self.session.get("http://gateway/healthz") as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.1)
        return False

    async def _watch(self) -> None:
        """Until the sibling exits or stops answering `/healthz` (stopped, deadlocked): large requests
        would wait on it for ever."""
        assert self.session is not None and self.proc is not None
        missed = 0
        while self.proc.returncode is None and missed < _WATCH_MISSES:
            try:
                await asyncio.wait_for(self.proc.wait(), self.watch_seconds)
                return
            except TimeoutError:
                pass
            try:
                async with asyncio.timeout(self.watch_seconds), self.session.get("http://gateway/healthz") as r:
                    missed = 0 if r.status == 200 else missed + 1
            except (aiohttp.ClientError, OSError, TimeoutError):
                missed += 1
        if missed:
            log.error("offload.unresponsive", seconds=self.watch_seconds * missed * 2,
                      message="the offload process stopped answering; it is restarted")

    def kill(self) -> None:
        """Stop the sibling at once (the supervisor starts another)."""
        self.ready = False
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def close(self) -> None:
        """Stop the sibling after what it is serving (SIGTERM: its own grace period), then clean up."""
        self._closing = True
        self.ready = False
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.grace + 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.session is not None:
            await self.session.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the relay -------------------------------------------------------------------------------

    async def take(self, request: web.Request, deadline: float) -> list[bytes]:
        """A chunked body read until it passes the threshold or ends (by `deadline`, loop time): the
        caller relays these chunks with the rest when they are over the threshold, else serves the
        request here with them."""
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout_at(deadline):
            while size <= self.threshold:
                chunk = await request.content.readany()
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        return chunks

    async def relay(self, request: web.Request, prelude: Sequence[bytes], deadline: float) -> web.StreamResponse:
        """The sibling's answer to `request`, streamed back as it comes. Raises NotRelayed when the
        sibling fails before its answer begins, TimeoutError when the body is not in by `deadline`."""
        assert self.session is not None
        read = list(prelude)  # every chunk taken from the client, kept until the answer begins
        # The client's body is read by a task of this call's, not by aiohttp's writer, so that on a
        # failure it is stopped and what it read is known: the request is then served here from it.
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        expired = answered = False
        failed: BaseException | None = None  # the client's body could not be read (corrupt, or it left)
        relaying = asyncio.current_task()

        async def pump() -> None:
            nonlocal expired, failed
            size = sum(map(len, read))
            try:
                async with asyncio.timeout_at(deadline):
                    while chunk := await request.content.readany():
                        read.append(chunk)
                        size += len(chunk)
                        await queue.put(chunk)
                        if size > self.max_body:
                            break  # the sibling answers its 413 for this much; the rest is never read
            except (TimeoutError, RequestPayloadError, ConnectionResetError) as exc:
                # The sibling would wait for the rest until its own body timeout: the relay stops now.
                if not answered:
                    if isinstance(exc, TimeoutError):
                        expired = True
                    else:
                        failed = exc
                    if relaying is not None:
                        relaying.cancel()
                return
            await queue.put(None)

        async def body() -> AsyncIterator[bytes]:
            for chunk in prelude:
                yield chunk
            while (more := await queue.get()) is not None:
                yield more

        reader = asyncio.get_running_loop().create_task(pump())
        # (A compressed body goes on decoded, as aiohttp reads it: chunked, without its Content-Encoding.)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _hop(request))
        length = self.declared(request)
        if length is not None:
            headers["Content-Length"] = str(length)
        call = secrets.token_hex(16)
        headers[CALL_HEADER] = call
        mark = os.path.join(self.dir, "pending-" + call)
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as exc:
            await _stopped(reader)
            self.kill()  # its directory is gone (a tmp cleaner?): a new process makes it again
            raise NotRelayed(f"no call mark: {exc}", read) from exc
        url = URL("http://gateway" + request.raw_path, encoded=True)
        try:
            up = await self.session.request(request.method, url, headers=headers, data=body(),
                                            skip_auto_headers=_AUTO, allow_redirects=False)
        except aiohttp.ClientError as exc:
            await _stopped(reader)
            if not _still_pending(mark):
                raise Called(str(exc) or type(exc).__name__) from exc
            if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, FileNotFoundError):
                self.kill()  # its socket is gone (a tmp cleaner?): a new process binds a new one
            raise NotRelayed(str(exc) or type(exc).__name__, read) from exc
        except asyncio.CancelledError:
            await _stopped(reader)
            pending = _still_pending(mark)
            # The pump's own cancel is turned into what it met; one from elsewhere as well (aiohttp
            # cancels the handler of a client that left) stays a cancel.
            if (expired or failed is not None) and relaying is not None and relaying.uncancel() == 0:
                if not pending:  # (not reached: the sibling calls only once it has the whole body)
                    raise Called("the body failed after the offload process took the call") from None
                if failed is not None:
                    raise failed from None
                raise TimeoutError from None
            raise
        # The sibling answers once it has read the body (or refused it): what the client still
        # sends is not needed, and the timer must not cut the answer.
        answered = True
        await _stopped(reader)
        _still_pending(mark)  # (there when the sibling answered without calling the upstream)
        read.clear()  # (a long stream need not hold the body)
        async with up:
            return await self._answer(request, up)

    async def _answer(self, request: web.Request, up: aiohttp.ClientResponse) -> web.StreamResponse:
        response = web.StreamResponse(status=up.status, reason=up.reason)
        for name, value in up.headers.items():
            if name.lower() not in _HOP_RESPONSE and name.lower() not in _OWN:
                response.headers.add(name, value)
        if up.content_length is not None:
            response.content_length = up.content_length
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await up.content.readany()
                except aiohttp.ClientError as exc:
                    # The sibling died mid-answer: the client sees its connection cut, as it would
                    # have had this process died (the turn, if recorded, is in the store).
                    log.error("offload.cut", error=str(exc) or type(exc).__name__)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                await response.write(chunk)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left: its handler is cancelled, and the sibling's with it
        return response

    async def metrics(self) -> SiblingSamples:
        """The sibling's samples, refreshed from its /metrics when it answers within a second."""
        if self.ready and self.session is not None and self.proc is not None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with asyncio.timeout(1.0), self.session.get("http://gateway/metrics") as r:
                    if r.status == 200:
                        self.samples.update(self.proc.pid, await r.text())
        return self.samples


class Called(Exception):
    """The sibling failed before answering, after it may have called the upstream: the provider may
    have run the request, so it is not sent again."""


def _still_pending(mark: str) -> bool:
    """Whether the sibling left the call mark `mark` in place, i.e. never called the upstream with it
    (removed here: each is read once)."""
    try:
        os.unlink(mark)
    except OSError:
        return False  # taken by the sibling, or lost with its directory: it may have called
    return True


class Unmarked(Exception):
    """In the offload process: the relay's mark for this request is gone; it is not sent upstream."""


def take_call(request: web.Request) -> None:
    """In the offload process, before the upstream call: take the relay's mark (`CALL_HEADER`), or
    raise Unmarked (the relay may serve the request itself, so this process must not call)."""
    marks = request.app.get(MARKS)
    if marks is None:
        return
    name = request.headers.get(CALL_HEADER)
    if name is None or not _CALL_NAME.fullmatch(name):
        raise Unmarked("the request came without the relay's call mark")
    try:
        os.unlink(os.path.join(marks, "pending-" + name))
    except OSError as exc:
        raise Unmarked(f"the relay's call mark is gone ({exc.strerror})") from None


def _hop(request: web.Request) -> frozenset[str]:
    """The request's headers that are about this hop: the fixed set and those its Connection names."""
    named = request.headers.getall("Connection", ())
    if not named:
        return _HOP
    return _HOP | {n.strip().lower() for v in named for n in v.split(",") if n.strip()}


async def _stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    # (What the body's reader met is the relay's to report: it ends on its own with a note of it.)
    with contextlib.suppress(asyncio.CancelledError, RequestPayloadError, ConnectionResetError):
        await task


# Headers aiohttp's client would add on its own: the client's own (or none) go through instead.
_AUTO = frozenset(("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
