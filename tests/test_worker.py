"""Fold workers against a real Redis (`redis_url`) and a fake summarizer upstream on port 0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_summarizer import PLANTED, FakeUpstream, count, llm_settings, planted_session, survival

from gateway import fold, state, worker
from gateway.config import Settings, parse_settings
from gateway.dialects import content_hash, dialect_named
from gateway.keys import ConvRef
from gateway.metrics import Metrics
from gateway.model import Message
from gateway.store import Store, open_store
from gateway.summarizer import build_summarizer

SHAPE = dialect_named("openai_chat")
REF = ConvRef("tenant-a", "conv-1")


def make_turn(role: str, text: str) -> Message:
    raw = {"role": role, "content": text}
    return Message(raw=raw, role=role, text=text, tokens=count(text), hash=content_hash(SHAPE, raw))


async def add(store: Store, ref: ConvRef, messages: list[tuple[str, str]]) -> int:
    view = await store.load(ref)
    result = await store.append(ref, [make_turn(r, t) for r, t in messages], base_length=view.length,
                                base_chain=view.last_chain or "", dialect="openai_chat")
    assert result.ok
    return result.length


def numbered(start: int, n: int) -> list[tuple[str, str]]:
    return [("user" if i % 2 == 0 else "assistant", f"message {i} about topic {i}") for i in range(start, start + n)]


def with_worker(settings: Settings, **changes: Any) -> Settings:
    """Settings with worker fields the validators would refuse in production (tiny claim_idle_ms)."""
    w = settings.memory.worker.model_copy(update=changes)
    return settings.model_copy(update={"memory": settings.memory.model_copy(update={"worker": w})})


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = await FakeUpstream().start()
    yield fake
    await fake.close()


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    s = await open_store(parse_settings({"store": {"url": redis_url}}).store)
    yield s
    await s.close()


async def test_sequence_20_then_30(store: Store, upstream: FakeUpstream) -> None:
    """At 20 messages the summary covers 10; at 30 it covers 20 from (previous summary + messages 10-19)."""
    settings = llm_settings(upstream.url)
    summarizer = build_summarizer(settings, count)
    metrics = Metrics()
    w = worker.FoldWorker(store, settings, summarizer, metrics=metrics, name="w1")

    await add(store, REF, numbered(0, 20))
    assert await store.enqueue_fold(REF)
    await w.run(burst=True)
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 10 and view.tail_start == 10
    assert view.summary.chain == (await store.chains(REF))[9]
    first_prompt = upstream.requests[0][1]["messages"][1]["content"]
    assert "[9] assistant: message 9" in first_prompt and "[10]" not in first_prompt

    await add(store, REF, numbered(20, 10))
    assert await store.enqueue_fold(REF)
    await w.run(burst=True)
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 20 and view.summary.version == 2
    second = [b for _, b in upstream.requests if "response_format" not in b][1]["messages"][1]["content"]
    assert second.startswith("Previous summary:\n- [0] user: message 0")
    assert "[10] user: message 10" in second and "[19] assistant" in second and "\n[9]" not in second
    assert view.summary.text.splitlines()[-1].startswith("- [19] assistant")

    stats = await store.stats(REF)
    assert stats["folds"] == 2 and stats["summarizer_tokens_in"] > 0 and stats["summarizer_tokens_out"] > 0
    assert metrics.folds.labels(result="ok")._value.get() == 2
    assert metrics.summarizer_tokens.labels(kind="input")._value.get() == stats["summarizer_tokens_in"]
    assert all(h["Authorization"] == "Bearer gw-own-key" for h, _ in upstream.requests)
    assert await worker.queued(store) == 0
    await summarizer.close()


async def test_the_first_fold_of_an_import_reads_it_off_the_event_loop(
        store: Store, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation imported with 700 messages: its first fold finds its target and the words it
    reads in a thread (thousands of messages took ~20 ms of the loop), and folds exactly what it
    folds when they are found on the loop: the same coverage, the same summarizer prompt."""
    import threading

    real = fold.fold_target
    threads: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(fold, "fold_target", spy)
    settings = llm_settings(upstream.url)
    summarizer = build_summarizer(settings, count)
    covers, prompts, where = [], [], []
    for ref, off_loop in ((REF, True), (ConvRef("tenant-a", "conv-2"), False)):
        monkeypatch.setattr(worker, "PICK_OFF_LOOP", 500 if off_loop else 10_000)
        upstream.requests.clear()
        threads.clear()
        await add(store, ref, numbered(0, 700))
        assert await store.enqueue_fold(ref)
        await worker.FoldWorker(store, settings, summarizer, name="w1").run(burst=True)
        view = await store.load(ref)
        assert view.summary is not None
        covers.append(view.summary.covers)
        prompts.append([b["messages"] for _, b in upstream.requests])
        where.append(threads[0])
    assert where == [False, True]  # the import's first pick: in a thread; (the same, on the loop)
    assert covers[0] == covers[1] > 600 and prompts[0] == prompts[1]
    await summarizer.close()


