"""What each tenant's requests did, for the dashboard and `/gateway/stats`: which conversations it
has (newest first), the last decision per conversation, running totals and a per-minute series.

Noted in memory per request (no Redis call on the request path: a warm turn stays one round trip)
and written in one pipelined round trip per `FLUSH_SECONDS` for all of them. All keys of a tenant
share a hash slot (`keys.py`). Conversations are listed from here: the store keeps no index of them.
Costs are kept in micro-USD so that they add up exactly as integers. A process that dies loses at
most its last second of notes; the conversations themselves are in the store.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
import structlog

if TYPE_CHECKING:  # a plain proxy imports this module (app.py) and must not load the store
    from gateway.store import Store

log = structlog.get_logger("gateway.activity")
FLUSH_SECONDS = 1.0

SERIES_DAYS = 7  # how long the per-minute series is kept
SERIES_FIELDS = ("requests", "tokens_original", "tokens_forwarded", "cost_original_uusd", "cost_forwarded_uusd")
TOTAL_FIELDS = (*SERIES_FIELDS, "tokens_saved")
EXCERPTS_MAX = 8000  # characters of the last request's excerpts kept for the conversation view
# Each tenant's newest requests are also kept one by one: while they cover the chart's span, it is
# drawn per request (a short or quiet period still shows a curve), else per minute.
RECENT_MAX = 2000
MAX_POINTS = 5000  # per-request points in one answer (the admin's, over many tenants); past it, per minute


@dataclass(frozen=True, slots=True)
class Noted:
    """One request of a conversation, as the log line and the dashboard tell it."""

    tenant: str
    conversation: str
    project: str | None
    model: str | None
    provider: str
    context: str
    reason: str | None
    status: int
    tokens_original: int
    tokens_forwarded: int
    usd_per_mtok: float
    excerpts: str = ""
    at: float = 0.0
    listed: bool = True  # False: counted in the totals, but no conversation row (nothing of it was kept)


def _day(ts: float) -> str:
    return _day_name(int(ts // 86400))


@functools.lru_cache(maxsize=16)
def _day_name(day: int) -> str:
    # Once per day, not per request: formatting a date costs as much as the rest of noting one.
    return datetime.fromtimestamp(day * 86400, UTC).strftime("%Y%m%d")


class Activity:
    def __init__(self, store: Callable[[], Store | None], spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self._store = store
        self._spawn = spawn
        self._totals: dict[str, dict[str, int]] = {}  # tenant -> counter -> increment
        self._series: dict[tuple[str, str], dict[str, int]] = {}  # (tenant, day) -> "<minute>:<counter>" -> increment
        self._used: dict[tuple[str, str], float] = {}  # (tenant, conversation) -> last used
        self._last: dict[tuple[str, str], bytes] = {}  # (tenant, conversation) -> last decision JSON
        self._recent: dict[str, list[bytes]] = {}  # tenant -> [time, original, forwarded, cost o, cost f]
        self._scheduled = False

    @property
    def store(self) -> Store:
        store = self._store()
        if store is None:
            raise RuntimeError("no store")
        return store

    def note(self, n: Noted) -> None:
        at = n.at or time.time()
        cost_o = round(n.tokens_original * n.usd_per_mtok)  # tokens x USD per Mtok = micro-USD
        cost_f = round(n.tokens_forwarded * n.usd_per_mtok)
        counts = {"requests": 1, "tokens_original": n.tokens_original, "tokens_forwarded": n.tokens_forwarded,
                  "cost_original_uusd": cost_o, "cost_forwarded_uusd": cost_f}
        totals = self._totals.setdefault(n.tenant, {})
        series = self._series.setdefault((n.tenant, _day(at)), {})
        minute = int(at // 60)
        for name, value in counts.items():
            totals[name] = totals.get(name, 0) + value
            series[f"{minute}:{name}"] = series.get(f"{minute}:{name}", 0) + value
        totals["tokens_saved"] = totals.get("tokens_saved", 0) + n.tokens_original - n.tokens_forwarded
        self._recent.setdefault(n.tenant, []).append(
            orjson.dumps([round(at, 3), n.tokens_original, n.tokens_forwarded, cost_o, cost_f]))
        conv = (n.tenant, n.conversation)
        if not n.listed:
            self._schedule()
            return
        self._used[conv] = at
        self._last[conv] = orjson.dumps({
            "context": n.context, "reason": n.reason, "model": n.model, "provider": n.provider, "project": n.project,
            "status": n.status, "tokens_original": n.tokens_original, "tokens_forwarded": n.tokens_forwarded,
            "excerpts": n.excerpts[:EXCERPTS_MAX], "at": round(at, 3)})
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(FLUSH_SECONDS, lambda: self._spawn(self._flush_later()))

    async def _flush_later(self) -> None:
        try:
            await self.flush()
        except Exception as exc:  # the store is away: these notes are lost (the conversations are not)
            log.warning("activity_not_recorded", error=type(exc).__name__)

    async def flush(self) -> None:
        """Write what was noted since the last flush (the API calls it first, so this process reads its own)."""
        self._scheduled = False
        if not self._used:
            return
        totals, series, used, last, recent = self._totals, self._series, self._used, self._last, self._recent
        self._totals, self._series, self._used, self._last, self._recent = {}, {}, {}, {}, {}
        k = self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for tenant, counters in totals.items():
            pipe.zadd(k.tenants(), {tenant: max(at for (t, _), at in used.items() if t == tenant)})
            for name, value in counters.items():
                if value:
                    pipe.hincrby(k.tenant(tenant, "totals"), name, value)
        for tenant, points in recent.items():
            pipe.rpush(k.tenant(tenant, "recent"), *points[-RECENT_MAX:])
            pipe.ltrim(k.tenant(tenant, "recent"), -RECENT_MAX, -1)
        for (tenant, day), fields in series.items():
            key = k.tenant(tenant, f"series:{day}")
            for name, value in fields.items():
                if value:
                    pipe.hincrby(key, name, value)
            pipe.expire(key, SERIES_DAYS * 86400)
        for (tenant, conv), at in used.items():
            pipe.zadd(k.tenant(tenant, "convs"), {conv: at})
            pipe.hset(k.tenant(tenant, "last"), conv, last[tenant, conv])
        ttl = self.store.ttl
        if ttl > 0:  # conversations expire this long after their last use: so does what lists them
            for tenant in totals:
                for part in ("convs", "last", "totals", "recent"):
                    pipe.expire(k.tenant(tenant, part), ttl)
        await pipe.execute()
        if ttl > 0:
            await self._drop_expired(list(totals), time.time() - ttl)

    async def _drop_expired(self, tenants: list[str], before: float) -> None:
        """Rows of conversations last used before `before` (expired from the store by now)."""
        k = self.store.keys
        pipe = self.store.redis.pipeline(transaction=False)
        for tenant in tenants:
            pipe.zrangebyscore(k.tenant(tenant, "convs"), "-inf", f"({before}")
        stale: list[Any] = await pipe.execute()
        pipe = self.store.redis.pipeline(transaction=False)
        for tenant, convs in zip(tenants, stale, strict=True):
            if convs:
                pipe.zrem(k.tenant(tenant, "convs"), *convs)
                pipe.hdel(k.tenant(tenant, "last"), *convs)
        await pipe.execute()

    async def forget(self, tenant: str, conversation: str) -> None:
        """Drop the conversation from the listing (the tenant's totals keep what it saved)."""
        self._used.pop((tenant, conversation), None)
        self._last.pop((tenant, conversation), None)
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.zrem(self.store.keys.tenant(tenant, "convs"), conversation)
        pipe.hdel(self.store.keys.tenant(tenant, "last"), conversation)
        await pipe.execute()

    async def tenants(self) -> list[str]:
        raw: Any = await self.store.redis.zrevrange(self.store.keys.tenants(), 0, 9999)
        return [r.decode() for r in raw]

    async def conversations(self, tenant: str, offset: int, limit: int) -> tuple[int, list[tuple[str, float]]]:
        """(how many, a page of (conversation id, last used) newest first)."""
        key = self.store.keys.tenant(tenant, "convs")
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.zcard(key)
        pipe.zrevrange(key, offset, offset + limit - 1, withscores=True)
        total, page = await pipe.execute()
        return int(total), [(c.decode(), float(s)) for c, s in page]

    async def last(self, tenant: str, conversations: list[str]) -> list[dict[str, Any] | None]:
        if not conversations:
            return []
        raw: Any = await self.store.redis.hmget(self.store.keys.tenant(tenant, "last"), conversations)
        return [orjson.loads(r) if r else None for r in raw]

    async def totals(self, tenants: Iterable[str]) -> dict[str, int]:
        out = dict.fromkeys(TOTAL_FIELDS, 0)
        pipe = self.store.redis.pipeline(transaction=False)
        for t in tenants:
            pipe.hgetall(self.store.keys.tenant(t, "totals"))
        for raw in await pipe.execute():
            for name, value in raw.items():
                out[name.decode()] = out.get(name.decode(), 0) + int(value)
        return out

    async def series(self, tenants: Iterable[str], *, hours: int, now: float | None = None) -> list[dict[str, Any]]:
        """Points of the last `hours` hours, oldest first: one per request while each tenant's kept
        requests reach back that far (or are all it ever made), else one per minute with requests."""
        tenants = list(tenants)
        now = now or time.time()
        start = now - hours * 3600
        pipe = self.store.redis.pipeline(transaction=False)
        for t in tenants:
            pipe.lrange(self.store.keys.tenant(t, "recent"), 0, -1)
        kept = [[orjson.loads(r) for r in rows] for rows in await pipe.execute()]
        if sum(map(len, kept)) <= MAX_POINTS and all(len(rows) < RECENT_MAX or rows[0][0] <= start
                                                     for rows in kept):
            points = sorted(p for rows in kept for p in rows if p[0] >= start)
            return [{"t": p[0], "requests": 1, "tokens_original": p[1], "tokens_forwarded": p[2],
                     "cost_original_uusd": p[3], "cost_forwarded_uusd": p[4]} for p in points]
        return await self._minutes(tenants, hours=hours, now=now)

    async def _minutes(self, tenants: Iterable[str], *, hours: int, now: float) -> list[dict[str, Any]]:
        since = int((now - hours * 3600) // 60)
        days = sorted({_day(now - d * 86400) for d in range(hours // 24 + 2)})
        points: dict[int, dict[str, Any]] = {}
        pipe = self.store.redis.pipeline(transaction=False)
        for t in tenants:
            for day in days:
                pipe.hgetall(self.store.keys.tenant(t, f"series:{day}"))
        for raw in await pipe.execute():
            for name, value in raw.items():
                minute_s, _, field = name.decode().partition(":")
                minute = int(minute_s)
                if minute < since:
                    continue
                point = points.setdefault(minute, {"t": minute * 60, **dict.fromkeys(SERIES_FIELDS, 0)})
                point[field] = point.get(field, 0) + int(value)
        return [points[m] for m in sorted(points)]
