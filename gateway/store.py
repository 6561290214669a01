"""Conversation storage in Redis (or `memory://`: fakeredis running the very same Lua).

Every operation that reads-then-writes is one Lua script (lua.py) over keys that share the
conversation's hash tag (see keys.py), so it is atomic and runs unchanged on Redis Cluster. The
request path costs one round trip to load (`load`) and one to record (`append`).

Messages: `msgs` is a list of JSON records (members `RECORD_*` in keys.py: tokens first so Lua can
read a record's tokens with one anchored match, the chain last because the script computes it and
splices it in), and `chains` a parallel list of chain hashes so that the CAS checks and `chains()`
never decode a message. History is never truncated except by an explicit `branch`.

Summary versions only grow. A fold commits by CAS on (version, chain at covers-1); when there is no
summary (never folded, or dropped by a branch) only the chain is checked, so a worker that passes
`view.summary.version if view.summary else 0` is never locked out by a dropped summary's version.

Errors: connection-level failures surface as `StoreUnavailable` so the request path can degrade;
`StoreBusy`, a kind of it, says the server answers but every connection of this process's pool
stayed in use for `store.pool_wait_seconds` (back-pressure: the caller may retry later).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, cast

import fakeredis
import orjson
import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import HiredisRespSerializer

from gateway import lua
from gateway.config import StoreSettings
from gateway.keys import (
    META_FOLD_QUEUED,
    RECORD_CHAIN,
    RECORD_HASH,
    RECORD_RAW,
    RECORD_ROLE,
    RECORD_TEXT,
    RECORD_TIME,
    RECORD_TOKENS,
    STATE_LEDGER,
    STATE_VERSION,
    SUMMARY_CHAIN,
    SUMMARY_COVERS,
    SUMMARY_EDITED,
    SUMMARY_FOLDED_AT,
    SUMMARY_PINNED,
    SUMMARY_PINNED_TOKENS,
    SUMMARY_TEXT,
    SUMMARY_TOKENS,
    SUMMARY_VERSION,
    ConvRef,
    Keys,
)
from gateway.model import ConversationView, Message, Summary
from gateway.pace import Pace
from gateway.queue import FoldQueue, job_fields
from gateway.validate import string_bytes


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused, timeout, cluster down)."""


class StoreBusy(StoreUnavailable):
    """No connection of the pool came free within `store.pool_wait_seconds`: the store is there, this
    process asks more of it at once than its pool allows."""


UNAVAILABLE: tuple[type[BaseException], ...] = (
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
        if isinstance(exc, rex.MaxConnectionsError):  # a cluster node's pool (see _GatedCluster)
            raise StoreBusy(str(exc) or type(exc).__name__) from exc
        if exc is not None and isinstance(exc, UNAVAILABLE):
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        return False


_guard = _Guard()

Committed = Callable[[ConvRef, Summary | None, tuple[dict[str, Any], int] | None], None]


@dataclass(slots=True)
class Overview:
    """One conversation at a glance, for the conversation list: no message is read."""

    length: int
    covers: int  # messages the summary stands for (0: none)
    version: int  # the summary's version
    edited: bool  # the summary was written by hand
    folded_at: float | None  # unix time of the last fold commit
    stats: dict[str, int]


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


# Records of more bytes are encoded (to the wire format, for a single Redis) and parsed in a thread
# (~5-10 ms a megabyte of CPU that would hold the event loop).
OFF_LOOP_BYTES = 1 << 20


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _turn(record: bytes) -> Message:
    d = orjson.loads(record)
    return Message(raw=d[RECORD_RAW], role=d[RECORD_ROLE], text=d[RECORD_TEXT], tokens=d[RECORD_TOKENS],
                hash=d[RECORD_HASH], chain=d[RECORD_CHAIN], time=d.get(RECORD_TIME))


async def _turns(records: Sequence[bytes]) -> list[Message]:
    """The stored records parsed; many megabytes of them in a thread (one record at a time there,
    letting the event loop in as it goes: pace.py): a 30 MB conversation's load held it 80 ms."""
    if sum(map(len, records)) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_turns_paced, records)
    return [_turn(r) for r in records]


def _turns_paced(records: Sequence[bytes]) -> list[Message]:
    pace = Pace()
    out = []
    for r in records:
        out.append(_turn(r))
        pace.spent(len(r))
    return out


