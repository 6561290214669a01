"""The rewrite rules, in one place: what a request with memory forwards, and why.

`plan(Inputs)` decides, from the stored conversation as this request extends it, the client's
system prompt, the budget and what the conversation forwarded last: forward the whole history
(`full`), or rewrite it into layers (state, summary, head, omitted marker, window, excerpts). Every
rule lives here: the thresholds, where the window starts, the head, the hard budget and its
fallback order, whether excerpts are worth recalling and how many fit, the prompt-cache cost
choice between the rewrite and the full history, and the refusal of a turn that cannot fit at
all. The plan says why it is what it is (`Plan.reason`, one of `REASONS`).

Excerpts are the one input that needs I/O (bringing a retrieval index up to date), so planning is
two steps: `plan()` returns a `Draft` that says whether excerpts are wanted (`Draft.wants`: for
which window, within what budget) and `Draft.finish(picked)` returns the `Outcome` with the
recalled messages placed. Production (memory.py) and the property tests call the same two.

Positions are indices in the logical conversation (the client's history without its leading system
prompt). A *cut* at position p lies between messages p-1 and p; it is *clean* when no tool-call group
crosses it (a call opened before p and answered at or after p, or an item bound to its successor,
such as a Responses reasoning item). A window starts at a clean cut that is a turn start; the head
ends at a clean cut. Everything here is pure: the caller loads, counts, searches and renders.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from hashlib import blake2b

from gateway import cost
from gateway.config import MemorySettings
from gateway.dialects import Dialect
from gateway.model import ConversationView, Message, Pin, Pins, Plan, Summary
from gateway.reconcile import Decision

# Why a request went as it did (Plan.reason).
UNDER_THRESHOLD = "under-threshold"  # short enough to go whole
REWRITTEN = "rewritten"
OVER_BUDGET = "over-window"  # rewritten, and the window cut to fit the context budget (fold urgent)
NO_SAVING = "no-saving"  # the rewrite would not be smaller: the full history goes
# No saving because no fold has summarised anything yet (the first one is queued or running): the
# turns that aged out cannot be dropped unsummarised, so the full history goes.
SUMMARY_PENDING = "summary-pending"
CHEAPER_CACHED = "cheaper-cached"  # the full history costs less with the provider's prompt cache
NO_CLEAN_CUT = "no-clean-cut"  # the history opens inside a tool group: only the whole body is valid
TOO_LARGE = "too-large"  # the newest turn alone is over the budget: sent as it came if whole and within the window
# Not the plan's: no plan was made (memory.py).
MEMORY_OFF = "memory-off"  # X-Memory: off, or memory.enabled false
NOT_REWRITABLE = "not-rewritable"  # no history the gateway can rewrite (e.g. Responses with previous_response_id)
TOO_MANY_MESSAGES = "too-many-messages"  # more messages than memory.max_messages: relayed, not stored
TOO_MANY_PARTS = "too-many-parts"  # more content parts than memory.max_parts: relayed, not stored
OTHER_DIALECT = "other-dialect"  # the conversation id is stored in another API's format
DEGRADED = "degraded"  # the store is unreachable: sent unchanged, not recorded
REASONS = (UNDER_THRESHOLD, REWRITTEN, OVER_BUDGET, NO_SAVING, SUMMARY_PENDING, CHEAPER_CACHED, NO_CLEAN_CUT,
           TOO_LARGE)
# Weight of a searched turn's new excerpt tokens in the conversation's running mean (Draft.finish).
EXCERPT_RATE_WEIGHT = 0.2

_FIELD = re.compile(r"\{(\w+)\}")


def fill(template: str, **values: object) -> str:
    """`template` with `{name}` replaced in one pass: text that itself contains `{summary}` or
    braces (code, JSON) is never re-expanded, and unknown fields stay as written."""
    return _FIELD.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), template)


def clean_cuts(dialect: Dialect, raws: Sequence[dict]) -> list[bool]:
    """clean[c] for c in 0..len(raws): no tool group crosses the cut before raws[c].

    A result whose call is not in `raws` was opened before the slice, so every cut up to it is
    crossed. One pass with a difference array: O(n).
    """
    n = len(raws)
    diff = [0] * (n + 2)
    opened: dict[str, int] = {}
    for j, raw in enumerate(raws):
        for cid in dialect.tool_results(raw):
            diff[opened.get(cid, -1) + 1] += 1
            diff[j + 1] -= 1
        for cid in dialect.tool_calls(raw):
            opened[cid] = j
        if dialect.binds_next(raw):
            diff[j + 1] += 1
            diff[j + 2] -= 1
    clean = []
    depth = 0
    for c in range(n + 1):
        depth += diff[c]
        clean.append(depth == 0)
    return clean


def closed_prefixes(dialect: Dialect, raws: Sequence[dict]) -> list[bool]:
    """closed[p] for p in 0..len(raws): raws[:p] leaves no call unanswered and no item waiting
    for its successor, whatever follows. Used for the head, whose continuation may not be loaded."""
    closed = [True]
    pending: set[str] = set()
    for raw in raws:
        pending.difference_update(dialect.tool_results(raw))
        pending.update(dialect.tool_calls(raw))
        closed.append(not pending and not dialect.binds_next(raw))
    return closed


def align_boundary(dialect: Dialect, raws: Sequence[dict], offset: int, target: int) -> int:
    """The largest position p <= target (p = offset + index into raws) such that raws[p - offset]
    is a turn start and no tool group crosses p; `offset` when there is none."""
    clean = clean_cuts(dialect, raws)
    for i in range(min(target - offset, len(raws) - 1), -1, -1):
        if clean[i] and dialect.is_turn_start(raws[i]):
            return offset + i
    return offset


def over_thresholds(messages: int, tokens: int, settings: MemorySettings) -> bool:
    """Whether a conversation this long is rewritten: under both thresholds it goes upstream whole."""
    return messages >= settings.message_threshold or tokens >= settings.token_threshold


# The pin cap (`pin_cap`), in excerpt budgets, lies between these.
PIN_CAP_MIN, PIN_CAP_MAX = 2, 4


def pin_cap(prices: cost.Prices) -> float:
    """Excerpt budgets the pins may hold before they all go. Letting them go is dear: the window after
    the first pin is written again, and later questions quote the same messages anew (in two
    conversations of the coding development set, at 2 budgets, 92% of the excerpt tokens written were
    such re-quotes). Keeping a block costs a cached read per request, quoting it anew a write, so the
    cap is the write/read ratio of the prices the cost model holds for the model (its list prices, or
    what calibration learned of its cache hits): 4 where a read costs at most a quarter of a write
    (Claude, GPT-5, GPT-4.1 while every read hits), 2 where it costs half (gpt-4o, as the cap was
    before). Past 4 the cap stopped binding on the coding set; more would only grow the requests."""
    if prices.read <= 0:
        return PIN_CAP_MAX
    return min(PIN_CAP_MAX, max(PIN_CAP_MIN, prices.write / prices.read))


def excerpt_budget(settings: MemorySettings, history_tokens: int, layers_tokens: int, context_budget: int) -> int:
    """Tokens the excerpts may fill for a history of `history_tokens` whose other layers (system,
    state, summary, head, window) take `layers_tokens`: what brings the request to
    `retrieval_target_share` of the history, at least `retrieval_budget_tokens`, at most
    `retrieval_context_share` of the model's context budget. (`retrieval_max_share` of the history
    bounds what the search fills: `plan`.)"""
    grown = int(settings.retrieval_target_share * history_tokens) - layers_tokens
    return max(0, min(max(settings.retrieval_budget_tokens, grown),
                      int(settings.retrieval_context_share * context_budget)))


def context_budget(context_window: int, settings: MemorySettings, max_output_tokens: int) -> int:
    """Input tokens a request may carry: `budget_ratio` of the model's window, less its output."""
    return int(context_window * settings.budget_ratio) - max_output_tokens


