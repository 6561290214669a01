"""Conversation storage in Redis (or `memory://`: fakeredis running the very same Lua).

Every operation that reads-then-writes is one Lua script over keys that share the conversation's
hash tag (see keys.py), so it is atomic and runs unchanged on Redis Cluster. The request path costs
one round trip to load (`load`) and one to record (`append`).

Messages: `msgs` is a list of JSON records `{"k": tokens, "h": hash, "o": role, "t": time, "x": text,
"r": raw, "c": chain}` ("k" first so Lua can read a record's tokens with one anchored match, "c" last
because the script computes it and splices it in), and `chains` a parallel list of chain hashes so
that the CAS checks and `chains()` never decode a message. History is never truncated except by an
explicit `branch`.

Summary versions only grow. A fold commits by CAS on (version, chain at covers-1); when there is no
summary (never folded, or dropped by a branch) only the chain is checked, so a worker that passes
`view.summary.version if view.summary else 0` is never locked out by a dropped summary's version.

Errors: connection-level failures surface as `StoreUnavailable` so the request path can degrade.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, cast

import orjson
import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import HiredisRespSerializer

from gateway.config import StoreSettings
from gateway.keys import ConvRef, Keys
from gateway.model import ConversationView, Summary, Turn


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused, timeout, cluster down)."""


_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterDownError,
    rex.RedisClusterException,
    rex.InvalidResponse,  # something that is not Redis answers on that port
    OSError,  # includes the builtin TimeoutError (= asyncio.TimeoutError on 3.11)
)


class _Guard:
    """`with _guard:` maps connection-level failures to StoreUnavailable (cheaper than @contextmanager)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc is not None and isinstance(exc, _UNAVAILABLE):
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        return False


_guard = _Guard()

Committed = Callable[[ConvRef, Summary | None, tuple[dict[str, Any], int] | None], None]


@dataclass(slots=True)
class AppendResult:
    ok: bool
    length: int  # messages stored after the call
    appended: int
    reason: str = ""  # "branched" when the CAS on the base failed
    chain: str = ""  # chain of the last stored message after the call
    start: int = -1  # position of the first of these turns (stored now or found already stored)
    summary_version: int = 0  # after the call, to tell whether a known view is current
    state_version: int = -1  # -1: not readable here (a project's state in another cluster slot)
    fold_queued: bool = False
    summarizer: dict[str, int] = field(default_factory=dict)  # summarizer_tokens_in/out/charged stats


# Every conversation script gets the conversation's keys in this order (keys.conversation_keys),
# so it can refresh the TTL of all of them: 1 meta, 2 msgs, 3 chains, 4 summary, 5 stats, 6 state.
_TOUCH = """
local function touch(ttl)
  if ttl > 0 then for i = 1, 6 do redis.call('EXPIRE', KEYS[i], ttl) end end
end
"""

# The optimistic check of append and branch: the history still has `chain` at position pos-1.
# Both answer {ok, length, appended, reason, last chain, start, summary version, state version,
# fold-queued flag, summarizer stats}: the last four tell the caller whether what it knows of the
# conversation is current (KEYS[sk] is the state hash when it lives in this slot, sk 0 when not).
_BASE = """
local function on_base(len, pos, chain)
  return pos <= len and (pos == 0 or redis.call('LINDEX', KEYS[3], pos - 1) == chain)
end
local function answer(ok, len, appended, reason, last, start, sk)
  local state = -1
  if sk > 0 then state = tonumber(redis.call('HGET', KEYS[sk], 'v')) or 0 end
  return {ok, len, appended, reason, last, start, tonumber(redis.call('HGET', KEYS[4], 'v')) or 0, state,
          redis.call('HGET', KEYS[1], 'q') or '',
          redis.call('HMGET', KEYS[5], 'summarizer_tokens_in', 'summarizer_tokens_out', 'summarizer_tokens_charged')}
end
local function refused(len, sk)
  return answer(0, len, 0, 'branched', redis.call('HGET', KEYS[1], 'l') or '', -1, sk)
