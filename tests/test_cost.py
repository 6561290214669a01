"""The prompt-cache cost model: full history or rewrite, whichever is billed less."""

from __future__ import annotations

from gateway import cost
from gateway.reconcile import chain_hashes

P = cost.Prices(read=0.1, write=1.25, ttl=300.0)


def test_cold_cache_bills_everything_as_written() -> None:
    """With no previous request, or one older than the cache TTL, every token is billed as a cache write."""
    assert cost.billed(["s", "m"], [100, 50], None, 0.0, P) == 1.25 * 150
    old = cost.Forwarded(False, ("s", "m"), (100, 50), at=0.0)
    assert cost.billed(["s", "m"], [100, 50], old, 301.0, P) == 1.25 * 150


def test_warm_cache_reads_the_common_prefix() -> None:
    """Items shared in order with the last request are billed as cache reads, the rest as writes."""
    last = cost.Forwarded(False, ("s", "b", "x"), (100, 200, 300), at=0.0)
    assert cost.billed(["s", "b", "y", "z"], [100, 200, 10, 20], last, 10.0, P) == 0.1 * 300 + 1.25 * 30


def test_full_history_extending_the_last_full_request_reads_it_from_cache() -> None:
    """A full history that extends the previous full request is billed at read price for that prefix."""
    chains = chain_hashes(["a", "b", "c", "d"])
    last = cost.full_record(("sys", 50), chains[:2], 1000, 400, now=0.0)
    billed = cost.billed_full(("sys", 50), 1400, chains, last, 5.0, P, cacheable=True)
    assert billed == 0.1 * 1050 + 1.25 * 400
    edited = chain_hashes(["X", "b", "c", "d"])  # history diverged: nothing but the system is cached
    assert cost.billed_full(("sys", 50), 1400, edited, last, 5.0, P, cacheable=True) == 0.1 * 50 + 1.25 * 1400


def test_a_full_history_that_replaces_the_last_message_reads_the_rest_from_cache() -> None:
    """A regenerate, or a question asked beside the newest turn, resends the previous full request
    but its last message: the provider still reads everything before that message from its cache."""
    chains = chain_hashes(["a", "b", "c"])
    last = cost.full_record(("sys", 50), chains, 1500, 300, now=0.0)  # "c" had 300 tokens
    beside = chain_hashes(["a", "b", "question"])
    assert cost.billed_full(("sys", 50), 1250, beside, last, 5.0, P, cacheable=True) == 0.1 * 1250 + 1.25 * 50
    further = chain_hashes(["a", "X", "question"])  # diverged earlier: only the system is cached
    assert cost.billed_full(("sys", 50), 1250, further, last, 5.0, P, cacheable=True) == 0.1 * 50 + 1.25 * 1250


def test_uncacheable_full_history_bills_every_token() -> None:
    """Where the provider caches nothing for the client (Anthropic without breakpoints), full costs its size."""
    assert cost.billed_full(("sys", 50), 1000, [], None, 0.0, P, cacheable=False) == 1050.0


def test_short_history_stays_full_and_long_history_is_rewritten() -> None:
    """Under a warm cache a modest history is cheaper resent whole; a long one is cheaper rewritten."""

    def decide(history: int) -> bool:
        return cost.choose(full_now=0.1 * history + 1.25 * 300, rewrite_now=1.25 * 8000, full_total=history,
                           rewrite_total=8000, new=300, volatile=4300, prices=P, horizon=5).full

    assert decide(20_000) is True
    assert decide(150_000) is False


def test_rewrite_always_wins_when_full_is_not_cached() -> None:
    """When the full history would not be cached, the smaller rewrite is chosen."""
    c = cost.choose(full_now=20_000, rewrite_now=1.25 * 8000, full_total=20_000, rewrite_total=8000, new=300,
                    volatile=4300, prices=P, horizon=5, full_cacheable=False)
    assert c.full is False and c.rewrite_cost < c.full_cost