async def _fold_held_open(store: Store, upstream: FakeUpstream, metrics: Metrics | None = None,
                          ) -> tuple[Any, asyncio.Task[Any]]:
    """20 stored messages, their fold running and held inside its summarizer call (upstream.gate):
    the summarizer, and the worker's task (released by upstream.gate.set())."""
    settings = llm_settings(upstream.url)
    summarizer = build_summarizer(settings, count)
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    upstream.gate = asyncio.Event()
    task = asyncio.create_task(worker.FoldWorker(store, settings, summarizer, metrics=metrics,
                                                 name="w1").run(burst=True))
    await asyncio.wait_for(upstream.entered.wait(), 5)
    return summarizer, task


async def test_turns_arriving_during_a_fold_stay_in_the_window(store: Store, upstream: FakeUpstream) -> None:
    """Turns appended while the summarizer runs stay in the window; the commit succeeds (prefix unchanged)."""
    summarizer, task = await _fold_held_open(store, upstream)
    await add(store, REF, numbered(20, 6))
    upstream.gate.set()
    await asyncio.wait_for(task, 10)
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 10
    assert view.length == 26 and [t.text for t in view.tail] == [f"message {i} about topic {i}" for i in range(10, 26)]
    await summarizer.close()


async def test_turns_that_call_for_another_fold_during_a_fold_get_it(store: Store, upstream: FakeUpstream) -> None:
    """Turns arriving during a fold that make the next fold due (their requests could not queue it: one
    job per conversation) are folded once the first fold finishes, without another request."""
    summarizer, task = await _fold_held_open(store, upstream)
    await add(store, REF, numbered(20, 20))
    assert not await store.enqueue_fold(REF)  # what the request path would do: refused, a job is queued
    upstream.gate.set()
    await asyncio.wait_for(task, 10)
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 30 and view.summary.version == 2
    assert await worker.queued(store) == 0
    await summarizer.close()


async def test_branch_during_a_fold_cancels_it(store: Store, upstream: FakeUpstream) -> None:
    """A branch that lands while the summarizer runs makes the commit fail; nothing is lost, no stale summary."""
    metrics = Metrics()
    summarizer, task = await _fold_held_open(store, upstream, metrics)
    chains = await store.chains(REF)
    branched = await store.branch(REF, at=4, base_chain=chains[3], dialect="openai_chat",
                                  turns=[make_turn("user", "a different question"), make_turn("assistant", "answer")])
    assert branched.ok
    upstream.gate.set()
    await asyncio.wait_for(task, 10)
    view = await store.load(REF)
    assert view.summary is None
    assert [t.text for t in await store.messages(REF)] == [
        *(f"message {i} about topic {i}" for i in range(4)), "a different question", "answer"]
    assert metrics.folds.labels(result="conflict")._value.get() == 1
    assert await worker.queued(store) == 0  # 6 messages: no new fold is due
    await summarizer.close()


