"""What the dashboard reads per tenant: totals, the listing newest first, and a chart series that is
per request while the kept requests cover its span, per minute beyond."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from gateway.activity import RECENT_MAX, Activity, Noted
from gateway.config import StoreSettings
from gateway.store import Store, open_store


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    s = await open_store(StoreSettings(url=redis_url))
    yield s
    await s.close()


def _noted(tenant: str, conv: str, at: float, original: int = 100, forwarded: int = 40) -> Noted:
    return Noted(tenant=tenant, conversation=conv, project=None, model="gpt-4o", provider="openai",
                 context="rewritten",
                 reason=None, status=200, tokens_original=original, tokens_forwarded=forwarded,
                 usd_per_mtok=2.5, at=at)


async def test_totals_and_listing_add_up_across_flushes(store: Store) -> None:
    """Counts noted over several flushes add up exactly (costs in micro-USD), and the listing is newest first."""
    activity = Activity(lambda: store, lambda coro: coro.close())  # flushed by hand here
    now = time.time()
    for i, conv in enumerate(["a", "b", "a", "c"]):
        activity.note(_noted("t1", conv, now - 100 + i))
        await activity.flush()
    activity.note(_noted("t2", "other", now))
    await activity.flush()
    totals = await activity.totals(["t1"])
    assert totals["requests"] == 4 and totals["tokens_original"] == 400 and totals["tokens_saved"] == 240
    assert totals["cost_original_uusd"] == 1000 and totals["cost_forwarded_uusd"] == 400
    total, page = await activity.conversations("t1", 0, 10)
    assert total == 3 and [c for c, _ in page] == ["c", "a", "b"]
    assert await activity.tenants() == ["t2", "t1"]
    last = await activity.last("t1", ["a", "nope"])
    assert last[0] is not None and last[0]["context"] == "rewritten" and last[1] is None
    await activity.forget("t1", "a")
    assert [c for c, _ in (await activity.conversations("t1", 0, 10))[1]] == ["c", "b"]


async def test_series_is_per_request_then_per_minute(store: Store) -> None:
    """A few requests chart one point each; past the kept requests the chart falls back to minute buckets
    that still count every request."""
    activity = Activity(lambda: store, lambda coro: coro.close())
    now = time.time()
    for i in range(10):
        activity.note(_noted("few", "c", now - 50 + i))
    await activity.flush()
    points = await activity.series(["few"], hours=1, now=now)
    assert len(points) == 10 and all(p["requests"] == 1 for p in points)
    n = RECENT_MAX + 100
    for i in range(n):
        activity.note(_noted("many", "c", now - 3000 + i))
    await activity.flush()
    points = await activity.series(["many"], hours=24, now=now)
    assert len(points) <= 60 and sum(p["requests"] for p in points) == n
    assert sum(p["tokens_original"] for p in points) == 100 * n
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)


async def test_with_a_store_ttl_the_listing_forgets_what_the_store_forgot(redis_url: str) -> None:
    """With store.ttl_seconds, a conversation last used longer ago leaves the listing, and the
    tenant's keys expire like its conversations."""
    store = await open_store(StoreSettings(url=redis_url, ttl_seconds=60))
    try:
        activity = Activity(lambda: store, lambda coro: coro.close())
        now = time.time()
        activity.note(_noted("ttl", "old", now - 120))
        activity.note(_noted("ttl", "new", now))
        await activity.flush()
        assert [c for c, _ in (await activity.conversations("ttl", 0, 10))[1]] == ["new"]
        assert (await activity.last("ttl", ["old"]))[0] is None
        assert 0 < await store.redis.ttl(store.keys.tenant("ttl", "convs")) <= 60
    finally:
        await store.close()
