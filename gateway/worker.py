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
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from gateway import fold
from gateway.config import ConfigError, Settings, load_settings
from gateway.dialects import dialect_named
from gateway.foldcpu import FoldCPU, LedgerCache, ProcessCPU, StateChange, ThreadCPU, fold_cpu, read_turns
from gateway.keys import ConvRef
from gateway.logs import configure, get_logger
from gateway.model import Summary
from gateway.queue import Delivery, Job
from gateway.store import Store, StoreUnavailable, open_store
from gateway.summarizer import build_summarizer
from gateway.tokens import TokenCounter

log = get_logger("gateway.worker")

_POLL_SECONDS = 0.5
PICK_OFF_LOOP = 500  # unfolded messages past which a fold's target and what it reads are found in a thread
_BLOCK_MS = 1000
# Consumers of the group idle this long with nothing pending are workers that died: removed (at a
# worker's start, then every _PRUNE_SECONDS). A live worker reads the stream every second or so, at
# worst after a breaker pause; one removed anyway comes back with its next read.
_DEAD_IDLE_MS = 600_000
_PRUNE_SECONDS = 300.0


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


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Jobs(Protocol):
    """The fold queue as a worker uses it (queue.FoldQueue over Redis)."""

    async def ensure_group(self) -> None: ...
    async def own_pending(self, consumer: str) -> Delivery: ...
    async def reclaim(self, consumer: str, min_idle_ms: int) -> Delivery: ...
    async def next(self, consumer: str, block_ms: int | None) -> Delivery: ...
    async def ack(self, job_id: str) -> int: ...
    async def lock(self, ref: ConvRef, token: str, ttl_ms: int) -> bool: ...
    async def unlock(self, ref: ConvRef, token: str) -> None: ...
    async def keep(self, ref: ConvRef, job_id: str | None, consumer: str, ttl_ms: int) -> None: ...
    async def unfinished(self) -> int: ...
    async def hand_back(self, consumer: str, idle_ms: int) -> int: ...
    async def retire(self, consumer: str) -> bool: ...
    async def prune(self, idle_ms: int) -> int: ...


