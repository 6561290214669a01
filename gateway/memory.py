"""The memory path: identify → load → reconcile → plan → render → forward; after the reply, record.

`Memory.prepare` is the proxy's hook. It is the only module that knows the store, the rewrite
rules, retrieval and token counting together; each of those is a plain module of its own. Nothing
here blocks on a summarizer: folds are queued and done by the workers.

A request answered while the store could not take its turn (busy past `store.pool_wait_seconds`,
or unreachable; the request then went upstream unchanged, "degraded") is not dropped: its turn is
queued in `backlog.py` and stored once the store accepts it, reconciled with what is stored by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from hashlib import blake2b
from typing import Any

import orjson
import structlog

from gateway import cost, fold, paths, rewrite, state, validate
from gateway.backlog import Backlog
from gateway.caches import Blocks, ConversationCaches, Held, conv_key
from gateway.config import Settings
from gateway.dialects import Dialect, content_hash
from gateway.embed import Embedder
from gateway.follow import Follower
from gateway.keys import ConvRef
from gateway.model import ConversationView, Message, Plan, Usage
from gateway.proxy import Call, GatewayError, Prepared
from gateway.recall import RecallCache
from gateway.reconcile import Decision, chain_hashes, reconcile, shown_style
from gateway.store import AppendResult, Store, StoreBusy, StoreUnavailable, patient
from gateway.tokens import TokenCounter

log = structlog.get_logger("gateway.memory")

MEMORY_DIALECTS = frozenset({"openai_chat", "openai_responses", "anthropic"})
# x-gateway-reason of a request degraded because every store connection stayed busy (back-pressure);
# an unreachable store gives rewrite.DEGRADED.
STORE_BUSY = "store-busy"
# Decisions a recording may take when the store moved on meanwhile (each on a fresh load); the
# last one takes a diverging history as its own branch, never as a sibling, and a branch keeps
# what it moves aside: every turn is stored, on the branch it was sent on.
RECORD_ATTEMPTS = 4
# New messages counted between two turns of the event loop (about 10-20 ms of tokenising).
COUNT_SLICE = 1000
# Characters past which new messages are counted in a thread: on the loop, ~0.1 µs a character
# (a pasted megabyte held every request for 120-160 ms; in a thread, the loop lagged 13 ms at most).
# Counted by the batch, not by the message: a 30 MB import of 15 KB messages held the loop 415 ms.
COUNT_OFF_LOOP = 16_000


class _Queued(StoreUnavailable):
    """Turns of the conversation wait in the retry queue: a later one is queued behind them."""


class _Contended(StoreUnavailable):
    """The conversation moved on under every attempt to record a turn: the retry queue tries later."""


# An Anthropic request asking for the 1-hour prompt cache (priced apart: `cache_write_1h`).
_ONE_HOUR = re.compile(rb'"ttl"\s*:\s*"1h"')
# Bytes of a body read for those marks between two turns of the event loop (a pass over 30 MB
# held it ~12 ms; the cost model read an Anthropic body three times).
_SCAN_SLICE = 1 << 20


@dataclass(frozen=True, slots=True)
class _Marks:
    """What the cost model reads in the body as sent: whether the provider caches its full history
    (Anthropic: up to a `cache_control` breakpoint the client set), and Anthropic's 1-hour cache."""

    cacheable: bool
    one_hour: bool


async def _marks(dialect: Dialect, raw: bytes) -> _Marks:
    """The body's `_Marks`, read once per request, a megabyte at a time."""
    if dialect.name != "anthropic":
        return _Marks(dialect.caches_full_history(raw), False)
    cacheable = one_hour = False
    for start in range(0, len(raw), _SCAN_SLICE):
        if start:
            await asyncio.sleep(0)
        end = start + _SCAN_SLICE + 4096  # (overlapping: a mark across the slices' edge is found)
        cacheable = cacheable or dialect.caches_full_history(raw if end >= len(raw) and not start else raw[start:end])
        one_hour = one_hour or _ONE_HOUR.search(raw, start, end) is not None
        if cacheable and one_hour:
            break
    return _Marks(cacheable, one_hour)
_UNPRICED_NOTED = 256  # model names warned about once each, at most this many
_LEARN = 0.3  # weight of the newest observation in a model's cache hit rate
_LONGEST_TTL = 3600.0  # a cache observed to outlive its configured lifetime is believed up to this
# A miss on a shorter expected prefix says little: both major providers cache nothing under 1,024
# tokens, whatever a pricing entry says.
_CALIBRATE_MIN = 1024


@dataclass(slots=True)
class _CacheBelief:
    """What upstream usage taught about one model's prompt cache, beyond its configured prices.

    hit: moving average of the share of the expected cached prefix the provider reported as read
    (1.0 until told otherwise; an OpenAI-compatible server that never caches drives it to 0).
    ttl: the longest idle gap after which the provider still reported a cached read."""

    hit: float = 1.0
    ttl: float = 0.0


@dataclass(slots=True)
class _Request:
    """What prepare learned, carried to the recording step."""

    ref: ConvRef
    dialect: Dialect
    model: str | None
    view: ConversationView
    decision: Decision
    incoming: list[dict[str, Any]]
    hashes: list[str]
    chains: list[str]
    new_messages: list[Message]  # incoming messages not stored yet, in order
    plan: Plan | None
    system_hash: str = ""
    summarizer_charge: int = 0  # summarizer tokens deducted from this request's savings
    known: bool = False  # planned from the view this process knew, not from a load
    arrived: float = 0.0
    when: str | None = None  # the client's time for the new turns (X-Message-Time), else the clock's
    body_bytes: int = 0  # of the request's body: what a deferred recording of it holds, roughly
    marks: _Marks = _Marks(cacheable=True, one_hour=False)  # read in the body as sent (_marks)
    cost_original: float = 0.0  # expected billed input, fresh-token equivalents (cost.py)
    cost_forwarded: float = 0.0
    window_used: float = 0.0  # share of the model's context window the forwarded request takes
    # For calibration from the reply's usage: the prices used, the tokens expected to be read from
    # the provider's cache and of the whole forwarded request, and the idle gap since the last one.
    prices: cost.Prices | None = None
    expected_cached: int = 0
    expected_total: int = 0
    gap: float | None = None


