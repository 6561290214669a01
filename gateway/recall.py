"""In-process cache of per-conversation retrieval indexes, fed incrementally from the store.

The store holds every message; the lexical index over them lives here, one per conversation, kept
up to date as turns arrive (`extend`) and topped up from the store when another replica recorded
turns this process has not seen (`ensure`). It is never rebuilt per request: a conversation's
messages are read from Redis once per process, then only the new ones. Least-recently-used
conversations are evicted past `max_conversations`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

from gateway.model import Turn
from gateway.retrieval import RetrievalIndex

# Tokens of an excerpt's "[message 123, assistant, 2023-05-08T13:56:00]" header (cl100k: 17-19).
EXCERPT_HEADER_TOKENS = 20
# A catch-up from the store (a cold index: restart, eviction, another replica) is indexed in slices
# that give the event loop back: indexing costs ~0.1 ms per message of real text, so 500 messages
# in one go would stall every other request for ~65 ms.
SLICE_MESSAGES = 64
SLICE_SECONDS = 0.002

# (conversation key) → messages [start, stop) from the store
FetchTurns = Callable[[int, int], Awaitable[list[Turn]]]


@dataclass(slots=True)
class _Entry:
    index: RetrievalIndex = field(default_factory=RetrievalIndex)
    texts: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    times: list[str | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    chains: list[str] = field(default_factory=list)
    version: int = 0  # bumped by every change to the index: a remembered search is stale after one
    # Held while a catch-up yields mid-way: a concurrent request waits instead of indexing the same
    # positions a second time.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The last search (arguments, version, result): a retried or regenerated request asks again
    # with the same question over the same messages.
    last: tuple[tuple[object, ...], int, list[Recalled]] | None = None


@dataclass(frozen=True, slots=True)
class Recalled:
    position: int
    role: str
    text: str
    time: str | None
    tokens: int


class RecallCache:
    def __init__(self, max_conversations: int = 512) -> None:
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._max = max_conversations

    def _entry(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def forget(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def _add(self, entry: _Entry, turns: Sequence[Turn]) -> None:
        if turns:
            entry.version += 1
        for turn in turns:
            # Budgeted at what the excerpt will cost: its text plus its "[message N, role, time]"
            # header. Budgeting the text alone overfilled the block, and the renderer then dropped
            # whichever excerpts came last in the conversation, not the least relevant.
            entry.index.add(len(entry.texts), turn.role, turn.text, turn.time, turn.tokens + EXCERPT_HEADER_TOKENS)
            entry.texts.append(turn.text)
            entry.roles.append(turn.role)
            entry.times.append(turn.time)
            entry.tokens.append(turn.tokens)
            entry.chains.append(turn.chain)

    def truncate(self, key: Hashable, length: int) -> None:
        """The conversation branched at `length`: positions from there on are no longer history."""
        entry = self._entries.get(key)
        if entry is not None and len(entry.texts) > length:
            entry.version += 1
            entry.index.truncate(length)
            for column in (entry.texts, entry.roles, entry.times, entry.tokens, entry.chains):
                del column[length:]

    async def sync(self, key: Hashable, tail: Sequence[Turn], tail_start: int, fetch: FetchTurns) -> None:
        """Make every stored position [0, tail_start + len(tail)) searchable.

        The tail was just loaded, so only positions before it that this process has never seen
        are read from the store. A cached position whose chain disagrees with the loaded tail was
        replaced by a branch on another replica, so the cache is cut back there first.
        """
        entry = self._entry(key)
        async with entry.lock:
            for offset, turn in enumerate(tail):
                pos = tail_start + offset
                if pos >= len(entry.chains):
                    break
                if entry.chains[pos] != turn.chain:
                    self.truncate(key, pos)
                    break
            have = len(entry.texts)
            if have < tail_start:
                if not await self._catch_up(entry, have, await fetch(have, tail_start)):
                    return  # a branch cut the index back meanwhile: the next sync goes on from there
                have = tail_start
            self._add(entry, tail[have - tail_start:])

    async def _catch_up(self, entry: _Entry, start: int, turns: Sequence[Turn]) -> bool:
        """Index `turns` (positions from `start`), yielding to the event loop between slices.

        False when the index no longer ends where this slice starts (truncated by a branch)."""
        done = 0
        while done < len(turns):
            if len(entry.texts) != start + done:
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
    ) -> list[Recalled]:
        """Best earlier messages among positions [after, before), within budget."""
        entry = self._entries.get(key)
        if entry is None or budget_tokens <= 0 or before <= max(after, 0):
            return []
        args = (query, after, before, budget_tokens, tuple(recent), query_time)
        if entry.last is not None and entry.last[1] == entry.version and entry.last[0] == args:
            return list(entry.last[2])

        def excluded(pos: int) -> bool:
            return pos >= before or pos < after

        hits = entry.index.search(
            query, budget_tokens=budget_tokens, exclude=excluded, recent=recent, query_time=query_time
        )
        found = [
            Recalled(h.index, entry.roles[h.index], entry.texts[h.index], entry.times[h.index],
                     entry.tokens[h.index])
            for h in hits
        ]
        entry.last = (args, entry.version, found)
        return list(found)