# ---------------------------------------------------------------- the conversation as this request extends it


@dataclass(slots=True)
class History:
    """The logical conversation this request makes, from the summary's coverage on.

    tail: messages [tail_start, total_messages), ending with the newest turn; head: the first stored
    messages (keep_initial of them when known, [] when tail_start is 0); total_tokens: tokens of the
    whole logical conversation; summary: the stored one, or None when it covers turns this request
    does not build on. stored_head: the loaded head, whose hashes stand for the head in the cost model.
    """

    head: Sequence[Message]
    tail: list[Message]
    tail_start: int
    total_messages: int
    total_tokens: int
    summary: Summary | None
    stored_head: Sequence[Message] = ()


def history(view: ConversationView, decision: Decision, client: Sequence[dict], new_messages: Sequence[Message],
            turn: Callable[[int], Message]) -> History:
    """What this request's conversation is: the stored tail up to the decision's base (with the
    client's own bytes where it sent them), then its new turns.

    client: the client's history; turn(i): client message i as a Message, counted (used only when the
    stored summary cannot be used and the client's history is taken from its start).
    """
    base = decision.base  # stored messages [0, base) this request builds on
    summary = view.summary
    if base < view.tail_start or (summary is not None and summary.covers > base):
        # The request builds on a point the summary already covers (a regenerate far back, an early
        # branch): the summary describes turns this request does not contain.
        summary = None
        tail = [turn(i) for i in range(0, decision.new_from)]
        tail_start = 0
        total_tokens = sum(t.tokens for t in tail)
    else:
        stored = view.tail[: base - view.tail_start]
        if decision.action != "delta":
            # A full-history client's message i is stored position i: forward its own bytes. For most
            # of them the resend parser handed back the very dict the stored message holds: that one
            # is used as it is (a copy of each, on every request, was most of a request's cost while
            # folds lag).
            at = view.tail_start
            tail = [t if client[at + i] is t.raw else Message(raw=client[at + i], role=t.role, text=t.text,
                                                              tokens=t.tokens, hash=t.hash, chain=t.chain, time=t.time)
                    for i, t in enumerate(stored)]
        else:
            tail = list(stored)
        tail_start = view.tail_start
        dropped = sum(t.tokens for t in view.tail[base - view.tail_start:])
        total_tokens = view.tokens_total - dropped
    tail.extend(new_messages)
    total_tokens += sum(t.tokens for t in new_messages)
    return History(head=view.head if tail_start > 0 else [], tail=tail, tail_start=tail_start,
                   total_messages=tail_start + len(tail), total_tokens=total_tokens, summary=summary,
                   stored_head=view.head)