def _record(turn: Message) -> bytes:
    # Key order matters: "k" first for the branch script's token match; "c" is added by Lua.
    d: dict[str, Any] = {RECORD_TOKENS: int(turn.tokens), RECORD_HASH: turn.hash, RECORD_ROLE: turn.role}
    if turn.time is not None:
        d[RECORD_TIME] = turn.time
    d[RECORD_TEXT] = turn.text
    d[RECORD_RAW] = turn.raw
    return orjson.dumps(d)


def _stat_args(stats: Mapping[str, int] | None) -> list[str | int]:
    """The _STATS block of ARGV: the number of pairs, then name, increment ..."""
    args: list[str | int] = [len(stats) if stats else 0]
    for name, n in (stats or {}).items():
        args.append(name)
        args.append(int(n))
    return args


def _turn_args(turns: Sequence[Message], pace: Pace | None = None) -> list[bytes | str | int]:
    args: list[bytes | str | int] = []
    for t in turns:
        args.append(t.hash)
        record = _record(t)
        args.append(record)
        if pace is not None:
            pace.spent(len(record))
    return args


@dataclass(frozen=True, slots=True)
class _Encoded:
    """Arguments of a command already in Redis's wire format (`count` of them in `blob`), as the
    last argument of a command: a connection of this store's (`_HiredisPacking`) sends them as they
    are. Packing the 20,000 arguments of an import's append took 20-45 ms of the event loop; they
    are encoded in a thread instead."""

    blob: bytes
    count: int


def _encoded(args: list[bytes | str | int]) -> _Encoded:
    pieces: list[bytes] = []
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        pieces += (b"$%d\r\n" % len(b), b, b"\r\n")
    return _Encoded(b"".join(pieces), len(args))


def _record_bytes(turns: Sequence[Message]) -> int:
    """About the bytes the turns' records hold: each text twice (as text and in the message), and
    what else the message holds (a picture as a data URL: megabytes that count few tokens)."""
    total = 2 * sum(len(t.text) for t in turns)
    if total <= OFF_LOOP_BYTES:
        total += sum(string_bytes(t.raw, 64) for t in turns[:256])
    return total


async def _turn_args_of(turns: Sequence[Message], encode: bool) -> list[bytes | str | int | _Encoded]:
    """`_turn_args`, for many megabytes of turns in a thread (as `_turns`), and there put in the
    wire format when `encode` (the store's connections send `_Encoded` arguments)."""
    if _record_bytes(turns) > OFF_LOOP_BYTES:
        if encode:
            return [await asyncio.to_thread(lambda: _encoded(_turn_args(turns, Pace())))]
        return list(await asyncio.to_thread(_turn_args, turns, Pace()))
    return list(_turn_args(turns))


