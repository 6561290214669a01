"""Fold workers: jobs on a Redis Stream, consumed by a group, committed by compare-and-set.

The loop (after arq): poll → claim → run → record. A job names a conversation; the worker works
out what to fold at the time it runs (`fold.fold_target`), so a duplicate or stale job is a
harmless no-op. Delivery is at-least-once and the commit idempotent:

- poll: first this consumer's own pending jobs (a retry after a breaker pause; not asked while
  the worker knows it has none), then jobs of crashed consumers idle longer than
  `worker.claim_idle_ms` (XAUTOCLAIM; after one that found none, not asked again for
  `_POLL_SECONDS`), then new ones (`>`).
- claim: a per-conversation lock (SET NX PX) so one fold per conversation runs at a time; a
  heartbeat keeps the lock and the job's idle time fresh while a long fold runs.
- run: load summary + aged messages, summarize, `store.commit_fold(expect_version=…)`. The CAS
  keeps turns that arrived meanwhile in the window and refuses a fold a branch made stale.
- record: stats and metrics; `fold_done`, then re-check: if the conversation still needs a fold
  (turns kept arriving), enqueue it; finally XACK + XDEL.

Failures are retried with backoff (`retry_base_seconds` × 2^n); `max_failures` in a row open a
circuit breaker for `breaker_seconds`: jobs stay queued, requests keep flowing on window + markers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from gateway import fold, state
from gateway.config import Settings
from gateway.keys import ConvRef, Keys
from gateway.logs import get_logger
from gateway.model import Summary
from gateway.store import StoreUnavailable

log = get_logger("gateway.worker")

# Atomic "delete if still mine": a lock that expired and was taken by another worker is not freed.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_POLL_SECONDS = 0.5
_BLOCK_MS = 1000


@dataclass(slots=True)
class Breaker:
    """Stops folding after `max_failures` failures in a row, for `seconds`; shared by a pool."""

    max_failures: int
    seconds: float
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    open_until: float = 0.0

    def is_open(self) -> bool:
        return self.clock() < self.open_until

    def remaining(self) -> float:
        return max(0.0, self.open_until - self.clock())

    def success(self) -> None:
        self.failures = 0

    def failure(self) -> bool:
        """Count a failure; True when this one opened (or re-opened) the breaker."""
        self.failures += 1
        if self.failures >= self.max_failures:
            self.open_until = self.clock() + self.seconds
            return True
        return False


@dataclass(slots=True)
class Job:
    id: str
    ref: ConvRef
    urgent: bool
    attempts: int = field(default=0)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_job(job_id: Any, fields: dict[Any, Any] | None) -> Job | None:
    if not fields:
        return None  # the entry was deleted from the stream: only its pending record is left
    f = {_s(k): _s(v) for k, v in fields.items()}
    if "t" not in f or "c" not in f:
        return None
    return Job(id=_s(job_id), ref=ConvRef(f["t"], f["c"], f.get("p") or None), urgent=f.get("u") == "1")


class LedgerCache:
    """Validated ledgers by state key, each with the JSON it was read or written as (LRU).

    Most folds leave the ledger as it was, so the next fold reads the same JSON back: comparing
    it with the JSON last seen (one C-level dict comparison) replaces validating it again
    (pydantic, ~1.5 us an item, up to state.MAX_ITEMS). A ledger is never changed in place
    (extract and apply_update work on copies), so the same object can be handed out again.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._by_key: OrderedDict[str, tuple[dict[str, Any], state.Ledger]] = OrderedDict()

    def load(self, key: str, data: dict[str, Any] | None) -> state.Ledger:
        """`state.load(data)`, without validating `data` again when it is the JSON last seen for `key`."""
        if not data:
            return state.load(data)
        known = self._by_key.get(key)
        if known is not None and known[0] == data:
            self._by_key.move_to_end(key)
            return known[1]
        ledger = state.load(data)
        self.remember(key, data, ledger)
        return ledger

    def remember(self, key: str, data: dict[str, Any], ledger: state.Ledger) -> None:
        self._by_key[key] = (data, ledger)
        self._by_key.move_to_end(key)
        if len(self._by_key) > self.size:
            self._by_key.popitem(last=False)


