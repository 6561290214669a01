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
from aiohttp.web_protocol import RequestPayloadError
from yarl import URL

from gateway import api, dashboard, paths
from gateway.activity import Activity, Noted
from gateway.config import Settings
from gateway.dialects import dialect_for_path
from gateway.logs import get_logger, quiet_answered_body_errors
from gateway.memory import Memory
from gateway.metrics import Metrics
from gateway.offload import Called, NotRelayed, Offload
from gateway.proxy import BODY_DEADLINE, PRELUDE, RECORD, GatewayError, MemoryHook, Proxy, Record, unreadable_body
from gateway.store import Store, StoreBusy, open_store
from gateway.summarizer import build_summarizer
from gateway.tokens import TokenCounter
from gateway.transport import HTTPClient
from gateway.worker import WorkerPool, start_workers

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger as BoundLogger

SETTINGS = web.AppKey("settings", Settings)
# The store (None: no store, pass-through only).
STORE: web.AppKey[Store | None] = web.AppKey("store")
HOOK: web.AppKey[MemoryHook | None] = web.AppKey("hook")
METRICS = web.AppKey("metrics", Metrics)
HTTP: web.AppKey[HTTPClient | None] = web.AppKey("http")  # towards the upstreams, open while the app runs
BACKGROUND: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("background")  # work that must not delay a reply
PROXY = web.AppKey("proxy", Proxy)
LOG: web.AppKey[BoundLogger] = web.AppKey("log")
ACTIVITY = web.AppKey("activity", Activity)
# The in-process fold workers (None: none run here), with the processes their fold CPU runs in.
FOLDS: web.AppKey[WorkerPool | None] = web.AppKey("folds")
# The offload process (gateway/offload.py), set by `gateway serve` on a shared store.
OFFLOAD: web.AppKey[Offload | None] = web.AppKey("offload")

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


async def _rerouted(request: web.Request, raw_path: str) -> tuple[web.Request, Handler]:
    """`request` routed again by its canonical path (aiohttp routes before any middleware runs)."""
    clone = request.clone(rel_url=URL(raw_path, encoded=True))
    match = await request.app.router.resolve(clone)
    match.add_app(request.app)
    match.freeze()
    clone._match_info = match  # what aiohttp's own dispatch sets before calling the handler
    return clone, match.handler


@web.middleware
async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    rec = Record(route=None, method=request.method, t0=perf_counter())
    offload = request.app.get(OFFLOAD)
    canon = paths.canonical(request.raw_path)
    if canon is not None and canon != request.raw_path:
        request, handler = await _rerouted(request, canon)
    request[RECORD] = rec
    try:
        if canon is None:
            rec.route = "unmatched"
            raise GatewayError(400, None, "the path climbs above the root")
        if offload is not None and offload.wants(request):
            relayed = await _offloaded(request, offload)
            if relayed is not None:
                return relayed  # (the offload process logged and counted it)
        response = await handler(request)
    except GatewayError as exc:
        # The log line says why the gateway answered itself (the caller got the same words).
        rec.extra["error"] = exc.message[:300]
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
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            # Not the client leaving (a backend's reset the handler did not wrap): the gateway's error.
            request.app[LOG].exception("unhandled_error", route=rec.route, method=rec.method)
            response = _error_response(request, 500, "internal gateway error")
        else:
            # The client left while its body was read (aiohttp raises this to the reader, not a
            # cancel): nothing to answer, and no error of the gateway's.
            rec.status = 499
            response = web.Response(status=400)
    except Exception:
        request.app[LOG].exception("unhandled_error", route=rec.route, method=rec.method)
        response = _error_response(request, 500, "internal gateway error")
    if rec.status != 499:
        rec.status = response.status
    if rec.gateway is not None and rec.conversation is not None and request.app[STORE] is not None:
        # Queued before the answer goes out, so whoever waits for the background work waits for it too.
        _note_activity(request.app, rec, rec.gateway)
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