class _Script:
    """A Lua script run by EVALSHA, loaded when the server answers NOSCRIPT: what redis-py's
    register_script does, without its per-call pipeline check and argument copies (~25 us of the
    ~80 us of client CPU an EVALSHA costs; the request path makes two)."""

    __slots__ = ("client", "sha", "text")

    def __init__(self, client: aioredis.Redis | RedisCluster, text: str) -> None:
        self.client, self.text = client, lua.filled(text)
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()

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
        self.encodes = False  # its connections send `_Encoded` arguments (a single Redis, not a cluster)
        self.origin = os.urandom(6).hex()  # this process, in its announcements (see watch)
        self._on_commit: list[Committed] = []
        # EVALSHA by precomputed sha; the text is sent once per server (NOSCRIPT).
        self._load = _Script(client, lua.LOAD)
        self._append = _Script(client, lua.APPEND)
        self._branch = _Script(client, lua.BRANCH)
        self._commit_fold = _Script(client, lua.COMMIT_FOLD)
        self._put_summary = _Script(client, lua.PUT_SUMMARY)
        self._put_state = _Script(client, lua.PUT_STATE)
        self._enqueue = _Script(client, lua.ENQUEUE)
        self._add_stats = _Script(client, lua.ADD_STATS)
        self.folds = FoldQueue(client, keys)  # the consumer side, for the fold workers
        # Set whenever this process queues a fold: in-process workers wake at once instead of at
        # their next poll (on memory:// a blocking XREADGROUP returns immediately, so they poll).
        self.fold_queued = asyncio.Event()

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self, wait: float = 0.2) -> bool:
        """Whether the store answers; raises StoreBusy when it is there but every connection of the
        pool stayed in use for `wait` seconds (a readiness probe gives up after a second or so: not
        store.pool_wait_seconds)."""
        try:
            with _guard, patient(wait):
                pong = await self.redis.ping()
        except StoreBusy:
            raise
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
            sk = 9
        else:
            sk = 6
        args = (head, self.ttl, sk)
        res: Any
        state: Any
        with _guard:
            if separate_state:
                calls: list[Awaitable[Any]] = [self._load(keys=keys, args=args),
                                               self.redis.hmget(state_key, [STATE_LEDGER, STATE_VERSION])]
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
        head_turns = await _turns(first)
        tail_turns = await _turns(tail)
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
            client=_s(meta[5]),
        )

    def _write_keys(self, ref: ConvRef) -> tuple[list[str], int]:
        """The keys of an append or branch, and the index of the state key among them (0: absent)."""
        keys = self.keys.conversation_keys(ref)
        if not self.keys.state_is_shared(ref):
            return keys, 6
        if self.cluster:
            return keys, 0  # the project's state lives in another slot
        keys.append(self.keys.project_state(ref))
        return keys, 9

    async def append(self, ref: ConvRef, turns: list[Message], *, base_length: int, base_chain: str,
                     dialect: str, stats: Mapping[str, int] | None = None, own: int | None = None,
                     client: str = "") -> AppendResult:
        """Store `turns` after message base_length-1, if it has chain base_chain.

        Turns of the run already stored right after the base are skipped (the caller's base was
        behind the store); the rest go after whatever is stored now (concurrent requests on one
        base), but only the last `own` of them (the request's new turn and reply; None: all): a run
        with more is refused (reason "branched"), its resent history not being what is stored. A run
        already stored anywhere after the base stores nothing (a retry).
        `stats`: increments added to the conversation's stats in the same call, stored or not.
        `client`: "full" or "delta", how the conversation's client sends its history, when this request
        shows it (kept with the conversation once turns are stored; reconcile.py reads it)."""
        if base_length < 0:
            raise ValueError("base_length must be >= 0")
        keys, sk = self._write_keys(ref)
        args = [self.ttl, base_length, base_chain, dialect, sk, len(turns) if own is None else own, client,
                *_stat_args(stats), *await _turn_args_of(turns, self.encodes)]
        with _guard:
            res = await self._append(keys=keys, args=args)
        return _result(res)

    async def branch(self, ref: ConvRef, *, at: int, base_chain: str, turns: list[Message],
                     dialect: str, stats: Mapping[str, int] | None = None) -> AppendResult:
        """Keep messages [0, at) (CAS on the chain at at-1), move the rest to a new abandoned branch
        (`branches`), append `turns` (+ `stats`)."""
        if at < 0:
            raise ValueError("at must be >= 0")
        keys, sk = self._write_keys(ref)
        args = [self.ttl, at, base_chain, dialect, sk, *_stat_args(stats), *await _turn_args_of(turns, self.encodes)]
        with _guard:
            res = await self._branch(keys=keys, args=args)
        return _result(res)

    # ---- history ---------------------------------------------------------------------------

    async def chains(self, ref: ConvRef) -> list[str]:
        with _guard:
            raw: Any = await self.redis.lrange(self.keys.chains(ref), 0, -1)
        return [c.decode() for c in raw]

    async def messages(self, ref: ConvRef, start: int = 0, stop: int | None = None) -> list[Message]:
        """Messages [start, stop) (stop None: to the end)."""
        if stop is not None and stop <= start:
            return []
        with _guard:
            raw: Any = await self.redis.lrange(
                self.keys.msgs(ref), start, -1 if stop is None else stop - 1)
        return await _turns(raw)

    async def branches(self, ref: ConvRef) -> list[dict[str, Any]]:
        """The abandoned branches, oldest first: {id, at, chain, start, count, time, tokens} (lua.BRANCH)."""
        with _guard:
            raw: Any = await self.redis.lrange(self.keys.branches(ref), 0, -1)
        return [orjson.loads(b) for b in raw]

    async def branch_messages(self, branch: Mapping[str, Any], ref: ConvRef, start: int = 0,
                              stop: int | None = None) -> list[Message]:
        """Messages [start, stop) of an abandoned branch (its own, from its `at` on)."""
        count = int(branch["count"])
        stop = count if stop is None else min(stop, count)
        if stop <= start:
            return []
        first = int(branch["start"])
        with _guard:
            raw: Any = await self.redis.lrange(self.keys.abandoned(ref), first + start, first + stop - 1)
        return await _turns(raw)

    # ---- summary ---------------------------------------------------------------------------

    async def commit_fold(self, ref: ConvRef, *, expect_version: int, summary: Summary) -> bool:
        """CAS on (summary version, chain at summary.covers-1); stores the summary, version + 1."""
        args: list[Any] = [self.ttl, expect_version, summary.covers, summary.chain, summary.text, int(summary.tokens),
                           round(time.time(), 3)]
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

    async def pinned_summary(self, ref: ConvRef) -> tuple[str, int]:
        """The text of the summary's last hand edit and its tokens ("", 0 when none): folds keep it."""
        with _guard:
            got: Any = await self.redis.hmget(self.keys.summary(ref), [SUMMARY_PINNED, SUMMARY_PINNED_TOKENS])
        text, tokens = got
        return (text.decode(), int(tokens or 0)) if text is not None else ("", 0)

    async def get_summary(self, ref: ConvRef) -> tuple[Summary | None, int, bool]:
        """(summary or None, current version, edited by hand)."""
        with _guard:
            got: Any = await self.redis.hmget(self.keys.summary(ref), [
                SUMMARY_VERSION, SUMMARY_TEXT, SUMMARY_COVERS, SUMMARY_TOKENS, SUMMARY_CHAIN, SUMMARY_EDITED])
        v, x, n, k, c, e = got
        version = int(v or 0)
        if x is None:
            return None, version, False
        summary = Summary(text=x.decode(), covers=int(n or 0), version=version, tokens=int(k or 0),
                          chain=(c or b"").decode())
        return summary, version, e == b"1"

    async def overview(self, ref: ConvRef) -> Overview:
        with _guard:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.llen(self.keys.chains(ref))
                pipe.hmget(self.keys.summary(ref), [SUMMARY_COVERS, SUMMARY_VERSION, SUMMARY_EDITED, SUMMARY_FOLDED_AT])
                pipe.hgetall(self.keys.stats(ref))
                length, (covers, version, edited, folded), stats = await pipe.execute()
        return Overview(int(length), int(covers or 0), int(version or 0), edited == b"1",
                        float(folded) if folded else None, {k.decode(): int(v) for k, v in stats.items()})

    # ---- project state ---------------------------------------------------------------------

    async def get_state(self, ref: ConvRef) -> tuple[dict[str, Any] | None, int]:
        with _guard:
            got: Any = await self.redis.hmget(self.keys.project_state(ref), [STATE_LEDGER, STATE_VERSION])
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
            await self._add_stats(keys=[self.keys.stats(ref), self.keys.meta(ref)],
                                  args=[self.ttl, *_stat_args(increments)])

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
            fields = job_fields(ref, urgent=urgent)
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
                await asyncio.shield(self.redis.hdel(self.keys.meta(ref), META_FOLD_QUEUED))
                raise
        self.fold_queued.set()
        return True

    async def fold_done(self, ref: ConvRef) -> None:
        with _guard:
            await self.redis.hdel(self.keys.meta(ref), META_FOLD_QUEUED)


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

