"""Forward the full history or the rewrite, whichever the provider will bill less.

Providers bill a prompt's cached prefix at a fraction of fresh input (`pricing.<model>.cache_read`:
0.1 for Anthropic and gpt-5, 0.25 for gpt-4.1, 0.5 for gpt-4o) and a newly cached part at a premium
on Anthropic (`cache_write` 1.25, none on OpenAI). A full history resent to a warm cache is cheap
per request, while a rewrite pays fresh input for its excerpts every request and rewrites its cached
prefix after every fold. So below some history size the full history is the cheaper request, above
it the rewrite is; where that size lies depends on the model's prices. This module decides, from
what was forwarded last in the conversation and whether that cache is still warm.

The comparison looks a few requests ahead (`horizon`): switching from full to rewritten costs one
cold write of the rewrite, which the cheaper requests after it must pay back; a greedy next-request
comparison would never switch until the history alone cost more than a cold rewrite.

Pure: the caller keeps `Forwarded` records (per conversation, in process) and a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import PriceSettings
from gateway.model import Pins


@dataclass(frozen=True, slots=True)
class Forwarded:
    """What a request carried upstream, as far as prompt caching is concerned.

    A rewritten request is a sequence of items (a hash each: system, the state/summary block,
    messages, the excerpts) with their tokens. A full request is identified by the chain hash of
    its last message, which stands for its whole prefix: `items` is (system hash, that chain) and
    `length` its number of messages.
    """

    full: bool
    items: tuple[str, ...]
    tokens: tuple[int, ...]
    at: float  # monotonic seconds
    length: int = 0  # messages of a full request
    pins: Pins | None = None  # a rewrite's excerpt blocks, kept in place by the next request (rewrite.py)
    # A full request's prefix without its newest message: (that message's predecessor's chain hash,
    # tokens up to it). A regenerate, a retry with another last message or a question asked beside
    # the last turn still reads that prefix from the cache.
    before_last: tuple[str, int] | None = None
    # New excerpt tokens a searched turn of this conversation writes, on average so far (rewrite.py
    # keeps it; None before the first search). The cost choice expects later turns to write as many.
    excerpt_rate: float | None = None

    @property
    def total(self) -> int:
        return sum(self.tokens)


@dataclass(frozen=True, slots=True)
class Prices:
    read: float = 0.1  # cached prefix, per token, in fresh-input equivalents
    write: float = 1.25  # the uncached rest (written to the cache for the next request)
    ttl: float = 300.0  # seconds a provider keeps a prompt cache warm
    min_tokens: int = 0  # a shorter prefix is never cached (OpenAI and Anthropic: 1,024)


DEFAULT_PRICES = Prices()


def prices(p: PriceSettings, *, one_hour: bool = False) -> Prices:
    """A model's cache prices; `one_hour`: the request asks Anthropic for its 1-hour cache."""
    if one_hour and p.provider == "anthropic":
        return Prices(read=p.cache_read, write=p.cache_write_1h, ttl=max(p.cache_ttl_seconds, 3600.0),
                      min_tokens=p.cache_min_tokens)
    return Prices(read=p.cache_read, write=p.cache_write, ttl=p.cache_ttl_seconds, min_tokens=p.cache_min_tokens)


def warm(last: Forwarded | None, now: float, prices: Prices) -> bool:
    return last is not None and prices.ttl > 0 and now - last.at <= prices.ttl


def cached(items: Sequence[str], tokens: Sequence[int], last: Forwarded | None, now: float, prices: Prices) -> int:
    """Tokens of `items` the provider is expected to read from its cache: the common prefix with the
    last request, when that is still warm and long enough to be cached."""
    if last is None or not warm(last, now, prices):
        return 0
    common = 0
    for mine, theirs in zip(items, last.items, strict=False):
        if mine != theirs:
            break
        common += 1
    hit = sum(tokens[:common])
    return hit if hit >= prices.min_tokens else 0


def billed(items: Sequence[str], tokens: Sequence[int], last: Forwarded | None, now: float,
           prices: Prices) -> float:
    """What sending `items` now would be billed: the common prefix with the last request is read
    from the cache when that is still warm, the rest is written."""
    hit = cached(items, tokens, last, now, prices)
    return prices.read * hit + prices.write * (sum(tokens) - hit)


def cached_full(system: tuple[str, int], history_tokens: int, chains: Sequence[str], last: Forwarded | None,
                now: float, prices: Prices) -> int:
    """Tokens of the full history the provider is expected to read from its cache (`billed_full`)."""
    if last is None or not warm(last, now, prices) or not last.items or last.items[0] != system[0]:
        return 0
    hit = system[1]
    if last.full and 0 < last.length <= len(chains) and chains[last.length - 1] == last.items[1]:
        hit = last.total
    elif (last.full and last.before_last is not None and 1 < last.length <= len(chains) + 1
          and chains[last.length - 2] == last.before_last[0]):
        hit = system[1] + last.before_last[1]
    return hit if hit >= prices.min_tokens else 0


def billed_full(system: tuple[str, int], history_tokens: int, chains: Sequence[str], last: Forwarded | None,
                now: float, prices: Prices, *, cacheable: bool) -> float:
    """What the full history would be billed now. `chains`: this request's chain hashes, by which a
    previous full request is recognised as a prefix of this one."""
    total = system[1] + history_tokens
    if not cacheable or total < prices.min_tokens:
        return float(total)
    hit = cached_full(system, history_tokens, chains, last, now, prices)
    return prices.read * hit + prices.write * (total - hit)


def full_record(system: tuple[str, int], chains: Sequence[str], history_tokens: int, last_tokens: int,
                now: float, excerpt_rate: float | None = None) -> Forwarded:
    """The record of a full request whose messages have these chain hashes; `last_tokens`: its
    newest message's tokens."""
    before = (chains[-2], history_tokens - last_tokens) if len(chains) > 1 else None
    return Forwarded(True, (system[0], chains[-1] if chains else ""), (system[1], history_tokens), now,
                     len(chains), before_last=before, excerpt_rate=excerpt_rate)


@dataclass(frozen=True, slots=True)
class Choice:
    full: bool
    full_cost: float
    rewrite_cost: float


def choose(*, full_now: float, rewrite_now: float, full_total: int, rewrite_total: int, new: int, volatile: int,
           prices: Prices, horizon: int, full_cacheable: bool = True, later_excerpts: int = 0) -> Choice:
    """Compare the next `horizon` requests under each mode, starting with this one.

    After this request, a full request re-reads everything and writes only the next turn (`new`
    tokens); a rewritten one re-reads its stable part and writes its `volatile` part (excerpts and
    the newest turn) again, with `later_excerpts` more excerpt tokens than this one. Ties go to the
    rewrite: smaller requests are faster too.
    """
    full_cacheable = full_cacheable and full_total >= prices.min_tokens
    steady_full = prices.read * full_total + prices.write * new if full_cacheable else float(full_total)
    stable = max(rewrite_total - volatile, 0)
    fresh = volatile + later_excerpts
    steady_rewrite = (prices.read * stable + prices.write * fresh if stable >= prices.min_tokens
                      else float(stable + fresh))
    later = max(horizon - 1, 0)
    full_cost = full_now + later * steady_full
    rewrite_cost = rewrite_now + later * steady_rewrite
    return Choice(full=full_cost < rewrite_cost, full_cost=full_cost, rewrite_cost=rewrite_cost)
