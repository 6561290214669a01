"""The memory path: identify → load → reconcile → plan → render; after the reply, record.

`Memory.prepare` is the proxy's hook. It is the only module that knows the store, the rewrite
rules, retrieval and token counting together; each of those is a plain module of its own. Nothing
here blocks on a summarizer: folds are queued and done by the workers.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from hashlib import blake2b
from typing import Any

import orjson
import structlog

from gateway import context, cost, fold, state
from gateway.config import Settings
from gateway.keys import ConvRef
from gateway.model import ConversationView, Plan, Summary, Turn, Usage
from gateway.proxy import Call, GatewayError, Prepared
from gateway.recall import RecallCache
from gateway.reconcile import Decision, chain_hashes, reconcile
from gateway.shape import Shape, content_hash, shape_for
from gateway.store import AppendResult, Store, StoreUnavailable
from gateway.tokens import TokenCounter
from gateway.views import KnownViews, advance, rebase, with_summary

log = structlog.get_logger("gateway.memory")

MEMORY_DIALECTS = frozenset({"openai_chat", "openai_responses", "anthropic"})


@dataclass(slots=True)
class _Request:
    """What prepare learned, carried to the recording step."""

    ref: ConvRef
    shape: Shape
    model: str | None
    view: ConversationView
    decision: Decision
    incoming: list[dict[str, Any]]
    hashes: list[str]
    chains: list[str]
    new_turns: list[Turn]  # incoming messages not stored yet, in order
    plan: Plan | None
    system_hash: str = ""
    summarizer_charge: int = 0  # summarizer tokens deducted from this request's savings
    known: bool = False  # planned from the view this process knew, not from a load
    arrived: float = 0.0


_clock: tuple[int, str] = (0, "")  # (second, its ISO text): turns arriving in one second share it


def _now() -> str:
    global _clock
    second = int(time.time())
    if second != _clock[0]:
        _clock = (second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return _clock[1]


def _digest(text: str) -> str:
    return blake2b(text.encode(), digest_size=12).hexdigest()


def _key(ref: ConvRef) -> tuple[str, str]:
    """The in-process caches' key for a conversation."""
    return (ref.tenant, ref.conversation)


