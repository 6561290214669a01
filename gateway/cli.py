"""The `gateway` command: serve, worker, check-config, eval, stats, demo (each command's work lives in
its own module; this one parses arguments and starts the server)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import structlog
from aiohttp import web

from gateway import demo, listener, logs, preflight, savings, worker
from gateway import eval as evaluation
from gateway.app import OFFLOAD, create_app
from gateway.config import ConfigError, ServerSettings, Settings, default_env, load_settings, resolve_path
from gateway.offload import MARKS, NICE, PROCESS_LABEL, Offload
from gateway.preflight import redact_url
from gateway.shutdown import log_draining


def config_problems(settings: Settings, listen: tuple[str, int] | None = None) -> list[str]:
    """Problems that only show when keys are read together (the schema checks each key alone)."""
    return preflight.problems(settings, listen)


def _load(path: str | None, host: str | None = None, port: int | None = None) -> Settings:
    def checks(settings: Settings) -> list[str]:
        return config_problems(settings, (host or settings.server.host, settings.server.port if port is None else port))

    return load_settings(path, checks, environ=True)


def _print_problems(exc: ConfigError) -> None:
    print("configuration is invalid:", file=sys.stderr)
    for problem in exc.problems:
        print(f"  {problem}", file=sys.stderr)


def check_config(args: argparse.Namespace) -> int:
    if args.path is not None:
        if args.config is not None and args.config != args.path:
            print(f"two config files given ({args.path} and --config {args.config}): name one", file=sys.stderr)
            return 2
        args.config = args.path
    path = resolve_path(args.config)
    try:
        settings = _load(args.config)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    used = list(default_env()) if path is None else []
    print(f"configuration OK ({path or 'built-in defaults'}{', with $' + ', $'.join(used) if used else ''})")
    print(f"  listen:     {settings.server.host}:{settings.server.port}")
    print(f"  store:      {redact_url(settings.store.url)}")
    for name, up in settings.upstreams.items():
        key = "own api_key" if up.api_key else "client credential forwarded"
        print(f"  upstream:   {name} → {redact_url(up.base_url)} ({key})")
    auth = f"{len(settings.auth.keys)} gateway client key(s)" if settings.auth.keys else "none (forward mode)"
    print(f"  auth:       {auth}")
    mem = settings.memory
    print(f"  memory:     {'on' if mem.enabled else 'off'}; rewrite over {mem.message_threshold} messages "
          f"or {mem.token_threshold} tokens; summarizer {settings.summarizer_mode()}; policy {mem.policy}")
    if (paid := preflight.paid_summaries(settings)) is not None:
        print(f"  note:       {paid}")
    for warning in preflight.warnings(settings):
        print(f"  warning:    {warning}")
    for name in settings.unpriced_models():
        print(f"  warning:    model {name!r} matches no pricing entry: priced as pricing.default (no price, no "
              "prompt caching assumed); add a pricing.<name> entry for it")
    return 0


def _install_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _freeze_startup_heap(app: web.Application) -> None:
    """Move everything alive after start-up (modules, settings, the tokenizer) out of the cyclic GC.

    A full collection walks every tracked object, and it runs on the event loop: with the start-up
    heap in it, each one paused all requests for ~25-55 ms in the overhead bench. What start-up
    built lives as long as the process, so collections never need to see it (`gc.freeze`).

    The thresholds go up from CPython's (700, 10, 10): a request parses a body of hundreds of
    messages, so the default ran a young collection several times per request, each walking that
    live body, and every 100th of them a full one over the caches (docs/architecture.md, Limits)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7_000, 20, 20)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = _load(args.config, args.host, args.port)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    server = settings.server
    logs.configure(args.log_format or server.log_format, server.log_level)
    if args.offload_socket:
        return _serve_offloaded(settings, args.offload_socket)
    log = logs.get_logger("gateway")
    host = args.host or server.host
    port = server.port if args.port is None else args.port
    store_url = settings.store.url
    offload = None
    if not store_url.startswith("memory://") and server.offload and settings.memory.enabled:
        offload = Offload(server.offload_body_bytes, server.max_body_bytes, args.config,
                          server.shutdown_grace_seconds, args.log_format, server.offload_health_seconds)
    app = create_app(settings)
    app.on_startup.append(_freeze_startup_heap)
    app.on_shutdown.append(log_draining)
    if store_url.startswith("memory://"):
        log.warning("store_embedded", store="memory://",
                    message="embedded in-process store: conversations are NOT persistent and not shared "
                            "between processes; set store.url to redis://… for real use")
    else:
        log.info("store", store=redact_url(store_url))
    for warning in preflight.warnings(settings):
        log.info("config_note", message=warning)  # (a documented setup: check-config is where it warns)
    if (paid := preflight.paid_summaries(settings)) is not None:
        summarizer = settings.memory.summarizer
        log.info("summarizer", mode="llm", model=summarizer.model, upstream=summarizer.upstream, message=paid)
    if offload is not None:
        _offload(app, offload)
    loop = _install_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(app, server, host, port, lambda: log.info(
            "listening", host=host, port=port,
            upstreams={n: redact_url(u.base_url) for n, u in settings.upstreams.items()},
            client_keys=bool(settings.auth.keys), memory=settings.memory.enabled)))
    except OSError as exc:  # the port is taken, the address is not this host's, …
        log.error("listen_failed", host=host, port=port, error=exc.strerror or str(exc),
                  message=f"cannot listen on {host}:{port}; choose another with --port or server.port")
        return 1
    return 0


