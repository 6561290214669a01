"""`create_app(settings)`: routes, the edge middleware, typed app state and resource lifetimes.

The edge middleware is the one place a request is timed, logged and counted, and the one place
errors are rendered (in the caller's dialect: known from the path, else from `anthropic-version`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.config import Settings
from gateway.dialects import dialect_for_path
from gateway.logs import get_logger
from gateway.metrics import Metrics
from gateway.proxy import RECORD, GatewayError, MemoryHook, Proxy, Record
from gateway.transport import HTTPClient

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger as BoundLogger

    from gateway.store import Store

SETTINGS = web.AppKey("settings", Settings)
# The store (None: no store, pass-through only); typed here only, so a plain proxy never imports it.
STORE: web.AppKey[Store | None] = web.AppKey("store")
HOOK: web.AppKey[MemoryHook | None] = web.AppKey("hook")
METRICS = web.AppKey("metrics", Metrics)
HTTP: web.AppKey[HTTPClient | None] = web.AppKey("http")  # towards the upstreams, open while the app runs
BACKGROUND: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("background")  # work that must not delay a reply
PROXY = web.AppKey("proxy", Proxy)
LOG: web.AppKey[BoundLogger] = web.AppKey("log")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def spawn(app: web.Application, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run `coro` in the background, tracked so shutdown (and tests) can wait for it."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks: set[asyncio.Task[None]] = app[BACKGROUND]
    tasks.add(task)

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            app[LOG].error("background_task_failed", exc_info=t.exception())

    task.add_done_callback(done)
    return task


async def drain_background(app: web.Application) -> None:
    """Wait until every background task (including ones spawned meanwhile) has finished."""
    tasks = app[BACKGROUND]
    while tasks:
        await asyncio.gather(*list(tasks), return_exceptions=True)


def _error_response(request: web.Request, status: int, message: str,
                    headers: dict[str, str] | None = None) -> web.Response:
    dialect = dialect_for_path(request.path, request.headers)
    err = GatewayError(status, None, message, headers)
    return web.Response(status=status, body=dialect.error_body(status, err.type, message),
                        content_type="application/json", headers=err.headers)


@web.middleware
async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    rec = Record(route=None, method=request.method, t0=perf_counter())
    request[RECORD] = rec
    try:
        response = await handler(request)
    except GatewayError as exc:
        dialect = dialect_for_path(request.path, request.headers)
        response = web.Response(status=exc.status, body=dialect.error_body(exc.status, exc.type, exc.message),
                                content_type="application/json", headers=exc.headers)
    except web.HTTPException as exc:
        # The router's 404 and the body limit's 413, re-rendered for the caller's SDK.
        if exc.status == 404:
            message = f"no route for {request.method} {request.path}"
            rec.route = "unmatched"
        else:
            message = exc.text or exc.reason
        extra = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = _error_response(request, exc.status, message, extra)
    except asyncio.CancelledError:
        rec.status = 499  # client closed the connection
        _finish(request.app, rec)
        raise
    except Exception:
        request.app[LOG].exception("unhandled_error", route=rec.route, method=rec.method)
        response = _error_response(request, 500, "internal gateway error")
    if rec.status != 499:
        rec.status = response.status
    if rec.route is not None:
        # Send the answer before the log line and metrics: they are not what the client waits for.
        # aiohttp's own prepare/write_eof after the handler are then no-ops.
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            rec.status = 499
    _finish(request.app, rec)
    return response


def _finish(app: web.Application, rec: Record) -> None:
    if rec.route is None:
        return
    total = perf_counter() - rec.t0
    gateway_s = max(total - rec.upstream_s, 0.0)
    m = app[METRICS]
    m.requests.labels(rec.route, rec.context, str(rec.status)).inc()
    m.overhead.observe(gateway_s)
    if rec.upstream_s:
        m.upstream.observe(rec.upstream_s)
    fields: dict[str, Any] = {
        "route": rec.route, "method": rec.method, "status": rec.status, "context": rec.context,
        "stream": rec.stream, "gateway_ms": round(gateway_s * 1000, 3), "upstream_ms": round(rec.upstream_s * 1000, 3),
    }
    if rec.conversation is not None:
        fields["conversation"] = rec.conversation
    if rec.tenant is not None:
        fields["tenant"] = rec.tenant
    if rec.request_id is not None:
        fields["upstream_request_id"] = rec.request_id
    if rec.usage is not None:
        fields["input_tokens"] = rec.usage.input_tokens
        fields["output_tokens"] = rec.usage.output_tokens
    if rec.extra:
        fields.update(rec.extra)
    app[LOG].info("request", **fields)


def _routed(route: str, handler: Handler) -> Handler:
    async def named(request: web.Request) -> web.StreamResponse:
        request[RECORD].route = route
        return await handler(request)

    return named


def _method_not_allowed(allowed: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise GatewayError(405, None, f"method {request.method} is not allowed on {request.path}", {"Allow": allowed})

    return handler


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    store = request.app[STORE]
    if store is not None:
        try:
            ok = bool(await store.ping())
        except Exception as exc:
            request.app[LOG].warning("store_unreachable", error=type(exc).__name__)
            ok = False
        if not ok:
            return web.json_response({"status": "unavailable", "store": "unreachable"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _upstream_client(app: web.Application) -> AsyncIterator[None]:
    client = HTTPClient()
    app[HTTP] = client
    app[PROXY].client = client
    try:
        yield
    finally:
        # Background work (recording turns) may still be running: let it finish first.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain_background(app), timeout=30)
        tasks = app[BACKGROUND]
        for task in list(tasks):
            task.cancel()
        await client.close()


async def _memory_layer(app: web.Application) -> AsyncIterator[None]:
    """The memory hook over the store, and the in-process fold workers (`memory.worker.in_process`)."""
    # Imported here: a plain proxy (memory=False) must not depend on the memory modules.
    from gateway.memory import Memory
    from gateway.store import open_store
    from gateway.summarizer import build_summarizer
    from gateway.tokens import TokenCounter
    from gateway.worker import start_workers

    settings = app[SETTINGS]
    store = app[STORE]
    owned = store is None
    if store is None:
        store = app[STORE] = await open_store(settings.store)
    counter = TokenCounter(settings.models)
    counter.count("warm up", settings.memory.summarizer.model)  # load the encoding now, not on a request
    hook = Memory(settings, store, counter, metrics=app[METRICS])
    app[HOOK] = hook
    app[PROXY].hook = hook
    pool = summarizer = None
    if settings.memory.worker.in_process:
        model = settings.memory.summarizer.model
        # The summarizer has its own aiohttp session: folds are background work, off the hot path.
        summarizer = build_summarizer(settings, lambda text: counter.count(text, model))
        pool = start_workers(store, settings, summarizer, metrics=app[METRICS])
    follow = asyncio.get_running_loop().create_task(hook.follow_store())
    try:
        yield
    finally:
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        # Turns are recorded in background tasks: they need the store, so they finish first.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain_background(app), timeout=30)
        if pool is not None:
            await pool.stop()
        if summarizer is not None:
            await summarizer.close()
        if owned:
            await store.close()


def create_app(settings: Settings, *, store: Any = None, hook: MemoryHook | None = None,
               memory: bool = True) -> web.Application:
    """The gateway app.

    `hook` given: that hook is the memory layer. Otherwise, with `memory` and `memory.enabled`, the
    app builds its own at start-up (the store from `store.url` unless `store` is given, the memory
    hook, in-process fold workers). `memory=False` (or no hook and `memory.enabled: false`) is a
    plain proxy: what the proxy's own tests and overhead benchmark run.
    """
    app = web.Application(middlewares=[edge], client_max_size=settings.server.max_body_bytes)
    app[SETTINGS] = settings
    app[STORE] = store
    app[HOOK] = hook
    app[METRICS] = Metrics()
    app[BACKGROUND] = set()
    app[HTTP] = None
    app[LOG] = get_logger("gateway")
    proxy = Proxy(settings, app[METRICS], hook, partial(spawn, app))
    app[PROXY] = proxy
    app.cleanup_ctx.append(_upstream_client)
    if hook is None and memory and settings.memory.enabled:
        app.cleanup_ctx.append(_memory_layer)
    else:
        app.on_startup.append(_bind_hook)

    def forward(route: str, *, memory: bool = False, json_body: bool = False) -> Handler:
        return _routed(route, partial(proxy.handle, memory=memory, json_body=json_body))

    r = app.router
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r.add_post(path, forward(path, memory=True, json_body=True))
    # OpenAI lists stored chat completions with GET on the same path: that is a pass-through.
    r.add_get("/v1/chat/completions", forward("/v1/chat/completions"), allow_head=False)
    r.add_post("/v1/messages/count_tokens", forward("/v1/messages/count_tokens", json_body=True))
    r.add_get("/v1/models", forward("/v1/models"), allow_head=False)
    for path, allowed in (("/v1/chat/completions", "GET, POST"), ("/v1/responses", "POST"),
                          ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"),
                          ("/v1/models", "GET")):
        r.add_route("*", path, _method_not_allowed(allowed))
    r.add_get("/healthz", healthz, allow_head=False)
    r.add_get("/readyz", readyz, allow_head=False)
    r.add_get("/metrics", metrics, allow_head=False)
    _conversation_api(app)
    r.add_route("*", "/v1/{tail:.*}", forward("/v1/*"))
    return app


def _conversation_api(app: web.Application) -> None:
    from gateway import api  # the conversation routes; they answer 404 while no store is set

    def count(text: str) -> int:
        hook = app[HOOK]
        tokens = getattr(hook, "tokens", None)
        return tokens.count(text) if tokens is not None else len(text) // 4

    conversations = api.ConversationAPI(app, app[SETTINGS], STORE, HOOK, count)
    for route, method, handler in api.routes(conversations):
        app.router.add_route(method, route, _routed("/v1/conversations", handler))


async def _bind_hook(app: web.Application) -> None:
    # A hook set on the app after create_app (e.g. by `gateway serve`) is the one the proxy uses.
    app[PROXY].hook = app[HOOK]
