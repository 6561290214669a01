"""Turns the store could not take when their request was answered, recorded later, in order.

A request whose turn cannot be stored (the store busy past `store.pool_wait_seconds`, or
unreachable) has already been answered: its turn goes here instead of being dropped. A few tasks
(`PARALLEL`) store the queued turns, oldest first, several conversations at once but one entry per
conversation at a time and in the order queued, so a conversation's turns keep their order; an
entry the store refuses again stays queued and is retried with backoff. The queue holds at most
`store.retry_queue_size` entries and `store.retry_queue_bytes` of them (an entry holds its request's
parsed history: a long outage with full-history clients must not grow the process until it is
killed, losing every queued turn): past either, a new one is dropped, counted and logged as an
error; so are those still queued when the process stops after its grace.

`gateway_unrecorded_total{result}`: `queued` (a request could not record its turn), `recorded` (a
queued one was stored later), `dropped` (queue full or shutdown: lost), `failed` (the retry itself
raised something other than the store being away: a bug, logged with its traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.store import StoreUnavailable

log = structlog.get_logger("gateway.backlog")

Record = Callable[[], Awaitable[None]]

# Entries stored at once: enough that a burst of failures drains while live traffic holds the pool,
# few enough that a store coming back is not flooded by retries.
PARALLEL = 16


@dataclass(slots=True, eq=False)
class _Entry:
    key: Hashable  # the conversation: its entries are stored one at a time, in order
    label: str  # for the logs
    record: Record
    weight: int = 0  # bytes it holds
    attempts: int = 0


class Backlog:
    """A bounded queue of deferred recordings and the tasks that drain it (see the module's docstring)."""

    def __init__(self, size: int, *, max_bytes: int = 1 << 62, metrics: Any = None, first_delay: float = 0.05,
                 max_delay: float = 2.0, parallel: int = PARALLEL) -> None:
        self.size, self.max_bytes, self.parallel = size, max_bytes, parallel
        self.bytes = 0
        self.metrics = metrics
        self.first_delay, self.max_delay = first_delay, max_delay
        self._entries: deque[_Entry] = deque()
        self._busy: set[Hashable] = set()  # conversations with an entry being stored now
        self._queued: dict[Hashable, int] = {}  # entries queued per conversation
        self._tasks: set[asyncio.Task[None]] = set()
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: Hashable) -> bool:
        """Whether turns of conversation `key` wait here: a later turn of it must queue behind them."""
        return key in self._queued

    def put(self, key: Hashable, label: str, record: Record, error: str, weight: int = 0) -> bool:
        """Queue `record` (a coroutine function that stores one request's turns, holding `weight`
        bytes) for conversation `key`; False if it was dropped because the queue is full. Call with
        the event loop running."""
        if len(self._entries) >= self.size or self.bytes + weight > self.max_bytes:
            self._count("dropped")
            log.error("memory.unrecorded_dropped", conversation=label, error=error, queued=len(self._entries),
                      queued_bytes=self.bytes,
                      detail="retry queue full (store.retry_queue_size / retry_queue_bytes): this turn is not stored")
            return False
        self.bytes += weight
        self._queued[key] = self._queued.get(key, 0) + 1
        self._entries.append(_Entry(key, label, record, weight))
        self._empty.clear()
        self._count("queued")
        self._gauge()
        log.warning("memory.unrecorded_queued", conversation=label, error=error, queued=len(self._entries))
        if len(self._tasks) < self.parallel:
            task = asyncio.get_running_loop().create_task(self._drain(), name="record-backlog")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    async def join(self) -> None:
        """Wait until every queued recording is stored (or given up)."""
        await self._empty.wait()

    async def close(self, grace: float) -> None:
        """Let the queue drain for up to `grace` seconds, then drop (count, log) what is left."""
        if self._entries:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), timeout=grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._entries:
            log.error("memory.unrecorded_dropped", queued=len(self._entries),
                      detail="the store did not take these turns before shutdown: not stored")
            self._count("dropped", len(self._entries))
            self._entries.clear()
            self._queued.clear()
            self.bytes = 0
            self._gauge()
        self._empty.set()

    def _next(self) -> _Entry | None:
        """The oldest entry of a conversation no other drainer is storing now."""
        for entry in self._entries:
            if entry.key not in self._busy:
                return entry
        return None

    async def _drain(self) -> None:
        delay = self.first_delay
        while (entry := self._next()) is not None:
            self._busy.add(entry.key)
            entry.attempts += 1
            refused: StoreUnavailable | None = None
            try:
                await entry.record()
            except StoreUnavailable as exc:
                refused = exc
            except Exception:
                log.exception("memory.unrecorded_failed", conversation=entry.label)
                self._count("failed")
            else:
                self._count("recorded")
                log.info("memory.unrecorded_recorded", conversation=entry.label, attempts=entry.attempts)
            finally:
                self._busy.discard(entry.key)
            if refused is not None:
                # The store still refuses: the entry stays first of its conversation, tried again later.
                if entry.attempts == 1 or entry.attempts % 50 == 0:
                    log.info("memory.unrecorded_waiting", conversation=entry.label, error=type(refused).__name__,
                             attempts=entry.attempts, queued=len(self._entries))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_delay)
                continue
            self._entries.remove(entry)
            self.bytes -= entry.weight
            if self._queued[entry.key] <= 1:
                del self._queued[entry.key]
            else:
                self._queued[entry.key] -= 1
            self._gauge()
            delay = self.first_delay
        if not self._entries:
            self._empty.set()

    def _count(self, result: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.unrecorded.labels(result).inc(n)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.unrecorded_pending.set(len(self._entries))