def _offload(app: web.Application, offload: Offload) -> None:
    """Large bodies go to a sibling process (gateway/offload.py) while this app runs."""
    async def start(app: web.Application) -> None:
        await offload.start()

    async def stop(app: web.Application) -> None:
        # (on_cleanup: after the requests in flight, relayed ones included, have been answered)
        await offload.close()

    app[OFFLOAD] = offload  # (it takes no request until its process answers)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)


def _without_fold_workers(settings: Settings) -> Settings:
    mem = settings.memory
    return settings.model_copy(update={"memory": mem.model_copy(
        update={"worker": mem.worker.model_copy(update={"in_process": 0})})})


def _serve_offloaded(settings: Settings, path: str) -> int:
    """The offload process: this app on a Unix socket, for the `gateway serve` that started it. It
    runs no fold workers: a fold committed in another process costs the serving one a reload of
    the conversation's view (docs/architecture.md, Known views), so they stay with the serving
    process. It stops at SIGTERM or when its stdin (a pipe from the parent) ends."""
    settings = _without_fold_workers(settings)
    with contextlib.suppress(OSError):
        os.nice(NICE)  # the serving process goes first when both want the CPU
    structlog.contextvars.bind_contextvars(process_role=PROCESS_LABEL)
    app = create_app(settings)
    app[MARKS] = os.path.dirname(path)
    app.on_startup.append(_freeze_startup_heap)
    loop = _install_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(_serve_unix(app, settings.server, path))
    return 0


async def _serve_unix(app: web.Application, limits: ServerSettings, path: str) -> None:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=limits.keepalive_timeout_seconds,
                           max_line_size=listener.MAX_REQUEST_LINE,
                           shutdown_timeout=listener.runner_timeout(limits.shutdown_grace_seconds))
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # The parent's end of our stdin closes when it exits, however it exits.
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    orphaned = loop.create_task(reader.read())
    orphaned.add_done_callback(lambda _: stop.set())
    try:
        site = web.UnixSite(runner, path)
        await site.start()
        await stop.wait()
    finally:
        orphaned.cancel()
        await runner.cleanup()
        # (The parent removes it too, unless it was killed.)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


async def _serve(app: web.Application, limits: ServerSettings, host: str, port: int,
                 listening: Callable[[], None]) -> None:
    """Serve until SIGINT or SIGTERM, under the `server.*` limits (gateway/listener.py)."""
    # handler_cancellation: a client that hangs up cancels its upstream call too.
    runner, sock = await listener.start(app, limits, host, port, handler_cancellation=True)
    listening()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        sock.close()
        await runner.cleanup()


def _command(module: ModuleType) -> Any:
    """Run `module.main(args)`, looked up when the command runs."""
    def run(args: argparse.Namespace) -> int:
        return int(module.main(args) or 0)

    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description="Memory Gateway: a conversation-memory proxy")
    sub = p.add_subparsers(dest="command", required=True)
    config_help = "YAML config file (default: $GATEWAY_CONFIG, else built-in defaults)"

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", help=config_help)
    s.add_argument("--host", help="listen address (default: server.host, 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default: server.port, 8080)")
    s.add_argument("--log-format", choices=("json", "console"), help="default: server.log_format")
    # Internal: what `gateway serve` starts its offload process with (gateway/offload.py).
    s.add_argument("--offload-socket", help=argparse.SUPPRESS)
    s.set_defaults(run=serve)

    c = sub.add_parser("check-config", help="validate a config file, naming each wrong key")
    c.add_argument("--config", help=config_help)
    # `gateway check-config my.yaml` is what people type first.
    c.add_argument("path", nargs="?", metavar="PATH", help="the config file (same as --config)")
    c.set_defaults(run=check_config)

    w = sub.add_parser("worker", help="run fold workers only (scale-out)")
    w.add_argument("--config", help=config_help)
    w.set_defaults(run=_command(worker))

    e = sub.add_parser("eval", help="replay a data set through the gateway and report quality")
    evaluation.add_arguments(e)
    e.set_defaults(run=_command(evaluation))

    st = sub.add_parser("stats", help="the savings table of a running gateway")
    st.add_argument("--url", help="the gateway's address (default: http://127.0.0.1:8080)")
    st.add_argument("--key", help="the API key an application uses through the gateway, or the admin token "
                                  "(default: $GATEWAY_KEY, else $OPENAI_API_KEY)")
    st.set_defaults(run=_command(savings))

    d = sub.add_parser("demo", help="offline tour against a simulated upstream")
    d.add_argument("--turns", type=_positive, default=None, help="conversation length (at least 1)")
    d.add_argument("--serve", action="store_true", help="keep the gateway running afterwards, for the dashboard")
    d.add_argument("--port", type=int, default=None, help="with --serve: the gateway's port (default 8080)")
    d.set_defaults(run=_command(demo))
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "demo" and args.port is not None and not args.serve:
        # Without --serve the demo's gateway lives only while it runs, on a port of its own.
        p.error("demo: --port goes with --serve (the tour alone opens no port for you)")
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
