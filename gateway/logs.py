"""Structured logging: one JSON line per event (orjson, bytes straight to the file), or a console view.

Configured once per process by the CLI (structlog's configuration is process-wide by nature).
Loggers are created by `get_logger()` *after* `configure()` so the cached fast path binds to the
configured pipeline. JSON lines are written in batches (at most `FLUSH_SECONDS` late, at once
outside an event loop, and at exit): one write per request would be a syscall on the hot path.
Nothing here ever receives a header map: callers log chosen fields only,
which is how credentials stay out of the logs.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
from typing import IO, Any, Literal, TextIO, cast

import orjson
import structlog
from aiohttp.web_protocol import RequestPayloadError

LogFormat = Literal["json", "console"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


FLUSH_SECONDS = 0.05
_FLUSH_BYTES = 64 * 1024


class BatchedBytesLogger:
    """A structlog logger writing bytes lines to a binary file in batches."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._buf: list[bytes] = []
        self._size = 0
        self._scheduled = False
        atexit.register(self.flush)

    def msg(self, message: bytes) -> None:
        self._buf.append(message + b"\n")
        self._size += len(message) + 1
        if self._size >= _FLUSH_BYTES:
            self.flush()
        elif not self._scheduled:
            try:
                asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)
            except RuntimeError:
                self.flush()
                return
            self._scheduled = True

    log = debug = info = warn = warning = error = err = critical = exception = fatal = failure = msg

    def flush(self) -> None:
        self._scheduled = False
        if not self._buf:
            return
        data, self._buf, self._size = b"".join(self._buf), [], 0
        try:
            self._file.write(data)
            self._file.flush()
        except (OSError, ValueError):
            pass  # stdout closed at shutdown: nothing left to tell


def _orjson_dumps(obj: Any, default: Any = None) -> bytes:
    return orjson.dumps(obj, default=default or str)


def configure(fmt: LogFormat = "json", level: str = "info", stream: IO[Any] | None = None) -> None:
    """Route structlog output to `stream` (default stdout) in `fmt`, dropping events below `level`."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    factory: Any
    if fmt == "json":
        processors = [*shared, structlog.processors.format_exc_info,
                      structlog.processors.JSONRenderer(serializer=_orjson_dumps)]
        out: Any = stream if stream is not None else sys.stdout
        shared_logger = BatchedBytesLogger(getattr(out, "buffer", out))
        factory = lambda *args: shared_logger  # noqa: E731
    else:
        processors = [*shared, structlog.dev.ConsoleRenderer(colors=stream is None and sys.stdout.isatty())]
        factory = structlog.PrintLoggerFactory(cast(TextIO, stream) if stream is not None else sys.stdout)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


class _AnsweredBodyErrors(logging.Filter):
    """aiohttp drains a request body after its handler answered, and logs a traceback ("Unhandled
    exception") when that body cannot be read (a corrupt gzip): the gateway has already answered it
    400 in the caller's format, and its request line says why."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, RequestPayloadError)


def quiet_answered_body_errors() -> None:
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _AnsweredBodyErrors) for f in server.filters):
        server.addFilter(_AnsweredBodyErrors())


def get_logger(name: str = "gateway") -> Any:
    return structlog.get_logger(name)


def flush() -> None:
    """Write out buffered log lines now (tests, shutdown)."""
    logger = structlog.get_config()["logger_factory"]()
    if isinstance(logger, BatchedBytesLogger):
        logger.flush()