class FoldWorker:
    """One consumer of the fold queue: takes jobs one at a time and folds their conversation."""

    def __init__(self, store: Store, settings: Settings, summarizer: fold.Summarizer, *, metrics: Any = None,
                 name: str | None = None, breaker: Breaker | None = None, cpu: FoldCPU | None = None,
                 block: bool = True) -> None:
        self.store = store
        # Whether an idle worker waits for new jobs in a blocking read. That read holds a connection of
        # the store's pool for up to _BLOCK_MS: right in `gateway worker`, but in a process that serves
        # requests it took the pool's connections from them (`store.pool_size: 1` made requests
        # store-busy on an idle gateway). There an idle worker asks without waiting, then sleeps until
        # this process queues a fold or _POLL_SECONDS pass.
        self.block = block
        self.settings = settings
        self.summarizer = summarizer
        self.local = summarizer.local  # see fold.run_local
        # Where a local fold's CPU runs (foldcpu.py): a thread unless the pool gives processes.
        self.cpu: FoldCPU = cpu or ThreadCPU(summarizer, settings.memory.max_summary_tokens,
                                             settings.memory.timeline_tokens)
        self._ledgers = LedgerCache()  # for a summarizer that is not local (its update runs here)
        self.metrics = metrics
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        w = settings.memory.worker
        self.breaker = breaker or Breaker(w.max_failures, w.breaker_seconds)
        self.jobs: Jobs = store.folds
        self._stopping = asyncio.Event()
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
        await self.jobs.ensure_group()
        prune_at = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= prune_at and not burst:
                prune_at = time.monotonic() + _PRUNE_SECONDS
                await self._prune()
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
                # A Redis error's text says which ("NOGROUP …" when the stream was deleted); other
                # errors' texts are not logged (an upstream's may echo what it was sent).
                detail = str(exc)[:200] if type(exc).__module__.startswith("redis.") else None
                log.warning("fold.loop_error", error=type(exc).__name__, detail=detail, worker=self.name)
                if burst:
                    raise
                await self._pause(_POLL_SECONDS)

    async def stop(self) -> None:
        self._stopping.set()

    async def hand_back(self) -> None:
        """Jobs still pending on this stopped worker go back to the others at once (`Jobs.hand_back`);
        a store that is down by now only delays their reclaim until claim_idle_ms. With nothing
        pending, the consumer leaves the group (else `prune` removes it once they are reclaimed)."""
        with contextlib.suppress(Exception):
            n = await self.jobs.hand_back(self.name, self.settings.memory.worker.claim_idle_ms)
            if n:
                log.info("fold.handed_back", jobs=n, worker=self.name)
            else:
                await self.jobs.retire(self.name)

    async def _prune(self) -> None:
        """Remove dead workers' consumers from the group (idle long, nothing pending)."""
        w = self.settings.memory.worker
        idle_ms = max(_DEAD_IDLE_MS, 2 * w.claim_idle_ms, int(2000 * w.breaker_seconds))
        try:
            removed = await self.jobs.prune(idle_ms)
        except Exception as exc:  # the store is away: the next prune will do
            log.warning("fold.prune_failed", error=type(exc).__name__, worker=self.name)
            return
        if removed:
            log.info("fold.consumers_removed", consumers=removed, idle_ms=idle_ms, worker=self.name)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _next(self, *, block: bool) -> tuple[str | None, Job | None]:
        # 1. own pending jobs: left unacked by a breaker pause, a busy lock or a store error.
        if self._unacked != 0:
            mine = await self.jobs.own_pending(self.name)
            if mine is not None:
                return mine
            self._unacked = 0
        # 2. jobs of crashed consumers. They have been idle for claim_idle_ms (a second at least):
        # after an XAUTOCLAIM that found none, asking again within _POLL_SECONDS finds none sooner.
        now = time.monotonic()
        if now >= self._reclaim_after:
            claimed = await self.jobs.reclaim(self.name, self.settings.memory.worker.claim_idle_ms)
            if claimed is not None:
                log.info("fold.reclaimed", job=claimed[0], worker=self.name)
                return self._delivered(claimed)
            self._reclaim_after = now + _POLL_SECONDS
        # 3. new jobs. fakeredis returns at once even with a block: never rely on the wait. (Cleared
        # first: a fold this process queues while the read is on its way wakes the wait below.)
        self.store.fold_queued.clear()
        started = time.monotonic()
        new = await self.jobs.next(self.name, _BLOCK_MS if block and self.block else None)
        if new is not None:
            return self._delivered(new)
        if block and time.monotonic() - started < _BLOCK_MS / 2000:
            await self._wait_for_job(_POLL_SECONDS)
        return None, None

    def _delivered(self, delivery: tuple[str, Job | None]) -> tuple[str, Job | None]:
        """A job the group just handed to this consumer: pending on it until acked."""
        if self._unacked is not None:
            self._unacked += 1
        return delivery

    async def _wait_for_job(self, seconds: float) -> None:
        """Sleep until this process queues a fold (since the last read), `stop()`, or `seconds` pass."""
        signal = self.store.fold_queued
        waits = [asyncio.ensure_future(signal.wait()), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _ack(self, job_id: str) -> None:
        acked = await self.jobs.ack(job_id)
        if self._unacked:
            self._unacked = max(0, self._unacked - acked)
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
        mem = self.settings.memory
        view = await self.store.load(ref)
        summary = view.summary
        covers = summary.covers if summary is not None else 0
        if view.tail_start == covers:
            turns = list(view.tail)
        else:
            turns = await self.store.messages(ref, covers, view.length)
        dialect = dialect_named(view.dialect or "openai_chat")

        def pick() -> tuple[int, list[Any]] | None:
            target = fold.fold_target(dialect, turns, covers, keep_recent=mem.keep_recent, fold_batch=mem.fold_batch,
                                      fold_tokens=mem.fold_tokens, urgent=urgent)
            return None if target is None else (target, fold.spoken(dialect, turns[: target - covers]))

        # The first fold of an import reads thousands of messages (~20 ms for 2,000): in a thread.
        picked = await asyncio.to_thread(pick) if len(turns) > PICK_OFF_LOOP else pick()
        if picked is None:
            return None
        target, aged = picked
        return view, aged, covers, target

    async def fold_conversation(self, ref: ConvRef, *, urgent: bool = False, job_id: str | None = None) -> str:
        """Fold one conversation once: "ok", "noop" (nothing due), "conflict" (CAS refused) or "busy"."""
        token = uuid.uuid4().hex
        ttl = self.settings.memory.worker.claim_idle_ms
        if not await self.jobs.lock(ref, token, ttl):
            return "busy"
        loop = asyncio.get_running_loop()
        beats: list[asyncio.Task[None]] = []
        # The heartbeat's task starts with its first beat: nearly every fold ends long before that.
        timer = loop.call_later(ttl / 3000, lambda: beats.append(
            loop.create_task(self._heartbeat(ref, job_id, ttl))))
        try:
            return await self._fold_locked(ref, urgent=urgent)
        finally:
            timer.cancel()
            for beat in beats:
                beat.cancel()
            try:
                if beats:  # waited, not awaited: a cancel of this worker itself still propagates
                    try:
                        await asyncio.wait(beats)
                    except asyncio.CancelledError:
                        # After the beats have ended (at their next check): one still beating after
                        # the unlock would claim the job back from a hand-back at shutdown.
                        await asyncio.wait(beats)
                        raise
            finally:
                # Shielded: a cancelled worker still frees the conversation for the next one.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.jobs.unlock(ref, token))

    async def _heartbeat(self, ref: ConvRef, job_id: str | None, ttl_ms: int) -> None:
        """Keep a long fold's lock and job from looking abandoned (reclaim after claim_idle_ms).

        Started a third of the ttl into the fold: beats at once, then every third of the ttl.
        """
        task = asyncio.current_task()
        while True:
            with contextlib.suppress(Exception):
                await self.jobs.keep(ref, job_id, self.name, ttl_ms)
            # The fold is over, but the store client swallowed the cancel (redis-py sends through
            # asyncio.wait_for, which on Python 3.11 can lose one: CPython gh-86296). Beating on
            # would keep the fold waiting for this task forever, and its lock fresh.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
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
        # A hand edit stays verbatim at the head: only what follows it is the summarizer's to rewrite.
        pinned, pinned_tokens = await self.store.pinned_summary(ref) if previous is not None else ("", 0)
        if pinned and text.startswith(pinned):
            text = text[len(pinned):].lstrip("\n")
        else:
            pinned, pinned_tokens = "", 0
        proposal: StateChange | None = None
        pid = os.getpid()
        if self.local:
            # All of a local fold's CPU in one hand-off (foldcpu.py): the summary, and the ledger's
            # update from the state `load` just returned (written after the commit, by CAS).
            state_key = self.store.keys.project_state(ref)
            out = await self.cpu.fold(text, aged, covers, state_key, view.state, view.state_version, _now_iso(),
                                      ref.conversation)
            result, tokens, proposal, pid = out.summary, out.tokens, out.state, out.pid
        else:
            result = await fold.fold_summary(self.summarizer, text, aged, covers, max_tokens=mem.max_summary_tokens,
                                             timeline_tokens=mem.timeline_tokens)
            tokens = self.summarizer.count(result.text)
        chain = aged[-1].chain
        folded = result.text
        if pinned:
            folded = f"{pinned}\n\n{folded}" if folded else pinned
            tokens += pinned_tokens + (2 if result.text else 0)  # the blank line between them
        summary = Summary(text=folded, covers=target, version=version + 1, tokens=tokens, chain=chain)
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
                 summarizer=self.summarizer.name, process=pid)
        # Replicas planning this conversation from what they know reload it now, not a request late.
        with contextlib.suppress(StoreUnavailable):
            await self.store.announce(ref, "folded")
        return "ok"

    async def _update_state(self, ref: ConvRef, aged: list[Any], start: int,
                            proposal: StateChange | None = None) -> tuple[int, int]:
        """Merge what the aged messages say into the (maybe project-shared) ledger, by CAS.

        `proposal`: the update already computed from the ledger the fold loaded; when another
        conversation of the project wrote the ledger since, the CAS refuses it and it is redone.
        """
        spent_in = spent_out = 0
        key = self.store.keys.project_state(ref)
        for _ in range(3):  # other conversations of the project may write the ledger meanwhile
            if proposal is None:
                data, version = await self.store.get_state(ref)
                if self.local:  # CPU: where the fold's runs, off the event loop
                    proposal = await self.cpu.state(key, data, version, aged, start, _now_iso(), ref.conversation)
                else:
                    proposal = await self._remote_state(key, data, version, aged, start, ref.conversation)
            change, proposal = proposal, None
            spent_in += change.tokens_in
            spent_out += change.tokens_out
            if change.dumped is None:
                return spent_in, spent_out
            if await self.store.put_state(ref, change.dumped, expect_version=change.version):
                if change.updated is not None:
                    self._ledgers.remember(key, change.dumped, change.updated)
                return spent_in, spent_out
        log.warning("fold.state_contended", conversation=ref.conversation)
        return spent_in, spent_out

    async def _remote_state(self, key: str, data: dict[str, Any] | None, version: int, aged: list[Any],
                            start: int, conversation: str) -> StateChange:
        """The ledger's update by a summarizer that waits on its upstream (on the event loop)."""
        ledger = self._ledgers.load(key, data)
        updated, tin, tout = await read_turns(self.summarizer, ledger, aged, start, conversation, _now_iso())
        if updated is ledger or updated == ledger:
            return StateChange(version, None, tin, tout)
        return StateChange(version, updated.dump(), tin, tout, updated)

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


