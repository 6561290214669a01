"""The per-process cache of retrieval indexes: incremental sync from the store and remembered searches."""

from __future__ import annotations

import asyncio
import gc
import inspect
import random
import tracemalloc
from typing import Any

import pytest

from gateway import retrieval
from gateway.model import Message
from gateway.recall import Column, RecallCache


def _turns(texts: list[str], start: int = 0) -> list[Message]:
    return [Message(raw={}, role="user" if (start + i) % 2 == 0 else "assistant", text=t, tokens=10,
                 hash=f"h{start + i}", chain=f"c{start + i}", time="2024-01-01T10:00:00")
            for i, t in enumerate(texts)]


TEXTS = ["my cat is called Luna", "nice name", "we moved to Lisbon", "great city", "Luna hates the rain",
         "poor cat", "what about dinner", "pasta tonight"]


async def _cache() -> RecallCache:
    cache = RecallCache()

    async def fetch(a: int, b: int) -> list[Message]:
        return _turns(TEXTS[a:b], a)

    await cache.sync("k", _turns(TEXTS[4:], 4), 4, fetch)
    return cache


async def test_search_stays_within_after_and_before() -> None:
    """Only positions in [after, before) come back."""
    cache = await _cache()
    hits = cache.search("k", query="cat Luna", after=1, before=5, budget_tokens=1000)
    assert 4 in {p for p, _ in hits} <= {1, 2, 3, 4}
    assert cache.search("k", query="cat Luna", after=0, before=8, budget_tokens=1000)[0][0] == 0
    assert cache.search("k", query="cat Luna", after=5, before=5, budget_tokens=1000) == []