end
"""

# Stats ride along with the append or branch that records a turn (one round trip, not two): ARGV[6]
# is the number k of (name, increment) pairs that follow; the turns' pairs start at ARGV[7 + 2k].
# Added whatever the outcome of the base check, as a separate add_stats would be.
_STATS = """
local function add_stats(ttl)
  local k = tonumber(ARGV[6])
  for i = 1, k do redis.call('HINCRBY', KEYS[5], ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
  if k > 0 and ttl > 0 then redis.call('EXPIRE', KEYS[5], ttl) end
  return 7 + 2 * k
end
"""

# Appends the n (hash, record) pairs from ARGV[off] after chain `prev`; returns the new last chain
# and the pushed messages' tokens (each record starts with {"k":tokens). RPUSH in batches: Lua
# 5.1's unpack() is bounded by the C stack (~8000 values).
_PUSH = """
local function push(prev, off, n)
  local recs, chs, tokens = {}, {}, 0
  for i = 1, n do
    local rec = ARGV[off + 2 * i - 1]
    prev = redis.sha1hex(prev .. ARGV[off + 2 * i - 2])
    chs[#chs + 1] = prev
    recs[#recs + 1] = string.sub(rec, 1, -2) .. ',"c":"' .. prev .. '"}'
    tokens = tokens + (tonumber(string.match(rec, '^{"k":(%d+)')) or 0)
    if #chs == 1000 or i == n then
      redis.call('RPUSH', KEYS[2], unpack(recs))
      redis.call('RPUSH', KEYS[3], unpack(chs))
      recs, chs = {}, {}
    end
  end
  return prev, tokens
end
"""

# KEYS: the six conversation keys (+ 7: project state when it may be read here).
# ARGV: head, ttl, index of the state key in KEYS (0: do not read state).
_LOAD = _TOUCH + """
local head, ttl, sk = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local len = redis.call('LLEN', KEYS[3])
local meta = redis.call('HMGET', KEYS[1], 'd', 'f', 'l', 'k', 'q')
local summ = redis.call('HMGET', KEYS[4], 'v', 'x', 'n', 'k', 'c')
local covers = 0
if summ[2] then covers = math.min(tonumber(summ[3]) or 0, len) end
local h = math.min(head, covers)
local first = {}
if h > 0 then first = redis.call('LRANGE', KEYS[2], 0, h - 1) end
local tail = {}
if len > covers then tail = redis.call('LRANGE', KEYS[2], covers, -1) end
local state = {}
if sk > 0 then
  state = redis.call('HMGET', KEYS[sk], 'j', 'v')
  if ttl > 0 and sk > 6 then redis.call('EXPIRE', KEYS[sk], ttl) end
end
if len > 0 then touch(ttl) end
return {len, meta, summ, state, first, tail, redis.call('HGETALL', KEYS[5]), covers}
"""

# KEYS: the conversation keys (+ 7: project state, as for _LOAD).
# ARGV: ttl, base_length, base_chain, dialect, state index (see _BASE), stats (see _STATS), then
# (hash, record) pairs: the run of turns to store after message base_length-1.
_APPEND = _TOUCH + _STATS + _PUSH + _BASE + """
local ttl, base, bchain, sk = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
local off = add_stats(ttl)
local n = (#ARGV - off + 1) / 2
local len = redis.call('LLEN', KEYS[3])
if not on_base(len, base, bchain) then return refused(len, sk) end
local seg = {}
if n > 0 and len > base then seg = redis.call('LRANGE', KEYS[3], base, -1) end
-- A base behind the store: the caller planned from what it knew before an append of this same
-- history landed (its own previous request, recorded meanwhile). What is already stored right
-- after the base is not stored again; the rest of the run goes on from there.
local skip, prev = 0, bchain
while skip < n and skip < #seg do
  local c = redis.sha1hex(prev .. ARGV[off + 2 * skip])
  if c ~= seg[skip + 1] then break end
  prev, skip = c, skip + 1
end
local m, first, at = n - skip, off + 2 * skip, base + skip
if m == 0 then
  touch(ttl)
  return answer(1, len, 0, '', redis.call('HGET', KEYS[1], 'l') or '', base, sk)
end
-- Idempotent retry: the rest of the run already stored anywhere after `at` (a retried request
-- whose first attempt was recorded, possibly after concurrent requests' turns).
if len - at >= m then
  for s = 0, len - at - m do
    local p = prev
    if s > 0 then p = seg[skip + s] end
    local i = 1
    while i <= m and redis.sha1hex(p .. ARGV[first + 2 * i - 2]) == seg[skip + s + i] do
      p = seg[skip + s + i]
      i = i + 1
    end
    if i > m then
      touch(ttl)
      return answer(1, len, 0, '', redis.call('HGET', KEYS[1], 'l') or '', at + s, sk)
    end
  end
end
-- Concurrent requests built on the same base land after whatever is stored now.
if len > at then prev = seg[#seg] end
local last, tokens = push(prev, first, m)
if len == 0 then redis.call('HSET', KEYS[1], 'f', ARGV[off]) end
redis.call('HSET', KEYS[1], 'd', ARGV[4], 'l', last)
redis.call('HINCRBY', KEYS[1], 'k', tokens)
touch(ttl)
return answer(1, len + m, m, '', last, len, sk)
"""

# ARGV: ttl, at, base_chain, dialect, state index, stats (see _STATS), then (hash, record) pairs.
_BRANCH = _TOUCH + _STATS + _PUSH + _BASE + """
local ttl, at, bchain, sk = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
local off = add_stats(ttl)
local n = (#ARGV - off + 1) / 2
local len = redis.call('LLEN', KEYS[3])
if not on_base(len, at, bchain) then return refused(len, sk) end
local dropped = 0
if at < len then
  for _, rec in ipairs(redis.call('LRANGE', KEYS[2], at, -1)) do
    dropped = dropped + (tonumber(string.match(rec, '^{"k":(%d+)')) or 0)
  end
  if at == 0 then
    redis.call('DEL', KEYS[2], KEYS[3])
  else
    redis.call('LTRIM', KEYS[2], 0, at - 1)
    redis.call('LTRIM', KEYS[3], 0, at - 1)
  end
end
local covers = tonumber(redis.call('HGET', KEYS[4], 'n'))
if covers and covers > at then
  -- The summary stands for messages of the abandoned branch: drop it, keep the version growing.
  redis.call('HDEL', KEYS[4], 'x', 'n', 'k', 'c', 'e')
  redis.call('HINCRBY', KEYS[4], 'v', 1)
end
local last, tokens = bchain, 0
if at == 0 then last = '' end
if n > 0 then last, tokens = push(last, off, n) end
if at == 0 and n > 0 then redis.call('HSET', KEYS[1], 'f', ARGV[off]) end
if at + n == 0 then
  redis.call('HDEL', KEYS[1], 'f', 'l')
else
  redis.call('HSET', KEYS[1], 'l', last)
end
redis.call('HSET', KEYS[1], 'd', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'k', tokens - dropped)
touch(ttl)
return answer(1, at + n, n, '', last, at, sk)
"""

# ARGV: ttl, expect_version, covers, chain, text, tokens.
_COMMIT_FOLD = _TOUCH + """
local ttl, covers = tonumber(ARGV[1]), tonumber(ARGV[3])
local cur = redis.call('HMGET', KEYS[4], 'v', 'x')
local v = tonumber(cur[1]) or 0
if cur[2] and v ~= tonumber(ARGV[2]) then return 0 end
if covers > 0 then
  if redis.call('LINDEX', KEYS[3], covers - 1) ~= ARGV[4] then return 0 end
elseif ARGV[4] ~= '' then
  return 0
end
redis.call('HSET', KEYS[4], 'v', v + 1, 'x', ARGV[5], 'n', covers, 'k', ARGV[6], 'c', ARGV[4], 'e', 0)
touch(ttl)
return v + 1
"""

# ARGV: ttl, text, tokens. Returns {version, covers, chain}.
_PUT_SUMMARY = _TOUCH + """
local cur = redis.call('HMGET', KEYS[4], 'v', 'x', 'n', 'c')
local v = (tonumber(cur[1]) or 0) + 1
local covers, chain = 0, ''
if cur[2] then covers, chain = tonumber(cur[3]) or 0, cur[4] or '' end
redis.call('HSET', KEYS[4], 'v', v, 'x', ARGV[2], 'n', covers, 'k', ARGV[3], 'c', chain, 'e', 1)
touch(tonumber(ARGV[1]))
return {v, covers, chain}
"""

# KEYS: the state key. ARGV: ttl, expected version ('' = unconditional), ledger JSON.
_PUT_STATE = """
local v = tonumber(redis.call('HGET', KEYS[1], 'v')) or 0
if ARGV[2] ~= '' and tonumber(ARGV[2]) ~= v then return 0 end
redis.call('HSET', KEYS[1], 'j', ARGV[3], 'v', v + 1)
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return v + 1
"""

# KEYS: stats. ARGV: ttl, then the pairs as in _STATS (counted from ARGV[2]).
_ADD_STATS = """
local k = tonumber(ARGV[2])
for i = 1, k do redis.call('HINCRBY', KEYS[1], ARGV[1 + 2 * i], ARGV[2 + 2 * i]) end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return k
"""

# KEYS: meta. ARGV: now (ms), stale after (ms), ttl. A flag older than `stale` is a lost job.
_ENQUEUE = """
local q = tonumber(redis.call('HGET', KEYS[1], 'q'))
if q and tonumber(ARGV[1]) - q < tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'q', ARGV[1])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _turn(record: bytes) -> Turn:
    d = orjson.loads(record)
    return Turn(raw=d["r"], role=d["o"], text=d["x"], tokens=d["k"], hash=d["h"], chain=d["c"], time=d.get("t"))


def _record(turn: Turn) -> bytes:
    # Key order matters: "k" first for the branch script's token match; "c" is added by Lua.
    d: dict[str, Any] = {"k": int(turn.tokens), "h": turn.hash, "o": turn.role}
    if turn.time is not None:
        d["t"] = turn.time
    d["x"] = turn.text
    d["r"] = turn.raw
    return orjson.dumps(d)


def _stat_args(stats: Mapping[str, int] | None) -> list[str | int]:
    """The _STATS block of ARGV: the number of pairs, then name, increment ..."""
    args: list[str | int] = [len(stats) if stats else 0]
    for name, n in (stats or {}).items():
        args.append(name)
        args.append(int(n))
    return args


def _turn_args(turns: Sequence[Turn]) -> list[bytes | str | int]:
    args: list[bytes | str | int] = []
    for t in turns:
        args.append(t.hash)
        args.append(_record(t))
    return args


class _Script:
    """A Lua script run by EVALSHA, loaded when the server answers NOSCRIPT: what redis-py's
    register_script does, without its per-call pipeline check and argument copies (~25 us of the
    ~80 us of client CPU an EVALSHA costs; the request path makes two)."""

    __slots__ = ("client", "sha", "text")

    def __init__(self, client: aioredis.Redis | RedisCluster, text: str) -> None:
        self.client, self.text = client, text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, *, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except rex.NoScriptError:
            self.sha = await self.client.script_load(self.text)
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)


class Store:
    """Conversation storage over one Redis (or Redis Cluster, or fakeredis) client."""

    # A queued-fold flag older than this is taken for a lost job and may be queued again.
    FOLD_FLAG_STALE_MS = 600_000
    # Approximate cap on the fold stream (workers ack; this only bounds a backlog nobody reads).
    FOLD_STREAM_MAXLEN = 100_000

    def __init__(self, client: aioredis.Redis | RedisCluster, keys: Keys, *, ttl: int = 0) -> None:
        self.redis = client
        self.keys = keys
        self.ttl = ttl
        self.cluster = isinstance(client, RedisCluster)
        self.embedded = False  # memory://: in this process, no other writer
        self.origin = os.urandom(6).hex()  # this process, in its announcements (see watch)
        self._on_commit: list[Committed] = []
        # EVALSHA by precomputed sha; the text is sent once per server (NOSCRIPT).
        self._load = _Script(client, _LOAD)
        self._append = _Script(client, _APPEND)
        self._branch = _Script(client, _BRANCH)
        self._commit_fold = _Script(client, _COMMIT_FOLD)
        self._put_summary = _Script(client, _PUT_SUMMARY)
        self._put_state = _Script(client, _PUT_STATE)
        self._enqueue = _Script(client, _ENQUEUE)
        self._add_stats = _Script(client, _ADD_STATS)
        # Set whenever this process queues a fold: in-process workers wake at once instead of at
        # their next poll (on memory:// a blocking XREADGROUP returns immediately, so they poll).
        self.fold_queued = asyncio.Event()

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        try:
            with _guard:
                pong = await self.redis.ping()
        except (StoreUnavailable, rex.RedisError):
            return False
        return bool(pong)

    # ---- request path ----------------------------------------------------------------------

    async def load(self, ref: ConvRef, *, head: int = 0) -> ConversationView:
        """Meta, summary, state, first `head` messages and the tail after the summary: one EVALSHA.

        On a cluster a project's state lives in another slot; it is then read by a concurrent
        HMGET (still one round trip of latency).
        """
        keys = self.keys.conversation_keys(ref)
        state_key = self.keys.project_state(ref)
        separate_state = self.cluster and self.keys.state_is_shared(ref)
        if separate_state:
            sk = 0
        elif self.keys.state_is_shared(ref):
            keys.append(state_key)
            sk = 7
        else:
            sk = 6
        args = (head, self.ttl, sk)
        res: Any
        state: Any
        with _guard:
            if separate_state:
                calls: list[Awaitable[Any]] = [self._load(keys=keys, args=args),
                                               self.redis.hmget(state_key, ["j", "v"])]
                if self.ttl:
                    calls.append(self.redis.expire(state_key, self.ttl))
                res, state, *_ = await asyncio.gather(*calls)
            else:
                res = await self._load(keys=keys, args=args)
                state = res[3]
        length, meta, summ, _, first, tail, stats, covers = res
        summary = None
        if summ[1] is not None:
            summary = Summary(text=summ[1].decode(), covers=covers, version=int(summ[0] or 0),
                              tokens=int(summ[3] or 0), chain=(summ[4] or b"").decode())
        head_turns = [_turn(r) for r in first]
        tail_turns = [_turn(r) for r in tail]
        if head > covers:  # the rest of the head is in the tail: not sent twice
            head_turns.extend(tail_turns[: min(head, length) - covers])
        return ConversationView(
            length=length,
            dialect=_s(meta[0]),
            first_hash=_s(meta[1]),
            last_chain=_s(meta[2]),
            summary=summary,
            state=orjson.loads(state[0]) if state and state[0] is not None else None,
            state_version=int(state[1] or 0) if state else 0,
            head=head_turns,
            tail=tail_turns,
            tail_start=covers,
            tokens_total=int(meta[3] or 0),
            stats={k.decode(): int(v) for k, v in zip(stats[::2], stats[1::2], strict=True)},
            fold_pending=_fresh_flag(meta[4]),
            summary_version=int(summ[0] or 0),
        )

    def _write_keys(self, ref: ConvRef) -> tuple[list[str], int]:
        """The keys of an append or branch, and the index of the state key among them (0: absent)."""
        keys = self.keys.conversation_keys(ref)
        if not self.keys.state_is_shared(ref):
            return keys, 6
        if self.cluster:
            return keys, 0  # the project's state lives in another slot
        keys.append(self.keys.project_state(ref))
        return keys, 7

    async def append(self, ref: ConvRef, turns: list[Turn], *, base_length: int, base_chain: str,
                     dialect: str, stats: Mapping[str, int] | None = None) -> AppendResult:
        """Store `turns` after message base_length-1, if it has chain base_chain.

        Turns of the run already stored right after the base are skipped (the caller's base was
        behind the store); the rest go after whatever is stored now (concurrent requests on one
        base). A run already stored anywhere after the base stores nothing (a retry).
        `stats`: increments added to the conversation's stats in the same call, stored or not."""
        if base_length < 0:
            raise ValueError("base_length must be >= 0")
        keys, sk = self._write_keys(ref)
        args = [self.ttl, base_length, base_chain, dialect, sk, *_stat_args(stats), *_turn_args(turns)]
        with _guard:
            res = await self._append(keys=keys, args=args)
        return _result(res)

    async def branch(self, ref: ConvRef, *, at: int, base_chain: str, turns: list[Turn],
                     dialect: str, stats: Mapping[str, int] | None = None) -> AppendResult:
        """Keep messages [0, at) (CAS on the chain at at-1), drop the rest, append `turns` (+ `stats`)."""
        if at < 0:
            raise ValueError("at must be >= 0")
        keys, sk = self._write_keys(ref)
        args = [self.ttl, at, base_chain, dialect, sk, *_stat_args(stats), *_turn_args(turns)]
        with _guard:
            res = await self._branch(keys=keys, args=args)
        return _result(res)

    # ---- history ---------------------------------------------------------------------------

    async def chains(self, ref: ConvRef) -> list[str]:
        with _guard:
            raw: Any = await self.redis.lrange(self.keys.chains(ref), 0, -1)
        return [c.decode() for c in raw]

    async def messages(self, ref: ConvRef, start: int = 0, stop: int | None = None) -> list[Turn]:
        """Messages [start, stop) (stop None: to the end)."""
        if stop is not None and stop <= start:
            return []
        with _guard:
            raw: Any = await self.redis.lrange(
                self.keys.msgs(ref), start, -1 if stop is None else stop - 1)
        return [_turn(r) for r in raw]

    # ---- summary ---------------------------------------------------------------------------

    async def commit_fold(self, ref: ConvRef, *, expect_version: int, summary: Summary) -> bool:
        """CAS on (summary version, chain at summary.covers-1); stores the summary, version + 1."""
        args: list[Any] = [self.ttl, expect_version, summary.covers, summary.chain, summary.text, int(summary.tokens)]
        with _guard:
            res = await self._commit_fold(keys=self.keys.conversation_keys(ref), args=args)
        if res:
            self._committed(ref, replace(summary, version=int(res)), None)
        return bool(res)

    async def put_summary(self, ref: ConvRef, text: str, tokens: int) -> Summary:
        """Manual edit: replaces the text, keeps coverage, bumps the version (in-flight folds lose)."""
        with _guard:
            v, covers, chain = await self._put_summary(
                keys=self.keys.conversation_keys(ref), args=[self.ttl, text, int(tokens)])
        return Summary(text=text, covers=int(covers), version=int(v), tokens=int(tokens), chain=chain.decode())

    async def get_summary(self, ref: ConvRef) -> tuple[Summary | None, int, bool]:
        """(summary or None, current version, edited by hand)."""
        with _guard:
            got: Any = await self.redis.hmget(self.keys.summary(ref), ["v", "x", "n", "k", "c", "e"])
        v, x, n, k, c, e = got
        version = int(v or 0)
        if x is None:
            return None, version, False
        summary = Summary(text=x.decode(), covers=int(n or 0), version=version, tokens=int(k or 0),
                          chain=(c or b"").decode())
        return summary, version, e == b"1"

    # ---- project state ---------------------------------------------------------------------

    async def get_state(self, ref: ConvRef) -> tuple[dict[str, Any] | None, int]:
        with _guard:
            got: Any = await self.redis.hmget(self.keys.project_state(ref), ["j", "v"])
        j, v = got
        return (orjson.loads(j) if j is not None else None), int(v or 0)

    async def put_state(self, ref: ConvRef, ledger: dict[str, Any], *, expect_version: int | None) -> bool:
        args: list[Any] = [self.ttl, "" if expect_version is None else expect_version, orjson.dumps(ledger)]
        with _guard:
            res = await self._put_state(keys=[self.keys.project_state(ref)], args=args)
        if res:
            self._committed(ref, None, (ledger, int(res)))
        return bool(res)

    def on_commit(self, callback: Committed) -> None:
        """Call `callback(ref, summary, (ledger, version))` after a summary or a state ledger was
        committed through this Store (one of them None): how this process's fold workers tell its
        request path at once (gateway/views.py)."""
        self._on_commit.append(callback)

    def _committed(self, ref: ConvRef, summary: Summary | None, state: tuple[dict[str, Any], int] | None) -> None:
        for callback in self._on_commit:
            callback(ref, summary, state)

    # ---- stats -----------------------------------------------------------------------------

    async def add_stats(self, ref: ConvRef, **increments: int) -> None:
        if not increments:
            return
        with _guard:
            # One EVALSHA rather than a pipeline of HINCRBYs: a tenth of the commands to encode.
            await self._add_stats(keys=[self.keys.stats(ref)], args=[self.ttl, *_stat_args(increments)])

    async def stats(self, ref: ConvRef) -> dict[str, int]:
        with _guard:
            raw: Any = await self.redis.hgetall(self.keys.stats(ref))
        return {k.decode(): int(v) for k, v in raw.items()}

    async def delete(self, ref: ConvRef) -> None:
        """Forget the conversation (a project's shared state stays)."""
        with _guard:
            await self.redis.delete(*self.keys.conversation_keys(ref), self.keys.fold_lock(ref))

    # ---- changes -------------------------------------------------------------------------

    async def announce(self, ref: ConvRef, kind: str = "edited") -> None:
        """Tell every replica that `ref` was edited or deleted ("edited"; with a project: its shared
        state), or that a fold committed a new summary for it ("folded")."""
        message = orjson.dumps([ref.tenant, ref.conversation, ref.project, kind, self.origin])
        with _guard:
            await self.redis.publish(self.keys.changes(), message)

    async def watch(self, changed: Callable[[ConvRef, str], None], live: Callable[[bool], None]) -> None:
        """Follow the change channel until cancelled: `changed(ref, kind)` for every announcement
        made by another process, `live(True)` once subscribed, `live(False)` as soon as the
        connection is lost (the store went away), then subscribe again with backoff.

        A connection of its own, read directly: redis-py's PubSub reconnects (and backs off) before it
        reports a lost connection, and the loss is what callers must learn first."""
        delay = 0.05
        for attempt in itertools.count():
            conn = self._watch_connection(attempt)
            try:
                await conn.connect()
                await conn.send_command("SUBSCRIBE", self.keys.changes())
                await conn.read_response(push_request=True)  # RESP3 (redis-py's default): pushes
                live(True)
                delay = 0.05
                while True:
                    message = await conn.read_response(push_request=True)
                    if isinstance(message, list) and len(message) == 3 and message[0] == b"message":
                        try:
                            tenant, conversation, project, kind, origin = orjson.loads(message[2])
                        except (ValueError, TypeError):
                            continue  # not ours
                        if origin != self.origin:
                            changed(ConvRef(str(tenant), str(conversation), project), str(kind))
            except (rex.ConnectionError, rex.TimeoutError, OSError):
                live(False)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                await conn.disconnect()

    def _watch_connection(self, attempt: int) -> Any:
        """A new connection for `watch`: blocking reads (no socket timeout), TCP keepalive; on a
        cluster, to the nodes in turn (a cluster delivers every PUBLISH to every node)."""
        if isinstance(self.redis, RedisCluster):
            nodes = self.redis.get_nodes() or list(self.redis.nodes_manager.startup_nodes.values())
            node = nodes[attempt % len(nodes)]
            cls, kwargs = node.connection_class, dict(node.connection_kwargs)
        else:
            pool = self.redis.connection_pool
            cls, kwargs = cast(Any, pool.connection_class), dict(pool.connection_kwargs)
        kwargs["socket_timeout"] = None
        if "host" in kwargs:  # TCP (a unix socket has no keepalive)
            kwargs["socket_keepalive"] = True
        return cls(**kwargs)

    # ---- fold queue ------------------------------------------------------------------------

    async def enqueue_fold(self, ref: ConvRef, *, urgent: bool = False) -> bool:
        """Queue a fold job unless one is queued already (flag in meta; a stale flag is re-queued)."""
        now_ms = int(time.time() * 1000)
        with _guard:
            if not await self._enqueue(keys=[self.keys.meta(ref)],
                                       args=[now_ms, self.FOLD_FLAG_STALE_MS, self.ttl]):
                return False
            fields = {"t": ref.tenant, "c": ref.conversation, "p": ref.project or "", "u": "1" if urgent else "0"}
            try:
                stream = self.keys.fold_stream()
                async with self.redis.pipeline(transaction=False) as pipe:
                    # The consumer group too (BUSYGROUP when it exists): a store restarted without
                    # persistence has lost the stream and its group, and workers could never read
                    # another job (NOGROUP) until something created the group again.
                    pipe.xgroup_create(stream, Keys.FOLD_GROUP, id="0", mkstream=True)
                    pipe.xadd(stream, cast(Any, fields), maxlen=self.FOLD_STREAM_MAXLEN, approximate=True)
                    _, added = await pipe.execute(raise_on_error=False)
                if isinstance(added, Exception):
                    raise added
            except BaseException:
                # The job was not queued: do not leave a flag that would block the next attempt.
                await asyncio.shield(self.redis.hdel(self.keys.meta(ref), "q"))
                raise
        self.fold_queued.set()
        return True

    async def fold_done(self, ref: ConvRef) -> None:
        with _guard:
            await self.redis.hdel(self.keys.meta(ref), "q")


def _result(res: list[Any]) -> AppendResult:
    ok, length, appended, reason, chain, start, summary_version, state_version, queued, spent = res
    return AppendResult(ok=bool(ok), length=int(length), appended=int(appended), reason=_text(reason),
                        chain=_text(chain), start=int(start), summary_version=int(summary_version),
                        state_version=int(state_version), fold_queued=_fresh_flag(queued),
                        summarizer={name: int(n or 0) for name, n in zip(_SUMMARIZER_STATS, spent, strict=True)})


_SUMMARIZER_STATS = ("summarizer_tokens_in", "summarizer_tokens_out", "summarizer_tokens_charged")


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _fresh_flag(value: bytes | str | None) -> bool:
    """A queued-fold flag (ms since the epoch) younger than Store.FOLD_FLAG_STALE_MS: a job is queued.
    Older, it belongs to a lost job: enqueue_fold would queue anew."""
    return bool(value) and time.time() * 1000 - int(value or 0) < Store.FOLD_FLAG_STALE_MS


def _cluster_nodes(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """`redis+cluster://[user:password@]h:p[,h:p]...` → startup nodes and credentials."""
    rest = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    kwargs: dict[str, Any] = {}
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if password:
            kwargs["password"] = password
            if user:
                kwargs["username"] = user
        elif user:
            kwargs["password"] = user
    nodes = []
    for part in filter(None, rest.split(",")):
        host, _, port = part.rpartition(":")
        if not host:
            host, port = part, "6379"
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"no cluster nodes in store url {url!r}")
    return nodes, kwargs


_BACKOFF = ExponentialWithJitterBackoff(base=0.01, cap=0.2)


class _HiredisPacking:
    """Commands packed by hiredis: redis-py's asyncio connections pack them in Python (its
    synchronous ones use hiredis), ~24 us against ~9 us for a turn's append here. Same bytes."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return cast(list[bytes], self._packer.pack(*args))


_PACKED: dict[type, type] = {
    cls: type(cls.__name__, (_HiredisPacking, cls), {})
    for cls in (aioredis.Connection, aioredis.SSLConnection, aioredis.UnixDomainSocketConnection)
}


def _sha1hex(data: bytes) -> bytes:
    return hashlib.sha1(data).hexdigest().encode()


async def _memory_client() -> aioredis.Redis:
    """A fakeredis client on its own FakeServer, with `redis.sha1hex` (which fakeredis's Lua lacks)."""
    import fakeredis

    server = fakeredis.FakeServer()
    client = fakeredis.FakeAsyncRedis(server=server)
    await client.eval("return 0", 0)  # creates the server's Lua runtime
    runtime = getattr(server, "_lua_runtime", None)
    if runtime is None:
        raise RuntimeError("this fakeredis version has no Lua runtime on FakeServer; install fakeredis[lua]")
    runtime.globals()[b"redis"][b"sha1hex"] = _sha1hex
    return client


async def open_store(settings: StoreSettings) -> Store:
    """A Store for `settings.url`; does not fail when the server is down (the request path degrades)."""
    url = settings.url
    # The request path waits on these: a dead or hung Redis must turn into a degraded request quickly,
    # not into redis-py's default of 10 retries with backoff. URL query options still win.
    options: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 1.0}
    client: aioredis.Redis | RedisCluster
    if url.startswith("memory://"):
        client = await _memory_client()
    elif url.startswith("redis+cluster://"):
        nodes, creds = _cluster_nodes(url)
        # A few more retries than a single server: MOVED/ASK redirections and failovers retry through these.
        client = RedisCluster(startup_nodes=nodes, retry=Retry(_BACKOFF, 3), **creds, **options)
    else:
        client = aioredis.Redis.from_url(url, retry=Retry(_BACKOFF, 1), **options)
        pool = client.connection_pool
        pool.connection_class = _PACKED.get(pool.connection_class, pool.connection_class)
    store = Store(client, Keys(settings.key_prefix), ttl=settings.ttl_seconds)
    store.embedded = url.startswith("memory://")
    return store