# -- waiting for the queue ------------------------------------------------------------------------

async def queued(store: Store) -> int:
    """Fold jobs not finished: pending (delivered, not acked) plus not yet delivered."""
    return await store.folds.unfinished()


async def settle(store: Store | None, timeout: float = 60.0) -> None:  # noqa: ASYNC109 (the CLI's contract)
    """Wait until no fold job is queued or pending (`gateway eval --settle`); None: no store, none are.

    Raises TimeoutError when jobs remain after `timeout` seconds (no worker running, breaker open).
    """
    if store is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        if await queued(store) == 0:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"fold jobs still queued after {timeout} s")
        await asyncio.sleep(0.05)


# -- running many ------------------------------------------------------------------------------

class WorkerPool:
    """`n` fold workers in this process sharing one circuit breaker (for `serve` and `worker`).

    `processes` > 0: their fold CPU runs in that many child processes (foldcpu.ProcessCPU), shared
    by the workers and stopped with them; 0: in threads of this process.
    """

    def __init__(self, store: Store, settings: Settings, summarizer: fold.Summarizer, n: int, *, metrics: Any = None,
                 name: str | None = None, processes: int = 0, block: bool = True) -> None:
        w = settings.memory.worker
        self.breaker = Breaker(w.max_failures, w.breaker_seconds)
        base = name or f"{socket.gethostname()}-{os.getpid()}"
        self.cpu = fold_cpu(settings, summarizer, processes if n else 0)
        if processes and n and hasattr(summarizer, "offload"):
            summarizer.offload = self.cpu.call  # the llm summarizer's fallback extraction
        self.workers = [FoldWorker(store, settings, summarizer, metrics=metrics, name=f"{base}-{i}",
                                   breaker=self.breaker, cpu=self.cpu, block=block) for i in range(n)]
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> WorkerPool:
        if isinstance(self.cpu, ProcessCPU) and self.workers[0].local:
            self.cpu.start()  # an llm summarizer's folds rarely need it: its child starts when one does
        self.tasks = [asyncio.create_task(w.run(), name=f"fold-worker-{w.name}") for w in self.workers]
        return self

    async def stop(self, grace: float = 10.0) -> None:
        """Stop taking jobs, let running folds finish for up to `grace` seconds, then cancel them.

        Idle workers are cancelled at once: they only wait for a job (a blocking read of up to a
        second on Redis, or a sleep). Jobs still pending on them (a fold cut short, one just handed
        to an idle worker) are handed back: other workers reclaim them at once, not after
        claim_idle_ms.
        """
        for w in self.workers:
            await w.stop()
        if not self.tasks:
            await self.cpu.close(grace)
            return
        for w, task in zip(self.workers, self.tasks, strict=True):
            if not w.busy:
                task.cancel()
        _, still = await asyncio.wait(self.tasks, timeout=grace)
        for task in still:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        # Folds cut short leave their child computing for nothing: it is given no more time.
        await self.cpu.close(0.0 if still else grace)
        for w in self.workers:
            await w.hand_back()


def start_workers(store: Store, settings: Settings, summarizer: fold.Summarizer, n: int | None = None, *,
                  metrics: Any = None, processes: int | None = None) -> WorkerPool:
    """Start `n` (default `memory.worker.in_process`) workers as tasks of a process that serves requests,
    their fold CPU in `processes` (default `memory.worker.fold_processes`) child processes; `await
    pool.stop()` at shutdown."""
    w = settings.memory.worker
    count = w.in_process if n is None else n
    procs = w.fold_processes if processes is None else processes
    log.info("fold.workers_started", workers=count, summarizer=summarizer.name, fold_processes=procs if count else 0)
    return WorkerPool(store, settings, summarizer, count, metrics=metrics, processes=procs, block=False).start()


def main(args: Any) -> int:
    """`gateway worker [--config PATH]`: run `memory.worker.concurrency` workers until SIGINT/SIGTERM."""
    try:
        settings = load_settings(getattr(args, "config", None), environ=True)
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
        await pool.stop(settings.server.shutdown_grace_seconds)
        await summarizer.close()
        await store.close()