async def test_worker_killed_mid_fold_is_reclaimed(store: Store, upstream: FakeUpstream) -> None:
    """A worker cancelled mid-fold leaves its job pending; another worker reclaims it after claim_idle_ms."""
    settings = with_worker(llm_settings(upstream.url), claim_idle_ms=50)
    summarizer = build_summarizer(settings, count)
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    upstream.gate = asyncio.Event()
    doomed = asyncio.create_task(worker.FoldWorker(store, settings, summarizer, name="doomed").run())
    await asyncio.wait_for(upstream.entered.wait(), 5)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert (await store.load(REF)).summary is None
    assert await worker.queued(store) == 1  # still pending, owned by the dead consumer
    upstream.gate.set()
    await asyncio.sleep(0.1)
    await worker.FoldWorker(store, settings, summarizer, name="rescuer").run(burst=True)
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 10
    assert view.length == 20 and await worker.queued(store) == 0
    await summarizer.close()


async def test_circuit_breaker_stops_calling_the_summarizer(store: Store, upstream: FakeUpstream) -> None:
    """After 3 failures in a row the worker stops calling the summarizer for breaker_seconds; the job stays queued."""
    settings = with_worker(llm_settings(upstream.url), retry_base_seconds=0.01, breaker_seconds=0.4)
    summarizer = build_summarizer(settings, count)
    w = worker.FoldWorker(store, settings, summarizer, name="w1")
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    upstream.fail = True
    await w.run(burst=True)
    assert upstream.summary_calls == 3 and w.breaker.is_open()
    await w.run(burst=True)
    await asyncio.sleep(0.1)
    await w.run(burst=True)
    assert upstream.summary_calls == 3  # breaker open: no call at all
    assert await worker.queued(store) == 1 and (await store.load(REF)).summary is None
    upstream.fail = False
    await asyncio.sleep(0.4)
    await w.run(burst=True)
    assert upstream.summary_calls == 4
    assert (await store.load(REF)).summary is not None and await worker.queued(store) == 0
    await summarizer.close()


async def test_one_fold_per_conversation(store: Store) -> None:
    """While another worker holds the conversation's lock, a fold does not start ("busy")."""
    settings = Settings()
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="w1")
    await add(store, REF, numbered(0, 20))
    await store.redis.set(store.keys.fold_lock(REF), "someone-else", px=5000)
    assert await w.fold_conversation(REF) == "busy"
    await store.redis.delete(store.keys.fold_lock(REF))
    assert await w.fold_conversation(REF) == "ok"
    assert await store.redis.exists(store.keys.fold_lock(REF)) == 0  # released


async def test_settle_waits_for_the_queue(store: Store) -> None:
    """settle() times out while jobs wait and returns once workers have drained the queue."""
    settings = Settings()
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    with pytest.raises(TimeoutError):
        await worker.settle(store, 0.1)
    pool = worker.start_workers(store, settings, build_summarizer(settings, count), 2)
    await worker.settle(store, 10)
    await pool.stop()
    assert (await store.load(REF)).summary is not None


async def test_project_state_shared_and_updated_at_folds(store: Store) -> None:
    """Each fold updates the project ledger by CAS; conversations of one project share it."""
    settings = Settings()
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="w1")
    a, b = ConvRef("t", "a", "orion"), ConvRef("t", "b", "orion")
    await add(store, a, [("user", "The goal is a billing service for Orion."), ("assistant", "ok"), *numbered(2, 18)])
    await add(store, b, [("user", "We must never log card numbers."), ("assistant", "ok"), *numbered(2, 18)])
    await store.enqueue_fold(a)
    await store.enqueue_fold(b)
    await w.run(burst=True)
    data, version = await store.get_state(a)
    ledger = state.load(data)
    assert version == 2
    assert [i.text for i in ledger.active("goal")] == ["The goal is a billing service for Orion."]
    assert [i.text for i in ledger.active("constraints")] == ["We must never log card numbers."]
    assert (await store.get_state(b))[0] == data