async def _offloaded(request: web.Request, offload: Offload) -> web.StreamResponse | None:
    """The offload process's answer, or None: serve the request here (a chunked body that ended under
    the threshold, or an offload process that failed before answering), from the chunks already read."""
    seconds = request.app[SETTINGS].server.body_timeout_seconds
    deadline = request[BODY_DEADLINE] = asyncio.get_running_loop().time() + seconds
    try:
        prelude: list[bytes] = []
        if offload.declared(request) is None:
            try:
                prelude = await offload.take(request, deadline)
            except (asyncio.CancelledError, ConnectionResetError):
                request[RECORD].route = "offload"  # the client left before the sibling heard of it: its 499
                raise
            if sum(map(len, prelude)) <= offload.threshold:
                request[PRELUDE] = prelude
                return None
        return await offload.relay(request, prelude, deadline)
    except NotRelayed as exc:
        request.app[LOG].warning("offload.failed", error=str(exc), message="served in this process")
        request[PRELUDE] = exc.prelude
        return None
    except Called as exc:
        request[RECORD].route = "offload"
        request.app[LOG].error("offload.failed", error=str(exc), message="it had called the upstream: not sent again")
        # x-should-retry: the official SDKs would otherwise send it again on their own.
        raise GatewayError(502, None, "the gateway process serving this request exited after sending it to the "
                           "provider and before the answer came back; it was not sent again (the provider may "
                           "have run it)", {"x-should-retry": "false"}) from None
    except TimeoutError:
        request[RECORD].route = "offload"  # (logged and counted here: no handler ran)
        raise GatewayError(408, None, f"the request body did not arrive within {seconds:g} s") from None
    except RequestPayloadError as exc:
        request[RECORD].route = "offload"
        raise unreadable_body(exc) from None


def _finish(app: web.Application, rec: Record) -> None:
    if rec.route is None:
        return
    total = perf_counter() - rec.t0
    gateway_s = max(total - rec.upstream_s, 0.0)
    m = app[METRICS]
    provider = rec.provider or "none"
    model = app[SETTINGS].model_label(rec.model) if rec.provider else "none"
    m.requests.labels(rec.route, rec.context, str(rec.status), provider, model).inc()
    m.overhead.observe(gateway_s)
    if rec.upstream_s:
        m.upstream.labels(provider).observe(rec.upstream_s)
    if rec.usage is not None:
        m.observe_usage(provider, model, rec.usage)
    fields: dict[str, Any] = {
        "route": rec.route, "method": rec.method, "status": rec.status, "context": rec.context,
        "stream": rec.stream, "gateway_ms": round(gateway_s * 1000, 3), "upstream_ms": round(rec.upstream_s * 1000, 3),
    }
    if rec.model is not None:
        fields["model"] = rec.model
    if rec.conversation is not None:
        fields["conversation"] = rec.conversation
    if rec.tenant is not None:
        fields["tenant"] = rec.tenant
    if rec.request_id is not None:
        fields["upstream_request_id"] = rec.request_id
    if rec.usage is not None:
        fields["input_tokens"] = rec.usage.input_tokens
        fields["output_tokens"] = rec.usage.output_tokens
    gw = rec.gateway
    if gw is not None:
        # The decision's reason comes from the memory path's x-gateway-reason when it gives one.
        fields["reason"] = gw.get("x-gateway-reason")
        for name in ("original", "forwarded", "saved"):
            value = gw.get(f"x-gateway-tokens-{name}")
            if value is not None and value.lstrip("-").isdigit():
                fields[f"tokens_{name}"] = int(value)
        for name in ("original", "forwarded"):
            value = gw.get(f"x-gateway-cost-{name}")
            if value is not None and value.isdigit():
                fields[f"cost_{name}"] = int(value)  # expected billed input, fresh-token equivalents
        used = gw.get("x-gateway-window-used")
        if used is not None:
            fields["window_used"] = float(used)
    if rec.extra:
        fields.update(rec.extra)
    app[LOG].info("request", **fields)


