"""The fold queue's consumer side in Redis: the stream's consumer group, delivery, reclaim, acks, and
the per-conversation fold lock. Part of the store layer: no other module talks to the stream.

Jobs are queued by the request path (`Store.enqueue_fold`: a flag in the conversation's meta, so at
most one job per conversation is queued, then XADD to `<prefix>:folds`). Workers read them through
the consumer group `Keys.FOLD_GROUP`: a job stays pending on the consumer it was delivered to until
`ack` (XACK + XDEL); one left pending by a crashed consumer is taken over after it has been idle
long enough (`reclaim`, XAUTOCLAIM). A fold runs under `lock` (SET NX PX), kept fresh by `keep`
while it runs (the lock's expiry and the job's idle time), and freed by `unlock` only by its owner.

Consumers are names in the group; a stopped worker removes its own (`retire`) once nothing is
pending on it, and `prune` removes those idle long with nothing pending (workers that died): a
consumer with pending jobs is never removed, its jobs would become unclaimable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from gateway.keys import JOB_CONVERSATION, JOB_PROJECT, JOB_TENANT, JOB_URGENT, ConvRef, Keys

# Atomic "delete if still mine": a lock that expired and was taken by another worker is not freed.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Remove `consumer` from the group if nothing is pending on it (atomic: a job delivered to it
# meanwhile keeps it). KEYS: stream. ARGV: group, consumer. Returns 1 if removed.
_RETIRE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Remove every consumer idle for ARGV[2] ms or more with nothing pending (XINFO CONSUMERS answers
# flat name/value lists). KEYS: stream. ARGV: group, idle ms. Returns how many were removed.
_PRUNE = """
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed = removed + 1
  end
end
return removed
"""


@dataclass(slots=True)
class Job:
    """A fold job: the conversation to fold now (the worker works out what is due)."""

    id: str
    ref: ConvRef
    urgent: bool
    attempts: int = field(default=0)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def job_fields(ref: ConvRef, *, urgent: bool) -> dict[str, str]:
    """A job's stream entry."""
    return {JOB_TENANT: ref.tenant, JOB_CONVERSATION: ref.conversation, JOB_PROJECT: ref.project or "",
            JOB_URGENT: "1" if urgent else "0"}


def parse_job(job_id: Any, fields: dict[Any, Any] | None) -> Job | None:
    if not fields:
        return None  # the entry was deleted from the stream: only its pending record is left
    f = {_s(k): _s(v) for k, v in fields.items()}
    if JOB_TENANT not in f or JOB_CONVERSATION not in f:
        return None
    return Job(id=_s(job_id), ref=ConvRef(f[JOB_TENANT], f[JOB_CONVERSATION], f.get(JOB_PROJECT) or None),
               urgent=f.get(JOB_URGENT) == "1")


# XPENDING pages when handing jobs back: a consumer holds one job at a time, plus the few a breaker
# pause left behind.
_HAND_BACK_PAGE = 100

# (entry id, the job or None when the entry cannot be read), or None when there is no entry.
Delivery = tuple[str, Job | None] | None


