"""Folding: which messages a fold takes, chunking, and the summary's length cap.

A fold turns (previous summary, messages that aged out of the window since) into a new summary:
it never re-reads the whole history. Everything here is plain computation; the summarizer that
does the actual writing is passed in (`Summarizer` protocol), so the pipeline is tested without
HTTP or Redis.

Summary text layout: plain lines while it fits its cap. Over the cap, the OLDEST part is
re-compressed into a higher-level section rather than cut:

    Earlier:
    <compressed older summary>

    Recent:
    <the newest lines, verbatim>

A later fold rewrites only the Recent section (with the new messages); Earlier changes only when
the cap forces another compression.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Protocol, TypeVar

from gateway import timeline
from gateway.dialects.base import Dialect
from gateway.model import Message
from gateway.rewrite import align_boundary
from gateway.state import Ledger

Count = Callable[[str], int]
T = TypeVar("T")
EARLIER = "Earlier:"
RECENT = "Recent:"


@dataclass(slots=True)
class SummaryResult:
    text: str
    tokens_in: int = 0
    tokens_out: int = 0


class Summarizer(Protocol):
    name: str  # "llm" | "extractive"
    count: Count
    budget_tokens: int  # most input tokens one call may take (chunks are cut to fit)
    local: bool  # CPU only, its coroutines never wait: a fold of it can run whole in a thread (run_local)

    async def summarize(self, previous: str, turns: Sequence[Message], start: int, *,
                        max_tokens: int) -> SummaryResult:
        """The summary of (previous summary, turns [start, start+len)) within max_tokens."""
        ...

    async def compress(self, text: str, *, max_tokens: int) -> SummaryResult:
        """A shorter, higher-level version of `text` within max_tokens, keeping durable facts."""
        ...

    async def update_state(self, ledger: Ledger, turns: Sequence[Message], start: int, *,
                           now: str | None = None) -> tuple[Ledger, int, int]:
        """The project state with what turns [start, start+len) establish; tokens in and out."""
        ...

    async def close(self) -> None: ...


# -- trigger ----------------------------------------------------------------------------------

def should_fold(*, length: int, covers: int, keep_recent: int, fold_batch: int,
                aged_tokens: int | None = None, fold_tokens: int | None = None) -> bool:
    """Cheap check after a recorded turn: enough messages (or tokens) aged out since the last fold."""
    aged = length - keep_recent - covers
    if aged <= 0:
        return False
    if aged >= fold_batch:
        return True
    return aged_tokens is not None and fold_tokens is not None and aged_tokens >= fold_tokens


def fold_target(dialect: object, turns: Sequence[Message], start: int, *, keep_recent: int, fold_batch: int,
                fold_tokens: int, urgent: bool = False) -> int | None:
    """The new coverage end for a fold over messages [start, start+len(turns)), or None: no fold now.

    `turns` are the messages after the current summary (`start` = its coverage). Everything but the
    newest `keep_recent` messages has aged out; a fold is due when those reach `fold_batch` messages
    or `fold_tokens` tokens, or at once when `urgent` (the hard budget was hit). The end is moved
    back to a turn start with no tool group split (`rewrite.align_boundary`, the request path's rule), so the window the
    request path keeps always begins with a whole turn.
    """
    length = start + len(turns)
    end = length - keep_recent
    aged = end - start
    if aged <= 0:
        return None
    aged_tokens = sum(t.tokens for t in turns[:aged])
    if not (urgent or aged >= fold_batch or aged_tokens >= fold_tokens):
        return None
    target = align_boundary(dialect, [t.raw for t in turns], start, end)  # type: ignore[arg-type]
    return target if target > start else None


# -- chunking ---------------------------------------------------------------------------------

def chunk_turns(turns: Sequence[Message], budget_tokens: int) -> list[list[Message]]:
    """Consecutive groups whose tokens fit `budget_tokens` (a larger single message is its own group)."""
    chunks: list[list[Message]] = []
    current: list[Message] = []
    used = 0
    for turn in turns:
        if current and used + turn.tokens > budget_tokens:
            chunks.append(current)
            current, used = [], 0
        current.append(turn)
        used += turn.tokens
    if current:
        chunks.append(current)
    return chunks


def remembering(count: Count, size: int = 4096) -> Count:
    """`count` with a memory of the last `size` texts it counted.

    A summary's lines are counted again at every fold (the cap splits Recent into units, the
    compressor ranks Earlier's lines), and the same line several times within one fold; the
    gateway's counter only remembers texts long enough to be worth hashing, which lines are not.
    """
    return lru_cache(maxsize=size)(count)


def clip(text: str, max_tokens: int, count: Count) -> str:
    """The longest prefix of `text` (cut at a word) within max_tokens."""
    if max_tokens <= 0:
        return ""
    if count(text) <= max_tokens:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # largest prefix length that fits
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    cut = text[:lo]
    space = cut.rfind(" ")
    if space > lo // 2:
        cut = cut[:space]
    return cut.rstrip()


# -- sections and the cap -----------------------------------------------------------------------

def split_sections(text: str) -> tuple[str, str]:
    """(earlier, recent) of a summary; a summary without sections is all recent."""
    stripped = text.strip()
    if not stripped.startswith(EARLIER):
        return "", stripped
    body = stripped[len(EARLIER):]
    marker = "\n" + RECENT
    pos = body.find(marker)
    if pos < 0:
        return body.strip(), ""
    return body[:pos].strip(), body[pos + len(marker):].strip()


def compose(earlier: str, recent: str) -> str:
    earlier, recent = earlier.strip(), recent.strip()
    if not earlier:
        return recent
    if not recent:
        return f"{EARLIER}\n{earlier}"
    return f"{EARLIER}\n{earlier}\n\n{RECENT}\n{recent}"


def _units(text: str, count: Count, max_unit: int) -> list[str]:
    """Lines of text; an over-long line is split at sentences so the cap can move part of it."""
    out: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if count(line) <= max_unit:
            out.append(line)
            continue
        out += [s for s in _sentence_split(line) if s.strip()]
    return out


def _sentence_split(line: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", line)


def hard_cap(text: str, max_tokens: int, count: Count) -> str:
    """Last resort when a compressor overshoots: drop the oldest lines of Earlier, then clip."""
    if count(text) <= max_tokens:
        return text
    earlier, recent = split_sections(text)
    lines = earlier.splitlines()
    while lines and count(compose("\n".join(lines), recent)) > max_tokens:
        lines.pop(0)
    text = compose("\n".join(lines), recent)
    return clip(text, max_tokens, count)


async def cap_summary(text: str, max_tokens: int, summarizer: Summarizer,
                      *, recent_share: float = 0.5) -> SummaryResult:
    """`text` within `max_tokens`: the oldest part is re-compressed into `Earlier:`, never just cut.

    The newest lines (up to `recent_share` of the cap) stay verbatim under `Recent:`; the previous
    Earlier section plus the older lines are compressed into the new Earlier within what is left.
    Never returns more than max_tokens (a compressor that overshoots is clipped by `hard_cap`).
    """
    count = summarizer.count
    if count(text) <= max_tokens:
        return SummaryResult(text)
    earlier, recent = split_sections(text)
    units = _units(recent, count, max(1, int(max_tokens * recent_share) // 2))
    keep: list[str] = []
    used = 0
    budget_recent = int(max_tokens * recent_share)
    for unit in reversed(units):
        cost = count(unit) + 1
        if used + cost > budget_recent:
            break
        keep.insert(0, unit)
        used += cost
    older = units[: len(units) - len(keep)]
    old_text = "\n".join(([earlier] if earlier else []) + older)
    overhead = count(f"{EARLIER}\n\n\n{RECENT}\n") + 2
    earlier_budget = max(1, max_tokens - used - overhead)
    result = await summarizer.compress(old_text, max_tokens=earlier_budget)
    capped = hard_cap(compose(result.text, "\n".join(keep)), max_tokens, count)
    return SummaryResult(capped, result.tokens_in, result.tokens_out)


# -- the fold itself ------------------------------------------------------------------------------

async def fold_summary(summarizer: Summarizer, previous: str, turns: Sequence[Message], start: int, *,
                       max_tokens: int, timeline_tokens: int = 0) -> SummaryResult:
    """new summary = fold(previous summary, newly aged messages), chunked to the summarizer's budget.

    Only the Recent section is rewritten with the new messages; the cap is applied after each
    chunk, so no intermediate summary grows without bound either. The timeline ahead of it
    (timeline.py: a line per session or task, within `timeline_tokens` or a share of what it
    covers, `timeline.budget`; 0 leaves it as it is) is extended locally, whatever the summarizer:
    off the event loop unless already off it.
    """
    lines, text = timeline.parse(previous)
    if "tool:" in text:
        # A summary written before tool output was kept out of it (summarizer.extract_lines) may hold
        # `tool:` lines, in Recent or Earlier: not carried into this one.
        text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("tool:"))
    tokens_in = tokens_out = 0
    # The previous summary rides along in every call: the rest of the budget is for messages.
    budget = max(256, summarizer.budget_tokens - max_tokens)
    position = start
    for chunk in chunk_turns(turns, budget):
        earlier, recent = split_sections(text)
        result = await summarizer.summarize(recent, chunk, position, max_tokens=max_tokens)
        tokens_in += result.tokens_in
        tokens_out += result.tokens_out
        capped = await cap_summary(compose(earlier, result.text), max_tokens, summarizer)
        tokens_in += capped.tokens_in
        tokens_out += capped.tokens_out
        text = capped.text
        position += len(chunk)
    if timeline_tokens > 0 and turns:
        def extended() -> list[timeline.Line]:
            held = sum(timeline.size(line, summarizer.count) for line in lines)
            room = timeline.budget(timeline_tokens, start + len(turns), turns, held)
            return timeline.cap(timeline.extend(lines, turns, start), room, summarizer.count)

        lines = extended() if summarizer.local else await asyncio.to_thread(extended)
    return SummaryResult(timeline.compose(lines, text), tokens_in, tokens_out)


def spoken(dialect: Dialect, turns: Sequence[Message]) -> list[Message]:
    """The messages as the summary, timeline and state read them (`Dialect.spoken`): with the role the
    dialect gives them now (a message stored by an older gateway may hold an older one) and only the
    words their author wrote: a file a tool read, or a client's note beside the user's words, is not
    the user's goal. A message with nothing of its author's is the tool's output, or an empty note."""
    out = list(turns)
    for i, t in enumerate(out):
        if t.raw:
            role, text = dialect.spoken(t.raw) or (dialect.role(t.raw), t.text)
            if role != t.role or text != t.text:
                out[i] = replace(t, role=role, text=text)
    return out


def slim(turns: Sequence[Message]) -> list[Message]:
    """The messages as a summarizer reads them (role, text, tokens, time): without `raw`, the bulk of
    a message, when they are sent to a fold process."""
    return [Message(raw={}, role=t.role, text=t.text, tokens=t.tokens, hash="", time=t.time) for t in turns]


def run_local(coro: Coroutine[Any, Any, T]) -> T:
    """Run to its end, in this thread, a coroutine that never waits: a local summarizer's fold.

    The pipeline above is written once, as coroutines, for summarizers that wait on HTTP. With a
    `local` summarizer nothing in it suspends, so one `send` runs it whole: the worker hands a
    fold to a thread in one piece instead of hopping to a thread for every summarizer call.
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("run_local: the coroutine waited on something (not a local summarizer?)")
