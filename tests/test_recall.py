"""The per-process cache of retrieval indexes: incremental sync from the store and remembered searches."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.model import Turn
from gateway.recall import RecallCache


def _turns(texts: list[str], start: int = 0) -> list[Turn]:
    return [Turn(raw={}, role="user" if (start + i) % 2 == 0 else "assistant", text=t, tokens=10,
                 hash=f"h{start + i}", chain=f"c{start + i}", time="2024-01-01T10:00:00")
            for i, t in enumerate(texts)]


TEXTS = ["my cat is called Luna", "nice name", "we moved to Lisbon", "great city", "Luna hates the rain",
         "poor cat", "what about dinner", "pasta tonight"]


async def _cache() -> RecallCache:
    cache = RecallCache()

    async def fetch(a: int, b: int) -> list[Turn]:
        return _turns(TEXTS[a:b], a)

    await cache.sync("k", _turns(TEXTS[4:], 4), 4, fetch)
    return cache


async def test_search_stays_within_after_and_before() -> None:
    """Only positions in [after, before) come back."""
    cache = await _cache()
    hits = cache.search("k", query="cat Luna", after=1, before=5, budget_tokens=1000)
    assert 4 in {h.position for h in hits} <= {1, 2, 3, 4}
    assert cache.search("k", query="cat Luna", after=0, before=8, budget_tokens=1000)[0].position == 0
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

    async def fetch(a: int, b: int) -> list[Turn]:
        raise AssertionError("nothing to fetch")

    await cache.sync("k", _turns([*TEXTS[4:], "Luna the cat again"], 4), 4, fetch)
    again = cache.search("k", query="cat Luna", before=9, budget_tokens=1000)
    assert len(calls) == 3 and 8 in {h.position for h in again}
    cache.truncate("k", 8)
    assert 8 not in {h.position for h in cache.search("k", query="cat Luna", before=9, budget_tokens=1000)}
    assert len(calls) == 4