class _Proposal(NamedTuple):
    """A ledger update computed ahead of its CAS write: from `ledger` at `version`, `updated`."""

    ledger: state.Ledger
    updated: state.Ledger
    version: int
    tokens_in: int
    tokens_out: int


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class FoldWorker:
    def __init__(self, store: Any, settings: Settings, summarizer: Any, *, metrics: Any = None,
                 name: str | None = None, breaker: Breaker | None = None) -> None:
        self.store = store
        self.settings = settings
        self.summarizer = summarizer
        self.local = bool(getattr(summarizer, "local", False))  # see fold.run_local
        self._ledgers = LedgerCache()
        self.metrics = metrics
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        w = settings.memory.worker
        self.breaker = breaker or Breaker(w.max_failures, w.breaker_seconds)
        self.redis: Any = store.redis  # redis.asyncio.Redis or RedisCluster
        self.keys: Keys = store.keys
        self.stream = self.keys.fold_stream()
        self._stopping = asyncio.Event()
        self._release = self.redis.register_script(_RELEASE)
        # A job that keeps failing (poison) must not hold the queue forever: dropped after this
        # many attempts; the conversation enqueues itself again on its next turn.
        self.max_attempts = w.max_failures * 3
        self._attempts: dict[str, int] = {}
        # Jobs delivered to this consumer and not acked yet, when known (None: a restart under the
        # same name may have left some). While it is 0 the poll need not ask the group for them.
        self._unacked: int | None = None
        self._reclaim_after = 0.0  # monotonic time before which XAUTOCLAIM is not asked again
        self.busy = False  # a job is being handled (pool.stop lets it finish; idle workers are cancelled)

    # -- loop ------------------------------------------------------------------------------------

    async def run(self, *, burst: bool = False) -> None:
        """Process jobs until `stop()`; with `burst`, until nothing is pending or new (tests)."""
        await ensure_group(self.redis, self.stream)
        while not self._stopping.is_set():
            if self.breaker.is_open():
                if burst:
                    return
                await self._pause(min(self.breaker.remaining(), _POLL_SECONDS))
                continue
            try:
                job_id, job = await self._next(block=not burst)
                if job_id is None:
                    if burst:
                        return
                    continue
                if job is None:
                    await self._ack(job_id)  # a malformed or deleted entry: nothing to do
                    continue
                self.busy = True
                try:
                    await self.handle(job)
                finally:
                    self.busy = False
            except Exception as exc:  # the store is down: the loop outlives it, jobs stay queued
                log.warning("fold.loop_error", error=type(exc).__name__, worker=self.name)
                if burst:
                    raise
                await self._pause(_POLL_SECONDS)

    async def stop(self) -> None:
        self._stopping.set()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _next(self, *, block: bool) -> tuple[str | None, Job | None]:
        group, stream = Keys.FOLD_GROUP, self.stream
        # 1. own pending jobs: left unacked by a breaker pause, a busy lock or a store error.
        if self._unacked != 0:
            mine: Any = await self.redis.xreadgroup(group, self.name, {stream: "0"}, count=1)
            for _, entries in mine or []:
                for job_id, fields in entries:
                    return _s(job_id), parse_job(job_id, fields)
            self._unacked = 0
        # 2. jobs of crashed consumers. They have been idle for claim_idle_ms (a second at least):
        # after an XAUTOCLAIM that found none, asking again within _POLL_SECONDS finds none sooner.
        now = time.monotonic()
        if now >= self._reclaim_after:
            claimed: Any = await self.redis.xautoclaim(stream, group, self.name,
                                                  min_idle_time=self.settings.memory.worker.claim_idle_ms,
                                                  start_id="0-0", count=1)
            entries = claimed[1] if claimed and len(claimed) > 1 else []
            for job_id, fields in entries:
                log.info("fold.reclaimed", job=_s(job_id), worker=self.name)
                return self._delivered(job_id, fields)
            self._reclaim_after = now + _POLL_SECONDS
        # 3. new jobs. fakeredis returns at once even with BLOCK: never rely on the block.
        started = time.monotonic()
        new: Any = await self.redis.xreadgroup(group, self.name, {stream: ">"}, count=1,
                                          block=_BLOCK_MS if block else None)
        for _, entries in new or []:
            for job_id, fields in entries:
                return self._delivered(job_id, fields)
        if block and time.monotonic() - started < _BLOCK_MS / 2000:
            await self._wait_for_job(_POLL_SECONDS)
        return None, None

    def _delivered(self, job_id: Any, fields: dict[Any, Any] | None) -> tuple[str, Job | None]:
        """A job the group just handed to this consumer: pending on it until acked."""
        if self._unacked is not None:
            self._unacked += 1
        return _s(job_id), parse_job(job_id, fields)

    async def _wait_for_job(self, seconds: float) -> None:
        """Sleep until this process queues a fold, `stop()`, or `seconds` pass."""
        signal = getattr(self.store, "fold_queued", None)
        if signal is None:
            await self._pause(seconds)
            return
        signal.clear()
        waits = [asyncio.ensure_future(signal.wait()), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _ack(self, job_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, Keys.FOLD_GROUP, job_id)
            pipe.xdel(self.stream, job_id)
            acked, _ = await pipe.execute()
        if self._unacked:
            self._unacked = max(0, self._unacked - int(acked))
        self._attempts.pop(job_id, None)

    # -- one job ---------------------------------------------------------------------------------

    async def handle(self, job: Job) -> str:
        """Run one job with retries; the job is acked unless the breaker opened (then it stays queued)."""
        w = self.settings.memory.worker
        delay = w.retry_base_seconds
        while True:
            attempts = self._attempts[job.id] = self._attempts.get(job.id, 0) + 1
            started = time.monotonic()
            try:
                result = await self.fold_conversation(job.ref, urgent=job.urgent, job_id=job.id)
            except asyncio.CancelledError:
                raise  # killed mid-fold: the job stays pending and is reclaimed elsewhere
            except Exception as exc:
                self._record("error", time.monotonic() - started)
                log.warning("fold.failed", conversation=job.ref.conversation, error=type(exc).__name__,
                            detail=str(exc)[:200], attempt=attempts)
                if attempts >= self.max_attempts:
                    log.error("fold.dropped", conversation=job.ref.conversation, attempts=attempts)
                    await self._finish(job, recheck=False)
                    return "dropped"
                if self.breaker.failure():
                    log.warning("fold.breaker_open", seconds=self.breaker.seconds, worker=self.name)
                    return "error"  # stays in this consumer's pending list until the breaker closes
                await self._pause(delay)
                delay *= 2
                if self._stopping.is_set():
                    return "error"
                continue
            self.breaker.success()
            if result == "busy":
                # Another worker folds this conversation now; it re-checks when done. Retry later.
                await self._pause(_POLL_SECONDS / 5)
                return result
            self._record(result, time.monotonic() - started)
            await self._finish(job, recheck=True)
            return result

    async def _finish(self, job: Job, *, recheck: bool) -> None:
        await self.store.fold_done(job.ref)
        if recheck:
            # Turns that arrived during the fold may already call for the next one; their request
            # could not enqueue it while this job was queued.
            with contextlib.suppress(Exception):
                if await self._target(job.ref, urgent=False) is not None:
                    await self.store.enqueue_fold(job.ref)
        await self._ack(job.id)

    def _record(self, result: str, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.folds.labels(result=result).inc()
        if result in ("ok", "conflict", "error"):
            self.metrics.fold_seconds.observe(seconds)

    async def _target(self, ref: ConvRef, *, urgent: bool) -> tuple[Any, list[Any], int, int] | None:
        """(view, aged turns, covers, target) when a fold is due now, else None."""
        from gateway.shape import shape_for

        mem = self.settings.memory
        view = await self.store.load(ref)
        summary = view.summary
        covers = summary.covers if summary is not None else 0
        if view.tail_start == covers:
            turns = list(view.tail)
        else:
            turns = await self.store.messages(ref, covers, view.length)
        shape = shape_for(view.dialect or "openai_chat")
        target = fold.fold_target(shape, turns, covers, keep_recent=mem.keep_recent, fold_batch=mem.fold_batch,
                                  fold_tokens=mem.fold_tokens, urgent=urgent)
        if target is None:
            return None
        return view, turns[: target - covers], covers, target

    async def fold_conversation(self, ref: ConvRef, *, urgent: bool = False, job_id: str | None = None) -> str:
        """Fold one conversation once: "ok", "noop" (nothing due), "conflict" (CAS refused) or "busy"."""
        lock_key = self.keys.fold_lock(ref)
        token = uuid.uuid4().hex
        ttl = self.settings.memory.worker.claim_idle_ms
        if not await self.redis.set(lock_key, token, nx=True, px=ttl):
            return "busy"
        loop = asyncio.get_running_loop()
        beats: list[asyncio.Task[None]] = []
        # The heartbeat's task starts with its first beat: nearly every fold ends long before that.
        timer = loop.call_later(ttl / 3000, lambda: beats.append(
            loop.create_task(self._heartbeat(lock_key, job_id, ttl))))
        try:
            return await self._fold_locked(ref, urgent=urgent)
        finally:
            timer.cancel()
            for beat in beats:
                beat.cancel()
                with contextlib.suppress(BaseException):
                    await beat
            # Shielded: a cancelled worker still frees the conversation for the next one.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._release(keys=[lock_key], args=[token]))

    async def _heartbeat(self, lock_key: str, job_id: str | None, ttl_ms: int) -> None:
        """Keep a long fold's lock and job from looking abandoned (reclaim after claim_idle_ms).

        Started a third of the ttl into the fold: beats at once, then every third of the ttl.
        """
        while True:
            with contextlib.suppress(Exception):
                await self.redis.pexpire(lock_key, ttl_ms)
                if job_id is not None:
                    await self.redis.xclaim(self.stream, Keys.FOLD_GROUP, self.name, min_idle_time=0,
                                            message_ids=[job_id], justid=True)
            await asyncio.sleep(ttl_ms / 3000)

    async def _fold_locked(self, ref: ConvRef, *, urgent: bool) -> str:
        mem = self.settings.memory
        due = await self._target(ref, urgent=urgent)
        if due is None:
            return "noop"
        view, aged, covers, target = due
        previous = view.summary
        version = previous.version if previous is not None else 0
        text = previous.text if previous is not None else ""
        proposal: _Proposal | None = None
        if self.local:
            # All of a local fold's CPU in one hand-off to a thread: the summary, and the ledger's
            # update from the state `load` just returned (written after the commit, by CAS).
            result, tokens, proposal = await asyncio.to_thread(
                self._fold_local, text, aged, covers, self.keys.project_state(ref), view.state, view.state_version)
        else:
            result = await fold.fold_summary(self.summarizer, text, aged, covers, max_tokens=mem.max_summary_tokens)
            tokens = self.summarizer.count(result.text)
        chain = aged[-1].chain
        summary = Summary(text=result.text, covers=target, version=version + 1, tokens=tokens, chain=chain)
        tokens_in, tokens_out = result.tokens_in, result.tokens_out
        if not await self.store.commit_fold(ref, expect_version=version, summary=summary):
            log.info("fold.conflict", conversation=ref.conversation, covers=target)
            await self._spent(ref, tokens_in, tokens_out, folds=0)
            return "conflict"
        try:
            s_in, s_out = await self._update_state(ref, aged, covers, proposal)
        except Exception as exc:  # the summary is committed; the ledger catches up at the next fold
            log.warning("fold.state_failed", conversation=ref.conversation, error=type(exc).__name__)
            s_in = s_out = 0
        await self._spent(ref, tokens_in + s_in, tokens_out + s_out, folds=1)
        log.info("fold.ok", conversation=ref.conversation, covers=target, summary_tokens=summary.tokens,
                 summarizer=self.summarizer.name)
        # Replicas planning this conversation from what they know reload it now, not a request late.
        with contextlib.suppress(StoreUnavailable):
            await self.store.announce(ref, "folded")
        return "ok"

    def _fold_local(self, text: str, aged: list[Any], covers: int, state_key: str, state_data: dict[str, Any] | None,
                    state_version: int) -> tuple[fold.SummaryResult, int, _Proposal]:
        """A local summarizer's fold, in a worker thread: (summary, its tokens, the ledger's update)."""
        mem = self.settings.memory
        result = fold.run_local(fold.fold_summary(self.summarizer, text, aged, covers,
                                                  max_tokens=mem.max_summary_tokens))
        ledger = self._ledgers.load(state_key, state_data)
        updated, s_in, s_out = fold.run_local(self.summarizer.update_state(ledger, aged, covers, now=_now_iso()))
        return result, self.summarizer.count(result.text), _Proposal(ledger, updated, state_version, s_in, s_out)

    async def _update_state(self, ref: ConvRef, aged: list[Any], start: int,
                            proposal: _Proposal | None = None) -> tuple[int, int]:
        """Merge what the aged messages say into the (maybe project-shared) ledger, by CAS.

        `proposal`: the update already computed from the ledger the fold loaded; when another
        conversation of the project wrote the ledger since, the CAS refuses it and it is redone.
        """
        spent_in = spent_out = 0
        key = self.keys.project_state(ref)
        for _ in range(3):  # other conversations of the project may write the ledger meanwhile
            if proposal is None:
                data, version = await self.store.get_state(ref)
                ledger = self._ledgers.load(key, data)
                call = self.summarizer.update_state(ledger, aged, start, now=_now_iso())
                # A local summarizer computes on the calling thread: not on the event loop's.
                updated, tin, tout = await (asyncio.to_thread(fold.run_local, call) if self.local else call)
            else:
                ledger, updated, version, tin, tout = proposal
                proposal = None
            spent_in += tin
            spent_out += tout
            if updated is ledger or updated == ledger:
                return spent_in, spent_out
            dumped = updated.dump()
            if await self.store.put_state(ref, dumped, expect_version=version):
                self._ledgers.remember(key, dumped, updated)
                return spent_in, spent_out
        log.warning("fold.state_contended", conversation=ref.conversation)
        return spent_in, spent_out

    async def _spent(self, ref: ConvRef, tokens_in: int, tokens_out: int, *, folds: int) -> None:
        stats = {"summarizer_tokens_in": tokens_in, "summarizer_tokens_out": tokens_out}
        if folds:
            stats["folds"] = folds
        await self.store.add_stats(ref, **stats)
        if self.metrics is not None:
            if tokens_in:
                self.metrics.summarizer_tokens.labels(kind="input").inc(tokens_in)
            if tokens_out:
                self.metrics.summarizer_tokens.labels(kind="output").inc(tokens_out)


# -- stream helpers ----------------------------------------------------------------------------

async def ensure_group(redis: Any, stream: str) -> None:
    try:
        # From "0": jobs enqueued before any worker ever started are not skipped.
        await redis.xgroup_create(stream, Keys.FOLD_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def queued(store: Any) -> int:
    """Fold jobs not finished: pending (delivered, not acked) plus not yet delivered."""
    redis, stream = store.redis, store.keys.fold_stream()
    if not await redis.exists(stream):
        return 0
    groups = await redis.xinfo_groups(stream)
    group = next((g for g in groups if _s(g.get("name", g.get(b"name", ""))) == Keys.FOLD_GROUP), None)
    if group is None:
        return int(await redis.xlen(stream))
    pending = int(group.get("pending", group.get(b"pending", 0)) or 0)
    last = _s(group.get("last-delivered-id", group.get(b"last-delivered-id", "0-0")))
    undelivered = await redis.xrange(stream, min=f"({last}", max="+", count=1)
    return pending + len(undelivered)


async def settle(store: Any, timeout: float = 60.0) -> None:  # noqa: ASYNC109 (the CLI's contract)
    """Wait until no fold job is queued or pending (`gateway eval --settle`).

    `store` is a Store, or an aiohttp app holding one (`gateway.app.STORE`). Raises TimeoutError
    when jobs remain after `timeout` seconds (no worker running, breaker open).
    """
    if not hasattr(store, "keys") or not hasattr(store, "redis"):
        from gateway.app import STORE

        store = store[STORE]
    deadline = time.monotonic() + timeout
    while True:
        if await queued(store) == 0:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"fold jobs still queued after {timeout} s")
        await asyncio.sleep(0.05)


# -- running many ------------------------------------------------------------------------------

class WorkerPool:
    """`n` fold workers in this process sharing one circuit breaker (for `serve` and `worker`)."""

    def __init__(self, store: Any, settings: Settings, summarizer: Any, n: int, *, metrics: Any = None,
                 name: str | None = None) -> None:
        w = settings.memory.worker
        self.breaker = Breaker(w.max_failures, w.breaker_seconds)
        base = name or f"{socket.gethostname()}-{os.getpid()}"
        self.workers = [FoldWorker(store, settings, summarizer, metrics=metrics, name=f"{base}-{i}",
                                   breaker=self.breaker) for i in range(n)]
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> WorkerPool:
        self.tasks = [asyncio.create_task(w.run(), name=f"fold-worker-{w.name}") for w in self.workers]
        return self

    async def stop(self, grace: float = 10.0) -> None:
        """Stop taking jobs, let running folds finish for up to `grace` seconds, then cancel them.

        Idle workers are cancelled at once: they only wait on a blocking read (up to a second on
        Redis), and a job they were just handed stays pending in the group and is reclaimed.
        """
        for w in self.workers:
            await w.stop()
        if not self.tasks:
            return
        for w, task in zip(self.workers, self.tasks, strict=True):
            if not w.busy:
                task.cancel()
        _, still = await asyncio.wait(self.tasks, timeout=grace)
        for task in still:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []


def start_workers(store: Any, settings: Settings, summarizer: Any, n: int | None = None, *,
                  metrics: Any = None) -> WorkerPool:
    """Start `n` (default `memory.worker.in_process`) workers as tasks; `await pool.stop()` at shutdown."""
    count = settings.memory.worker.in_process if n is None else n
    log.info("fold.workers_started", workers=count, summarizer=getattr(summarizer, "name", "?"))
    return WorkerPool(store, settings, summarizer, count, metrics=metrics).start()


def main(args: Any) -> int:
    """`gateway worker [--config PATH]`: run `memory.worker.concurrency` workers until SIGINT/SIGTERM."""
    from gateway.config import ConfigError, load_settings
    from gateway.logs import configure

    try:
        settings = load_settings(getattr(args, "config", None))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config: {problem}")
        return 1
    configure(settings.server.log_format, settings.server.log_level)
    if settings.store.url.startswith("memory://"):
        log.warning("fold.worker_memory_store",
                    detail="memory:// is private to one process: a separate worker sees no conversations")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run_workers(settings))
    return 0


async def _run_workers(settings: Settings) -> None:
    import signal

    from gateway.store import open_store
    from gateway.summarizer import build_summarizer
    from gateway.tokens import TokenCounter

    store = await open_store(settings.store)
    counter = TokenCounter(settings.models)
    model = settings.memory.summarizer.model
    summarizer = build_summarizer(settings, lambda text: counter.count(text, model))
    log.info("fold.summarizer", mode=summarizer.name, upstream=settings.memory.summarizer.upstream,
             model=model if summarizer.name == "llm" else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    pool = WorkerPool(store, settings, summarizer, settings.memory.worker.concurrency).start()
    try:
        await stop.wait()
    finally:
        await pool.stop()
        await summarizer.close()
        await store.close()