def _note_activity(app: web.Application, rec: Record, gw: dict[str, str]) -> None:
    """What the dashboard and /gateway/stats show of this request (written to the store in batches)."""
    if rec.tenant is None or rec.conversation is None:
        return
    # A credential the provider refused is nobody's: noting it would let any caller add tenants to
    # the store. A passthrough or a failed request kept nothing: counted, but a row would list a
    # conversation the API then answers 404 for.
    if rec.status in (401, 403):
        return
    original, forwarded = (int(v) if (v := gw.get(f"x-gateway-tokens-{n}", "0")).isdigit() else 0
                           for n in ("original", "forwarded"))
    noted = Noted(tenant=rec.tenant, conversation=rec.conversation, project=rec.project, model=rec.model,
                  provider=rec.provider or "",
                  context=rec.context, reason=gw.get("x-gateway-reason"), status=rec.status,
                  tokens_original=original, tokens_forwarded=forwarded,
                  usd_per_mtok=app[SETTINGS].price(rec.model).input_usd_per_mtok, excerpts=rec.excerpts,
                  listed=rec.context != "passthrough" and rec.status < 400)
    app[ACTIVITY].note(noted)


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
        except StoreBusy:
            # Reachable, its pool taken: requests are still served (their turns queued for a retry),
            # and a probe that failed now would move load to replicas as full, then back.
            return web.json_response({"status": "ok", "store": "busy"})
        except Exception as exc:
            request.app[LOG].warning("store_unreachable", error=type(exc).__name__)
            ok = False
        if not ok:
            return web.json_response({"status": "unavailable", "store": "unreachable"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    offload = request.app.get(OFFLOAD)
    sibling = await offload.metrics() if offload is not None else None
    body, content_type = request.app[METRICS].render(sibling)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _gc_pauses(app: web.Application) -> AsyncIterator[None]:
    stop = app[METRICS].gc_pauses.watch()
    try:
        yield
    finally:
        stop()


async def _upstream_client(app: web.Application) -> AsyncIterator[None]:
    client = HTTPClient()
    app[HTTP] = client
    app[PROXY].client = client
    try:
        yield
    finally:
        await _flush_activity(app)
        # Background work (recording turns) may still be running: let it finish first.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain_background(app), timeout=30)
        tasks = app[BACKGROUND]
        for task in list(tasks):
            task.cancel()
        await client.close()


async def _memory_layer(app: web.Application) -> AsyncIterator[None]:
    """The memory hook over the store, and the in-process fold workers (`memory.worker.in_process`)."""
    settings = app[SETTINGS]
    store = app[STORE]
    owned = store is None
    if store is None:
        store = app[STORE] = await open_store(settings.store)
    counter = TokenCounter(settings.models)
    counter.count("warm up", settings.memory.summarizer.model)  # load the encoding now, not on a request
    hook = Memory(settings, store, counter, metrics=app[METRICS])
    await hook.warm()
    app[HOOK] = hook
    app[PROXY].hook = hook
    pool = summarizer = None
    if settings.memory.worker.in_process:
        model = settings.memory.summarizer.model
        # The summarizer has its own HTTP client (its own pools): folds never wait on requests' connections.
        summarizer = build_summarizer(settings, lambda text: counter.count(text, model))
        pool = app[FOLDS] = start_workers(store, settings, summarizer, metrics=app[METRICS])
    follow = asyncio.get_running_loop().create_task(hook.follow_store())
    try:
        yield
    finally:
        await _flush_activity(app)
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        # Turns are recorded in background tasks: they need the store, so they finish first.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain_background(app), timeout=30)
        # Turns the store could not take yet: a last chance to store them (the rest are counted, logged).
        await hook.close(settings.server.shutdown_grace_seconds)
        if pool is not None:
            await pool.stop(settings.server.shutdown_grace_seconds)
        if summarizer is not None:
            await summarizer.close()
        if owned:
            await store.close()


async def _flush_activity(app: web.Application) -> None:
    if app[STORE] is not None:
        with contextlib.suppress(Exception):  # the store is gone: nothing to keep the notes in
            await app[ACTIVITY].flush()


def create_app(settings: Settings, *, store: Any = None, hook: MemoryHook | None = None,
               memory: bool = True) -> web.Application:
    """The gateway app.

    `hook` given: that hook is the memory layer. Otherwise, with `memory` and `memory.enabled`, the
    app builds its own at start-up (the store from `store.url` unless `store` is given, the memory
    hook, in-process fold workers). `memory=False` (or no hook and `memory.enabled: false`) is a
    plain proxy: what the proxy's own tests and overhead benchmark run.
    """
    app = web.Application(middlewares=[edge], client_max_size=settings.server.max_body_bytes)
    quiet_answered_body_errors()
    app[SETTINGS] = settings
    app[STORE] = store
    app[HOOK] = hook
    app[METRICS] = Metrics()
    app[BACKGROUND] = set()
    app[HTTP] = None
    app[FOLDS] = None
    app[LOG] = get_logger("gateway")
    proxy = Proxy(settings, app[METRICS], hook, partial(spawn, app))
    app[ACTIVITY] = Activity(lambda: app[STORE], partial(spawn, app))
    app[PROXY] = proxy
    app.cleanup_ctx.append(_gc_pauses)
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
    dashboard.add_routes(app)
    # Everything else under /v1, OpenAI's own Conversations API (/v1/conversations…) included.
    r.add_route("*", "/v1/{tail:.*}", forward("/v1/*"))
    return app


def _conversation_api(app: web.Application) -> None:
    # The conversation routes answer 404 while no store is set.
    def count(text: str) -> int:
        hook = app[HOOK]
        tokens = getattr(hook, "tokens", None)
        return tokens.count(text) if tokens is not None else len(text) // 4

    conversations = api.ConversationAPI(app, app[SETTINGS], STORE, HOOK, count, activity_key=ACTIVITY,
                                         metrics_key=METRICS)
    for route, method, handler in api.routes(conversations):
        name = "/gateway/stats" if route.endswith("/stats") else "/gateway/conversations"
        app.router.add_route(method, route, _routed(name, handler))


async def _bind_hook(app: web.Application) -> None:
    # A hook set on the app after create_app (e.g. by `gateway serve`) is the one the proxy uses.
    app[PROXY].hook = app[HOOK]
