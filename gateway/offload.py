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
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.logs import get_logger

log = get_logger("gateway.offload")

PROCESS_LABEL = "offload"  # the sibling's log lines carry process_role=<this>
# Headers about this hop only (RFC 9110 7.6.1), and ones each side sets for itself. `Expect`: this
# process has already answered `100 Continue` to the client.
_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                  "upgrade", "expect", "content-length"))
_OWN = frozenset(("date", "server"))
_RESTART_DELAYS = (0.5, 2.0, 10.0)  # seconds before each restart after a crash (then the last, again)
_READY_SECONDS = 60.0
NICE = 10


class NotRelayed(Exception):
    """The sibling failed before its answer began: serve the request here, its body's chunks read so
    far (`prelude`) first. (A sibling that died after calling the upstream but before answering
    makes that call twice; a stale connection to one that died idle, the usual case, makes none.)"""

    def __init__(self, reason: str, prelude: list[bytes]) -> None:
        super().__init__(reason)
        self.prelude = prelude


class Offload:
    """The sibling process and the relay to it."""

    def __init__(self, threshold: int, max_body: int, config: str | None, grace: float) -> None:
        self.threshold = threshold
        self.max_body = max_body
        self.config = config
        self.grace = grace
        self.dir = tempfile.mkdtemp(prefix="gateway-offload-")  # 0700: only this user may connect
        self.path = os.path.join(self.dir, "gateway.sock")
        self.proc: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ready = False
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    # -- which requests --------------------------------------------------------------------------

    def wants(self, request: web.Request) -> bool:
        """A body of a declared length over the threshold (and within max_body_bytes: a larger one is
        refused here, unread). Chunked bodies are measured as they arrive (`take`)."""
        length = request.content_length
        return self.ready and length is not None and self.threshold < length <= self.max_body

    def chunked(self, request: web.Request) -> bool:
        return self.ready and request.content_length is None and request.body_exists

    # -- the sibling's lifetime ------------------------------------------------------------------

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "gateway", "serve", "--offload-socket", self.path]
        return args + (["--config", self.config] if self.config else [])

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(self.path, limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            # The memory path's x-gateway-* headers can be long; the client's limits are the listener's.
            max_line_size=64 << 10, max_field_size=64 << 10)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv(), stdin=asyncio.subprocess.PIPE, start_new_session=True, preexec_fn=_lower_priority)
            if await self._wait_ready():
                self.ready = True
                failures = 0
                log.info("offload.ready", pid=self.proc.pid, threshold_bytes=self.threshold)
            code = await self.proc.wait()
            self.ready = False
            if self._closing:
                return
            delay = _RESTART_DELAYS[min(failures, len(_RESTART_DELAYS) - 1)]
            failures += 1
            log.error("offload.exited", code=code, restart_in_s=delay,
                      message="the large-bodies process exited; large requests are served here until it is back")
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

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    # -- the relay -------------------------------------------------------------------------------

    async def take(self, request: web.Request, seconds: float) -> list[bytes]:
        """A chunked body read until it passes the threshold or ends: the caller relays these chunks
        with the rest when they are over the threshold, else serves the request here with them."""
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(seconds):
            while size <= self.threshold:
                chunk = await request.content.readany()
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        return chunks

    async def relay(self, request: web.Request, prelude: Sequence[bytes] = ()) -> web.StreamResponse:
        """The sibling's answer to `request`, streamed back as it comes. Raises NotRelayed when the
        sibling fails before its answer begins."""
        assert self.session is not None
        read = list(prelude)  # every chunk taken from the client, kept until the answer begins
        size = sum(map(len, read))

        async def body() -> AsyncIterator[bytes]:
            nonlocal size
            for chunk in prelude:
                yield chunk
            while chunk := await request.content.readany():
                read.append(chunk)
                size += len(chunk)
                yield chunk
                if size > self.max_body:
                    return  # the sibling answers its 413 for this much; the rest is never read

        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        try:
            up = await self.session.request(request.method, "http://gateway" + request.raw_path, headers=headers,
                                            data=body(), skip_auto_headers=_AUTO, allow_redirects=False)
        except aiohttp.ClientError as exc:
            raise NotRelayed(str(exc) or type(exc).__name__, read) from exc
        read = []
        async with up:
            response = web.StreamResponse(status=up.status, reason=up.reason)
            for name, value in up.headers.items():
                low = name.lower()
                if low not in _HOP and low not in _OWN:
                    response.headers.add(name, value)
            if up.content_length is not None:
                response.content_length = up.content_length
            await response.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientError as exc:
                # The sibling died mid-answer: the client sees its connection cut, as it would have
                # had this process died (the turn, if recorded, is in the store).
                log.error("offload.cut", error=str(exc) or type(exc).__name__)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
        return response

    async def metrics(self) -> str | None:
        """The sibling's /metrics text (None: not running or not answering within a second)."""
        if not self.ready or self.session is None:
            return None
        try:
            async with asyncio.timeout(1.0), self.session.get("http://gateway/metrics") as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None


def _lower_priority() -> None:
    """The sibling yields the CPU to the serving process when both want it (its own fold processes
    run lower still: foldcpu.py)."""
    with contextlib.suppress(OSError):
        os.nice(NICE)


# Headers aiohttp's client would add on its own: the client's own (or none) go through instead.
_AUTO = frozenset(("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
