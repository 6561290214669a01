"""Fold planning: trigger, alignment, chunking, the summary cap and re-compression (pure, no Redis/HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import fold, state
from gateway.dialects import dialect_named
from gateway.fold import SummaryResult
from gateway.model import Message
from gateway.summarizer import ExtractiveSummarizer

SHAPE = dialect_named("openai_chat")


def words(text: str) -> int:
    return len(text.split())


def msg(role: str, text: str = "", **extra: Any) -> Message:
    raw: dict[str, Any] = {"role": role, "content": text, **extra}
    return Message(raw=raw, role=role, text=text, tokens=max(1, words(text)), hash="ab")


def dialogue(n: int, text: str = "some words here") -> list[Message]:
    return [msg("user" if i % 2 == 0 else "assistant", f"{text} {i}") for i in range(n)]


def target(turns: Sequence[Message], start: int = 0, **kw: Any) -> int | None:
    opts = {"keep_recent": 10, "fold_batch": 10, "fold_tokens": 6000} | kw
    return fold.fold_target(SHAPE, turns[start:], start, **opts)


def test_sequence_20_30_40() -> None:
    """keep_recent 10, fold_batch 10: at 20 messages the summary covers 10, at 30 it covers 20, at 40 30."""
    convo = dialogue(45)
    covers = 0
    seen = []
    for length in range(1, 46):
        t = target(convo[:length], covers)
        if t is not None:
            seen.append((length, t))
            covers = t
    assert seen == [(20, 10), (30, 20), (40, 30)]


def test_should_fold_matches_trigger() -> None:
    """The request path's cheap check agrees with the worker's trigger on a plain dialogue."""
    assert not fold.should_fold(length=19, covers=0, keep_recent=10, fold_batch=10)
    assert fold.should_fold(length=20, covers=0, keep_recent=10, fold_batch=10)
    assert not fold.should_fold(length=29, covers=10, keep_recent=10, fold_batch=10)
    assert fold.should_fold(length=25, covers=10, keep_recent=10, fold_batch=10, aged_tokens=7000,
                            fold_tokens=6000)


def test_token_trigger_and_urgent() -> None:
    """Aged-out tokens reaching fold_tokens trigger a fold before fold_batch; urgent folds what aged out."""
    convo = dialogue(14, "word " * 300)
    assert target(convo, fold_tokens=6000) is None  # 4 aged messages, 1200 tokens
    assert target(convo, fold_tokens=1000) == 4
    assert target(dialogue(14), urgent=True) == 4
    assert target(dialogue(10), urgent=True) is None  # nothing aged out


def test_boundary_never_splits_a_tool_group() -> None:
    """The coverage end moves back to a turn start so a tool call and its result stay together."""
    convo = dialogue(8)
    convo += [msg("user", "run it"),
              msg("assistant", "", tool_calls=[{"id": "c1", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]),
              msg("tool", "result", tool_call_id="c1"),
              msg("assistant", "done")]
    convo += dialogue(10)
    # Unaligned end would be 22 - 10 = 12 (inside nothing), but 10 and 11 are inside the group:
    t = target(convo[:21], fold_batch=1)  # end 11: the tool result; back to the user turn at 8
    assert t == 8
    assert convo[t].role == "user"


def test_chunk_turns_respects_budget() -> None:
    """Chunks keep order and fit the budget; an oversized message is a chunk of its own."""
    turns = [msg("user", "w " * n) for n in (40, 40, 40, 200, 10)]
    chunks = fold.chunk_turns(turns, 100)
    assert [[t.tokens for t in c] for c in chunks] == [[40, 40], [40], [200], [10]]


def test_clip_and_sections() -> None:
    """clip fits a budget at a word boundary; sections round-trip through compose/split."""
    assert fold.clip("one two three four five", 3, words) == "one two three"
    text = fold.compose("old facts", "line a\nline b")
    assert fold.split_sections(text) == ("old facts", "line a\nline b")
    assert fold.split_sections("just lines") == ("", "just lines")
    assert fold.compose("", "r") == "r"


def test_remembering_counts_each_text_once() -> None:
    """A remembering counter gives the wrapped counter's answers and asks it once per distinct text."""
    asked: list[str] = []

    def counting(text: str) -> int:
        asked.append(text)
        return words(text)

    count = fold.remembering(counting, size=8)
    assert [count("a b"), count("c"), count("a b"), count("c")] == [2, 1, 2, 1]
    assert asked == ["a b", "c"]


