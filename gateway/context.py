"""The rewrite rules, in one place: when to rewrite, where the window starts, what the budget drops.

Positions are indices in the logical conversation (the client's history without its leading system
prompt). A *cut* at position p lies between messages p-1 and p; it is *clean* when no tool-call group
crosses it (a call opened before p and answered at or after p, or an item bound to its successor,
such as a Responses reasoning item). A window starts at a clean cut that is a turn start; the head
ends at a clean cut. Everything here is pure: the caller (memory.py) loads, counts and renders.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import MemorySettings
from gateway.model import Plan, Summary, Turn
from gateway.shape import Shape

Recall = Callable[[int, int], Sequence[tuple[int, Turn]]]

_FIELD = re.compile(r"\{(\w+)\}")


def fill(template: str, **values: object) -> str:
    """`template` with `{name}` replaced in one pass: text that itself contains `{summary}` or
    braces (code, JSON) is never re-expanded, and unknown fields stay as written."""
    return _FIELD.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), template)


def clean_cuts(shape: Shape, raws: Sequence[dict]) -> list[bool]:
    """clean[c] for c in 0..len(raws): no tool group crosses the cut before raws[c].

    A result whose call is not in `raws` was opened before the slice, so every cut up to it is
    crossed. One pass with a difference array: O(n).
    """
    n = len(raws)
    diff = [0] * (n + 2)
    opened: dict[str, int] = {}
    for j, raw in enumerate(raws):
        for cid in shape.tool_results(raw):
            diff[opened.get(cid, -1) + 1] += 1
            diff[j + 1] -= 1
        for cid in shape.tool_calls(raw):
            opened[cid] = j
        if shape.binds_next(raw):
            diff[j + 1] += 1
            diff[j + 2] -= 1
    clean = []
    depth = 0
    for c in range(n + 1):
        depth += diff[c]
        clean.append(depth == 0)
    return clean


def closed_prefixes(shape: Shape, raws: Sequence[dict]) -> list[bool]:
    """closed[p] for p in 0..len(raws): raws[:p] leaves no call unanswered and no item waiting
    for its successor, whatever follows. Used for the head, whose continuation may not be loaded."""
    closed = [True]
    pending: set[str] = set()
    for raw in raws:
        pending.difference_update(shape.tool_results(raw))
        pending.update(shape.tool_calls(raw))
        closed.append(not pending and not shape.binds_next(raw))
    return closed


def align_boundary(shape: Shape, raws: Sequence[dict], offset: int, target: int) -> int:
    """The largest position p <= target (p = offset + index into raws) such that raws[p - offset]
    is a turn start and no tool group crosses p; `offset` when there is none."""
    clean = clean_cuts(shape, raws)
    for i in range(min(target - offset, len(raws) - 1), -1, -1):
        if clean[i] and shape.is_turn_start(raws[i]):
            return offset + i
    return offset


@dataclass(slots=True)
class _Layout:
    """One candidate request: where the window starts, how much head, which layers."""

    start: int  # absolute position of the window's first message
    head_end: int  # messages [0, head_end) go as the head
    state: bool
    summary: bool


@dataclass(frozen=True, slots=True)
class Draft:
    """A plan before excerpts. `plan` is what goes out without them; when `finish` is set, excerpts
    are wanted for a window starting at `window_start`, within `budget` tokens, and
    `finish(picked)` is the plan with the recalled messages `picked` (see build_plan's `recall`)."""

    plan: Plan
    window_start: int = 0
    budget: int = 0
    finish: Callable[[Sequence[tuple[int, Turn]]], Plan] | None = None


def build_plan(
    shape: Shape,
    *,
    head: Sequence[Turn],
    tail: Sequence[Turn],
    tail_start: int,
    total_messages: int,
    total_tokens: int,
    system_tokens: int,
    summary: Summary | None,
    state_block: str,
    state_tokens: int,
    settings: MemorySettings,
    context_budget: int,
    count: Callable[[str], int],
    recall: Recall | None = None,
    worth_recalling: Callable[[Plan], bool] | None = None,
) -> Plan:
    """The plan for one request.

    head: the first stored messages (at least `keep_initial` of them when the conversation has
      that many; more are ignored). tail: messages [tail_start, end) of the logical conversation,
      ending with the newest turn; tail_start is normally the summary's coverage (0 without one).
    total_messages, total_tokens: messages and tokens of the whole logical conversation (what
      sending it whole costs; total_messages == tail_start + len(tail)); system_tokens: the client's
      system prompt (and tools), forwarded in every case.
    state_block, state_tokens: the project state already wrapped with `templates.state` ("" for
      none) and its token count. The summary block is built here from `summary`.
    context_budget: budget_ratio x context window - max output tokens (computed by the caller).
    count: token counter for the injected texts (messages use Turn.tokens).
    recall(window_start, budget_tokens): earlier (position, Turn) pairs picked by retrieval, most
      relevant first; None or `retrieval.enabled: false` turns excerpts off.
    worth_recalling(plan): asked before recall with the rewrite as it stands without excerpts;
      False leaves excerpts out (the caller knows it will forward the full history instead, which
      excerpts, adding tokens, could only make more certain).

    kind "full": forward the whole conversation as is; only chosen when it is all at hand
    (tail_start == 0 or `head` reaches the tail), and plan.window then holds all of it, so a delta
    client's request can be rendered from it. kind "rewritten": render the plan.
    `tokens_forwarded > context_budget` means even the newest turn alone does not fit: the caller
    rejects the request rather than send it.

    In two steps (`draft_plan`, then `Draft.finish`) for a caller that prepares the search only
    when excerpts are wanted.
    """
    draft = draft_plan(
        shape, head=head, tail=tail, tail_start=tail_start, total_messages=total_messages,
        total_tokens=total_tokens, system_tokens=system_tokens, summary=summary, state_block=state_block,
        state_tokens=state_tokens, settings=settings, context_budget=context_budget, count=count)
    if recall is None or draft.finish is None or (worth_recalling is not None and not worth_recalling(draft.plan)):
        return draft.plan
    return draft.finish(recall(draft.window_start, draft.budget))


def over_thresholds(messages: int, tokens: int, settings: MemorySettings) -> bool:
    """Whether a conversation this long is rewritten: under both thresholds it goes upstream whole."""
    return messages >= settings.message_threshold or tokens >= settings.token_threshold


def draft_plan(
    shape: Shape,
    *,
    head: Sequence[Turn],
    tail: Sequence[Turn],
    tail_start: int,
    total_messages: int,
    total_tokens: int,
    system_tokens: int,
    summary: Summary | None,
    state_block: str,
    state_tokens: int,
    settings: MemorySettings,
    context_budget: int,
    count: Callable[[str], int],
) -> Draft:
    """build_plan up to the excerpts: the plan without them, and whether (and where) they are wanted."""
    n = tail_start + len(tail)
    original = total_tokens + system_tokens
    # Without messages [0, tail_start) at hand, "full" could not be rendered for a delta client.
    full = _full_plan(head, tail, tail_start, original) if len(head) >= tail_start else None
    if full is not None and not over_thresholds(total_messages, total_tokens, settings) and original <= context_budget:
        return Draft(full)

    templates = settings.templates
    coverage = summary.covers if summary is not None else 0
    summary_block = ""
    if summary is not None and summary.text:
        summary_block = fill(templates.summary, summary=summary.text, covered=summary.covers)
    state_tokens = state_tokens if state_block else 0
    summary_tokens = count(summary_block) if summary_block else 0

    raws = [t.raw for t in tail]
    clean = clean_cuts(shape, raws)
    turn_starts = [i for i in range(len(raws)) if clean[i] and shape.is_turn_start(raws[i])]
    # No turn start after the coverage (one long agent loop): any clean cut will do.
    starts = turn_starts or [i for i in range(len(raws)) if clean[i]]
    if not starts:
        # The tail opens inside a tool group we cannot see: only the whole body is valid.
        return Draft(full if full is not None else _full_plan(head, tail, tail_start, original))
    target = min(coverage, n - settings.keep_recent) - tail_start
    start = _initial_start(turn_starts, [i for i in range(len(raws)) if clean[i]], target)

    # The head: contiguous known messages from 0, cut at the last closed prefix <= keep_initial.
    prefix = list(head[: min(len(head), tail_start)])
    if len(prefix) == tail_start:
        prefix.extend(tail)
    prefix = prefix[: settings.keep_initial]
    closed = closed_prefixes(shape, [t.raw for t in prefix])
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

    def cost(lay: _Layout) -> int:
        m = marker(lay)
        return (system_tokens + (state_tokens if lay.state else 0) + (summary_tokens if lay.summary else 0)
                + head_cum[lay.head_end] + (count(m) if m else 0) + window_cum[lay.start - tail_start])

    def layout(rel_start: int, *, keep_head: bool = True, state: bool = True, summ: bool = True) -> _Layout:
        s = tail_start + rel_start
        return _Layout(start=s, head_end=min(head_len, s) if keep_head else 0, state=state, summary=summ)

    lay = layout(start)
    forced = cost(lay) > context_budget
    if forced:
        lay = _fit(start, [s for s in starts if s > start], layout, cost, context_budget)

    spare = context_budget - cost(lay)
    budget = min(settings.retrieval_budget_tokens, spare)

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
        )

    def finish(picked: Sequence[tuple[int, Turn]]) -> Plan:
        excerpts = _excerpts(picked, lay, budget, templates.excerpts, count) if picked else ""
        forwarded = cost(lay) + (count(excerpts) if excerpts else 0)
        if not forced and excerpts and forwarded >= original:
            excerpts, forwarded = "", cost(lay)
        if not forced and forwarded >= original and full is not None:
            return full  # a rewrite must save something, or the provider's cache of the full body wins
        return rewrite(excerpts, forwarded)

    # Excerpts only add tokens: a layout that saves nothing without them goes full with them too.
    wanted = (settings.retrieval.enabled and budget > 0 and lay.start > lay.head_end and not forced
              and (cost(lay) < original or full is None))
    return Draft(finish(()), lay.start, budget, finish) if wanted else Draft(finish(()))