async def test_repeated_search_is_remembered_until_the_index_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same search over unchanged messages is answered from memory; a new message or a branch searches again."""
    cache = await _cache()
    entry = cache._entries["k"]
    calls: list[str] = []
    real = type(entry.index).search

    def spy(self: Any, query: str, **kwargs: Any) -> Any:
        calls.append(query)
        return real(self, query, **kwargs)

    monkeypatch.setattr(type(entry.index), "search", spy)
    first = cache.search("k", query="cat Luna", before=8, budget_tokens=1000)
    assert cache.search("k", query="cat Luna", before=8, budget_tokens=1000) == first
    assert len(calls) == 1
    cache.search("k", query="cat Luna", before=7, budget_tokens=1000)  # other arguments: searched
    assert len(calls) == 2

    async def fetch(a: int, b: int) -> list[Message]:
        raise AssertionError("nothing to fetch")

    await cache.sync("k", _turns([*TEXTS[4:], "Luna the cat again"], 4), 4, fetch)
    again = cache.search("k", query="cat Luna", before=9, budget_tokens=1000)
    assert len(calls) == 3 and 8 in {p for p, _ in again}
    cache.truncate("k", 8)
    assert 8 not in {p for p, _ in cache.search("k", query="cat Luna", before=9, budget_tokens=1000)}
    assert len(calls) == 4


def _many(n: int) -> list[str]:
    return [f"message {i} about topic{i % 37} and the cat named Luna{i % 5}" for i in range(n)]


async def test_cold_catch_up_gives_the_event_loop_back() -> None:
    """Indexing hundreds of stored messages at once (a cold index) lets other requests run meanwhile."""
    texts = _many(400)
    cache = RecallCache()
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    async def fetch(a: int, b: int) -> list[Message]:
        return _turns(texts[a:b], a)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await cache.sync("k", _turns(texts[390:], 390), 390, fetch)
    stop = True
    await task
    assert ticks - before >= 400 // 64  # at least once per slice
    assert len(cache._entries["k"].rows) == 400


async def test_concurrent_catch_ups_index_each_message_once() -> None:
    """Two requests that find the same cold index index its messages once, in order."""

    texts = _many(300)
    cache = RecallCache()

    async def fetch(a: int, b: int) -> list[Message]:
        await asyncio.sleep(0)
        return _turns(texts[a:b], a)

    tail = _turns(texts[290:], 290)
    await asyncio.gather(cache.sync("k", tail, 290, fetch), cache.sync("k", tail, 290, fetch))
    entry = cache._entries["k"]
    assert [row[4] for row in entry.rows] == [f"c{i}" for i in range(300)]
    assert [p for p, _ in cache.search("k", query="topic5 Luna0", before=300, budget_tokens=60)]


async def test_branch_during_a_catch_up_leaves_a_consistent_index() -> None:
    """A branch that cuts the index back while a catch-up yields stops it; positions never shift."""

    texts = _many(400)
    cache = RecallCache()

    async def fetch(a: int, b: int) -> list[Message]:
        return _turns(texts[a:b], a)

    sync = asyncio.create_task(cache.sync("k", _turns(texts[390:], 390), 390, fetch))
    for _ in range(3):
        await asyncio.sleep(0)
    cache.truncate("k", 10)
    await sync
    entry = cache._entries["k"]
    assert [row[4] for row in entry.rows] == [f"c{i}" for i in range(len(entry.rows))]
    await cache.sync("k", _turns(texts[390:], 390), 390, fetch)
    assert [row[4] for row in entry.rows] == [f"c{i}" for i in range(400)]


def test_a_column_reads_appends_and_truncates_across_its_chunks() -> None:
    """Indexing, iteration and truncation agree with a plain list on both sides of chunk edges."""
    col: Column[str] = Column()
    plain = [f"row {i}" for i in range(3 * Column.CHUNK + 5)]
    for row in plain:
        col.append(row)
    assert len(col) == len(plain) and list(col) == plain
    assert col[0] == plain[0] and col[Column.CHUNK] == plain[Column.CHUNK] and col[-1] == plain[-1]
    edges = [0, Column.CHUNK - 1, Column.CHUNK, Column.CHUNK + 1, 3 * Column.CHUNK, len(plain) - 1]
    assert col.pick(edges) == [plain[i] for i in edges]  # what a search's hits are read with
    for length in (2 * Column.CHUNK + 3, 2 * Column.CHUNK, Column.CHUNK - 1, 0):
        col.truncate(length)
        assert list(col) == plain[:length]
        assert col.pick(range(length)) == plain[:length]
    col.append("again")
    assert list(col) == ["again"] == col.pick([0])


def test_a_long_column_keeps_only_its_last_chunk_in_the_gc_sight() -> None:
    """Full chunks of strings are untracked once collected, so full collections do not walk every row."""
    col: Column[tuple[str, int]] = Column()
    for i in range(10 * Column.CHUNK + 7):
        col.append((f"text {i}", i))
    gc.collect()  # untracks the rows; the next collection, the chunks that hold only untracked rows
    gc.collect()
    walked = sum(len(gc.get_referents(c)) for c in col._chunks if gc.is_tracked(c))
    assert walked == 0
    assert len(col._tail) == 7


async def test_the_indexes_of_many_long_conversations_stay_within_their_memory_bound() -> None:
    """`memory.retrieval.index_cache_mb` bounds what the indexes really hold, whatever the
    conversations' length (the cache used to keep 512 conversations of any size): the least
    recently used go, one still in use stays searchable, and an evicted one is indexed again
    from the store at its next sync."""
    rng = random.Random(7)
    vocab = [f"term{i}" for i in range(3000)]

    def conversation(n: int) -> list[str]:
        return [f"about label{n} " + " ".join(rng.choice(vocab) for _ in range(150)) for _ in range(200)]

    bound = 3 << 20
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = RecallCache(bound)
        fetched: list[int] = []
        for n in range(16):
            texts = conversation(n)

            async def fetch(a: int, b: int, texts: list[str] = texts, n: int = n) -> list[Message]:
                fetched.append(n)
                return _turns(texts[a:b], a)

            await cache.sync(n, _turns(texts[-2:], 198), 198, fetch)
            if n == 0:
                first = texts
            await cache.sync(0, _turns(first[-2:], 198), 198, fetch)  # conversation 0 keeps being used
            assert cache.search(0, query="label0", before=200, budget_tokens=50)
            del texts
        del first
        gc.collect()
        # The interpreter's table of interned strings is global: when earlier tests have filled it,
        # this test's words may be the ones that make it grow, a one-off of the process, not the cache.
        interning = [tracemalloc.Filter(False, retrieval.__file__, lineno=n)
                     for n, line in enumerate(inspect.getsource(retrieval).splitlines(), 1)
                     if "sys.intern(" in line]
        snapshot = tracemalloc.take_snapshot().filter_traces(interning)
        holding = sum(s.size for s in snapshot.statistics("filename")) - before
    finally:
        tracemalloc.stop()
    # 16 conversations of 200 messages of ~1.2 KB hold well over 10 MB; the bound's estimate keeps
    # them near 3 MB (allowing for the texts' object headers and the index's own dicts).
    assert holding < 1.5 * bound
    assert cache._bytes <= bound
    kept = list(cache._entries)
    assert 0 in kept and 15 in kept and 1 not in kept and fetched.count(0) == 1
    assert cache.search(15, query="label15", before=200, budget_tokens=50)
    # An evicted conversation is read from the store again at its next sync, then searchable.
    texts1 = conversation(1)

    async def fetch1(a: int, b: int) -> list[Message]:
        fetched.append(1)
        return _turns(texts1[a:b], a)

    await cache.sync(1, _turns(texts1[-2:], 198), 198, fetch1)
    assert fetched.count(1) == 2 and cache.search(1, query="label1", before=200, budget_tokens=50)


async def test_what_searches_keep_in_an_index_counts_against_the_bound() -> None:
    """Each queried term keeps its per-session frequencies for the next search: many different
    questions over a long conversation of many sessions grow the index, and the bound must see it."""
    rng = random.Random(3)
    vocab = [f"term{i}" for i in range(3000)]
    texts = [" ".join(rng.choice(vocab) for _ in range(60)) for _ in range(600)]
    turns = [Message(raw={}, role="user" if i % 2 == 0 else "assistant", text=t, tokens=60, hash=f"h{i}",
                     chain=f"c{i}", time=f"2024-01-{1 + i // 20:02d}T10:00:00") for i, t in enumerate(texts)]

    async def fetch(a: int, b: int) -> list[Message]:
        return turns[a:b]

    cache = RecallCache(64 << 20)
    await cache.sync("c", turns[-2:], 598, fetch)
    counted = cache._bytes
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for q in range(400):
            assert cache.search("c", query=" ".join(vocab[(q * 7 + j) % 3000] for j in range(8)),
                                before=590, budget_tokens=200)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 200 << 10
    assert 0.6 * grown <= cache._bytes - counted <= 2 * grown


async def test_an_index_being_brought_up_to_date_is_not_evicted_under_it() -> None:
    """A catch-up yields to the event loop between slices; another conversation growing the cache
    past its bound meanwhile must not evict the index that request is about to search."""
    def texts(label: str) -> list[str]:
        return [f"{label} " + " ".join(f"w{(i * 7 + j) % 997}" for j in range(120)) for i in range(300)]

    a, b = texts("alpha"), texts("beta")
    cache = RecallCache(max_bytes=100_000)  # less than either conversation holds

    async def fetch_a(lo: int, hi: int) -> list[Message]:
        return _turns(a[lo:hi], lo)

    async def fetch_b(lo: int, hi: int) -> list[Message]:
        await asyncio.sleep(0)
        return _turns(b[lo:hi], lo)

    async def request(key: str, history: list[str], fetch: Any) -> list[Any]:
        await cache.sync(key, _turns(history[-2:], 298), 298, fetch)  # as the memory path: sync, then search
        return cache.search(key, query=history[0].split()[0], before=300, budget_tokens=100)

    found_a, found_b = await asyncio.gather(request("a", a, fetch_a), request("b", b, fetch_b))
    assert found_a and found_b