async def test_extractive_120_turns_keeps_planted_facts(store: Store) -> None:
    """Through 120 turns and many folds the 8 planted facts survive in the summary, which never exceeds its cap."""
    settings = Settings()
    cap = settings.memory.max_summary_tokens + settings.memory.timeline_tokens  # the timeline has its own budget
    summarizer = build_summarizer(settings, count)
    w = worker.FoldWorker(store, settings, summarizer, name="w1")
    messages = planted_session(120)
    folds = 0
    for i in range(0, len(messages), 2):
        length = await add(store, REF, messages[i:i + 2])
        view = await store.load(REF)
        covers = view.summary.covers if view.summary else 0
        if fold.should_fold(length=length, covers=covers, keep_recent=10, fold_batch=10):
            await store.enqueue_fold(REF)
            await w.run(burst=True)
            summary = (await store.load(REF)).summary
            assert summary is not None and summary.covers > covers and count(summary.text) <= cap
            folds += 1
    view = await store.load(REF)
    assert view.summary is not None
    in_summary = survival(view.summary.text)
    rendered = state.render(state.load(view.state), settings.memory.state_budget_tokens, count)
    in_state = survival(rendered)
    print(f"\nworker extractive: {folds} folds over {len(messages)} messages; summary {count(view.summary.text)} "
          f"tokens; facts in summary {sum(in_summary.values())}/{len(PLANTED)}, in state "
          f"{sum(in_state.values())}/{len(PLANTED)}")
    assert all(in_summary.values()), in_summary
    assert folds >= 20


async def test_ledger_update_loses_cas_to_a_concurrent_write_and_is_redone(store: Store) -> None:
    """A local fold's ledger update, computed from the state it loaded, is redone on a fresh read when its CAS fails."""
    settings = Settings()
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="w1")
    await add(store, REF, [("user", "We must never log card numbers."), ("assistant", "ok"), *numbered(2, 18)])
    commit = store.commit_fold

    async def commit_then_someone_writes(*args: Any, **kwargs: Any) -> bool:
        ok = await commit(*args, **kwargs)
        data, version = await store.get_state(REF)
        edited = state.apply_edits(state.load(data), {"goal": "A billing service for Orion."}, time=None)
        assert await store.put_state(REF, edited.dump(), expect_version=version)
        return ok

    store.commit_fold = commit_then_someone_writes  # type: ignore[method-assign]
    assert await w.fold_conversation(REF) == "ok"
    data, version = await store.get_state(REF)
    ledger = state.load(data)
    assert version == 2
    assert [i.text for i in ledger.active("goal")] == ["A billing service for Orion."]
    assert [i.text for i in ledger.active("constraints")] == ["We must never log card numbers."]


async def test_fold_with_nothing_durable_leaves_the_ledger_unwritten(store: Store) -> None:
    """A fold whose messages state nothing for the ledger commits the summary and does not write the state."""
    settings = Settings()
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="w1")
    await add(store, REF, numbered(0, 20))
    assert await w.fold_conversation(REF) == "ok"
    view = await store.load(REF)
    assert view.summary is not None and view.summary.covers == 10
    assert view.state is None and view.state_version == 0