def _bounded_put(cache: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Insert or refresh `key` as most recent, evicting the least recent past `limit`."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


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
        self.recall = recall or RecallCache()
        self._system_tokens: OrderedDict[int, int] = OrderedDict()
        # (ledger digest, encoding, state budget) -> (state block, its tokens)
        self._state_blocks: OrderedDict[tuple[bytes, str, int], tuple[str, int]] = OrderedDict()
        # (tenant, conversation, dialect) → the last request's messages and their hashes.
        self._hashes: OrderedDict[tuple[str, str, str],
                                  tuple[list[dict[str, Any]], tuple[str, ...], tuple[str, ...]]] = OrderedDict()
        self._cache_size = 256  # conversations each in-process cache keeps
        # The embedded store has no other writer: what this process knows of it is always current.
        self.views = KnownViews(self._cache_size, live=store.embedded)
        self._refreshing: dict[tuple[str, str], asyncio.Task[None]] = {}  # reloads after a fold elsewhere
        store.on_commit(self._committed)
        # What each conversation's last request carried, for the prompt-cache cost model.
        self._forwarded: OrderedDict[tuple[str, str], cost.Forwarded] = OrderedDict()
        # (tenant, conversation) → recent (start, stop, replied at) of the turns this process stored:
        # tells a concurrent sibling request from an edit (see `_siblings`).
        self._stored_runs: OrderedDict[tuple[str, str], list[tuple[int, int, float]]] = OrderedDict()
        self._storing: dict[tuple[str, str], list[tuple[int, float]]] = {}  # (turns, replied at) in flight

    def forget(self, ref: ConvRef) -> None:
        """Drop what this process caches about a deleted conversation."""
        conv = _key(ref)
        self.views.drop(ref)
        self.recall.forget(conv)
        for key in [k for k in self._hashes if k[:2] == conv]:
            del self._hashes[key]
        for cache in (self._forwarded, self._stored_runs, self._storing):
            cache.pop(conv, None)

    def changed(self, ref: ConvRef, kind: str = "edited") -> None:
        """`ref` was edited or deleted ("edited"), here or on another replica: its next request loads.
        Another process folded it ("folded"): what this process knows of it is reloaded now, in the
        background, rather than after its next request (views.py)."""
        if kind != "folded":
            self.views.drop_project(ref)  # a state edit concerns every conversation of the project
            return
        key = _key(ref)
        if key in self._refreshing or not self.views.of_project(ref):
            return
        task = asyncio.get_running_loop().create_task(self._refresh(ref))
        self._refreshing[key] = task
        task.add_done_callback(lambda _: self._refreshing.pop(key, None))

    async def _refresh(self, ref: ConvRef) -> None:
        """Reload the conversation and merge the summary, state and counters into its known view; the
        state also into its project's other known conversations (the fold updated their shared state)."""
        try:
            loaded = await self.store.load(ref, head=self.settings.memory.keep_initial)
        except StoreUnavailable:
            self.views.drop_project(ref)
            return
        self.views.update(ref, lambda known: rebase(known, loaded))
        if ref.project and loaded.state is not None:
            self._committed(ref, None, (loaded.state, loaded.state_version))

    def _committed(self, ref: ConvRef, summary: Summary | None, state: tuple[dict[str, Any], int] | None) -> None:
        """A fold worker of this process committed a summary or a state ledger: known views take it now."""
        if summary is not None:
            self.views.update(ref, lambda known: with_summary(known, summary))
        if state is not None:
            ledger, version = state
            for other, known in self.views.of_project(ref):
                if version > known.state_version:
                    self.views.put(other, replace(known, state=ledger, state_version=version))

    async def follow_store(self) -> None:
        """Keep what this process knows of conversations honest while it runs (views.py): follow the
        store's change channel. Returns at once for the embedded store, which has no other writer."""
        if self.store.embedded:
            return

        def live(up: bool) -> None:
            if up != self.views.live:
                log.info("memory.changes_followed") if up else log.warning("memory.changes_lost")
            self.views.set_live(up)

        try:
            await self.store.watch(self.changed, live)
        finally:
            for task in list(self._refreshing.values()):
                task.cancel()

    # -- identify ---------------------------------------------------------------------------

    def conversation_of(self, call: Call) -> ConvRef | None:
        conv = _header(call.headers, self.settings.conversation.headers)
        if not conv:
            return None
        project = _header(call.headers, self.settings.conversation.project_headers)
        return ConvRef(call.tenant, conv, project)

    async def prepare(self, call: Call) -> Prepared | None:
        ref = self.conversation_of(call)
        if ref is None:
            return None  # no conversation: forwarded byte for byte
        mem = self.settings.memory
        off = str(call.headers.get(self.settings.conversation.memory_header, "")).lower() == "off"
        shape = shape_for(call.dialect.name) if call.dialect.name in MEMORY_DIALECTS else None
        history = shape.history(call.body) if shape is not None else None
        if off or not mem.enabled or shape is None or history is None:
            return Prepared(body=None, headers={"x-gateway-context": "passthrough"})

        started = time.perf_counter()
        arrived = time.monotonic()
        hashes, chains = self._hash_history(ref, shape, history)
        view, decision = self._from_known(ref, shape, hashes, chains)
        known = view is not None
        if view is None:
            try:
                view = await self.store.load(ref, head=mem.keep_initial)
                if view.dialect in (None, shape.dialect):
                    decision = await self._decide(ref, hashes, chains, view, arrived)
            except StoreUnavailable as exc:
                return self._degraded(call, shape, history, exc)
        if view.dialect is not None and view.dialect != shape.dialect:
            # One conversation id reused across API dialects: its stored turns cannot be replayed
            # in the other format, so this request goes through untouched and is not recorded.
            return Prepared(body=None, headers={"x-gateway-context": "passthrough"})
        assert decision is not None

        model = shape.model(call.body)
        req = self._logical(ref, shape, model, view, decision, history, hashes, chains)
        req.known, req.arrived = known, arrived
        try:
            plan, body = await self._plan(call, req, history)
        except StoreUnavailable as exc:
            return self._degraded(call, shape, history, exc)
        req.plan = plan
        # Savings are net of what folding cost: the summarizer tokens spent since the last request
        # are charged once, against this request (0 with the extractive summarizer).
        st = view.stats
        req.summarizer_charge = max(0, st.get("summarizer_tokens_in", 0) + st.get("summarizer_tokens_out", 0)
                                    - st.get("summarizer_tokens_charged", 0))
        saved = plan.tokens_original - plan.tokens_forwarded - req.summarizer_charge
        headers = {
            "x-gateway-context": plan.kind,
            "x-gateway-tokens-original": str(plan.tokens_original),
            "x-gateway-tokens-forwarded": str(plan.tokens_forwarded),
            "x-gateway-tokens-saved": str(saved),
        }
        if self.metrics is not None:
            self.metrics.observe_tokens(plan.tokens_original, plan.tokens_forwarded, self._usd(model, saved))
        log.debug("memory.plan", conversation=ref.conversation, action=decision.action, kind=plan.kind, known=known,
                  ms=round((time.perf_counter() - started) * 1000, 3))

        def on_success(items: list[dict[str, Any]], usage: Usage) -> Coroutine[Any, Any, None]:
            return self._record(req, items, usage, replied=time.monotonic())  # the reply is relayed now

        return Prepared(body=body, headers=headers, on_success=on_success)

    def _from_known(self, ref: ConvRef, shape: Shape, hashes: list[str],
                    chains: list[str]) -> tuple[ConversationView | None, Decision | None]:
        """The view this process knows, when the request simply goes on from it (views.py)."""
        view = self.views.get(ref)
        if view is None or view.dialect not in (None, shape.dialect):
            return None, None
        decision = reconcile(hashes, chains, view, self.settings.conversation.history)
        if decision.action not in ("extend", "delta"):
            return None, None  # a retry, an edit, a regenerate: decided on what the store holds now
        return view, decision

    async def _decide(self, ref: ConvRef, hashes: list[str], chains: list[str], view: ConversationView,
                      arrived: float) -> Decision:
        """Reconcile the request with a view just loaded (reading the stored chains when needed)."""
        mode = self.settings.conversation.history
        decision = reconcile(hashes, chains, view, mode)
        if decision.action == "need_chains":
            decision = reconcile(hashes, chains, view, mode, stored_chains=await self.store.chains(ref))
        if decision.action == "branch" and self._siblings(ref, decision.base, view.length, arrived):
            # Every turn after the divergence was stored by requests still unanswered when this one
            # arrived: concurrent requests on one base, not an edit. Store the union (append after them).
            decision = Decision("extend", base=decision.base, new_from=decision.new_from,
                                base_chain=decision.base_chain)
        return decision

    def _hash_history(self, ref: ConvRef, shape: Shape,
                      history: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """Content and chain hashes of every incoming message, reusing the previous request's.

        Full-history clients resend the same messages every turn. A message that compares equal
        (a C-level dict comparison, ~0.1 µs) to the one at the same position last time has the
        same hash, so only the messages that are new or changed are canonicalised and hashed:
        a 500-message history costs about as much as a 10-message one.
        """
        key = (*_key(ref), shape.dialect)
        cached = self._hashes.get(key)
        same = 0
        if cached is not None:
            raws, old_hashes, old_chains = cached
            limit = min(len(raws), len(history))
            if history[:limit] == raws[:limit]:
                same = limit  # the usual resend, compared in one C loop
            else:
                while same < limit and history[same] == raws[same]:
                    same += 1
            hashes, chains = list(old_hashes[:same]), list(old_chains[:same])
        else:
            hashes, chains = [], []
        fresh = [content_hash(shape, m) for m in history[same:]]
        hashes += fresh
        chains += chain_hashes(fresh, prev=chains[-1] if chains else "")
        # The hashes as tuples, not lists: the cyclic GC stops tracking a tuple of strings once it has
        # seen it, so its full collections do not walk every cached hash. (A tuple of message dicts
        # stays tracked like a list would, so the messages are kept as they came.)
        _bounded_put(self._hashes, key, (history, tuple(hashes), tuple(chains)), self._cache_size)
        return hashes, chains

    # -- plan -------------------------------------------------------------------------------

    def _turn(self, shape: Shape, raw: dict[str, Any], h: str, model: str | None,
              when: str | None = None) -> Turn:
        text = shape.text(raw)
        return Turn(raw=raw, role=shape.role(raw), text=text,
                    tokens=self.tokens.count_message(text, model), hash=h, time=when or _now())

    def _logical(self, ref: ConvRef, shape: Shape, model: str | None, view: ConversationView,
                 decision: Decision, history: list[dict[str, Any]], hashes: list[str],
                 chains: list[str]) -> _Request:
        """The new turns this request brings, counted once (stored ones carry their counts)."""
        now = _now()
        new = [self._turn(shape, history[i], hashes[i], model, now)
               for i in range(decision.new_from, len(history))]
        for t, c in zip(new, chains[decision.new_from:], strict=False):
            t.chain = c
        return _Request(ref, shape, model, view, decision, history, hashes, chains, new, None)

    def _system_count(self, text: str, model: str | None) -> int:
        if not text:
            return 0
        key = hash((text, model))
        n = self._system_tokens.get(key)
        if n is None:
            n = self.tokens.count(text, model)
            _bounded_put(self._system_tokens, key, n, 4096)
        return n

    def _state_block(self, ledger: dict[str, Any] | None, model: str | None) -> tuple[str, int]:
        """The project state wrapped in its template, and its tokens; remembered by content.

        The ledger changes only when a fold or an edit updates it, but validating and rendering it
        (a count per line) on every request cost ~0.4 ms for 40 items."""
        if not ledger:
            return "", 0
        mem = self.settings.memory
        key = (blake2b(orjson.dumps(ledger), digest_size=16).digest(), self.tokens.encoding(model).name,
               mem.state_budget_tokens)
        hit = self._state_blocks.get(key)
        if hit is None:
            rendered = state.render(state.Ledger.model_validate(ledger), mem.state_budget_tokens,
                                    lambda s: self.tokens.count(s, model))
            block = mem.templates.state.format(state=rendered) if rendered else ""
            hit = (block, self.tokens.count(block, model) if block else 0)
        _bounded_put(self._state_blocks, key, hit, self._cache_size)
        return hit

    async def _plan(self, call: Call, req: _Request, history: list[dict[str, Any]]) -> tuple[Plan, bytes | None]:
        mem = self.settings.memory
        view, decision, shape = req.view, req.decision, req.shape
        summary: Summary | None = view.summary
        base = decision.base  # stored messages [0, base) this request builds on
        client_sent_all = decision.action != "delta"

        # The logical conversation from the summary's coverage on: stored tail up to `base`
        # (with the client's own bytes where it sent them), then the new turns.
        if base < view.tail_start or (summary is not None and summary.covers > base):
            # The request builds on a point the summary already covers (a regenerate far back,
            # an early branch): the summary describes turns this request does not contain.
            summary = None
            tail: list[Turn] = [self._turn(shape, history[i], req.hashes[i], req.model)
                                for i in range(0, decision.new_from)]
            tail_start = 0
            total_tokens = sum(t.tokens for t in tail)
        else:
            stored = view.tail[: base - view.tail_start]
            if client_sent_all:
                # A full-history client's message i is stored position i: forward its own bytes.
                tail = [Turn(raw=history[view.tail_start + i], role=t.role, text=t.text,
                             tokens=t.tokens, hash=t.hash, chain=t.chain, time=t.time)
                        for i, t in enumerate(stored)]
            else:
                tail = list(stored)
            tail_start = view.tail_start
            dropped = sum(t.tokens for t in view.tail[base - view.tail_start:])
            total_tokens = view.tokens_total - dropped
        tail.extend(req.new_turns)
        total_tokens += sum(t.tokens for t in req.new_turns)
        total_messages = tail_start + len(tail)

        system_text = shape.system_text(call.body)
        system_tokens = self._system_count(system_text, req.model)
        req.system_hash = _digest(system_text)
        model_cfg = self.settings.model(req.model)
        max_out = shape.max_output_tokens(call.body) or 0
        budget = int(model_cfg.context_window * mem.budget_ratio) - max_out

        state_block, state_tokens = self._state_block(view.state, req.model)

        now = time.monotonic()  # one clock reading for both cost comparisons
        weigh_full = client_sent_all and mem.cost_model and total_tokens + system_tokens <= budget
        draft = context.draft_plan(
            shape, head=view.head if tail_start > 0 else [], tail=tail, tail_start=tail_start,
            total_messages=total_messages, total_tokens=total_tokens, system_tokens=system_tokens,
            summary=summary, state_block=state_block, state_tokens=state_tokens,
            settings=mem, context_budget=budget, count=lambda s: self.tokens.count(s, req.model),
        )
        plan = draft.plan
        # Excerpts only add to a rewrite's bill: when the full history already costs less than the
        # rewrite without them, it is what gets forwarded, and neither the search nor bringing the
        # index up to date for it is needed (the index catches up from the store when it is).
        if draft.finish is not None and (not weigh_full or self._rewrite_may_win(
                call, req, plan, tail, system_tokens, state_tokens, total_tokens, summary, now)):
            plan = await self._with_excerpts(req, draft, tail, tail_start, total_tokens)
        if plan.tokens_forwarded > budget:
            raise GatewayError(400, "invalid_request_error",
                               f"the newest turn alone needs about {plan.tokens_forwarded} tokens, more than "
                               f"the {budget} this model's context window allows after max output tokens")
        items = (self._rewrite_items(req, plan, tail, system_tokens, state_tokens, summary)
                 if plan.kind == "rewritten" else None)
        if items is not None and weigh_full:
            plan = self._cheaper(call, req, plan, tail, system_tokens, total_tokens, items, now)
        self._remember_forwarded(req, plan, system_tokens, total_tokens, items)
        if plan.kind == "full" and client_sent_all:
            return plan, None
        rendered_body = shape.render(call.body, plan, cache_control=mem.cache_control)
        return plan, orjson.dumps(rendered_body)

    def _rewrite_may_win(self, call: Call, req: _Request, plan: Plan, tail: list[Turn], system_tokens: int,
                         state_tokens: int, total_tokens: int, summary: Summary | None, now: float) -> bool:
        """Does the rewrite `plan` (no excerpts yet) cost less than the full history?"""
        items = self._rewrite_items(req, plan, tail, system_tokens, state_tokens, summary)
        return self._cheaper(call, req, plan, tail, system_tokens, total_tokens, items, now) is plan

    async def _with_excerpts(self, req: _Request, draft: context.Draft, tail: list[Turn], tail_start: int,
                             total_tokens: int) -> Plan:
        """The draft finished with the messages recalled for the newest turn (the index synced first).

        tail, tail_start: the logical conversation from the summary's coverage on (tail_start 0 when
        the summary is not used), as _plan built it."""
        assert draft.finish is not None
        mem, view = self.settings.memory, req.view
        query_turn = next((t for t in reversed(tail) if req.shape.is_turn_start(t.raw)), tail[-1] if tail else None)
        # Less the block's own heading; each excerpt's header is budgeted by the index.
        budget_tokens = min(draft.budget, int(mem.retrieval_max_share * total_tokens)) - 20
        if query_turn is None or budget_tokens <= 0:
            return draft.plan
        key = _key(req.ref)
        if tail_start > 0:
            await self.recall.sync(key, view.tail[: max(0, req.decision.base - view.tail_start)], view.tail_start,
                                   lambda a, b: self.store.messages(req.ref, a, b))
        hits = self.recall.search(
            key, query=query_turn.text, after=len(view.head), before=draft.window_start,
            budget_tokens=budget_tokens, recent=[t.text for t in tail[-6:]], query_time=query_turn.time,
        )
        return draft.finish([(h.position, Turn(raw={}, role=h.role, text=h.text, tokens=h.tokens, hash="",
                                               time=h.time)) for h in hits])

    # -- cost -------------------------------------------------------------------------------

    def _prices(self) -> cost.Prices:
        p = self.settings.pricing
        return cost.Prices(read=p.cache_read_factor, write=p.cache_write_factor, ttl=p.cache_ttl_seconds)

    def _rewrite_items(self, req: _Request, plan: Plan, tail: list[Turn], system_tokens: int, state_tokens: int,
                       summary: Summary | None) -> tuple[list[str], list[int], int]:
        """The rewritten request as prompt-cache items, and its volatile tokens (excerpts onwards)."""
        window = tail[len(tail) - len(plan.window):] if plan.window else []
        blocks = plan.state_block + "\x1f" + plan.summary_block
        block_tokens = (summary.tokens if summary is not None and plan.summary_block else 0)
        block_tokens += state_tokens if plan.state_block else 0
        items = [req.system_hash, _digest(blocks)] + [t.hash for t in req.view.head[: len(plan.head)]]
        tokens = [system_tokens, block_tokens] + [t.tokens for t in req.view.head[: len(plan.head)]]
        if plan.omitted_marker:
            items.append(_digest(plan.omitted_marker))
            tokens.append(8)
        cut = next((i for i in range(len(window) - 1, -1, -1) if req.shape.is_turn_start(window[i].raw)), len(window))
        stable = sum(tokens) + sum(t.tokens for t in window[:cut])
        excerpts = max(plan.tokens_forwarded - stable - sum(t.tokens for t in window[cut:]), 0)
        items += [t.hash for t in window[:cut]]
        tokens += [t.tokens for t in window[:cut]]
        if plan.excerpts_block:
            items.append(_digest(plan.excerpts_block))
            tokens.append(excerpts)
        items += [t.hash for t in window[cut:]]
        tokens += [t.tokens for t in window[cut:]]
        return items, tokens, excerpts + sum(t.tokens for t in window[cut:])

    def _cheaper(self, call: Call, req: _Request, plan: Plan, tail: list[Turn], system_tokens: int,
                 total_tokens: int, rewrite: tuple[list[str], list[int], int], now: float) -> Plan:
        """The rewrite, unless the full history would be billed less once prompt caching counts."""
        prices = self._prices()
        last = self._forwarded.get(_key(req.ref))
        # OpenAI caches long prompt prefixes by itself; Anthropic only up to a client's breakpoint.
        cacheable = req.shape.dialect != "anthropic" or b"cache_control" in call.raw
        full_now = cost.billed_full((req.system_hash, system_tokens), total_tokens, req.chains, last, now, prices,
                                    cacheable=cacheable)
        items, tokens, volatile = rewrite
        choice = cost.choose(
            full_now=full_now, rewrite_now=cost.billed(items, tokens, last, now, prices),
            full_total=system_tokens + total_tokens, rewrite_total=sum(tokens),
            new=2 * sum(t.tokens for t in req.new_turns), volatile=volatile,
            prices=prices, horizon=max(2, self.settings.memory.fold_batch // 2), full_cacheable=cacheable)
        if not choice.full:
            return plan
        return Plan(kind="full", state_block="", summary_block="", head=[], omitted_marker="",
                    window=[t.raw for t in tail], excerpts_block="", tokens_original=plan.tokens_original,
                    tokens_forwarded=plan.tokens_original)

    def _remember_forwarded(self, req: _Request, plan: Plan, system_tokens: int, total_tokens: int,
                            rewrite: tuple[list[str], list[int], int] | None) -> None:
        """What this request carries upstream, for the next request's cost estimate."""
        now = time.monotonic()
        if plan.kind == "rewritten" and rewrite is not None:
            record = cost.Forwarded(False, tuple(rewrite[0]), tuple(rewrite[1]), now)
        else:
            record = cost.full_record((req.system_hash, system_tokens), len(req.incoming),
                                      req.chains[-1] if req.chains else "", total_tokens, now)
        _bounded_put(self._forwarded, _key(req.ref), record, self._cache_size)

    def _degraded(self, call: Call, shape: Shape, history: list[dict[str, Any]], exc: Exception) -> Prepared:
        if self.metrics is not None:
            self.metrics.store_errors_total.inc()
        log.warning("memory.degraded", error=type(exc).__name__)
        model = shape.model(call.body)
        tokens = sum(self.tokens.count_message(shape.text(m), model) for m in history)
        tokens += self._system_count(shape.system_text(call.body), model)
        return Prepared(body=None, headers={
            "x-gateway-context": "degraded", "x-gateway-tokens-original": str(tokens),
            "x-gateway-tokens-forwarded": str(tokens), "x-gateway-tokens-saved": "0"})

    # -- record -----------------------------------------------------------------------------

    def _usd(self, model: str | None, tokens: int) -> float:
        return tokens * self.settings.model(model).input_usd_per_mtok / 1_000_000

    def _siblings(self, ref: ConvRef, at: int, length: int, arrived: float) -> bool:
        """Were stored messages [at, length) all stored by requests answered after `arrived`?

        Runs whose store call has not returned yet (`_storing`) may account for the positions no
        known run covers.
        """
        key = _key(ref)
        runs, storing = self._stored_runs.get(key, []), self._storing.get(key, [])
        if at >= length or not (runs or storing):
            return False
        covered, gaps = at, 0
        for start, stop, replied in sorted(runs):
            if start >= length:
                break
            if stop <= covered:
                continue
            if replied <= arrived:
                return False
            gaps += max(0, start - covered)
            covered = stop
        gaps += max(0, length - covered)
        return gaps <= sum(n for n, replied in storing if replied > arrived)

    def _note_stored(self, ref: ConvRef, start: int, stop: int, replied: float, *, branched: bool) -> None:
        key = _key(ref)
        runs = self._stored_runs.get(key, [])
        if branched:  # the branch replaced everything from `start` on
            runs = [r for r in runs if r[1] <= start]
        runs.append((start, stop, replied))
        _bounded_put(self._stored_runs, key, runs[-64:], self._cache_size)

    async def _store_turns(self, req: _Request, reply: list[Turn], turns: list[Turn],
                           stats: dict[str, int] | None) -> AppendResult | None:
        """Append / branch as the decision says, adding `stats` in the same call; None when there is
        nothing to store (the caller adds the stats then)."""
        shape, decision, view, ref = req.shape, req.decision, req.view, req.ref
        result: AppendResult | None
        if decision.action in ("new", "extend", "delta"):
            result = await self.store.append(ref, turns, base_length=decision.base,
                                             base_chain=decision.base_chain, dialect=shape.dialect, stats=stats)
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
                                                 base_chain=decision.base_chain, dialect=shape.dialect, stats=stats)
            else:
                result = await self.store.branch(ref, at=decision.base, base_chain=decision.base_chain,
                                                 turns=reply, dialect=shape.dialect, stats=stats)
        else:  # branch
            result = await self.store.branch(ref, at=decision.base, base_chain=decision.base_chain,
                                             turns=turns, dialect=shape.dialect, stats=stats)
        return result

    async def _record(self, req: _Request, items: list[dict[str, Any]], usage: Usage,
                      replied: float = 0.0) -> None:
        """Store the new turns and the reply; queue a fold when enough turns aged out."""
        shape, ref = req.shape, req.ref
        reply = [self._turn(shape, raw, content_hash(shape, raw), req.model) for raw in items]
        turns = [*req.new_turns, *reply]
        replied = replied or time.monotonic()
        conv, storing = _key(ref), (len(turns), replied)
        plan = req.plan
        stats = {"requests": 1, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                 "cache_read_tokens": usage.cache_read_tokens, "cache_write_tokens": usage.cache_write_tokens}
        if plan is not None:
            stats |= {"tokens_original": plan.tokens_original, "tokens_forwarded": plan.tokens_forwarded,
                      "tokens_saved": plan.tokens_original - plan.tokens_forwarded - req.summarizer_charge,
                      "summarizer_tokens_charged": req.summarizer_charge}
        # The view this record leaves, known before the store answers: the conversation's next
        # request may arrive first (its client has the reply already).
        expected = self._expect(req, turns, stats)
        self._storing.setdefault(conv, []).append(storing)
        try:
            try:
                result = await self._store_turns(req, reply, turns, stats)
                if result is not None and not result.ok and req.known:
                    # Planned from a known view the store had moved on from (another replica wrote):
                    # record as a request planned from a fresh load would have (stats are added already).
                    req, turns, result = await self._record_again(req, reply)
                    stats = {}
            finally:
                pending = self._storing.get(conv, [])
                if storing in pending:
                    pending.remove(storing)
                if not pending:
                    self._storing.pop(conv, None)
            decision, view = req.decision, req.view
            if result is not None and result.ok and result.appended:
                start = result.start if result.start >= 0 else result.length - result.appended
                branched = decision.action == "branch" or (decision.action == "prefix" and decision.base < view.length)
                self._note_stored(ref, start, start + result.appended, replied, branched=branched)
            if result is None and stats:
                await self.store.add_stats(ref, **stats)
            await self._settle_known(req, turns, result, expected)
            if result is not None and not result.ok:
                log.info("memory.record_conflict", conversation=ref.conversation, reason=result.reason)
                return
            if plan is not None and usage.input_tokens and plan.kind != "passthrough":
                self.tokens.calibrate(req.model, plan.tokens_forwarded, usage.input_tokens)
            length = result.length if result is not None else view.length
            if result is not None and result.appended and decision.action in ("branch", "prefix"):
                self.recall.truncate(_key(ref), decision.base)
            await self._maybe_fold(req, length, turns, urgent=bool(plan and plan.urgent_fold))
        except StoreUnavailable as exc:
            self.views.drop(ref)
            if self.metrics is not None:
                self.metrics.store_errors_total.inc()
            log.warning("memory.record_failed", conversation=ref.conversation, error=type(exc).__name__)

    async def _record_again(self, req: _Request, reply: list[Turn]) -> tuple[_Request, list[Turn], AppendResult | None]:
        """Decide and store the request's turns again, on what the store holds now."""
        view = await self.store.load(req.ref, head=self.settings.memory.keep_initial)
        decision = await self._decide(req.ref, req.hashes, req.chains, view, req.arrived)
        again = self._logical(req.ref, req.shape, req.model, view, decision, req.incoming, req.hashes, req.chains)
        again.plan, again.summarizer_charge, again.arrived = req.plan, req.summarizer_charge, req.arrived
        turns = [*again.new_turns, *reply]
        return again, turns, await self._store_turns(again, reply, turns, None)

    def _expect(self, req: _Request, turns: list[Turn], stats: dict[str, int]) -> tuple[str, ConversationView] | None:
        """Know the view this record will leave, before the store confirms it (views.py).

        Only a record that appends right after a view this process holds can be known: the chain
        the store must end with is computed here. Returns it, with the view the turns go after."""
        decision, ref = req.decision, req.ref
        if not self.views.live or not turns or decision.action not in ("new", "extend", "delta"):
            self.views.drop(ref)
            return None
        base = self.views.get(ref)
        if base is None or base.length != decision.base or (base.last_chain or "") != decision.base_chain:
            base = req.view if req.view.length == decision.base else None
        if base is None:
            self.views.drop(ref)
            return None
        chained = chain_hashes([t.hash for t in turns], prev=decision.base_chain)
        for t, c in zip(turns, chained, strict=True):
            t.chain = c
        self.views.put(ref, advance(base, turns, dialect=req.shape.dialect, last_chain=chained[-1],
                                    keep_initial=self.settings.memory.keep_initial, stats=stats,
                                    fold_pending=base.fold_pending))
        return chained[-1], base

    async def _settle_known(self, req: _Request, turns: list[Turn], result: AppendResult | None,
                            expected: tuple[str, ConversationView] | None) -> None:
        """Keep the view `_expect` put when the store holds exactly that; reload it in the background
        of this record when a fold or an edit changed the summary or state meanwhile."""
        if expected is None:
            return
        chain, base = expected
        ref = req.ref
        if result is None or not result.ok or result.appended != len(turns) or result.chain != chain:
            self.views.drop(ref)  # the store holds something else: the next request loads
            return
        known = self.views.get(ref)
        if known is None:
            return
        # What folds spent (charged against the next request's savings) and whether one is queued
        # come with the answer: neither waits for a reload.
        spent = {k: max(known.stats.get(k, 0), n) for k, n in result.summarizer.items()}
        if known.length == base.length + len(turns) and (
                known.fold_pending != result.fold_queued or any(known.stats.get(k) != n for k, n in spent.items())):
            known = replace(known, fold_pending=result.fold_queued, stats=known.stats | spent)
            self.views.put(ref, known)
        # A fold of this process has been taken already (_committed); another process's has not.
        if result.summary_version > known.summary_version or result.state_version not in (-1, known.state_version):
            await self._refresh(ref)

    async def _maybe_fold(self, req: _Request, length: int, turns: list[Turn], *, urgent: bool) -> None:
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
        # nothing. And the load just said whether a fold is queued: asking Redis again is a round trip.
        tokens = view.tokens_total + sum(t.tokens for t in turns)
        if view.fold_pending or not context.over_thresholds(length, tokens, mem):
            return
        if fold.should_fold(length=length, covers=covers, keep_recent=mem.keep_recent, fold_batch=mem.fold_batch,
                            aged_tokens=sum(t.tokens for t in aged), fold_tokens=mem.fold_tokens):
            await self.store.enqueue_fold(req.ref)
            self.views.update(req.ref, lambda known: replace(known, fold_pending=True))
