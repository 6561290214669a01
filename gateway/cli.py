"""The `gateway` command: serve, worker, check-config, eval, demo.

`worker`, `eval` and `demo` live in their own modules and are imported only when run, so `serve`
starts without loading them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from yarl import URL

from gateway.config import ConfigError, Settings, load_settings, resolve_path


def redact_url(url: str) -> str:
    """A store URL fit for logs: any password replaced."""
    try:
        parsed = URL(url)
    except ValueError:
        return "<unparseable url>"
    return str(parsed.with_password("***")) if parsed.password else url


def config_problems(settings: Settings) -> list[str]:
    """Problems that only show when keys are read together (the schema checks each key alone)."""
    problems = []
    if settings.requires_client_keys() and not settings.auth.keys:
        problems.append("auth.keys: required when an upstreams.<name>.api_key is configured "
                        "(the gateway must not lend its upstream key to anyone who can reach the port)")
    return problems


def _load(path: str | None) -> Settings:
    settings = load_settings(path)
    problems = config_problems(settings)
    if problems:
        raise ConfigError(problems)
    return settings


def _print_problems(exc: ConfigError) -> None:
    print("configuration is invalid:", file=sys.stderr)
    for problem in exc.problems:
        print(f"  {problem}", file=sys.stderr)


def check_config(args: argparse.Namespace) -> int:
    path = resolve_path(args.config)
    try:
        settings = _load(args.config)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    print(f"configuration OK ({path or 'built-in defaults'})")
    print(f"  listen:     {settings.server.host}:{settings.server.port}")
    print(f"  store:      {redact_url(settings.store.url)}")
    for name, up in settings.upstreams.items():
        key = "own api_key" if up.api_key else "client credential forwarded"
        print(f"  upstream:   {name} → {up.base_url} ({key})")
    auth = f"{len(settings.auth.keys)} gateway client key(s)" if settings.auth.keys else "none (forward mode)"
    print(f"  auth:       {auth}")
    mem = settings.memory
    print(f"  memory:     {'on' if mem.enabled else 'off'}; rewrite over {mem.message_threshold} messages "
          f"or {mem.token_threshold} tokens; summarizer {settings.summarizer_mode()}")
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
    built lives as long as the process, so collections never need to see it (`gc.freeze`)."""
    gc.collect()
    gc.freeze()


def serve(args: argparse.Namespace) -> int:
    from gateway import logs
    from gateway.app import create_app

    try:
        settings = _load(args.config)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    server = settings.server
    logs.configure(args.log_format or server.log_format, server.log_level)
    log = logs.get_logger("gateway")
    host = args.host or server.host
    port = server.port if args.port is None else args.port
    app = create_app(settings)
    app.on_startup.append(_freeze_startup_heap)
    store_url = settings.store.url
    if store_url.startswith("memory://"):
        log.warning("store_embedded", store="memory://",
                    message="embedded in-process store: conversations are NOT persistent and not shared "
                            "between processes; set store.url to redis://… for real use")
    else:
        log.info("store", store=redact_url(store_url))
    log.info("listening", host=host, port=port, upstreams={n: u.base_url for n, u in settings.upstreams.items()},
             client_keys=bool(settings.auth.keys), memory=settings.memory.enabled)
    loop = _install_event_loop()
    asyncio.set_event_loop(loop)
    # handler_cancellation: a client that hangs up cancels its upstream call too.
    web.run_app(app, host=host, port=port, loop=loop, access_log=None, print=None, handler_cancellation=True)
    return 0


def _lazy(module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        result = importlib.import_module(module).main(args)
        return int(result or 0)

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
    s.set_defaults(run=serve)

    c = sub.add_parser("check-config", help="validate a config file, naming each wrong key")
    c.add_argument("--config", help=config_help)
    c.set_defaults(run=check_config)

    w = sub.add_parser("worker", help="run fold workers only (scale-out)")
    w.add_argument("--config", help=config_help)
    w.set_defaults(run=_lazy("gateway.worker"))

    e = sub.add_parser("eval", help="replay a data set through the gateway and report quality")
    e.add_argument("dataset", metavar="DATASET", help="JSONL replay file")
    e.add_argument("--config", help=config_help)
    e.add_argument("--summarizer", choices=("extractive", "llm"))
    e.add_argument("--settle", action="store_true", help="wait for folds to finish before each probe")
    e.add_argument("--json", metavar="OUT", help="write the results as JSON")
    e.add_argument("--limit", type=int, help="replay at most N conversations")
    e.set_defaults(run=_lazy("gateway.eval"))

    d = sub.add_parser("demo", help="offline tour against a simulated upstream")
    d.add_argument("--turns", type=int, default=None, help="conversation length")
    d.set_defaults(run=_lazy("gateway.demo"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