@dataclass(slots=True)
class _Late:
    """A request whose turns the store did not take when it was answered: what storing them later needs."""

    ref: ConvRef
    dialect: Dialect
    model: str | None
    incoming: list[dict[str, Any]]
    hashes: list[str]
    chains: list[str]
    arrived: float
    sent: str  # when its new messages arrived (their stored time)
    reply: list[Message]
    stats: dict[str, int]
    plan: Plan | None = None
    summarizer_charge: int = 0
    weight: int = 0  # bytes it holds (the retry queue's byte bound)


# A parsed body weighs 1.3x (long strings) to 9x (many small parts) its JSON (resend.held): the
# retry queue charges an entry this many times its request's body.
_HELD_PER_BODY_BYTE = 4


_clock: tuple[int, str] = (0, "")  # (second, its ISO text): messages arriving in one second share it


def _now() -> str:
    global _clock
    second = int(time.time())
    if second != _clock[0]:
        _clock = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return _clock[1]


def _digest(text: str) -> str:
    return blake2b(text.encode(), digest_size=12).hexdigest()


class _TooManyParts(Exception):
    """More parts than memory.max_parts: relayed, not read (validate.parts_over)."""


def _check(dialect: Dialect, body: dict[str, Any], history: list[dict[str, Any]], max_parts: int, same: int) -> None:
    """The caller's 400 for a history of the wrong JSON types (`validate.py`), read before anything
    else reads it; its first `same` messages were checked in an earlier request. Before that, its
    parts are counted (`_TooManyParts`), those of the `same` messages aside: counted then, and not
    read again by the hashing, the check or the resend parser."""
    sent = body.get(dialect.history_field)
    if not isinstance(sent, list):
        sent = history  # a Responses string input: the one message it is, not a list of its characters
    lead = len(sent) - len(history)  # OpenAI chat's leading system messages
    if validate.body_parts_over(body, dialect.history_field, max_parts, [*sent[:lead], *history[same:]]):
        raise _TooManyParts
    why = validate.problem(dialect.name, body, range(lead, lead + same))
    if why is not None:
        raise GatewayError(400, None, f"invalid request: {why}")


def _carries_a_reply(dialect: Dialect, history: list[dict[str, Any]]) -> bool:
    """An assistant message is in the request: reconcile's `replies` (a whole history has one at its
    second message, so this stops there)."""
    return any(dialect.role(m) == "assistant" for m in history)


async def _carries_a_reply_served(dialect: Dialect, history: list[dict[str, Any]]) -> bool:
    """`_carries_a_reply` for a history of any length (one memory refused as too long may hold
    millions of items), the event loop served every 4,096 of them."""
    for start in range(0, len(history), 4096):
        if start:
            await asyncio.sleep(0)
        if _carries_a_reply(dialect, history[start:start + 4096]):
            return True
    return False


def _sent(req: _Request) -> str:
    """When the request's new messages arrived, as stored."""
    return req.new_messages[0].time if req.new_messages and req.new_messages[0].time else _now()


def _own(new: list[Message], reply: list[Message]) -> int:
    """How many of a recording's last turns are the request's own: the reply, and the new messages
    after the last assistant message it resent (its user turn, tool results); before that, history."""
    own = len(reply)
    for turn in reversed(new):
        if turn.role == "assistant":
            break
        own += 1
    return own


def _usage_stats(usage: Usage) -> dict[str, int]:
    """A request's stats from what the upstream reported."""
    return {"requests": 1, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "cache_read_tokens": usage.cache_read_tokens, "cache_write_tokens": usage.cache_write_tokens}


TIME_HEADER = "X-Message-Time"
MIN_YEAR, MAX_YEAR = 1000, 9000


def _forget_from(data: dict[str, Any], conversation: str, at: int) -> state.Ledger | None:
    return state.forget_from(state.load(data), conversation, at)


def _client_time(headers: Any) -> str | None:
    """The time the client gives this request's new turns (`X-Message-Time`, ISO 8601: a replay
    or an import of an older conversation), as UTC `YYYY-MM-DDTHH:MM:SS`; None when not sent."""
    value = str(headers.get(TIME_HEADER, "") or "").strip()
    if not value:
        return None
    try:
        when = datetime.fromisoformat(value[:64])
        if when.tzinfo is not None:
            when = when.astimezone(UTC).replace(tzinfo=None)  # OverflowError at the calendar's ends
    except (ValueError, OverflowError):
        raise GatewayError(400, None, f"invalid request: {TIME_HEADER} must be an ISO 8601 time") from None
    if not MIN_YEAR <= when.year <= MAX_YEAR:
        # Stored, a time at the calendar's ends broke date arithmetic on every later request of the
        # conversation (the search's "the day after"), and a year under 1000 was written back unreadable.
        raise GatewayError(400, None, f"invalid request: {TIME_HEADER} must be a time in the years "
                                      f"{MIN_YEAR}..{MAX_YEAR}")
    return when.strftime("%Y-%m-%dT%H:%M:%S")


