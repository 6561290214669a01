"""Forward one call upstream and relay the answer, JSON or SSE, chunk by chunk; the memory hook seam.

The request path, in order: authenticate, read and check the body, let the memory hook (if any)
prepare the call, forward the original bytes (or the hook's body), relay the answer as it arrives
while the dialect's accumulator rebuilds the assistant reply on the side, and, after a 2xx answer
was relayed whole, hand the reply to the hook's `on_success` in a background task.

Errors raised here are `GatewayError`s; `app.py` renders them once, in the caller's dialect.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.auth import Authenticator, AuthError
from gateway.config import Settings
from gateway.dialects import Dialect, dialect_for_path
from gateway.metrics import Metrics
from gateway.model import Usage
from gateway.resend import ResendParser
from gateway.transport import HTTPClient, Response, UpstreamError, UpstreamTimeout
from gateway.upstream import Upstream, request_headers, response_headers, upstreams

# --- the hook seam (docs/interfaces.md, "proxy hook") ---------------------------------------------


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


class MemoryHook(Protocol):
    async def prepare(self, call: Call) -> Prepared | None: ...


# --- errors and the per-request record -------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    415: "invalid_request_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
    504: "timeout_error",
}


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
    tenant: str | None = None
    stream: bool = False
    upstream_s: float = 0.0
    request_id: str | None = None
    usage: Usage | None = None
    extra: dict[str, Any] = field(default_factory=dict)


RECORD = web.RequestKey("gateway_record", Record)

def upstream_error(exc: UpstreamError) -> GatewayError:
    if isinstance(exc, UpstreamTimeout):
        return GatewayError(504, None, f"upstream timed out: {exc}")
    return GatewayError(502, None, f"upstream failed: {exc}")


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
        self.bodies = ResendParser()
        self.client: HTTPClient | None = None  # opened by the app's cleanup_ctx, inside the event loop

    async def handle(self, request: web.Request, *, memory: bool, json_body: bool) -> web.StreamResponse:
        rec = request[RECORD]
        headers = request.headers
        dialect = dialect_for_path(request.path, headers)
        for name in self.conversation_headers:
            conv = headers.get(name)
            if conv:
                rec.conversation = conv
                break
        try:
            ident = self.auth.identify(headers)
        except AuthError as exc:
            raise GatewayError(401, None, str(exc)) from None
        rec.tenant = ident.tenant

        raw = await request.read()  # over server.max_body_bytes → aiohttp's 413, rendered by app.py
        body: dict[str, Any] | None = None
        stream = False
        if json_body:
            if not _is_json(request.content_type):
                raise GatewayError(415, None, f"Content-Type must be application/json, not {request.content_type!r}")
            # A conversation's resent history is parsed only around what its last request held.
            key = ((ident.tenant, rec.conversation, dialect.name)
                   if memory and self.hook is not None and rec.conversation else None)
            try:
                body = self.bodies.loads(key, raw, dialect.history_field)
            except orjson.JSONDecodeError as exc:
                raise GatewayError(400, None, f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise GatewayError(400, None, "request body must be a JSON object")
            stream = dialect.is_stream(body)
            rec.stream = stream

        prepared: Prepared | None = None
        if memory and self.hook is not None and body is not None:
            prepared = await self.hook.prepare(Call(dialect, request.path, body, raw, headers,
                                                    ident.credential, ident.tenant, stream))
            if prepared is not None:
                rec.context = prepared.headers.get("x-gateway-context", "passthrough")
                if prepared.body is not None:
                    raw = prepared.body

        upstream = self.upstreams[dialect.upstream]
        out_headers = request_headers(headers, upstream.auth_headers(),
                                      keep_credentials=upstream.api_key is None and ident.credential is not None)
        return await self._forward(request, rec, dialect, upstream, raw, out_headers, prepared, memory)

    async def _forward(self, request: web.Request, rec: Record, dialect: Dialect, upstream: Upstream,
                       data: bytes, headers: list[tuple[str, str]], prepared: Prepared | None,
                       memory: bool) -> web.StreamResponse:
        assert self.client is not None, "the upstream client is opened by the app's cleanup_ctx"
        t = perf_counter()
        try:
            resp = await self.client.request(upstream.endpoint, request.method, upstream.target(request.raw_path),
                                             headers, data)
        except UpstreamError as exc:
            raise upstream_error(exc) from exc
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
                    raise upstream_error(exc) from exc
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
            return web.Response(body=payload, status=resp.status, headers=out_headers), (
                _rebuilt(dialect, payload, rec) if rebuild else None)
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        await out.prepare(request)
        tee: list[bytes] | None = [] if rebuild else None
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
                await out.write(chunk)
            await out.write_eof()
        except ConnectionResetError:
            # The client went away: close the upstream connection so the provider stops generating.
            resp.close()
            rec.status = 499
            return out, None
        if not complete:
            rec.extra["stream_interrupted"] = True
            return out, None
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