class FoldQueue:
    """The fold stream as a fold worker sees it (see the module's docstring)."""

    def __init__(self, client: aioredis.Redis | RedisCluster, keys: Keys) -> None:
        self.redis, self.keys = client, keys
        self.stream = keys.fold_stream()
        self._release = client.register_script(_RELEASE)
        self._retire = client.register_script(_RETIRE)
        self._prune = client.register_script(_PRUNE)

    async def ensure_group(self) -> None:
        try:
            # From "0": jobs enqueued before any worker ever started are not skipped.
            await self.redis.xgroup_create(self.stream, Keys.FOLD_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def own_pending(self, consumer: str) -> Delivery:
        """The first job delivered to `consumer` and not acked yet."""
        mine: Any = await self.redis.xreadgroup(Keys.FOLD_GROUP, consumer, {self.stream: "0"}, count=1)
        for _, entries in mine or []:
            for job_id, fields in entries:
                return _s(job_id), parse_job(job_id, fields)
        return None

    async def reclaim(self, consumer: str, min_idle_ms: int) -> Delivery:
        """A job pending on another consumer for `min_idle_ms` or more, now delivered to `consumer`."""
        claimed: Any = await self.redis.xautoclaim(self.stream, Keys.FOLD_GROUP, consumer,
                                                   min_idle_time=min_idle_ms, start_id="0-0", count=1)
        entries = claimed[1] if claimed and len(claimed) > 1 else []
        for job_id, fields in entries:
            return _s(job_id), parse_job(job_id, fields)
        return None

    async def next(self, consumer: str, block_ms: int | None) -> Delivery:
        """A job never delivered before, waiting up to `block_ms` for one (None: not at all).
        fakeredis returns at once even with a block: callers must not rely on the wait."""
        new: Any = await self.redis.xreadgroup(Keys.FOLD_GROUP, consumer, {self.stream: ">"}, count=1,
                                               block=block_ms)
        for _, entries in new or []:
            for job_id, fields in entries:
                return _s(job_id), parse_job(job_id, fields)
        return None

    async def ack(self, job_id: str) -> int:
        """Finish a job: acked and deleted from the stream. Returns how many were pending (0 or 1)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, Keys.FOLD_GROUP, job_id)
            pipe.xdel(self.stream, job_id)
            acked, _ = await pipe.execute()
        return int(acked)

    async def lock(self, ref: ConvRef, token: str, ttl_ms: int) -> bool:
        """Take the conversation's fold lock for `ttl_ms` unless another holder has it."""
        return bool(await self.redis.set(self.keys.fold_lock(ref), token, nx=True, px=ttl_ms))

    async def unlock(self, ref: ConvRef, token: str) -> None:
        """Free the lock if `token` still holds it."""
        await self._release(keys=[self.keys.fold_lock(ref)], args=[token])

    async def keep(self, ref: ConvRef, job_id: str | None, consumer: str, ttl_ms: int) -> None:
        """A long fold is alive: its lock expires `ttl_ms` from now, its job's idle time restarts."""
        await self.redis.pexpire(self.keys.fold_lock(ref), ttl_ms)
        if job_id is not None:
            await self.redis.xclaim(self.stream, Keys.FOLD_GROUP, consumer, min_idle_time=0,
                                    message_ids=[job_id], justid=True)

    async def hand_back(self, consumer: str, idle_ms: int) -> int:
        """Make every job still pending on `consumer` look `idle_ms` old, so the next `reclaim` of any
        other worker (which asks for jobs idle that long) takes it at once. Returns how many."""
        handed, start = 0, "-"
        while True:
            pending: Any = await self.redis.xpending_range(self.stream, Keys.FOLD_GROUP, min=start, max="+",
                                                           count=_HAND_BACK_PAGE, consumername=consumer)
            ids = [p["message_id"] for p in pending]
            if not ids:
                return handed
            # XCLAIM to the same consumer with IDLE only rewrites the job's last-delivery time.
            await self.redis.xclaim(self.stream, Keys.FOLD_GROUP, consumer, min_idle_time=0, message_ids=ids,
                                    idle=idle_ms, justid=True)
            handed += len(ids)
            if len(ids) < _HAND_BACK_PAGE:
                return handed
            start = "(" + _s(ids[-1])

    async def retire(self, consumer: str) -> bool:
        """Remove `consumer` from the group unless a job is pending on it; True if removed."""
        try:
            return bool(await self._retire(keys=[self.stream], args=[Keys.FOLD_GROUP, consumer]))
        except ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
                return False  # no stream or group (a store restarted empty): nothing to remove
            raise

    async def prune(self, idle_ms: int) -> int:
        """Remove the consumers idle `idle_ms` or longer with no job pending; how many."""
        try:
            return int(await self._prune(keys=[self.stream], args=[Keys.FOLD_GROUP, idle_ms]))
        except ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
                return 0
            raise

    async def unfinished(self) -> int:
        """Fold jobs not finished: pending (delivered, not acked) plus not yet delivered."""
        redis, stream = self.redis, self.stream
        if not await redis.exists(stream):
            return 0
        groups: Any = await redis.xinfo_groups(stream)
        group = next((g for g in groups if _s(g.get("name", g.get(b"name", ""))) == Keys.FOLD_GROUP), None)
        if group is None:
            return int(await redis.xlen(stream))
        pending = int(group.get("pending", group.get(b"pending", 0)) or 0)
        last = _s(group.get("last-delivered-id", group.get(b"last-delivered-id", "0-0")))
        undelivered: Any = await redis.xrange(stream, min=f"({last}", max="+", count=1)
        return pending + len(undelivered)