def _header(headers: Any, names: Sequence[str]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return str(value).strip()
    return None


class Memory:
    """The proxy hook that gives conversations memory."""

    def __init__(self, settings: Settings, store: Store, tokens: TokenCounter, metrics: Any = None,
                 recall: RecallCache | None = None) -> None:
        self.settings = settings
        self.store = store
        self.tokens = tokens
        self.metrics = metrics
        # The embedded store has no other writer: what this process knows of it is always current.
        recall = recall or RecallCache(settings.memory.retrieval.index_cache_mb << 20)
        self.caches = ConversationCaches(live=store.embedded, recall=recall)
        if settings.memory.retrieval.embeddings and self.caches.recall.embedder is None:
            self.caches.recall.embedder = Embedder()  # numpy and onnxruntime are imported at first use
        self.blocks = Blocks(settings.memory, tokens)
        self.follower = Follower(store, self.caches.views, settings.memory.keep_initial, self.caches.edited,
                                 self.caches.channel_changed)
        self.backlog = Backlog(settings.store.retry_queue_size, max_bytes=settings.store.retry_queue_bytes,
                               metrics=metrics)
        # The cost model's clock (monotonic seconds): tests and replays substitute their own.
        self.clock = time.monotonic
        self._unpriced: set[str] = set()
        # (upstream, pricing entry) → what usage taught about its cache; bounded by the pricing table.
        self._beliefs: dict[tuple[str, str], _CacheBelief] = {}
        for name in settings.unpriced_models():
            self._warn_unpriced(name, "configured")

    def _warn_unpriced(self, model: str, where: str) -> None:
        """One warning per model name `pricing` does not know: its costs are guesses."""
        shown = model if len(model) <= 100 else model[:100] + "…"  # a client's model name can be any size
        if shown in self._unpriced or len(self._unpriced) >= _UNPRICED_NOTED:
            return
        self._unpriced.add(shown)
        log.warning("pricing.unknown_model", model=shown, seen=where,
                    message=f"model {shown!r} matches no pricing entry: priced as pricing.default (no price, no "
                            "prompt caching assumed, so over the thresholds it is always rewritten); add a "
                            f"pricing.<name> entry for it")

    def prices(self, model: str | None, dialect: Dialect, marks: _Marks) -> cost.Prices:
        """The request's model's cache prices (Anthropic's 1-hour cache when the request asks for it)."""
        if model and not self.settings.priced(model):
            self._warn_unpriced(model, "request")
        base = cost.prices(self.settings.price(model), one_hour=marks.one_hour)
        belief = self._beliefs.get((dialect.upstream, self.settings.price_key(model)))
        if belief is None:
            return base
        # A cached token is read at `read` when the provider does hit, written again when it does not.
        return replace(base, read=belief.hit * base.read + (1 - belief.hit) * base.write,
                       ttl=max(base.ttl, belief.ttl))

    def _calibrate(self, req: _Request, usage: Usage) -> None:
        """Correct the model's cache belief from what the provider reported it read from its cache
        (OpenAI `cached_tokens`, Anthropic `cache_read_input_tokens`)."""
        prices = req.prices
        if prices is None or req.plan is None or usage.input_tokens <= 0 or req.expected_total <= 0:
            return
        belief = self._beliefs.setdefault((req.dialect.upstream, self.settings.price_key(req.model)), _CacheBelief())
        if req.expected_cached >= _CALIBRATE_MIN:
            # Shares, not counts: the provider's tokenizer is not the gateway's.
            seen = min(1.0, usage.cache_read_tokens / usage.input_tokens)
            expected = req.expected_cached / req.expected_total
            belief.hit = (1 - _LEARN) * belief.hit + _LEARN * min(1.0, seen / expected)
        elif usage.cache_read_tokens > 0 and req.gap is not None and req.gap > prices.ttl:
            belief.ttl = min(max(belief.ttl, req.gap), _LONGEST_TTL)

    async def warm(self) -> None:
        """Load what the first requests would otherwise wait for (start-up)."""
        if self.caches.recall.embedder is not None:
            await self.caches.recall.embedder.warm()

    async def close(self, grace: float) -> None:
        """Give the turns still waiting for the store up to `grace` seconds to be stored (backlog.py),
        then stop background embedding."""
        await self.backlog.close(grace)
        if self.caches.recall.embedder is not None:
            await self.caches.recall.embedder.close()

    def forget(self, ref: ConvRef) -> None:
        """Drop what this process caches about a deleted conversation."""
        self.caches.forget(ref)

    def changed(self, ref: ConvRef, kind: str = "edited") -> None:
        """`ref` was edited, deleted or folded elsewhere (follow.py)."""
        self.follower.changed(ref, kind)

    async def follow_store(self) -> None:
        """Keep what this process knows of conversations true to the store while it runs (follow.py)."""
        await self.follower.follow()

    # -- identify ---------------------------------------------------------------------------

    def conversation_of(self, call: Call) -> ConvRef | None:
        conv = _header(call.headers, self.settings.conversation.headers)
        if not conv:
            return None
        project = _header(call.headers, self.settings.conversation.project_headers)
        # Header bytes that are not UTF-8 as %XX, as the conversation API's path spells them.
        return ConvRef(call.tenant, paths.conversation_id(conv), project and paths.conversation_id(project))

    async def prepare(self, call: Call) -> Prepared | None:
        ref = self.conversation_of(call)
        if ref is None:
            return None  # no conversation: forwarded byte for byte
        mem = self.settings.memory
        off = str(call.headers.get(self.settings.conversation.memory_header, "")).lower() == "off"
        dialect = call.dialect if call.dialect.name in MEMORY_DIALECTS else None
        history = dialect.history(call.body) if dialect is not None else None
        if off or not mem.enabled or dialect is None or history is None:
            why = rewrite.MEMORY_OFF if off or not mem.enabled else rewrite.NOT_REWRITABLE
            return Prepared(body=None, headers={"x-gateway-context": "passthrough", "x-gateway-reason": why})
        if len(history) > mem.max_messages:
            log.warning("memory.too_many_messages", conversation=ref.conversation, messages=len(history),
                        limit=mem.max_messages)
            await self._refuse_if_delta(ref, dialect, history, f"{len(history)} messages, more than "
                                                               f"memory.max_messages ({mem.max_messages})")
            return Prepared(body=None, headers={"x-gateway-context": "passthrough",
                                                "x-gateway-reason": rewrite.TOO_MANY_MESSAGES})

        started = time.perf_counter()
        arrived = time.monotonic()
        when = _client_time(call.headers)
        marks = await _marks(dialect, call.raw)
        try:
            hashes, chains = await self.caches.hashes(ref, dialect, history,
                                                      partial(_check, dialect, call.body, history, mem.max_parts),
                                                      len(call.raw))
        except _TooManyParts:
            log.warning("memory.too_many_parts", conversation=ref.conversation, limit=mem.max_parts)
            await self._refuse_if_delta(ref, dialect, history,
                                        f"more content parts than memory.max_parts ({mem.max_parts})")
            return Prepared(body=None, headers={"x-gateway-context": "passthrough",
                                                "x-gateway-reason": rewrite.TOO_MANY_PARTS})
        replies = _carries_a_reply(dialect, history)
        view, decision = self._from_known(ref, dialect, hashes, chains, replies=replies)
        known = view is not None
        if view is None:
            try:
                view = await self.store.load(ref, head=mem.keep_initial)
                if view.dialect in (None, dialect.name):
                    decision = await self._decide(ref, hashes, chains, view, arrived, replies=replies)
            except StoreUnavailable as exc:
                return await self._degraded(call, dialect, history, exc, ref, hashes, chains, arrived, when, marks)
        if view.dialect is not None and view.dialect != dialect.name:
            # One conversation id reused across API dialects: its stored turns cannot be replayed
            # in the other format, so this request goes through untouched and is not recorded.
            return Prepared(body=None, headers={"x-gateway-context": "passthrough",
                                                "x-gateway-reason": rewrite.OTHER_DIALECT})
        assert decision is not None

        model = dialect.model(call.body)
        req = await self._logical(ref, dialect, model, view, decision, history, hashes, chains, when)
        req.known, req.arrived, req.body_bytes, req.marks = known, arrived, len(call.raw), marks
        try:
            plan, body = await self._plan(call, req, history)
        except StoreUnavailable as exc:
            return await self._degraded(call, dialect, history, exc, ref, hashes, chains, arrived, when, marks)
        req.plan = plan
        # Savings are net of what folding cost: the summarizer tokens spent since the last request
        # are charged once, against this request (0 with the extractive summarizer).
        st = view.stats
        req.summarizer_charge = max(0, st.get("summarizer_tokens_in", 0) + st.get("summarizer_tokens_out", 0)
                                    - st.get("summarizer_tokens_charged", 0))
        saved = plan.tokens_original - plan.tokens_forwarded - req.summarizer_charge
        headers = {
            "x-gateway-context": plan.kind,
            "x-gateway-reason": plan.reason,
            "x-gateway-tokens-original": str(plan.tokens_original),
            "x-gateway-tokens-forwarded": str(plan.tokens_forwarded),
            "x-gateway-tokens-saved": str(saved),
            "x-gateway-cost-original": str(round(req.cost_original)),
            "x-gateway-cost-forwarded": str(round(req.cost_forwarded)),
            "x-gateway-window-used": f"{req.window_used:.3f}",
        }
        if self.metrics is not None:
            self.metrics.observe_tokens(plan.tokens_original, plan.tokens_forwarded, self._usd(model, saved),
                                        model=self.settings.model_label(model), provider=call.dialect.upstream)
        log.debug("memory.plan", conversation=ref.conversation, action=decision.action, kind=plan.kind, known=known,
                  ms=round((time.perf_counter() - started) * 1000, 3))

        def on_success(items: list[dict[str, Any]], usage: Usage) -> Coroutine[Any, Any, None]:
            return self._record(req, items, usage, replied=time.monotonic())  # the reply is relayed now

        return Prepared(body=body, headers=headers, on_success=on_success, excerpts=plan.excerpts_block)

    async def _refuse_if_delta(self, ref: ConvRef, dialect: Dialect, history: list[dict[str, Any]],
                               what: str) -> None:
        """A request memory cannot take is relayed as it came: right for a client that sends its whole
        history, but a client that sends only its new turns would reach the model without its history
        and leave a hole in the only copy of it. Such a request gets a 400 in its dialect: in mode
        `delta`, or in `auto` where reconcile would take it for new turns (the conversation's client was
        seen sending them, in this dialect, and the request carries no reply). The view is this
        process's, or the store's when this process has none (a restart, another replica, an eviction):
        a rare request, so one load."""
        mode = self.settings.conversation.history
        delta = mode == "delta"
        if mode == "auto" and not await _carries_a_reply_served(dialect, history):
            view = self.caches.views.get(ref)
            if view is None:
                try:
                    view = await self.store.load(ref, head=0)
                except StoreUnavailable:
                    view = None  # relayed, as a store outage relays any request
            delta = view is not None and view.client == "delta" and view.dialect in (None, dialect.name)
        if delta:
            raise GatewayError(400, "invalid_request_error",
                               f"this request holds {what}: the gateway cannot store it, and this conversation's "
                               "client sends only new turns, so the model would not see its history. Split it, "
                               f"raise the limit, or send it with {self.settings.conversation.memory_header}: off")

    def _from_known(self, ref: ConvRef, dialect: Dialect, hashes: list[str], chains: list[str], *,
                    replies: bool) -> tuple[ConversationView | None, Decision | None]:
        """The view this process knows, when the request simply goes on from it (views.py)."""
        view = self.caches.views.get(ref)
        if view is None or view.dialect not in (None, dialect.name):
            return None, None
        decision = reconcile(hashes, chains, view, self.settings.conversation.history, replies=replies)
        if decision.action not in ("extend", "delta"):
            return None, None  # a retry, an edit, a regenerate: decided on what the store holds now
        return view, decision

    async def _decide(self, ref: ConvRef, hashes: list[str], chains: list[str], view: ConversationView,
                      arrived: float, *, replies: bool, siblings: bool = True) -> Decision:
        """Reconcile the request with a view just loaded (reading the stored chains when needed);
        `siblings` False: a diverging history is a branch, whatever the timing; `replies`: it carries
        an assistant message (`_carries_a_reply`)."""
        mode = self.settings.conversation.history
        decision = reconcile(hashes, chains, view, mode, replies=replies)
        if decision.action == "need_chains":
            decision = reconcile(hashes, chains, view, mode, stored_chains=await self.store.chains(ref),
                                 replies=replies)
        writes = self.caches.writes
        if (siblings and decision.action == "branch"
                and writes.siblings(conv_key(ref), decision.base, view.length, arrived)):
            # Every turn after the divergence was stored by requests still unanswered when this one
            # arrived: concurrent requests on one base, not an edit. Store the union (append after them).
            decision = Decision("extend", base=decision.base, new_from=decision.new_from,
                                base_chain=decision.base_chain)
        return decision

    # -- plan -------------------------------------------------------------------------------

    def _message(self, dialect: Dialect, raw: dict[str, Any], h: str, model: str | None,
                 when: str | None = None, text: str | None = None) -> Message:
        text = dialect.text(raw) if text is None else text
        return Message(raw=raw, role=dialect.role(raw), text=text,
                       tokens=self.tokens.count_message(text, model), hash=h, time=when or _now())

    async def _precount(self, texts: list[str], model: str | None) -> None:
        """Counts of a pasted file, or of many messages at once, taken in a thread (tiktoken lets go of
        the interpreter lock while it encodes) and cached for `_message`'s: on the event loop they
        would hold every conversation."""
        if sum(map(len, texts)) > COUNT_OFF_LOOP:
            count = self.tokens.count
            await asyncio.to_thread(lambda: [count(t, model) for t in texts])

    async def _system(self, text: str, model: str | None) -> tuple[str, int]:
        """The system prompt's digest and tokens; a long one's taken in a thread, as a pasted file's
        are (a 30 MB system prompt held the event loop for seconds)."""
        if len(text) > COUNT_OFF_LOOP:
            count = self.tokens.count
            # (The thread's count is cached for `system_tokens`, and its hash(text) kept by the str.)
            digest = await asyncio.to_thread(lambda: (count(text, model), _digest(text))[1])
            return digest, self.blocks.system_tokens(text, model)
        return _digest(text), self.blocks.system_tokens(text, model)

    async def _replies(self, dialect: Dialect, items: list[dict[str, Any]], model: str | None,
                       when: str | None) -> list[Message]:
        """The reply's messages, a long one counted off the event loop as a pasted file is."""
        texts = [dialect.text(raw) for raw in items]
        await self._precount(texts, model)
        return [self._message(dialect, raw, content_hash(dialect, raw), model, when, text)
                for raw, text in zip(items, texts, strict=True)]

    async def _logical(self, ref: ConvRef, dialect: Dialect, model: str | None, view: ConversationView,
                       decision: Decision, history: list[dict[str, Any]], hashes: list[str],
                       chains: list[str], when: str | None = None) -> _Request:
        """The new messages this request brings, counted once (stored ones carry their counts)."""
        now = when or _now()
        new: list[Message] = []
        for start in range(decision.new_from, len(history), COUNT_SLICE):
            if new:
                # An import of thousands of messages: other requests are served between the slices.
                await asyncio.sleep(0)
            span = range(start, min(start + COUNT_SLICE, len(history)))
            texts = [dialect.text(history[i]) for i in span]
            await self._precount(texts, model)
            new += [self._message(dialect, history[i], hashes[i], model, now, text)
                    for i, text in zip(span, texts, strict=True)]
        for t, c in zip(new, chains[decision.new_from:], strict=False):
            t.chain = c
        return _Request(ref, dialect, model, view, decision, history, hashes, chains, new, None, when=when)

    async def _plan(self, call: Call, req: _Request, history: list[dict[str, Any]]) -> tuple[Plan, bytes | None]:
        """The rewrite rules' plan for this request (rewrite.py), with its excerpts, rendered."""
        mem, view, dialect = self.settings.memory, req.view, req.dialect
        logical = rewrite.history(view, req.decision, history, req.new_messages,
                                  lambda i: self._message(dialect, history[i], req.hashes[i], req.model))
        system_text = dialect.system_text(call.body)
        req.system_hash, system_tokens = await self._system(system_text, req.model)
        state_block, state_tokens = self.blocks.state_block(view.state, req.model)
        window = self.settings.model(req.model).context_window
        key = conv_key(req.ref)
        inputs = rewrite.Inputs(
            dialect=dialect, history=logical, system_tokens=system_tokens,
            state_block=state_block, state_tokens=state_tokens, settings=mem,
            context_budget=rewrite.context_budget(window, mem, dialect.max_output_tokens(call.body) or 0),
            count=lambda s: self.tokens.count(s, req.model), whole=req.decision.action != "delta",
            system_hash=req.system_hash, chains=req.chains, new_tokens=sum(t.tokens for t in req.new_messages),
            last=self.caches.forwarded.get(key), now=self.clock(), prices=self.prices(req.model, dialect, req.marks),
            cacheable=req.marks.cacheable, context_window=window,
        )
        edits = self.caches.edits
        draft = rewrite.plan(inputs, self._kept_layers(req, history, inputs))
        inputs = draft.inputs
        outcome = draft.finish(await self._recall(req, inputs.history, draft.wants) if draft.wants is not None else ())
        plan = outcome.plan
        if outcome.forwarded is None:
            raise GatewayError(400, "invalid_request_error",
                               f"the newest turn alone needs about {plan.tokens_forwarded} tokens, more than "
                               f"the gateway's budget for this model allows ({inputs.context_budget}: "
                               "memory.budget_ratio of its context window, less the request's max output tokens)")
        rendered: bytes | None = None
        if not (plan.kind == "full" and inputs.whole):
            try:
                rendered = orjson.dumps(dialect.render(call.body, plan, cache_control=mem.cache_control))
            except (TypeError, RecursionError):
                # Only the history is checked for depth at the edge: a member nested past what orjson
                # writes (255 levels, e.g. in `tools`) cannot be sent back rewritten.
                raise GatewayError(400, None, "invalid request: a member of the body is nested more than "
                                   f"{validate.MAX_DEPTH} levels deep") from None
        if plan.kind == "rewritten" and inputs.whole and mem.policy == "cost":
            h = inputs.history
            await self.caches.hold(req.ref, Held(req.ref.project, h.summary, inputs.state_block, inputs.state_tokens,
                                           h.tail_start, tuple(h.tail)), edits)
        original = self._costs(req, inputs, plan, outcome.forwarded, window)
        self.caches.remember_forwarded(req.ref, outcome.forwarded, original)
        return plan, rendered

    def _kept_layers(self, req: _Request, history: list[dict[str, Any]],
                     inputs: rewrite.Inputs) -> rewrite.Inputs | None:
        """`inputs` on the summary and state the last rewrite forwarded, when a fold finished since
        (rewrite.plan weighs the two: rewrite.keep_layers); None when there is nothing held to keep."""
        held = self.caches.held.get(conv_key(req.ref))
        h = inputs.history
        if (held is None or not inputs.whole or h.summary is None or held.summary is None
                or not self.caches.views.live  # edits announced elsewhere would go unseen
                or held.tail_start > h.tail_start
                or (held.summary == h.summary and held.state_block == inputs.state_block)):
            return None
        between = h.tail_start - held.tail_start
        # Chain hashes stand for the whole prefix: the same messages on the same history, not a branch.
        chains = req.chains[held.tail_start: h.tail_start]
        if between > len(held.tail) or any(not t.chain or t.chain != c
                                           for t, c in zip(held.tail, chains, strict=False)):
            return None  # not the messages the held layers were forwarded with
        # The client's own bytes, as for the rest of a whole client's tail.
        older = [replace(t, raw=history[held.tail_start + i]) for i, t in enumerate(held.tail[:between])]
        logical = replace(h, tail=older + h.tail, tail_start=held.tail_start, summary=held.summary)
        return replace(inputs, history=logical, state_block=held.state_block, state_tokens=held.state_tokens,
                       held_window=sum(t.tokens for t in older))

    def _costs(self, req: _Request, inputs: rewrite.Inputs, plan: Plan, forwarded: cost.Forwarded,
               window: int) -> cost.Forwarded:
        """Price the request as forwarded, and as the client sent it had the gateway not been there
        (its previous full history then in the provider's cache); returns the latter's record."""
        h, now, prices = inputs.history, inputs.now, inputs.prices
        system = (inputs.system_hash, inputs.system_tokens)
        cacheable = req.marks.cacheable
        original = cost.full_record(system, inputs.chains, h.total_tokens, h.tail[-1].tokens if h.tail else 0, now)
        req.cost_original = cost.billed_full(system, h.total_tokens, inputs.chains,
                                             self.caches.originals.get(conv_key(req.ref)), now, prices,
                                             cacheable=cacheable)
        if forwarded.full:
            req.cost_forwarded = cost.billed_full(system, h.total_tokens, inputs.chains, inputs.last, now, prices,
                                                  cacheable=cacheable)
            total = system[1] + h.total_tokens
            req.expected_cached = (cost.cached_full(system, h.total_tokens, inputs.chains, inputs.last, now, prices)
                                   if cacheable and total >= prices.min_tokens else 0)
        else:
            req.cost_forwarded = cost.billed(forwarded.items, forwarded.tokens, inputs.last, now, prices)
            total = forwarded.total
            req.expected_cached = cost.cached(forwarded.items, forwarded.tokens, inputs.last, now, prices)
        req.prices, req.expected_total = prices, total
        req.gap = now - inputs.last.at if inputs.last is not None else None
        req.window_used = plan.tokens_forwarded / window if window else 0.0
        return original

    async def _recall(self, req: _Request, logical: rewrite.History,
                      wants: rewrite.Wanted) -> list[tuple[int, Message]]:
        """The earlier messages retrieval picks for the excerpts the plan wants (the index synced first)."""
        view, key, recall = req.view, conv_key(req.ref), self.caches.recall
        if logical.tail_start > 0:
            await recall.sync(key, view.tail[: max(0, req.decision.base - view.tail_start)], view.tail_start,
                              lambda a, b: self.store.messages(req.ref, a, b))
        vector = None
        if recall.embedder is not None and recall.embedded(key) > len(view.head):
            # In a thread of its own (~0.5 ms): the loop serves other requests meanwhile.
            vector = await recall.embedder.query(wants.query.text)
        return recall.search(
            key, query=wants.query.text, after=len(view.head), before=wants.window_start,
            budget_tokens=wants.search_budget, recent=wants.recent, query_time=wants.query.time,
            query_vector=vector, reach_back=self.settings.memory.retrieval.reach_back,
            min_relevance=self.settings.memory.retrieval.min_relevance,
        )

    async def _degraded(self, call: Call, dialect: Dialect, history: list[dict[str, Any]], exc: Exception,
                  ref: ConvRef, hashes: list[str], chains: list[str], arrived: float,
                  when: str | None, marks: _Marks) -> Prepared:
        """Forward unchanged; the turns are stored later (backlog.py) if the upstream answers."""
        if self.metrics is not None:
            self.metrics.store_errors_total.inc()
        busy = isinstance(exc, StoreBusy)
        log.warning("memory.degraded", conversation=ref.conversation, error=type(exc).__name__)
        model = dialect.model(call.body)
        texts = [dialect.text(m) for m in history]
        await self._precount(texts, model)
        history_tokens = sum(self.tokens.count_message(t, model) for t in texts)
        system_text = dialect.system_text(call.body)
        system = await self._system(system_text, model)
        tokens = history_tokens + system[1]
        # Sent as it came: the bill of the client's own request, its previous one in the cache when known.
        billed = round(cost.billed_full(system, history_tokens, chains, self.caches.originals.get(conv_key(ref)),
                                        self.clock(), self.prices(model, dialect, marks),
                                        cacheable=marks.cacheable))
        window = self.settings.model(model).context_window
        sent = when or _now()  # the client's time (X-Message-Time) when it gave one, as for a stored turn

        async def on_success(items: list[dict[str, Any]], usage: Usage) -> None:
            reply = await self._replies(dialect, items, model, when)
            late = _Late(ref, dialect, model, history, hashes, chains, arrived, sent, reply, _usage_stats(usage),
                         weight=_HELD_PER_BODY_BYTE * len(call.raw))
            await self._defer(late, exc)

        return Prepared(body=None, on_success=on_success, headers={
            "x-gateway-context": "degraded", "x-gateway-reason": STORE_BUSY if busy else rewrite.DEGRADED,
            "x-gateway-tokens-original": str(tokens),
            "x-gateway-tokens-forwarded": str(tokens), "x-gateway-tokens-saved": "0",
            "x-gateway-cost-original": str(billed), "x-gateway-cost-forwarded": str(billed),
            "x-gateway-window-used": f"{tokens / window if window else 0.0:.3f}"})

    async def _defer(self, late: _Late, exc: BaseException) -> None:
        """Queue `late` to be stored when the store accepts it."""
        self.backlog.put(conv_key(late.ref), late.ref.conversation, partial(self._record_late, late),
                         type(exc).__name__, late.weight)

    async def _record_late(self, late: _Late) -> None:
        """Store a deferred request's turns on what the store holds now (StoreUnavailable: try later)."""
        with patient(self.settings.store.record_wait_seconds):
            await self._record_late_now(late)

    async def _record_late_now(self, late: _Late) -> None:
        ref, dialect = late.ref, late.dialect
        stats = late.stats
        for attempt in range(RECORD_ATTEMPTS):  # another writer moved the conversation meanwhile
            view = await self.store.load(ref, head=self.settings.memory.keep_initial)
            if view.dialect not in (None, dialect.name):
                log.warning("memory.unrecorded_other_dialect", conversation=ref.conversation)
                return
            decision = await self._decide(ref, late.hashes, late.chains, view, late.arrived,
                                          siblings=attempt < RECORD_ATTEMPTS - 1,
                                          replies=_carries_a_reply(dialect, late.incoming))
            req = await self._logical(ref, dialect, late.model, view, decision, late.incoming, late.hashes,
                                      late.chains, late.sent)
            req.plan, req.summarizer_charge, req.arrived = late.plan, late.summarizer_charge, late.arrived
            turns = [*req.new_messages, *late.reply]
            result = await self._store_turns(req, late.reply, turns, stats)
            self.caches.views.drop(ref)
            if result is None:
                if stats:
                    await self.store.add_stats(ref, **stats)
                return
            stats = {}  # added by the call, stored or not
            if result.ok:
                if result.appended and decision.action in ("branch", "prefix"):
                    await self._branched(ref, decision.base)
                await self._maybe_fold(req, result.length, turns, urgent=False)
                return
        raise _Contended(f"the conversation moved on under {RECORD_ATTEMPTS} attempts to record")

    # -- record -----------------------------------------------------------------------------

    def _usd(self, model: str | None, tokens: int) -> float:
        return tokens * self.settings.price(model).input_usd_per_mtok / 1_000_000

    async def _store_turns(self, req: _Request, reply: list[Message], turns: list[Message],
                           stats: dict[str, int] | None) -> AppendResult | None:
        """Append / branch as the decision says, adding `stats` in the same call; None when there is
        nothing to store (the caller adds the stats then)."""
        dialect, decision, view, ref = req.dialect, req.decision, req.view, req.ref
        result: AppendResult | None
        if decision.action in ("new", "extend", "delta"):
            style = shown_style(decision, self.settings.conversation.history)
            result = await self.store.append(ref, turns, base_length=decision.base, base_chain=decision.base_chain,
                                             dialect=dialect.name, stats=stats, own=_own(req.new_messages, reply),
                                             client="" if style == view.client else style)
        elif decision.action == "prefix":
            stored_next = decision.base - view.tail_start
            same = bool(0 <= stored_next < len(view.tail) and reply
                        and view.tail[stored_next].hash == reply[0].hash)
            if reply and not same and stored_next < 0:
                # The stored message at `base` is covered by the summary (not loaded): compare
                # its chain, so a late retry of an old turn does not truncate the conversation.
                expect = chain_hashes([reply[0].hash], prev=decision.base_chain)[0]
                stored_chains = await self.store.chains(ref)
                same = len(stored_chains) > decision.base and stored_chains[decision.base] == expect
            if same or not reply:
                result = None  # a retry that got the same answer: nothing to store twice
            elif decision.base == view.length:
                result = await self.store.append(ref, reply, base_length=decision.base,
                                                 base_chain=decision.base_chain, dialect=dialect.name, stats=stats)
            else:
                result = await self.store.branch(ref, at=decision.base, base_chain=decision.base_chain,
                                                 turns=reply, dialect=dialect.name, stats=stats)
        else:  # branch
            result = await self.store.branch(ref, at=decision.base, base_chain=decision.base_chain,
                                             turns=turns, dialect=dialect.name, stats=stats)
        return result

    async def _record(self, req: _Request, items: list[dict[str, Any]], usage: Usage,
                      replied: float = 0.0) -> None:
        """Store the new turns and the reply; queue a fold when enough turns aged out."""
        self._calibrate(req, usage)
        if req.decision.action == "delta" and self.backlog.holds(conv_key(req.ref)):
            # Earlier turns of this conversation wait in the retry queue: storing a delta client's
            # new turns now would put them before those. (A whole history is stored as it came; the
            # queued turns then find themselves stored already.)
            reply = await self._replies(req.dialect, items, req.model, req.when)
            await self._defer(_Late(req.ref, req.dialect, req.model, req.incoming, req.hashes, req.chains,
                                    req.arrived, _sent(req), reply, _usage_stats(usage), req.plan,
                                    req.summarizer_charge, _HELD_PER_BODY_BYTE * req.body_bytes),
                              _Queued("earlier turns of this conversation are queued"))
            return
        with patient(self.settings.store.record_wait_seconds):
            await self._record_now(req, items, usage, replied)

    async def _record_now(self, req: _Request, items: list[dict[str, Any]], usage: Usage, replied: float) -> None:
        dialect, ref = req.dialect, req.ref
        reply = await self._replies(dialect, items, req.model, req.when)
        turns = [*req.new_messages, *reply]
        replied = replied or time.monotonic()
        conv = conv_key(ref)
        plan = req.plan
        stats = _usage_stats(usage)
        if plan is not None:
            stats |= {"tokens_original": plan.tokens_original, "tokens_forwarded": plan.tokens_forwarded,
                      "tokens_saved": plan.tokens_original - plan.tokens_forwarded - req.summarizer_charge,
                      "summarizer_tokens_charged": req.summarizer_charge}
        # The view this record leaves, known before the store answers: the conversation's next
        # request may arrive first (its client has the reply already).
        expected = self.follower.expect(ref, req.decision, req.view, turns, dialect=dialect.name, stats=stats,
                                        client=shown_style(req.decision, self.settings.conversation.history))
        storing = self.caches.writes.storing(conv, len(turns), replied)
        stored = False
        try:
            try:
                result = await self._store_turns(req, reply, turns, stats)
                for attempt in range(1, RECORD_ATTEMPTS):
                    if result is None or result.ok:
                        break
                    # The store moved on from what this request was planned on (another request or
                    # replica wrote): decide again on what it holds now (stats are added already).
                    stats = {}
                    req, turns, result = await self._record_again(req, reply, siblings=attempt < RECORD_ATTEMPTS - 1)
            finally:
                self.caches.writes.stored(conv, storing)
            stored = True
            decision, view = req.decision, req.view
            if result is not None and result.ok and result.appended:
                start = result.start if result.start >= 0 else result.length - result.appended
                branched = decision.action == "branch" or (decision.action == "prefix" and decision.base < view.length)
                self.caches.writes.note(conv, start, start + result.appended, replied, branched=branched)
            if result is None and stats:
                await self.store.add_stats(ref, **stats)
            await self.follower.settle(ref, turns, result, expected)
            if result is not None and not result.ok:
                # Busy writers kept moving the conversation: stored later by the retry queue.
                await self._defer(_Late(ref, dialect, req.model, req.incoming, req.hashes, req.chains, req.arrived,
                                        _sent(req), reply, {}, req.plan, req.summarizer_charge,
                                        _HELD_PER_BODY_BYTE * req.body_bytes),
                                  _Contended(result.reason))
                return
            if plan is not None and usage.input_tokens and plan.kind != "passthrough":
                self.tokens.calibrate(req.model, plan.tokens_forwarded, usage.input_tokens)
            length = result.length if result is not None else view.length
            if result is not None and result.appended and decision.action in ("branch", "prefix"):
                await self._branched(ref, decision.base)
            await self._maybe_fold(req, length, turns, urgent=bool(plan and plan.urgent_fold))
        except StoreUnavailable as exc:
            self.caches.views.drop(ref)
            if self.metrics is not None:
                self.metrics.store_errors_total.inc()
            if stored:  # the turns are stored; what failed after (stats, a fold's queueing) is caught up later
                log.warning("memory.record_failed", conversation=ref.conversation, error=type(exc).__name__)
                return
            await self._defer(_Late(ref, dialect, req.model, req.incoming, req.hashes, req.chains, req.arrived,
                                    _sent(req), reply, stats, req.plan, req.summarizer_charge,
                                    _HELD_PER_BODY_BYTE * req.body_bytes), exc)

    async def _record_again(self, req: _Request, reply: list[Message], *,
                            siblings: bool) -> tuple[_Request, list[Message], AppendResult | None]:
        """Decide and store the request's turns again, on what the store holds now."""
        view = await self.store.load(req.ref, head=self.settings.memory.keep_initial)
        decision = await self._decide(req.ref, req.hashes, req.chains, view, req.arrived, siblings=siblings,
                                      replies=_carries_a_reply(req.dialect, req.incoming))
        again = await self._logical(req.ref, req.dialect, req.model, view, decision, req.incoming, req.hashes,
                                    req.chains, req.when)
        again.plan, again.summarizer_charge, again.arrived = req.plan, req.summarizer_charge, req.arrived
        turns = [*again.new_messages, *reply]
        return again, turns, await self._store_turns(again, reply, turns, None)

    async def _branched(self, ref: ConvRef, at: int) -> None:
        """Turns from `at` on were moved aside (an edit, a regenerate): the retrieval index forgets
        them, and so does the conversation's own state (a project's shared ledger cannot tell its
        conversations' positions apart, and keeps what it read). Best effort, by CAS."""
        self.caches.recall.truncate(conv_key(ref), at)
        if ref.project:
            return
        try:
            for _ in range(3):
                data, version = await self.store.get_state(ref)
                if data is None:
                    return
                ledger = await asyncio.to_thread(_forget_from, data, ref.conversation, at)
                if ledger is None:
                    return
                if await self.store.put_state(ref, ledger.dump(), expect_version=version):
                    self.caches.edited(ref)  # layers held for the cache must not outlive what they held
                    with contextlib.suppress(StoreUnavailable):
                        await self.store.announce(ref, "folded")
                    return
            # Other writers won every attempt: the abandoned turns' items stay until the next fold.
            log.warning("memory.branch_state_contended", conversation=ref.conversation, at=at)
        except StoreUnavailable as exc:
            log.warning("memory.branch_state_failed", conversation=ref.conversation, error=type(exc).__name__)

    async def _read_state(self, req: _Request, length: int) -> None:
        """Read a conversation too short to fold into its state, every few turns (folds do it later):
        by pattern (`state.extract`, off the event loop), whatever the summarizer, and by CAS (a
        concurrent write wins; the next turns read again)."""
        mem, view, ref = self.settings.memory, req.view, req.ref
        ledger = state.load(view.state)
        read = max(state.mark(ledger, ref.conversation), view.summary.covers if view.summary is not None else 0)
        if length - read < max(2, mem.fold_batch // 2):
            return
        turns = fold.spoken(req.dialect, await self.store.messages(ref, read, length))
        updated = await asyncio.to_thread(state.extract, ledger, turns, read)
        if await self.store.put_state(ref, state.marked(updated, ref.conversation, read + len(turns)).dump(),
                                      expect_version=view.state_version) and updated is not ledger:
            # Other replicas reload the view only when the state gained something, not for a mark.
            with contextlib.suppress(StoreUnavailable):
                await self.store.announce(ref, "folded")

    async def _maybe_fold(self, req: _Request, length: int, turns: list[Message], *, urgent: bool) -> None:
        mem = self.settings.memory
        view = req.view
        covers = view.summary.covers if view.summary else 0
        # The unsummarised messages as far as this request knows them (stored tail, then its own
        # turns): the older ones beyond the window are what a fold would take, by tokens too.
        unsummarised = [*view.tail[: max(0, req.decision.base - view.tail_start)], *turns]
        aged = unsummarised[: max(0, len(unsummarised) - mem.keep_recent)]
        if urgent:
            await self.store.enqueue_fold(req.ref, urgent=True)
            return
        # A summary is read only by rewritten requests: while the conversation stays under both
        # thresholds it goes upstream whole, and folding it would spend summarizer CPU (or tokens) for
        # nothing; its state is read all the same. And the load just said whether a fold is queued:
        # asking Redis again is a round trip.
        tokens = view.tokens_total + sum(t.tokens for t in turns)
        if view.fold_pending:
            return
        if not rewrite.over_thresholds(length, tokens, mem):
            # Too short to fold, but its first messages may state a goal, decisions, constraints.
            await self._read_state(req, length)
            return
        # The aged tokens only matter while fewer than fold_batch messages aged: not summed over a backlog.
        few = len(aged) < mem.fold_batch
        if fold.should_fold(length=length, covers=covers, keep_recent=mem.keep_recent, fold_batch=mem.fold_batch,
                            aged_tokens=sum(t.tokens for t in aged) if few else None, fold_tokens=mem.fold_tokens):
            await self.store.enqueue_fold(req.ref)
            self.caches.views.update(req.ref, lambda known: replace(known, fold_pending=True))