class Recorder:
    """A summarizer that records what it was asked and answers by concatenation."""

    name = "test"
    count = staticmethod(words)

    def __init__(self, budget: int = 10_000) -> None:
        self.budget_tokens = budget
        self.calls: list[tuple[str, int]] = []

    async def summarize(self, previous: str, turns: Sequence[Message], start: int, *,
                        max_tokens: int) -> SummaryResult:
        self.calls.append(("summarize", len(turns)))
        lines = [previous] if previous else []
        lines += [f"{t.role}: {t.text}" for t in turns]
        return SummaryResult("\n".join(lines), tokens_in=5, tokens_out=3)

    async def compress(self, text: str, *, max_tokens: int) -> SummaryResult:
        self.calls.append(("compress", max_tokens))
        return SummaryResult(" ".join(text.split()[: max_tokens // 2]), tokens_in=1, tokens_out=1)


async def test_fold_is_previous_plus_new_only() -> None:
    """A fold sends the previous summary and the newly aged messages, never the history again."""
    r = Recorder()
    first = await fold.fold_summary(r, "", dialogue(10), 0, max_tokens=500)
    second = await fold.fold_summary(r, first.text, dialogue(10, "later")[:10], 10, max_tokens=500)
    assert r.calls == [("summarize", 10), ("summarize", 10)]
    assert second.text.startswith(first.text)
    assert (second.tokens_in, second.tokens_out) == (5, 3)


async def test_fold_chunks_over_budget() -> None:
    """Input over the summarizer's budget is folded chunk by chunk, each chunk building on the last."""
    r = Recorder(budget=500 + 300)  # 300 tokens of messages per call next to a 500-token summary cap
    turns = [msg("user", "w " * 100) for _ in range(9)]
    await fold.fold_summary(r, "", turns, 0, max_tokens=500)
    assert [c for c in r.calls if c[0] == "summarize"] == [("summarize", 3)] * 3


async def test_cap_recompresses_oldest_into_earlier() -> None:
    """Over the cap the oldest part becomes an Earlier section; the newest lines stay verbatim under Recent."""
    lines = [f"user: fact number {i} is value{i}" for i in range(40)]
    r = Recorder()
    out = await fold.cap_summary("\n".join(lines), 100, r)
    earlier, recent = fold.split_sections(out.text)
    assert out.text.startswith("Earlier:") and "Recent:" in out.text
    assert recent.splitlines()[-1] == lines[-1]
    assert "fact number 0" in earlier  # the oldest part was compressed, not cut
    assert words(out.text) <= 100


async def test_cap_survives_an_overshooting_compressor() -> None:
    """A compressor that ignores its budget is still clipped: the cap is never exceeded."""
    class Greedy(Recorder):
        async def compress(self, text: str, *, max_tokens: int) -> SummaryResult:
            return SummaryResult(text + " extra" * 500)

    out = await fold.cap_summary("\n".join(f"line {i} " + "w " * 20 for i in range(50)), 120, Greedy())
    assert words(out.text) <= 120


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab cd-ef/12. \nXY_z"), min_size=0, max_size=200),
                min_size=1, max_size=40),
       st.integers(min_value=50, max_value=400))
async def test_extractive_summary_never_over_cap(chunks: list[str], cap: int) -> None:
    """Whatever the messages, an extractive fold's summary is never over max_summary_tokens."""
    s = ExtractiveSummarizer(words)
    text = ""
    for i, chunk in enumerate(chunks):
        turn = msg("user" if i % 2 == 0 else "assistant", f"We decided {chunk} port {i} v1.2.{i}")
        r = await fold.fold_summary(s, text, [turn], i, max_tokens=cap)
        text = r.text
        assert words(text) <= cap


async def _waits() -> int:
    await asyncio.sleep(0)
    return 1


async def _returns() -> int:
    return 2


def test_run_local_runs_a_coroutine_that_never_waits() -> None:
    """run_local returns a never-waiting coroutine's result in the calling thread and refuses one that waits."""
    assert fold.run_local(_returns()) == 2
    with pytest.raises(RuntimeError):
        fold.run_local(_waits())


def test_extractive_fold_runs_local() -> None:
    """A whole extractive fold, summary and ledger update, runs to its end with run_local (no event loop)."""
    s = ExtractiveSummarizer(words)
    turns = [msg("user", "We must never log card numbers."), msg("assistant", "Noted, never."), *dialogue(8)]
    result = fold.run_local(fold.fold_summary(s, "", turns, 0, max_tokens=50))
    assert "user: We must never log card numbers." in result.text
    ledger, _, _ = fold.run_local(s.update_state(state.Ledger(), turns, 0))
    assert [i.text for i in ledger.active("constraints")] == ["We must never log card numbers."]