async def test_a_worker_that_found_nothing_to_reclaim_still_reclaims_later(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an XAUTOCLAIM that found nothing, a job abandoned later is reclaimed once _POLL_SECONDS have passed."""
    monkeypatch.setattr(worker, "_POLL_SECONDS", 0.05)
    settings = with_worker(Settings(), claim_idle_ms=50)
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="rescuer")
    await w.run(burst=True)  # nothing queued: its XAUTOCLAIM found nothing
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    taken = await store.redis.xreadgroup(store.keys.FOLD_GROUP, "crashed", {store.keys.fold_stream(): ">"}, count=1)
    assert taken  # delivered to a consumer that will never ack it
    await asyncio.sleep(0.1)
    await w.run(burst=True)
    assert (await store.load(REF)).summary is not None and await worker.queued(store) == 0


def test_ledger_cache_validates_only_json_it_has_not_seen() -> None:
    """LedgerCache hands back the ledger it validated for equal JSON, and validates JSON that differs."""
    cache = worker.LedgerCache(size=2)
    first = state.apply_edits(state.Ledger(), {"goal": "A billing service."}, time=None)
    data = first.dump()
    loaded = cache.load("k", data)
    assert loaded == first
    assert cache.load("k", state.Ledger.model_validate(data).dump()) is loaded
    changed = state.apply_edits(first, {"goal": "A payments service."}, time=None).dump()
    other = cache.load("k", changed)
    assert other is not loaded and [i.text for i in other.active("goal")] == ["A payments service."]
    cache.remember("k", data, first)
    assert cache.load("k", data) is first
    assert cache.load("k", None) == state.Ledger()


async def _consumers(store: Store) -> dict[str, int]:
    """The fold group's consumers and how many jobs are pending on each."""
    found: Any = await store.redis.xinfo_consumers(store.keys.fold_stream(), "fold-workers")
    return {c["name"].decode(): int(c["pending"]) for c in found}


async def test_stopped_workers_leave_the_consumer_group(store: Store) -> None:
    """Workers that stop with nothing pending remove their consumer from the fold group: restarts
    do not pile up dead consumers."""
    settings = Settings()
    await add(store, REF, numbered(0, 20))
    await store.enqueue_fold(REF)
    pool = worker.start_workers(store, settings, build_summarizer(settings, count), 2)
    await worker.settle(store, 10)  # a job was delivered: its worker is a consumer of the group
    consumers = await _consumers(store)
    assert consumers and set(consumers.values()) == {0}
    await pool.stop()
    assert await _consumers(store) == {}


async def test_prune_removes_idle_consumers_with_nothing_pending(store: Store) -> None:
    """Consumers idle long with no job pending are removed; one holding a job is kept (its job
    would become unclaimable), as are the recently active."""
    jobs = store.folds
    await jobs.ensure_group()
    await store.enqueue_fold(REF)
    assert await jobs.next("holder", None) is not None  # one job pending on "holder"
    await store.redis.xgroup_createconsumer(store.keys.fold_stream(), "fold-workers", "idle")
    assert await jobs.prune(3_600_000) == 0  # nobody has been idle an hour
    assert await jobs.prune(0) == 1
    assert await _consumers(store) == {"holder": 1}
    assert not await jobs.retire("holder")
    assert await _consumers(store) == {"holder": 1}


class _SwallowsACancel:
    """The fold queue, but `keep` (the heartbeat's call) runs until cancelled and swallows the
    first cancel, as redis-py's commands can on Python 3.11 (they send through asyncio.wait_for,
    which returns the result of a send that finished as the cancel arrived: CPython gh-86296)."""

    def __init__(self, jobs: Any) -> None:
        self._jobs = jobs
        self.swallowed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jobs, name)

    async def keep(self, *args: Any) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed += 1


async def test_a_fold_ends_even_when_its_heartbeat_swallows_a_cancel(store: Store) -> None:
    """A heartbeat whose cancel is lost still ends with its fold: else the fold never returns, its
    worker never stops (a shutdown waits the whole grace period) and the lock is kept fresh forever."""
    settings = with_worker(Settings(), claim_idle_ms=150)  # a beat 50 ms into the fold
    w = worker.FoldWorker(store, settings, build_summarizer(settings, count), name="w1")
    jobs = w.jobs = _SwallowsACancel(store.folds)
    cpu = w.cpu

    class SlowCPU:
        async def fold(self, *args: Any) -> Any:
            await asyncio.sleep(0.3)  # the heartbeat is in `keep` when the fold ends
            return await cpu.fold(*args)

    w.cpu = SlowCPU()  # type: ignore[assignment]
    await add(store, REF, numbered(0, 20))
    task = asyncio.create_task(w.fold_conversation(REF))
    done, _ = await asyncio.wait({task}, timeout=5)
    if not done:  # before the fix: the fold waits on its heartbeat forever
        task.cancel()
        await asyncio.wait({task}, timeout=5)
    assert jobs.swallowed == 1
    assert task in done and task.result() == "ok"
