"""Forward one call upstream and relay the answer, JSON or SSE, chunk by chunk; the memory hook seam.

The request path, in order: authenticate, read and check the body, let the memory hook (if any)
prepare the call, forward the original bytes (or the hook's body), relay the answer as it arrives
while the dialect's accumulator rebuilds the assistant reply on the side, and, after a 2xx answer
was relayed whole, hand the reply to the hook's `on_success` in a background task.

Errors raised here are `GatewayError`s; `app.py` renders them once, in the caller's dialect.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDictProxy

from gateway import paths
from gateway.auth import Authenticator, AuthError
from gateway.config import Settings
from gateway.dialects import Dialect, dialect_for_path
from gateway.metrics import Metrics
from gateway.model import Usage
from gateway.offload import Unmarked, take_call
from gateway.resend import ResendParser, TooManyValues
from gateway.stream_usage import UsageTap, ask_for_usage
from gateway.transport import HTTPClient, Response, UpstreamError, UpstreamTimeout
from gateway.upstream import Upstream, request_headers, response_headers, upstreams

# --- the hook seam: what the memory layer (memory.py) implements ---------------------------------


@dataclass(slots=True)
class Call:
    dialect: Dialect
    path: str
    body: dict[str, Any]
    raw: bytes
    headers: CIMultiDictProxy[str]
    credential: str | None
    tenant: str
    stream: bool


@dataclass(slots=True)
class Prepared:
    body: bytes | None  # None: forward the client's original bytes
    headers: dict[str, str]  # added to the response (x-gateway-context, x-gateway-tokens-*)
    on_success: Callable[[list[dict[str, Any]], Usage], Coroutine[Any, Any, None]] | None = None
    excerpts: str = ""  # what the rewrite recalled for the newest turn (the dashboard shows it)


class MemoryHook(Protocol):
    async def prepare(self, call: Call) -> Prepared | None: ...


# --- errors and the per-request record -------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
    415: "invalid_request_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
    504: "timeout_error", 508: "api_error",
}
# Added to every request the gateway forwards: a request that comes back carrying this process's
# id is a loop (an upstream base_url pointing at the gateway itself) and is refused at once.
HOP_HEADER = "X-Gateway-Hop"
MAX_HOPS = 8


class GatewayError(Exception):
    """A failure the gateway itself answers, rendered in the caller's dialect by app.py."""

    def __init__(self, status: int, type_: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_ or ERROR_TYPES.get(status, "api_error")
        self.message = message
        self.headers = headers or {}


@dataclass(slots=True)
class Record:
    """What the request log line and the metrics say about one request."""

    route: str | None  # None: not logged (health checks, metrics scrapes)
    method: str
    t0: float
    status: int = 0
    context: str = "passthrough"
    conversation: str | None = None
    project: str | None = None  # X-Project-Id (conversation.project_headers)
    tenant: str | None = None
    stream: bool = False
    upstream_s: float = 0.0
    request_id: str | None = None
    usage: Usage | None = None
    model: str | None = None
    provider: str | None = None
    gateway: dict[str, str] | None = None  # the memory path's x-gateway-* headers
    excerpts: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


RECORD = web.RequestKey("gateway_record", Record)
# Request bodies of more bytes are joined in a thread (read_body).
JOIN_OFF_LOOP = 1 << 20
TAP: web.RequestKey[UsageTap | None] = web.RequestKey("gateway_usage_tap")
# Body chunks already read from the client (gateway/offload.py measured a chunked body, or its
# process failed): read first, and the body's deadline (loop time) that then still holds.
PRELUDE: web.RequestKey[list[bytes]] = web.RequestKey("gateway_body_prelude")
BODY_DEADLINE: web.RequestKey[float] = web.RequestKey("gateway_body_deadline")

async def read_body(request: web.Request, seconds: float, max_bytes: int) -> bytes:
    """The request body; over `max_bytes` (server.max_body_bytes) → aiohttp's 413, slower than
    `seconds` → 408. Read as it arrives, then joined once, a long one in a thread (bytes.join lets go
    of the interpreter lock on long inputs): aiohttp's `read()` buffers up to the limit and copies a
    30 MB body three times on the event loop (~25 ms during which no other request is served)."""
    chunks: list[bytes] = list(request.get(PRELUDE, ()))
    size = sum(map(len, chunks))
    if size > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
    deadline = request.get(BODY_DEADLINE)
    try:
        async with asyncio.timeout_at(deadline) if deadline is not None else asyncio.timeout(seconds):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
                chunks.append(chunk)
    except TimeoutError:
        raise GatewayError(408, None, f"the request body did not arrive within {seconds:g} s") from None
    except RequestPayloadError as exc:
        raise unreadable_body(exc) from None
    if len(chunks) == 1:
        return chunks[0]
    return await asyncio.to_thread(b"".join, chunks) if size > JOIN_OFF_LOOP else b"".join(chunks)


def unreadable_body(exc: RequestPayloadError) -> GatewayError:
    """The 400 for a body aiohttp could not read: a corrupt Content-Encoding, or a chunked encoding that
    broke after the head (listener.py reports that one to the body)."""
    cause = exc.__cause__ or exc
    why = " ".join(str(getattr(cause, "message", None) or cause).split())  # ("Can not decode content-encoding: gzip")
    return GatewayError(400, None, f"the request body could not be read: {why[:200]}")


def upstream_error(exc: UpstreamError, prepared: Prepared | None = None) -> GatewayError:
    """The 502/504 the gateway answers for an upstream that failed; with the memory layer's headers
    (what it would have forwarded, and why), as on any response to a request naming a conversation."""
    memory = dict(prepared.headers) if prepared is not None else {}
    if isinstance(exc, UpstreamTimeout):
        return GatewayError(504, None, f"upstream timed out: {exc}", memory)
    return GatewayError(502, None, f"upstream failed: {exc}", memory)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


# --- the proxy -------------------------------------------------------------------------------------


class Proxy:
    """Per-app forwarding state; `handle` is the aiohttp handler of every proxied route."""

    def __init__(self, settings: Settings, metrics: Metrics, hook: MemoryHook | None,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.hook = hook
        self.spawn = spawn
        self.auth = Authenticator(settings)
        self.upstreams: dict[str, Upstream] = upstreams(settings)
        self.conversation_headers = tuple(settings.conversation.headers)
        self.project_headers = tuple(settings.conversation.project_headers)
        self.bodies = ResendParser(max_parts=settings.memory.max_parts)
        self.client: HTTPClient | None = None  # opened by the app's cleanup_ctx, inside the event loop
        self.hop_id = os.urandom(6).hex()

    async def handle(self, request: web.Request, *, memory: bool, json_body: bool) -> web.StreamResponse:
        rec = request[RECORD]
        headers = request.headers
        dialect = dialect_for_path(request.path, headers)
        hops = self._hops(headers)
        for name in self.conversation_headers:
            conv = headers.get(name)
            if conv:
                rec.conversation = paths.conversation_id(conv)
                break
        for name in self.project_headers:
            project = headers.get(name)
            if project:
                rec.project = paths.conversation_id(project)
                break
        try:
            ident = self.auth.identify(headers, request.raw_path)
        except AuthError as exc:
            raise GatewayError(401, None, str(exc)) from None
        rec.tenant = ident.tenant
        upstream = self.upstreams[dialect.upstream]
        rec.provider = upstream.name
        if self.auth.required and upstream.needs_key and upstream.api_key is None and ident.credential is None:
            # The key presented was the gateway's own, never forwarded: the provider would answer a 401
            # that reads as if the gateway key were wrong.
            raise GatewayError(401, None, f"no {upstream.name} API key to send upstream: the gateway has no "
                               f"upstreams.{upstream.name}.api_key, and the key presented is a gateway key (never "
                               f"forwarded); send your {upstream.name} key as the API key and the gateway key in "
                               "X-Gateway-Key, or set the upstream's api_key")
        if not paths.forwardable(request.raw_path):
            raise GatewayError(400, None, "an encoded slash or a backslash in the path is not forwarded")
        remember = memory and self.hook is not None and not ident.anonymous

        raw = await read_body(request, self.settings.server.body_timeout_seconds, self.settings.server.max_body_bytes)
        body: dict[str, Any] | None = None
        stream = False
        if json_body:
            if not _is_json(request.content_type):
                raise GatewayError(415, None, f"Content-Type must be application/json, not {request.content_type!r}")
            # A conversation's resent history is parsed only around what its last request held.
            key = (ident.tenant, rec.conversation, dialect.name) if remember and rec.conversation else None
            try:
                body = await self.bodies.aloads(key, raw, dialect.history_field)
            except orjson.JSONDecodeError as exc:
                raise GatewayError(400, None, f"request body is not valid JSON: {exc}") from None
            except TooManyValues as exc:
                raise GatewayError(400, None, str(exc)) from None
            if not isinstance(body, dict):
                raise GatewayError(400, None, "request body must be a JSON object")
            stream = dialect.is_stream(body)
            rec.stream = stream
            model = body.get("model")
            rec.model = model if isinstance(model, str) else None

        prepared: Prepared | None = None
        if memory and self.hook is not None and ident.anonymous and rec.conversation:
            # Without a credential there is no tenant to keep it for: passed through, never shared.
            prepared = Prepared(None, {"x-gateway-context": "passthrough", "x-gateway-reason": "no-credential"})
        elif memory and self.hook is None and rec.conversation:
            # memory.enabled: false. Said on the response, or a user tuning thresholds sees nothing happen.
            prepared = Prepared(None, {"x-gateway-context": "passthrough", "x-gateway-reason": "memory-off"})
        elif remember and self.hook is not None and body is not None:
            prepared = await self.hook.prepare(Call(dialect, request.path, body, raw, headers,
                                                    ident.credential, ident.tenant, stream))
            if prepared is not None:
                rec.context = prepared.headers.get("x-gateway-context", "passthrough")
                rec.gateway, rec.excerpts = prepared.headers, prepared.excerpts
                if prepared.body is not None:
                    raw = prepared.body
        tap: UsageTap | None = None
        if stream and body is not None and dialect.name == "openai_chat":
            # A request without a conversation goes upstream byte for byte (DESIGN): its usage is read
            # only when its client asked for it.
            asked = ask_for_usage(body, raw) if rec.conversation is not None else None
            tap = UsageTap(strip=asked is not None)
            raw = asked or raw

        out_headers = request_headers(headers, upstream.auth,
                                      keep_credentials=upstream.api_key is None and ident.credential is not None)
        out_headers.append((HOP_HEADER, f"{hops}, {self.hop_id}" if hops else self.hop_id))
        request[TAP] = tap
        return await self._forward(request, rec, dialect, upstream, raw, out_headers, prepared, memory)

    def _hops(self, headers: CIMultiDictProxy[str]) -> str:
        """The hop marker the request came with; a loop back into this process is a 508 at once."""
        hops = ", ".join(headers.getall(HOP_HEADER, ()))
        seen = [h.strip() for h in hops.split(",") if h.strip()]
        if self.hop_id in seen or len(seen) >= MAX_HOPS:
            raise GatewayError(508, None, "loop detected: this request came back through the gateway; an "
                               "upstreams.<name>.base_url points at the gateway itself, not at the provider",
                               {"x-should-retry": "false"})
        return hops

    async def _forward(self, request: web.Request, rec: Record, dialect: Dialect, upstream: Upstream,
                       data: bytes, headers: list[tuple[str, str]], prepared: Prepared | None,
                       memory: bool) -> web.StreamResponse:
        assert self.client is not None, "the upstream client is opened by the app's cleanup_ctx"
        try:
            take_call(request)  # (in the offload process: from here on the relay must not send this again)
        except Unmarked as exc:
            raise GatewayError(503, None, f"not sent to the provider: {exc}; retry the request",
                               {"Retry-After": "1"}) from None
        t = perf_counter()
        try:
            resp = await self.client.request(upstream.endpoint, request.method, upstream.target(request.raw_path),
                                             headers, data)
        except UpstreamError as exc:
            raise upstream_error(exc, prepared) from exc
        finally:
            rec.upstream_s += perf_counter() - t
        try:
            rec.request_id = resp.headers.get("x-request-id") or resp.headers.get("request-id")
            ok = 200 <= resp.status < 300
            out_headers = response_headers(resp.headers, prepared.headers.items() if prepared else ())
            # The reply is rebuilt only for someone who consumes it: pass-through parses nothing.
            on_success = prepared.on_success if prepared is not None and ok and memory else None
            if resp.content_type == "text/event-stream":
                response, items = await self._relay_stream(request, rec, dialect, resp, out_headers,
                                                           rebuild=on_success is not None)
                if items is not None and on_success is not None:
                    self.spawn(on_success(*items))
            else:
                t = perf_counter()
                try:
                    payload = await resp.read()
                except UpstreamError as exc:
                    raise upstream_error(exc, prepared) from exc
                finally:
                    rec.upstream_s += perf_counter() - t
                if on_success is not None:
                    parsed = _parse_reply(dialect, payload)
                    if parsed is not None:
                        rec.usage = parsed[1]
                        self.spawn(on_success(*parsed))
                response = web.Response(body=payload, status=resp.status, headers=out_headers)
                rec.status = resp.status
            return response
        finally:
            resp.release()

    async def _relay_stream(self, request: web.Request, rec: Record, dialect: Dialect,
                            resp: Response, out_headers: Any, *,
                            rebuild: bool) -> tuple[web.StreamResponse, tuple[list[dict[str, Any]], Usage] | None]:
        """Relay SSE bytes as they arrive; with the rebuilt reply when asked and the stream ended cleanly.

        The tee keeps the raw chunks and feeds them to the dialect's accumulator once the last one
        is relayed, so no parsing ever sits between an upstream chunk and the client.
        """
        rec.status = resp.status
        if resp.arrived:
            # The whole stream came with its headers (a short answer): relayed in one write, as a
            # body of known length, rather than as headers, a chunk and an end written apart.
            try:
                payload = await resp.read()
            except UpstreamError as exc:  # a body that does not decode; nothing is sent yet
                raise upstream_error(exc) from exc
            tap = request.get(TAP)
            result = _rebuilt(dialect, payload, rec) if rebuild else None
            if tap is not None:
                payload = tap.feed(payload) + tap.flush()
                rec.usage = rec.usage if rec.usage is not None and rec.usage.input_tokens else tap.usage
            return web.Response(body=payload, status=resp.status, headers=out_headers), result
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        await out.prepare(request)
        tee: list[bytes] | None = [] if rebuild else None
        tap = request.get(TAP)
        complete = False
        try:
            while True:
                t = perf_counter()
                try:
                    chunk = await resp.readany()
                except UpstreamError as exc:
                    # The client already has a 200 and half a stream: end it the way the provider would.
                    rec.extra["upstream_error"] = type(exc).__name__
                    reason = upstream_error(exc).message
                    await out.write(dialect.stream_error_frame(f"upstream stream interrupted: {reason}"))
                    break
                finally:
                    rec.upstream_s += perf_counter() - t
                if not chunk:
                    complete = True
                    break
                if tee is not None:
                    tee.append(chunk)
                if tap is not None:
                    chunk = tap.feed(chunk)
                    if not chunk:
                        continue
                await out.write(chunk)
            if tap is not None and (rest := tap.flush()):
                await out.write(rest)
            await out.write_eof()
        except ConnectionResetError:
            # The client went away: close the upstream connection so the provider stops generating.
            resp.close()
            rec.status = 499
            return out, None
        if not complete:
            rec.extra["stream_interrupted"] = True
            return out, None
        if tap is not None:
            rec.usage = tap.usage
        if tee is None:
            return out, None
        return out, _rebuilt(dialect, b"".join(tee), rec)


def _rebuilt(dialect: Dialect, stream: bytes, rec: Record) -> tuple[list[dict[str, Any]], Usage]:
    """The assistant reply and usage a whole SSE stream carried."""
    acc = dialect.accumulator()
    acc.feed(stream)
    result = acc.result()
    rec.usage = result[1]
    return result


def _parse_reply(dialect: Dialect, payload: bytes) -> tuple[list[dict[str, Any]], Usage] | None:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return dialect.parse_response(obj) if isinstance(obj, dict) else None