# ---------------------------------------------------------------- inputs and outputs


@dataclass(slots=True)
class Inputs:
    """Everything a plan depends on.

    system_tokens: the client's system prompt (and tools), forwarded in every case; system_hash
    identifies it for the cost model. state_block, state_tokens: the project state already wrapped
    with `templates.state` ("" for none). count: token counter for the texts built here (messages
    carry their own counts). whole: the client sent its whole history (not a delta client), so a
    `full` plan forwards the client's body. The rest is the cost model's: the request's chain
    hashes, the tokens of its new turns, what the conversation forwarded last (`last`, None when
    unknown), the clock, the provider's prices, and the client's body as sent (`raw`: whether the
    provider caches the full history may depend on it).
    """

    dialect: Dialect
    history: History
    system_tokens: int
    state_block: str
    state_tokens: int
    settings: MemorySettings
    context_budget: int
    count: Callable[[str], int]
    whole: bool = True
    system_hash: str = ""
    chains: Sequence[str] = ()
    new_tokens: int = 0
    last: cost.Forwarded | None = None
    now: float = 0.0
    prices: cost.Prices = cost.DEFAULT_PRICES
    raw: bytes = b""
    cacheable: bool | None = None  # dialect.caches_full_history(raw), when the caller read it already
    held_window: int = 0  # tokens of the window a held fold (keep_layers) would have summarised
    context_window: int = 0  # the model's whole window (context_budget is the gateway's share of it); 0: unknown


