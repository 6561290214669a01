"""In-process cache of per-conversation retrieval indexes, fed incrementally from the store.

The store holds every message; the lexical index over them lives here, one per conversation, kept
up to date as turns arrive (`extend`) and topped up from the store when another replica recorded
turns this process has not seen (`ensure`). It is never rebuilt per request: a conversation's
messages are read from Redis once per process, then only the new ones. Least-recently-used
conversations are evicted past `max_bytes` (`memory.retrieval.index_cache_mb`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.embed import nearest
from gateway.model import Message
from gateway.retrieval import STAMP_RE, RetrievalIndex

# Tokens of an excerpt's "[message 123, assistant, 2023-05-08T13:56:00]" header (cl100k: 17-19).
EXCERPT_HEADER_TOKENS = 20
# A catch-up from the store (a cold index: restart, eviction, another replica) is indexed in slices
# that give the event loop back: indexing costs ~0.1 ms per message of real text, so 500 messages
# in one go would stall every other request for ~65 ms.
SLICE_MESSAGES = 64
SLICE_SECONDS = 0.002
# Messages nearest the question by embedding that are fused with the lexical ranking.
DENSE_TOP = 50
# What one indexed message holds, roughly (measured with tracemalloc on both development sets): its
# text, ~16 bytes per distinct term it posts, and its row. The cache's bound counts these.
POSTING_BYTES = 16
ROW_BYTES = 200
ENTRY_BYTES = 2048  # an empty index's arrays and dicts
VECTOR_BYTES = 768  # a message's int8 embedding (384 dimensions), its array grown by doubling

T = TypeVar("T")

# (conversation key) → messages [start, stop) from the store
FetchTurns = Callable[[int, int], Awaitable[list[Message]]]


class Column(Generic[T]):
    """An append-only sequence the cyclic GC does not walk item by item.

    A full collection visits every reference a tracked container holds, and a list is always
    tracked: with a few hundred conversations of 1,000 messages, the per-message lists held over a
    million references and each full collection stalled the event loop for 30-60 ms. Here items
    sit in tuples of `CHUNK`, which the GC stops tracking once it has seen that they hold only
    strings, numbers, None or such tuples; only the list of chunks and the last, unfinished chunk
    stay in its sight.
    """

    CHUNK = 64
    __slots__ = ("_chunks", "_tail")

    def __init__(self) -> None:
        self._chunks: list[tuple[T, ...]] = []
        self._tail: list[T] = []

    def __len__(self) -> int:
        return len(self._chunks) * self.CHUNK + len(self._tail)

    def __getitem__(self, i: int) -> T:
        if i < 0:
            i += len(self)
        chunk, at = divmod(i, self.CHUNK)
        return self._chunks[chunk][at] if chunk < len(self._chunks) else self._tail[at]

    def __iter__(self) -> Iterator[T]:
        for chunk in self._chunks:
            yield from chunk
        yield from self._tail

    def pick(self, positions: Sequence[int]) -> list[T]:
        """The items at `positions` (each in range)."""
        chunks, tail, size = self._chunks, self._tail, self.CHUNK
        full = len(chunks) * size
        return [chunks[i // size][i % size] if i < full else tail[i - full] for i in positions]

    def append(self, item: T) -> None:
        self._tail.append(item)
        if len(self._tail) == self.CHUNK:
            self._chunks.append(tuple(self._tail))
            self._tail = []

    def truncate(self, length: int) -> None:
        """Keep the first `length` items."""
        if length >= len(self):
            return
        chunk, at = divmod(max(0, length), self.CHUNK)
        self._tail = list(self._chunks[chunk][:at]) if chunk < len(self._chunks) else self._tail[:at]
        del self._chunks[chunk:]


@dataclass(slots=True)
class _Entry:
    index: RetrievalIndex = field(default_factory=RetrievalIndex)
    # Per position: (role, text, time, tokens, chain, bytes held); tuples of strings and numbers, out
    # of the GC's sight.
    rows: Column[tuple[str, str, str | None, int, str, int]] = field(default_factory=Column)
    size: int = 0  # bytes held, roughly: ENTRY_BYTES, the sum of the rows' last field and `side`
    side: int = 0  # the index's `side_bytes` as last counted in `size` (what its searches keep)
    version: int = 0  # bumped by every change to the index: a remembered search is stale after one
    # Held while a catch-up yields mid-way: a concurrent request waits instead of indexing the same
    # positions a second time.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The last search (arguments, version, positions found): a retried or regenerated request asks
    # again with the same question over the same messages. Positions, not the messages built from
    # them: a tuple of ints is out of the GC's sight, a hundred Message objects per entry are not.
    last: tuple[tuple[object, ...], int, tuple[int, ...]] | None = None
    # Embeddings (gateway/embed.py), when on: int8 rows for positions [0, embedded), filled in the
    # background; `cuts` counts truncations, so a batch embedded across one is discarded.
    vectors: Any = None
    embedded: int = 0
    cuts: int = 0
    dropped: bool = False  # evicted or forgotten: a queued embedding job for it is skipped

    def behind(self) -> bool:
        return self.embedded < len(self.rows) and not self.dropped

    def take(self, n: int) -> tuple[int, list[str], int] | None:
        """The texts of the next `n` positions without vectors (the embedder's batch)."""
        start = self.embedded
        stop = min(len(self.rows), start + n)
        if stop <= start or self.dropped:
            return None
        # The date stamp some clients open a session with says nothing about the subject.
        texts = [STAMP_RE.sub("", self.rows[i][1], count=1) for i in range(start, stop)]
        return start, texts, self.cuts

    def put(self, start: int, vectors: Any, cuts: int) -> None:
        if cuts != self.cuts or start != self.embedded or start + len(vectors) > len(self.rows):
            return  # the conversation branched meanwhile: these texts may no longer be its history
        import numpy as np

        need = start + len(vectors)
        if self.vectors is None or len(self.vectors) < need:
            grown = np.zeros((max(need, 2 * (0 if self.vectors is None else len(self.vectors)), 64),
                              vectors.shape[1]), np.int8)
            if self.vectors is not None:
                grown[:start] = self.vectors[:start]
            self.vectors = grown
        self.vectors[start:need] = vectors
        self.embedded = need


class RecallCache:
    """The indexes of the conversations this process served last, within `max_bytes` (roughly:
    an index of 500 coding-assistant messages holds ~2 MB). The least recently used go first; an
    evicted conversation is read from the store and indexed again on its next request."""

    def __init__(self, max_bytes: int = 512 << 20, embedder: Any = None) -> None:
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.max_bytes = max_bytes
        self._bytes = 0
        # gateway.embed.Embedder when memory.retrieval.embeddings is on: None never loads the model.
        self.embedder = embedder

    def _entry(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._grow(entry, ENTRY_BYTES)
        else:
            self._entries.move_to_end(key)
        return entry

    def _grow(self, entry: _Entry, change: int) -> None:
        """Count `change` bytes more (or fewer) held by `entry`, evicting others past the bound. An
        evicted entry a catch-up still fills is no longer counted in the cache's total."""
        entry.size += change
        if not entry.dropped:
            self._bytes += change
            self._evict(entry)

    def _evict(self, growing: _Entry) -> None:
        """Drop least recently used indexes until within the bound. Never the one growing, nor one a
        request is bringing up to date (its lock held): that request would then search nothing."""
        if self._bytes <= self.max_bytes:
            return
        for key in list(self._entries):
            old = self._entries[key]
            if old is growing or old.lock.locked():
                continue
            del self._entries[key]
            old.dropped = True
            self._bytes -= old.size
            if self._bytes <= self.max_bytes:
                return

    def _count_side(self, entry: _Entry) -> None:
        """Count what the index's searches keep (per queried term) since it was last counted."""
        change = entry.index.side_bytes - entry.side
        if change:
            entry.side = entry.index.side_bytes
            self._grow(entry, change)

    def forget(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.dropped = True
            self._bytes -= entry.size

    def _add(self, entry: _Entry, turns: Sequence[Message]) -> None:
        if turns:
            entry.version += 1
        grown = 0
        vector = VECTOR_BYTES if self.embedder is not None else 0
        for turn in turns:
            # Budgeted at what the excerpt will cost: its text plus its "[message N, role, time]"
            # header. Budgeting the text alone overfilled the block, and the renderer then dropped
            # whichever excerpts came last in the conversation, not the least relevant.
            terms = entry.index.add(len(entry.rows), turn.role, turn.text, turn.time,
                                    turn.tokens + EXCERPT_HEADER_TOKENS)
            size = sys.getsizeof(turn.text) + POSTING_BYTES * terms + ROW_BYTES + vector
            entry.rows.append((turn.role, turn.text, turn.time, turn.tokens, turn.chain, size))
            grown += size
        self._grow(entry, grown)

    def truncate(self, key: Hashable, length: int) -> None:
        """The conversation branched at `length`: positions from there on are no longer history."""
        entry = self._entries.get(key)
        if entry is not None:
            self._cut(entry, length)

    def _cut(self, entry: _Entry, length: int) -> None:
        if len(entry.rows) > length:
            entry.version += 1
            entry.index.truncate(length)
            self._grow(entry, -sum(entry.rows[i][5] for i in range(max(0, length), len(entry.rows))))
            self._count_side(entry)
            entry.rows.truncate(length)
            entry.cuts += 1
            entry.embedded = min(entry.embedded, length)

    async def sync(self, key: Hashable, tail: Sequence[Message], tail_start: int, fetch: FetchTurns) -> None:
        """Make every stored position [0, tail_start + len(tail)) searchable.

        The tail was just loaded, so only positions before it that this process has never seen
        are read from the store. A cached position whose chain disagrees with the loaded tail was
        replaced by a branch on another replica, so the cache is cut back there first.
        """
        entry = self._entry(key)
        async with entry.lock:
            for offset, turn in enumerate(tail):
                pos = tail_start + offset
                if pos >= len(entry.rows):
                    break
                if entry.rows[pos][4] != turn.chain:
                    self._cut(entry, pos)  # this entry: the key may name a newer one if it was evicted
                    break
            have = len(entry.rows)
            if have < tail_start:
                if not await self._catch_up(entry, have, await fetch(have, tail_start)):
                    return  # a branch cut the index back meanwhile: the next sync goes on from there
                have = tail_start
            self._add(entry, tail[have - tail_start:])
            if self.embedder is not None and entry.behind():
                self.embedder.notify(key, entry)  # embedded in the background, never by this request

    def embedded(self, key: Hashable) -> int:
        """Positions [0, n) of `key` that have vectors."""
        entry = self._entries.get(key)
        return entry.embedded if entry is not None else 0

    async def _catch_up(self, entry: _Entry, start: int, turns: Sequence[Message]) -> bool:
        """Index `turns` (positions from `start`), yielding to the event loop between slices.

        False when the index no longer ends where this slice starts (truncated by a branch)."""
        done = 0
        while done < len(turns):
            if len(entry.rows) != start + done:
                return False
            deadline = time.perf_counter() + SLICE_SECONDS
            stop = min(done + SLICE_MESSAGES, len(turns))
            end = done + 1
            self._add(entry, turns[done:end])
            while end < stop and time.perf_counter() < deadline:
                self._add(entry, turns[end:end + 1])
                end += 1
            done = end
            if done < len(turns):
                await asyncio.sleep(0)
        return True

    def search(
        self,
        key: Hashable,
        *,
        query: str,
        before: int,
        after: int = 0,
        budget_tokens: int,
        recent: Sequence[str] = (),
        query_time: str | None = None,
        query_vector: Any = None,
        reach_back: float = 0.0,
        min_relevance: float = 0.0,
    ) -> list[tuple[int, Message]]:
        """Best earlier messages among positions [after, before), within budget, as (position, message)
        in conversation order; fused with the messages nearest `query_vector` among those embedded so
        far, when given. Nothing when the window (positions from `before` on) matches the question
        `reach_back` times as well (retrieval.py)."""
        entry = self._entries.get(key)
        if entry is None or budget_tokens <= 0 or before <= max(after, 0):
            return []
        dense_stop = min(before, entry.embedded) if query_vector is not None else 0
        args = (query, after, before, budget_tokens, tuple(recent), query_time, dense_stop, reach_back, min_relevance)
        if entry.last is not None and entry.last[1] == entry.version and entry.last[0] == args:
            return self._messages(entry, entry.last[2])

        def excluded(pos: int) -> bool:
            return pos >= before or pos < after

        dense: list[tuple[int, float]] = []
        if dense_stop > max(after, 0):
            dense = nearest(entry.vectors, query_vector, max(after, 0), dense_stop, DENSE_TOP)
        hits = entry.index.search(
            query, budget_tokens=budget_tokens, exclude=excluded, recent=recent, query_time=query_time, dense=dense,
            window_start=before, reach_back=reach_back, min_relevance=min_relevance,
        )
        self._count_side(entry)
        positions = tuple(h.index for h in hits)
        entry.last = (args, entry.version, positions)
        return self._messages(entry, positions)

    @staticmethod
    def _messages(entry: _Entry, positions: Sequence[int]) -> list[tuple[int, Message]]:
        # Built per hit per search (a block of short turns has a hundred), straight from the rows'
        # chunks, as the plan reads them. Row: (role, text, time, tokens, chain, bytes); Message
        # fields in order: raw, role, text, tokens, hash, chain, time.
        rows = entry.rows.pick(positions)
        return [(p, Message({}, r[0], r[1], r[3], "", "", r[2])) for p, r in zip(positions, rows, strict=True)]
