"""Graceful shutdown: what SIGTERM does to `gateway serve` and `gateway worker`.

`serve` (aiohttp's runner, with half of `server.shutdown_grace_seconds` as its `shutdown_timeout`, which
it waits twice: `listener.runner_timeout`): the listening socket
closes at once (new connections are refused, so a load balancer moves on), idle keep-alive
connections close, in-flight requests and streams run to their end for up to the grace period and
are cut after it; then turns still being recorded finish and the fold workers stop.

Fold workers (in `serve` or `gateway worker`) stop taking jobs, let a running fold finish within
the same grace period, and then hand back what they still hold: a job left pending on a consumer
that is going away would otherwise wait `memory.worker.claim_idle_ms` before anyone reclaims it
(`worker.WorkerPool.stop`, `queue.FoldQueue.hand_back`).
"""

from __future__ import annotations

from aiohttp import web

from gateway.app import SETTINGS
from gateway.logs import get_logger

log = get_logger("gateway.shutdown")


async def log_draining(app: web.Application) -> None:
    """on_shutdown: runs once the listener is closed, before in-flight requests are waited for."""
    log.info("draining", grace_seconds=app[SETTINGS].server.shutdown_grace_seconds)