@dataclass(frozen=True, slots=True)
class Wanted:
    """Excerpts wanted for a window starting at `window_start`: messages before it, after the head,
    recalled for the text of `query` (with the `recent` texts as context). The block holds `budget`
    tokens; the search fills `search_budget` (a share of the history, less the block's heading)."""

    window_start: int
    budget: int
    search_budget: int
    query: Message
    recent: list[str]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The plan, and what it forwards as far as prompt caching is concerned (None when refused)."""

    plan: Plan
    forwarded: cost.Forwarded | None

    @property
    def refused(self) -> bool:
        return self.forwarded is None


@dataclass(slots=True)
class _Layout:
    """One candidate request: where the window starts, how much head, which layers."""

    start: int  # absolute position of the window's first message
    head_end: int  # messages [0, head_end) go as the head
    state: bool
    summary: bool


@dataclass(frozen=True, slots=True)
class _Layers:
    """The layered plan before excerpts: `plan` is it without them; `finish(picked)` places the
    recalled messages `picked` (when excerpts are wanted at all: `budget` tokens for a window
    starting at `window_start`)."""

    plan: Plan
    window_start: int = 0
    budget: int = 0
    finish: Callable[[Sequence[tuple[int, Message]]], Plan] | None = None
    pins: Callable[[Plan], Pins | None] = lambda plan: None  # what a rewrite leaves for the next request


class Draft:
    """A plan waiting for its excerpts: `wants` says which, `finish(picked)` gives the Outcome."""

    __slots__ = ("_inputs", "_layers", "_weigh_full", "wants")

    def __init__(self, inputs: Inputs, layers: _Layers, weigh_full: bool, wants: Wanted | None) -> None:
        self._inputs, self._layers, self._weigh_full, self.wants = inputs, layers, weigh_full, wants

    @property
    def inputs(self) -> Inputs:
        """What the plan was made from (the kept layers' inputs, when plan() chose those)."""
        return self._inputs

    @property
    def plan(self) -> Plan:
        """The layered plan as it stands without excerpts."""
        return self._layers.plan

    def finish(self, picked: Sequence[tuple[int, Message]] = ()) -> Outcome:
        """The plan with the recalled (position, Message) pairs `picked`, in the order retrieval gives
        them (ignored unless `wants`); refused when too large; swapped for the full history when that
        is cheaper."""
        inp, layers = self._inputs, self._layers
        plan = layers.finish(picked) if self.wants is not None and layers.finish is not None else layers.plan
        if plan.tokens_forwarded > inp.context_budget:
            h = inp.history
            if not inp.whole or (inp.context_window and plan.tokens_original > inp.context_window):
                # A delta client's history is only in the store; a request over the model's whole window
                # would only come back refused by the provider.
                return Outcome(replace(plan, reason=TOO_LARGE), None)
            # Past the gateway's budget (budget_ratio of the window, less the output) even when cut to
            # the newest turn, but within the window: the client's own request goes as it came, for
            # the provider to judge.
            whole = _full_plan(h.head, h.tail, h.tail_start, plan.tokens_original, TOO_LARGE)
            return Outcome(whole, cost.full_record((inp.system_hash, inp.system_tokens), inp.chains, h.total_tokens,
                                                   h.tail[-1].tokens if h.tail else 0, inp.now))
        items = _rewrite_items(inp, plan) if plan.kind == "rewritten" else None
        rate = inp.last.excerpt_rate if inp.last is not None else None
        block = items[2] - inp.new_tokens if items is not None and plan.excerpts_block else 0
        if self.wants is not None and items is not None:
            # What later turns will write is judged by what this conversation's searched turns
            # wrote so far, starting from the worst case (each fills what the search may fill) so
            # that a few turns that recalled nothing do not tip a cached full history into a rewrite
            # whose later excerpts cost more than the history (a chat of short messages did).
            prior = float(self.wants.search_budget) if rate is None else rate
            rate = prior + EXCERPT_RATE_WEIGHT * (block - prior)
        if items is not None and self._weigh_full:
            later = 0  # no record of the conversation: this turn alone
            if self.wants is not None and inp.last is not None and rate is not None:
                later = max(-block, round(rate) - block)
            plan = _cheaper(inp, plan, items, later)
        if plan.kind == "rewritten" and items is not None:
            record = cost.Forwarded(False, tuple(items[0]), tuple(items[1]), inp.now, pins=layers.pins(plan),
                                    excerpt_rate=rate)
        else:
            h = inp.history
            record = cost.full_record((inp.system_hash, inp.system_tokens), inp.chains, h.total_tokens,
                                      h.tail[-1].tokens if h.tail else 0, inp.now, rate)
        return Outcome(plan, record)


# ---------------------------------------------------------------- the plan


def plan(inputs: Inputs, kept: Inputs | None = None) -> Draft:
    """The plan for one request, up to its excerpts (see Draft).

    kind "full": forward the whole conversation as is; only chosen when it is all at hand
    (tail_start == 0 or the head reaches the tail), and plan.window then holds all of it, so a delta
    client's request can be rendered from it. kind "rewritten": render the plan. A plan whose
    reason is TOO_LARGE costs more than the context budget even with the newest turn alone: the
    caller sends the client's own request instead, or refuses it: a delta client's (the rest of its
    history is the store's) or one over the model's whole window (`Inputs.context_window`).

    kept: the same request on the layers the provider has cached (a finished fold not applied
    yet), planned instead of `inputs` when `keep_layers` says so.
    """
    layers = _layers(inputs)
    # A held fold's request searches as the applied fold's would (before the applied window's start):
    # what it finds in its own longer window is there already, so keeping the cached layers never
    # forwards less of the past than applying the fold would.
    search_from = layers.window_start if layers.finish is not None else None
    if kept is not None:
        held = _layers(kept)
        if keep_layers(inputs, kept, layers.plan, held.plan, layers.budget):
            inputs, layers = kept, held
    mem, h = inputs.settings, inputs.history
    # The full history is weighed against the rewrite only when it could be forwarded instead.
    weigh_full = (inputs.whole and mem.policy == "cost"
                  and h.total_tokens + inputs.system_tokens <= inputs.context_budget)
    wants = None
    # Excerpts only add to a rewrite's bill: when the full history already costs less than the
    # rewrite without them, it is what gets forwarded, and the search is not needed.
    if layers.finish is not None and (not weigh_full or rewrite_may_win(inputs, layers.plan)):
        tail = h.tail
        query = next((t for t in reversed(tail) if inputs.dialect.is_turn_start(t.raw)), tail[-1] if tail else None)
        # Less the block's own heading; each excerpt's header is budgeted by the index.
        search_budget = min(layers.budget, int(mem.retrieval_max_share * h.total_tokens)) - 20
        if query is not None and search_budget > 0:
            start = max(layers.window_start, search_from or 0)
            wants = Wanted(start, layers.budget, search_budget, query, [t.text for t in tail[-6:]])
    return Draft(inputs, layers, weigh_full, wants)


def keep_layers(applied: Inputs, kept: Inputs, a: Plan, k: Plan, excerpt_budget: int) -> bool:
    """Cache-aware folding: forward `kept` (the layers the provider has cached, a finished fold not
    applied yet: the older summary and state, the window from their coverage on) rather than
    `applied` (the fold's new layers)? `a`, `k`: their layered plans before excerpts;
    `excerpt_budget`: what the applied request's excerpts may fill.

    Yes while the kept request is a plain rewrite (within the hard budget, its saving share and
    `hold_cap`) and the reads holding is estimated to have cost are less than what applying would
    bill now. Applying writes the new prefix once (and the pinned excerpts anew); holding reads a
    longer window at every request; a wait may end for free: a cold cache costs both a write, so the
    fold goes in then. The estimate comes from the held part's size, not from a count of the
    requests that held it: it does not grow while one fold is held, so a held fold lasts until the
    next fold, a cold cache, the saving share or `hold_cap` ends it (an exact running count of the
    reads paid is not kept)."""
    prices, last, now = applied.prices, applied.last, applied.now
    if applied.settings.policy != "cost" or last is None or last.full or not cost.warm(last, now, prices):
        return False
    if k.kind != "rewritten" or k.reason != REWRITTEN or a.kind != "rewritten":
        return False
    items_a, tokens_a, _ = _rewrite_items(applied, a)
    items_k, tokens_k, _ = _rewrite_items(kept, k)
    original = applied.history.total_tokens + applied.system_tokens
    if sum(tokens_k) > hold_cap(applied.settings, original, sum(tokens_a), excerpt_budget):
        return False
    # Pins belong to the layout they were quoted in: the applied request starts its excerpts over
    # and writes a whole block (up to its budget), where the kept one reads its pins from the cache
    # and writes only what its question recalls beyond them (this conversation's rate so far).
    rate = last.excerpt_rate
    carried = 0 if rate is None else max(0, min(_pinned_tokens(kept, k), excerpt_budget) - round(rate))
    buy = (cost.billed(items_a, tokens_a, last, now, prices) + prices.write * carried
           - cost.billed(items_k, tokens_k, last, now, prices))
    # The reads paid so far, estimated: each request since the first fold was held read the part held
    # then. That part grew with the conversation to `held_window` tokens over `between` messages, about
    # one request per two, so the reads add up to about a triangle's area. (A fixed horizon instead, the
    # next fold_batch / 2 requests, applied folds too soon: docs/architecture.md, "Held folds".)
    between = applied.history.tail_start - kept.history.tail_start
    rent = prices.read * kept.held_window * between / 4
    return rent < buy


def hold_cap(settings: MemorySettings, original: int, applied_tokens: int, excerpt_budget: int) -> float:
    """Tokens a request holding cached parts (a held fold's window, pinned excerpts) may reach before
    its new excerpts: `hold_max_share` of the full request (`original`, system prompt included),
    never less than the rewrite without them (`applied_tokens`, layers with the fold applied and no
    pins) leaves for a full excerpt budget. At 1.0, no bound (the saving share still applies)."""
    if settings.hold_max_share >= 1.0:
        return math.inf
    return max(int(settings.hold_max_share * original) - excerpt_budget, applied_tokens)


def _pinned_tokens(inputs: Inputs, plan: Plan) -> int:
    """Tokens of the earlier requests' excerpt blocks `plan` keeps at their places."""
    pins = inputs.last.pins if inputs.last is not None and plan.pinned else None
    if pins is None:
        return 0
    texts = {text for _, text in plan.pinned}
    return sum(p.tokens for p in pins.blocks if p.text in texts)


def rewrite_may_win(inputs: Inputs, plan: Plan) -> bool:
    """Does the rewrite `plan` (no excerpts yet) cost less than the full history?"""
    return _cheaper(inputs, plan, _rewrite_items(inputs, plan)) is plan


def _layers(inputs: Inputs) -> _Layers:
    """The layered plan without excerpts, and whether (and where) they are wanted."""
    dialect, settings, h = inputs.dialect, inputs.settings, inputs.history
    head, tail, tail_start, summary = h.head, h.tail, h.tail_start, h.summary
    system_tokens, state_block, count = inputs.system_tokens, inputs.state_block, inputs.count
    context_budget = inputs.context_budget
    n = tail_start + len(tail)
    original = h.total_tokens + system_tokens
    # Without messages [0, tail_start) at hand, "full" could not be rendered for a delta client;
    # a client that sent its whole history can always have its own body forwarded instead.
    full = _full_plan(head, tail, tail_start, original, UNDER_THRESHOLD) if len(head) >= tail_start else None
    fallback = full if full is not None or not inputs.whole else _full_plan(head, tail, tail_start, original,
                                                                            NO_SAVING)
    if (full is not None and not over_thresholds(h.total_messages, h.total_tokens, settings)
            and original <= context_budget):
        return _Layers(full)

    templates = settings.templates
    coverage = summary.covers if summary is not None else 0
    summary_block = ""
    if summary is not None and summary.text:
        summary_block = fill(templates.summary, summary=summary.text, covered=summary.covers)
    state_tokens = inputs.state_tokens if state_block else 0
    summary_tokens = count(summary_block) if summary_block else 0

    raws = [t.raw for t in tail]
    clean = clean_cuts(dialect, raws)
    turn_starts = [i for i in range(len(raws)) if clean[i] and dialect.is_turn_start(raws[i])]
    # No turn start after the coverage (one long agent loop): any clean cut will do.
    starts = turn_starts or [i for i in range(len(raws)) if clean[i]]
    if not starts:
        # The tail opens inside a tool group we cannot see: only the whole body is valid.
        return _Layers(_full_plan(head, tail, tail_start, original, NO_CLEAN_CUT))
    target = min(coverage, n - settings.keep_recent) - tail_start
    start = _initial_start(turn_starts, [i for i in range(len(raws)) if clean[i]], target)

    # The head: contiguous known messages from 0, cut at the last closed prefix <= keep_initial.
    prefix = list(head[: min(len(head), tail_start)])
    if len(prefix) == tail_start:
        prefix.extend(tail)
    prefix = prefix[: settings.keep_initial]
    closed = closed_prefixes(dialect, [t.raw for t in prefix])
    head_len = max(p for p in range(len(prefix) + 1) if closed[p])
    head_cum = [0]
    for t in prefix[:head_len]:
        head_cum.append(head_cum[-1] + t.tokens)
    window_cum = [0] * (len(tail) + 1)  # window_cum[i]: tokens of tail[i:]
    for i in range(len(tail) - 1, -1, -1):
        window_cum[i] = window_cum[i + 1] + tail[i].tokens

    def marker(lay: _Layout) -> str:
        covered = coverage if lay.summary and summary_block else 0
        skipped = lay.start - max(covered, lay.head_end)
        return fill(templates.omitted, count=skipped) if skipped > 0 else ""

    def size(lay: _Layout) -> int:
        m = marker(lay)
        return (system_tokens + (state_tokens if lay.state else 0) + (summary_tokens if lay.summary else 0)
                + head_cum[lay.head_end] + (count(m) if m else 0) + window_cum[lay.start - tail_start])

    def layout(rel_start: int, *, keep_head: bool = True, state: bool = True, summ: bool = True) -> _Layout:
        s = tail_start + rel_start
        return _Layout(start=s, head_end=min(head_len, s) if keep_head else 0, state=state, summary=summ)

    lay = layout(start)
    forced = size(lay) > context_budget
    if forced and fallback is not None and original <= context_budget:
        # The layers outgrow the context while the history fits it (an edited summary far longer than
        # what it covers): cutting the window to make room for them would forward less than the client sent.
        return _Layers(replace(fallback, reason=NO_SAVING))
    if forced:
        lay = _fit(start, [s for s in starts if s > start], layout, size, context_budget)

    # A rewrite must save min_saving_share of the original when the original could go instead.
    ceiling = original - max(1, int(settings.min_saving_share * original)) if fallback is not None else None
    # A held fold's longer window is not taken out of the excerpts: they get what the applied fold gives.
    target = excerpt_budget(settings, h.total_tokens, size(lay) - inputs.held_window, context_budget)
    layers_key = _digest("\x1f".join((state_block if lay.state else "", summary_block if lay.summary else "",
                                      str(lay.head_end), marker(lay))))
    budget = min(target, context_budget - size(lay))
    if ceiling is not None:
        budget = min(budget, ceiling - size(lay))
    kept = _kept_pins(inputs.last, layers_key, lay.start, tail, tail_start, forced)
    # Pins are read from the provider's cache at a fraction of the price. They never take the room
    # of new excerpts: they stay while the request with them and a full excerpt budget still fits
    # and saves, up to pin_cap() excerpt budgets, then all go at once.
    held = sum(p.tokens for p in kept)
    room = min(context_budget, ceiling) if ceiling is not None else context_budget
    # A cold cache bills every pin as a fresh write: nothing is saved by keeping them, and the
    # question's own search quotes again whichever of them it still needs.
    if kept and (held > pin_cap(inputs.prices) * target or size(lay) + held + max(budget, 0) > room
                 or size(lay) + held > hold_cap(settings, original, size(lay) - inputs.held_window, max(budget, 0))
                 or not cost.warm(inputs.last, inputs.now, inputs.prices)):
        kept, held = (), 0
    last_pins = inputs.last.pins if inputs.last is not None else None
    pinned_at: Mapping[int, int] = {}
    if kept and last_pins is not None:
        # All of the last request's blocks share its merged positions; a part merges its own.
        pinned_at = (last_pins.quoted if len(kept) == len(last_pins.blocks)
                     else {pos: n for p in kept for pos, n in p.quoted})

    def rewrite(excerpts: str, forwarded: int) -> Plan:
        return Plan(
            kind="rewritten",
            state_block=state_block if lay.state else "",
            summary_block=summary_block if lay.summary else "",
            head=[t.raw for t in prefix[: lay.head_end]],
            omitted_marker=marker(lay),
            window=raws[lay.start - tail_start:],
            excerpts_block=excerpts,
            tokens_original=original,
            tokens_forwarded=forwarded,
            urgent_fold=forced,
            reason=OVER_BUDGET if forced else REWRITTEN,
            pinned=[(p.at - lay.start, p.text) for p in kept],
        )

    quoted: list[tuple[int, int]] = []  # what this request's own block quotes, for its pin
    block = [0]  # and its tokens (counted once: a block of thousands of tokens takes milliseconds)

    def finish(picked: Sequence[tuple[int, Message]]) -> Plan:
        # Pinned quotes this question recalls count against its budget, in rank order: a conversation
        # that keeps to its topic re-reads its excerpts from the cache instead of writing new ones.
        excerpts, chosen = _excerpts(picked, lay, budget, templates.excerpts, count, pinned_at) if picked else ("", [])
        quoted[:] = chosen
        block[0] = count(excerpts) if excerpts else 0
        forwarded = size(lay) + held + block[0]
        if not forced and excerpts and ceiling is not None and forwarded > ceiling:
            excerpts, forwarded = "", size(lay) + held
            quoted.clear()
        # (Never when forced by the hard budget: a history that fits it went as sent above.)
        if ceiling is not None and forwarded > ceiling and fallback is not None and not forced:
            # A rewrite must save something, or the provider's cache of the full body wins. A summary
            # of a short head can outweigh the messages it covers: then the client's body goes as sent.
            # Before the first fold has covered anything, that is why, not the threshold.
            return replace(fallback, reason=SUMMARY_PENDING if coverage == 0 else NO_SAVING)
        return rewrite(excerpts, forwarded)

    def pins(plan: Plan) -> Pins | None:
        blocks = list(kept)
        newest = next((i for i in range(len(tail) - 1, -1, -1) if dialect.is_turn_start(tail[i].raw)), None)
        if plan.excerpts_block and quoted and newest is not None:
            at = tail_start + newest
            blocks.append(Pin(at, tail[newest].hash, plan.excerpts_block, block[0], tuple(quoted),
                              _digest(plan.excerpts_block)))
            return Pins(layers_key, lay.start, tuple(blocks), {**pinned_at, **dict(quoted)})
        return Pins(layers_key, lay.start, tuple(blocks), pinned_at) if blocks else None

    # Excerpts only add tokens: a layout that saves nothing without them goes full with them too.
    wanted = (settings.retrieval.enabled and budget > 0 and lay.start > lay.head_end and not forced
              and (ceiling is None or size(lay) + held <= ceiling))
    if wanted:
        return _Layers(finish(()), lay.start, budget, finish, pins)
    return _Layers(finish(()), pins=pins)


def _full_plan(head: Sequence[Message], tail: Sequence[Message], tail_start: int, original: int, reason: str) -> Plan:
    known = [t.raw for t in tail]
    if len(head) >= tail_start:
        known = [t.raw for t in head[:tail_start]] + known  # the whole conversation is at hand
    return Plan(kind="full", state_block="", summary_block="", head=[], omitted_marker="", window=known,
                excerpts_block="", tokens_original=original, tokens_forwarded=original, reason=reason)


# ---------------------------------------------------------------- the prompt-cache cost choice


def _digest(text: str) -> str:
    return blake2b(text.encode(), digest_size=12).hexdigest()


def _rewrite_items(inputs: Inputs, plan: Plan) -> tuple[list[str], list[int], int]:
    """The rewritten request as prompt-cache items, and its volatile tokens (excerpts onwards)."""
    h, summary = inputs.history, inputs.history.summary
    tail = h.tail
    window = tail[len(tail) - len(plan.window):] if plan.window else []
    blocks = plan.state_block + "\x1f" + plan.summary_block
    block_tokens = (summary.tokens if summary is not None and plan.summary_block else 0)
    block_tokens += inputs.state_tokens if plan.state_block else 0
    head = h.stored_head[: len(plan.head)]
    items = [inputs.system_hash, _digest(blocks)] + [t.hash for t in head]
    tokens = [inputs.system_tokens, block_tokens] + [t.tokens for t in head]
    if plan.omitted_marker:
        items.append(_digest(plan.omitted_marker))
        tokens.append(8)
    dialect = inputs.dialect
    cut = next((i for i in range(len(window) - 1, -1, -1) if dialect.is_turn_start(window[i].raw)), len(window))
    pins = inputs.last.pins if inputs.last is not None and plan.pinned else None
    # (plan.pinned: the leading blocks of the last request's that this plan keeps.)
    # A message may have more than one block before it: a retried turn keeps its pin and adds another.
    pinned: dict[int, list[Pin]] = {}
    for p in pins.blocks[:len(plan.pinned)] if pins is not None else ():
        pinned.setdefault(p.at, []).append(p)
    start = inputs.history.total_messages - len(window)
    for i, t in enumerate(window[:cut]):
        for pin in pinned.get(start + i, ()):
            items.append(pin.digest)
            tokens.append(pin.tokens)
        items.append(t.hash)
        tokens.append(t.tokens)
    for pin in pinned.get(start + cut, ()):  # pins before the newest turn itself (that turn sent again)
        items.append(pin.digest)
        tokens.append(pin.tokens)
    stable = sum(tokens)
    excerpts = max(plan.tokens_forwarded - stable - sum(t.tokens for t in window[cut:]), 0)
    if plan.excerpts_block:
        items.append(_digest(plan.excerpts_block))
        tokens.append(excerpts)
    items += [t.hash for t in window[cut:]]
    tokens += [t.tokens for t in window[cut:]]
    return items, tokens, excerpts + sum(t.tokens for t in window[cut:])


def _cheaper(inputs: Inputs, plan: Plan, rewrite: tuple[list[str], list[int], int], later_excerpts: int = 0) -> Plan:
    """The rewrite, unless the full history would be billed less once prompt caching counts.

    Compared over the next `fold_batch / 2` requests: switching to the rewrite pays one cold write
    that later requests must earn back (cost.choose); each of those writes `later_excerpts` tokens
    of excerpts more than this one."""
    h, prices, last, now = inputs.history, inputs.prices, inputs.last, inputs.now
    cacheable = inputs.dialect.caches_full_history(inputs.raw) if inputs.cacheable is None else inputs.cacheable
    full_now = cost.billed_full((inputs.system_hash, inputs.system_tokens), h.total_tokens, inputs.chains, last,
                                now, prices, cacheable=cacheable)
    items, tokens, volatile = rewrite
    choice = cost.choose(
        full_now=full_now, rewrite_now=cost.billed(items, tokens, last, now, prices),
        full_total=inputs.system_tokens + h.total_tokens, rewrite_total=sum(tokens),
        new=2 * inputs.new_tokens, volatile=volatile, later_excerpts=later_excerpts,
        prices=prices, horizon=max(2, inputs.settings.fold_batch // 2), full_cacheable=cacheable)
    if not choice.full:
        return plan
    return Plan(kind="full", state_block="", summary_block="", head=[], omitted_marker="",
                window=[t.raw for t in h.tail], excerpts_block="", tokens_original=plan.tokens_original,
                tokens_forwarded=plan.tokens_original, reason=CHEAPER_CACHED)


# ---------------------------------------------------------------- layout helpers


def _initial_start(turn_starts: list[int], cuts: list[int], target: int) -> int:
    """Window start (index into the tail) for `target`: a turn start at or before it, else any
    clean cut at or before it (no message lost), else the first turn start or cut after it."""
    for group in (turn_starts, cuts):
        before = [s for s in group if s <= target]
        if before:
            return before[-1]
    for group in (turn_starts, cuts):
        after = [s for s in group if s > target]
        if after:
            return after[0]
    return cuts[0]


def _fit(
    current: int,
    later: list[int],
    layout: Callable[..., _Layout],
    size: Callable[[_Layout], int],
    budget: int,
) -> _Layout:
    """Drop the oldest window groups until the request fits; then the head, the state, the
    summary. The newest turn always stays; what still does not fit is returned as the smallest
    plan (its size above the budget tells the caller to refuse the request).

    current, later: the window start and the later possible starts, as indices into the tail."""
    # Cost falls as the window starts later: bisect, then step over the rare non-monotone spot
    # (a marker whose count gains a digit).
    lo, hi = 0, len(later)
    while lo < hi:
        mid = (lo + hi) // 2
        if size(layout(later[mid])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    for s in later[lo:]:
        cand = layout(s)
        if size(cand) <= budget:
            return cand
    newest = later[-1] if later else current
    for cand in (layout(newest, keep_head=False),
                 layout(newest, keep_head=False, state=False)):
        if size(cand) <= budget:
            return cand
    return layout(newest, keep_head=False, state=False, summ=False)


def _kept_pins(last: cost.Forwarded | None, layers: str, start: int, tail: Sequence[Message], tail_start: int,
               forced: bool) -> tuple[Pin, ...]:
    """The excerpt blocks the previous request placed, when this one keeps its layers and window
    start: those up to the first whose place no longer holds the message it was placed before. A
    request that changes its last turn (edited, regenerated, a question off the record) keeps the
    cached blocks before it; only the ones at and after the change go."""
    pins = last.pins if last is not None else None
    if forced or pins is None or pins.layers != layers or pins.start != start:
        return ()
    for n, p in enumerate(pins.blocks):
        i = p.at - tail_start
        if not (start <= p.at and i < len(tail)) or tail[i].hash != p.hash:
            return pins.blocks[:n]
    return pins.blocks


def _excerpts(
    picked: Sequence[tuple[int, Message]],
    lay: _Layout,
    budget: int,
    template: str,
    count: Callable[[str], int],
    pinned: Mapping[int, int] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render recalled messages outside the head and window, taken in the order given until the
    budget is spent, then in conversation order (how a reader follows them); with the (position,
    tokens) of those it quotes. `pinned`: positions an earlier block already quotes, with their
    tokens: they take their share of the budget where they come, and are not quoted again."""
    seen: set[int] = set()
    chosen: list[tuple[int, str, int]] = []
    spent = count(fill(template, excerpts=""))
    for pos, turn in picked:
        if pos in seen or not lay.head_end <= pos < lay.start or not turn.text:
            continue
        seen.add(pos)
        if pinned and pos in pinned:
            spent += pinned[pos]
            continue
        when = f", {turn.time}" if turn.time else ""
        header = f"[message {pos}, {turn.role}{when}]\n"
        # The text's count is the stored one (counted once, when the turn arrived) and includes
        # the per-message overhead, which covers the joins: re-tokenising a block of thousands of
        # tokens on every request would cost milliseconds.
        needs = count(header) + max(turn.tokens, 1)
        if spent + needs > budget:
            continue  # a smaller, less relevant one may still fit
        spent += needs
        chosen.append((pos, header + turn.text, needs))
    if not chosen:
        return "", []
    chosen.sort()
    return fill(template, excerpts="\n\n".join(e for _, e, _ in chosen)), [(pos, n) for pos, _, n in chosen]