def _full_plan(head: Sequence[Turn], tail: Sequence[Turn], tail_start: int, original: int) -> Plan:
    known = [t.raw for t in tail]
    if len(head) >= tail_start:
        known = [t.raw for t in head[:tail_start]] + known  # the whole conversation is at hand
    return Plan(kind="full", state_block="", summary_block="", head=[], omitted_marker="", window=known,
                excerpts_block="", tokens_original=original, tokens_forwarded=original)


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
    cost: Callable[[_Layout], int],
    budget: int,
) -> _Layout:
    """Drop the oldest window groups until the request fits; then the head, the state, the
    summary. The newest turn always stays; what still does not fit is returned as the smallest
    plan (its cost above the budget tells the caller to refuse the request).

    current, later: the window start and the later possible starts, as indices into the tail."""
    # Cost falls as the window starts later: bisect, then step over the rare non-monotone spot
    # (a marker whose count gains a digit).
    lo, hi = 0, len(later)
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(layout(later[mid])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    for s in later[lo:]:
        cand = layout(s)
        if cost(cand) <= budget:
            return cand
    newest = later[-1] if later else current
    for cand in (layout(newest, keep_head=False),
                 layout(newest, keep_head=False, state=False)):
        if cost(cand) <= budget:
            return cand
    return layout(newest, keep_head=False, state=False, summ=False)


def _excerpts(
    picked: Sequence[tuple[int, Turn]],
    lay: _Layout,
    budget: int,
    template: str,
    count: Callable[[str], int],
) -> str:
    """Render recalled messages outside the head and window, most relevant first until the budget
    is spent, then in conversation order (how a reader follows them)."""
    seen: set[int] = set()
    chosen: list[tuple[int, str]] = []
    spent = count(fill(template, excerpts=""))
    for pos, turn in picked:
        if pos in seen or not lay.head_end <= pos < lay.start or not turn.text:
            continue
        seen.add(pos)
        when = f", {turn.time}" if turn.time else ""
        header = f"[message {pos}, {turn.role}{when}]\n"
        # The text's count is the stored one (counted once, when the turn arrived) and includes
        # the per-message overhead, which covers the joins: re-tokenising a block of thousands of
        # tokens on every request would cost milliseconds.
        cost = count(header) + max(turn.tokens, 1)
        if spent + cost > budget:
            continue  # a smaller, less relevant one may still fit
        spent += cost
        chosen.append((pos, header + turn.text))
    if not chosen:
        return ""
    chosen.sort()
    return fill(template, excerpts="\n\n".join(e for _, e in chosen))