# How long the store calls of this task wait for a free connection (None: the pool's own wait).
_WAIT: ContextVar[float | None] = ContextVar("store_wait", default=None)


@contextmanager
def patient(seconds: float) -> Iterator[None]:
    """Store calls in this block (and in tasks started from it) wait up to `seconds` for a free
    connection: recording an answered turn has no client waiting on it, and giving up sooner only
    moves it to the retry queue, which needs the same connections."""
    token = _WAIT.set(seconds)
    try:
        yield
    finally:
        _WAIT.reset(token)


class _BlockingPool(aioredis.ConnectionPool):
    """A pool whose callers wait for a free connection, up to `timeout` seconds, then get StoreBusy.

    Not redis-py's BlockingConnectionPool: its waiters and its releases queue on one asyncio.Condition,
    so with a thousand waiters each release waits its turn behind them all and throughput collapses
    (1,000 parallel conversations: waits past 5 s). A FIFO semaphore of `max_connections` slots in
    front of redis-py's plain pool costs nothing uncontended; the plain pool then never runs out."""

    def __init__(self, *, timeout: float | None = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        self._slots = asyncio.Semaphore(self.max_connections)
        # Connections handed out, each holding a slot. redis-py releases a connection that failed to
        # connect itself, inside get_connection: only a connection in this set gives its slot back.
        self._slotted: set[Any] = set()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        wait = _WAIT.get() or self.timeout
        try:
            async with asyncio.timeout(wait):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreBusy(f"all {self.max_connections} store connections busy for {wait} s") from None
        try:
            connection = await super().get_connection()
        except BaseException:
            self._slots.release()
            raise
        self._slotted.add(connection)
        return connection

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            if connection in self._slotted:  # a connection released twice frees one slot
                self._slotted.discard(connection)
                self._slots.release()


class _GatedCluster(RedisCluster):
    """A cluster client whose commands wait for one of `max_connections` slots, up to `wait` seconds,
    then raise StoreBusy. redis-py 8's cluster nodes have no blocking pool (a full node raises
    MaxConnectionsError at once); commands in flight never exceed the slots, so no node's pool fills
    through them (pipelines are not gated: their MaxConnectionsError maps to StoreBusy too)."""

    def __init__(self, *args: Any, wait: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = asyncio.Semaphore(int(kwargs.get("max_connections", 100)))
        self._wait = wait

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        wait = _WAIT.get() or self._wait
        try:
            async with asyncio.timeout(wait):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreBusy(f"all store connection slots busy for {wait} s") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._slots.release()


class _HiredisPacking:
    """Commands packed by hiredis: redis-py's asyncio connections pack them in Python (its
    synchronous ones use hiredis), ~24 us against ~9 us for a turn's append here. Same bytes.

    Leans on redis-py internals (`redis.connection.HiredisRespSerializer`, `pack_command`, the
    pool's `connection_class`): pyproject pins the redis-py minor version, and
    tests/test_store.py checks the bytes against redis-py's own packer."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        if args and isinstance(args[-1], _Encoded):
            encoded = args[-1]
            head = self._packer.pack(*args[:-1])[0]
            n = head[1:head.index(b"\r\n")]  # "*<n>\r\n": that many arguments are packed before them
            rest = cast(bytes, memoryview(head)[len(n) + 3:])  # (a view: the socket takes any buffer)
            return [b"*%d\r\n" % (int(n) + encoded.count), rest, encoded.blob]
        return cast(list[bytes], self._packer.pack(*args))


_PACKED: dict[type, type] = {
    cls: type(cls.__name__, (_HiredisPacking, cls), {})
    for cls in (aioredis.Connection, aioredis.SSLConnection, aioredis.UnixDomainSocketConnection)
}


def _sha1hex(data: bytes) -> bytes:
    return hashlib.sha1(data).hexdigest().encode()


async def _memory_client() -> aioredis.Redis:
    """A fakeredis client on its own FakeServer, with `redis.sha1hex` (which fakeredis's Lua lacks).

    fakeredis has no public way to add a Lua function: this reaches its server's private
    `_lua_runtime`. pyproject pins the fakeredis minor version; tests/test_store.py checks the
    function against a real Redis's."""
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
        client = _GatedCluster(startup_nodes=nodes, retry=Retry(_BACKOFF, 3), max_connections=settings.pool_size,
                               wait=settings.pool_wait_seconds, **creds, **options)
    else:
        # The pool's size and wait come from the config, not redis-py's defaults (its async pool went
        # from unbounded in 5.x to 100 that fail at once in 8.x); the URL's query may still set them.
        pool = _BlockingPool.from_url(url, retry=Retry(_BACKOFF, 1), max_connections=settings.pool_size,
                                      timeout=settings.pool_wait_seconds, **options)
        pool.connection_class = _PACKED.get(pool.connection_class, pool.connection_class)
        client = aioredis.Redis.from_pool(pool)
    store = Store(client, Keys(settings.key_prefix), ttl=settings.ttl_seconds)
    store.embedded = url.startswith("memory://")
    # (Only connections of ours send `_Encoded` arguments: a single Redis whose pool took them.)
    store.encodes = isinstance(client, aioredis.Redis) and not store.embedded and \
        client.connection_pool.connection_class in _PACKED.values()
    return store
