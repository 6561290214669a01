"""rewrite.py: boundaries, the full/rewritten decision, layers, excerpts and the hard budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from gateway import cost, rewrite
from gateway.config import MemorySettings, Settings
from gateway.dialects import Dialect, content_hash, dialect_named
from gateway.model import Message, Plan, Summary
from gateway.reconcile import chain_hashes
from gateway.rewrite import History, Inputs, align_boundary, clean_cuts, fill

oa = dialect_named("openai_chat")
an = dialect_named("anthropic")
rs = dialect_named("openai_responses")


def count(text: str) -> int:
    return len(text.split())


def turns(dialect: Dialect, raws: list[dict[str, Any]], tokens: int = 10) -> list[Message]:
    return [Message(raw=r, role=dialect.role(r), text=dialect.text(r), tokens=tokens, hash=content_hash(dialect, r),
                 time="2024-05-01T10:00:00" if i == 1 else None) for i, r in enumerate(raws)]


def chat(n: int) -> list[dict[str, Any]]:
    """n exchanges: user i / assistant i."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return out


def call(ids: list[str]) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}


def result(i: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": i, "content": "ok"}


def planned(inputs: Inputs, recall: Any = None) -> Plan:
    """What production does with a plan (memory.py), with `recall(window_start, budget)` as the search."""
    draft = rewrite.plan(inputs)
    wants = draft.wants
    return draft.finish(recall(wants.window_start, wants.budget) if recall and wants else ()).plan


def build(dialect: Dialect, *, head: list[Message], tail: list[Message], tail_start: int, total_messages: int,
          total_tokens: int, system_tokens: int, summary: Summary | None, state_block: str, state_tokens: int,
          settings: MemorySettings, context_budget: int, recall: Any = None, **cost_inputs: Any) -> Plan:
    """The plan for a conversation given as its parts (counts by `count`)."""
    history = History(head=head, tail=tail, tail_start=tail_start, total_messages=total_messages,
                      total_tokens=total_tokens, summary=summary, stored_head=head)
    return planned(Inputs(dialect=dialect, history=history, system_tokens=system_tokens, state_block=state_block,
                          state_tokens=state_tokens, settings=settings, context_budget=context_budget, count=count,
                          **cost_inputs), recall)


def plan_for(ts: list[Message], *, cov: int = 0, summary: str = "the story so far", state: str = "",
             budget: int = 100_000, recall: Any = None, dialect: Dialect = oa, full_known: bool = False,
             cost_inputs: dict[str, Any] | None = None, **mem: Any) -> Plan:
    # The layering rules; the prompt-cache cost choice is on only where a test asks for it, and
    # excerpts may take any share of these small histories.
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "token_threshold": 10_000, "keep_recent": 2, "cost_model": False,
         "retrieval_max_share": 1.0, "retrieval_target_share": 0.0, "retrieval_context_share": 1.0,
         "min_saving_share": 0.0, **mem})
    state_block = fill(settings.templates.state, state=state) if state else ""
    return build(
        dialect, head=ts[: max(settings.keep_initial, cov) if full_known else settings.keep_initial],
        tail=ts[cov:], tail_start=cov, total_messages=len(ts), total_tokens=sum(t.tokens for t in ts),
        system_tokens=5, summary=Summary(text=summary, covers=cov, version=1, tokens=count(summary)) if cov else None,
        state_block=state_block, state_tokens=count(state_block), settings=settings, context_budget=budget,
        recall=recall, **(cost_inputs or {}),
    )


# ---------------------------------------------------------------- boundaries


def test_align_boundary_picks_the_last_turn_start_at_or_before_target() -> None:
    """The window may start at a user message at or before the target, never after it."""
    raws = chat(3)
    assert align_boundary(oa, raws, 0, 3) == 2
    assert align_boundary(oa, raws, 0, 4) == 4
    assert align_boundary(oa, raws, 10, 13) == 12  # positions are offset-based
    assert align_boundary(oa, raws, 0, 99) == 4


def test_align_boundary_never_splits_parallel_tool_calls() -> None:
    """A user message between an open call and its result is not a boundary (OpenAI parallel calls)."""
    raws: list[dict[str, Any]] = [{"role": "user", "content": "go"}, call(["a", "b"]), result("a"), result("b"),
            {"role": "user", "content": "next"}]
    assert align_boundary(oa, raws, 0, 3) == 0
    assert clean_cuts(oa, raws) == [True, True, False, False, True, True]


def test_align_boundary_skips_anthropic_tool_result_messages() -> None:
    """An Anthropic user message carrying tool results cannot start a window, even with text in it."""
    raws: list[dict[str, Any]] = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"},
                                         {"type": "text", "text": "and then?"}]},
            {"role": "assistant", "content": "done"}]
    assert align_boundary(an, raws, 0, 3) == 0


def test_clean_cuts_bind_responses_reasoning_to_its_next_item() -> None:
    """A Responses reasoning item and the item after it are never separated."""
    raws: list[dict[str, Any]] = [{"role": "user", "content": "q"}, {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": "a"}]
    assert clean_cuts(rs, raws) == [True, True, False, True]


def test_clean_cuts_see_results_of_calls_before_the_slice() -> None:
    """A result whose call precedes the slice makes every cut up to it unclean."""
    raws: list[dict[str, Any]] = [result("x"), {"role": "user", "content": "q"}]
    assert clean_cuts(oa, raws) == [False, True, True]
    assert align_boundary(oa, [result("x"), result("y")], 7, 9) == 7  # none: the offset


# ---------------------------------------------------------------- full or rewritten


def test_under_both_thresholds_the_request_goes_full() -> None:
    """Below message_threshold and token_threshold nothing is rewritten."""
    ts = turns(oa, [*chat(1), {"role": "user", "content": "q"}])
    p = plan_for(ts, message_threshold=30)
    assert p.kind == "full" and p.tokens_forwarded == p.tokens_original == 35
    assert p.window == [t.raw for t in ts]


def test_under_thresholds_but_over_budget_is_rewritten() -> None:
    """A short conversation that does not fit the context budget is cut down anyway, urgently."""
    ts = turns(oa, [*chat(2), {"role": "user", "content": "q"}], tokens=100)
    p = plan_for(ts, message_threshold=30, budget=250)
    assert p.kind == "rewritten" and p.urgent_fold
    assert p.window == [ts[4].raw] and p.omitted_marker == "[4 earlier messages omitted]"
    assert p.tokens_forwarded <= 250


def test_over_threshold_without_summary_sends_full_when_nothing_is_saved() -> None:
    """With no summary the window is the whole conversation: a rewrite would save nothing."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    assert plan_for(ts).kind == "full"


def test_full_needs_the_whole_conversation_at_hand() -> None:
    """A delta client's "full" must be rendered from stored messages, so it is chosen for one only
    when every message is known; otherwise a summary that saves nothing is still forwarded in place
    of what it covers (the client did not send those messages)."""
    ts = turns(oa, [*chat(2), {"role": "user", "content": "q"}])
    big = "word " * 40
    assert plan_for(ts, cov=2, summary=big, full_known=True).kind == "full"

    def never(start: int, budget: int) -> list[tuple[int, Message]]:
        raise AssertionError("searched for a plan that goes full either way")

    assert plan_for(ts, cov=2, summary=big, full_known=True, recall=never, keep_initial=1).kind == "full"
    p = plan_for(ts, cov=2, summary=big, cost_inputs={"whole": False})
    assert p.kind == "rewritten" and p.window == [t.raw for t in ts[2:]]


def test_a_rewrite_never_exceeds_the_request_it_replaces() -> None:
    """A client that sends its whole history gets it forwarded as sent (no-saving) whenever the
    layers would not be smaller, even when the summary covers messages not loaded (no head at hand):
    a small conversation with a long summary and state is never inflated."""
    ts = turns(oa, [*chat(6), {"role": "user", "content": "q"}], tokens=5)

    def recall(start: int, budget: int) -> list[tuple[int, Message]]:
        return [(i, ts[i]) for i in range(start)]

    for cov in (2, 4, 6, 8):
        for summary in ("short", "word " * 20, "word " * 60):
            for state in ("", "- db: redis", "- goal: " + "x " * 30):
                p = plan_for(ts, cov=cov, summary=summary, state=state, recall=recall, keep_recent=2)
                assert p.tokens_forwarded <= p.tokens_original, (cov, summary, state)
                if p.kind == "full":
                    assert p.reason in (rewrite.NO_SAVING, rewrite.UNDER_THRESHOLD)
                else:
                    assert p.tokens_forwarded < p.tokens_original
    p = plan_for(ts, cov=4, summary="word " * 60)
    assert p.kind == "full" and p.reason == rewrite.NO_SAVING and p.tokens_forwarded == p.tokens_original


def test_rewrite_carries_state_summary_and_the_unsummarised_tail() -> None:
    """Over the thresholds: the templates wrap state and summary, the window is everything after
    the summary's coverage, and the token accounting matches the parts."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    p = plan_for(ts, cov=6, state="- db: redis")
    assert p.kind == "rewritten" and not p.urgent_fold
    assert p.summary_block == "## Summary of the earlier conversation (6 messages)\nthe story so far"
    assert p.state_block == "## Project state (maintained by the memory gateway)\n- db: redis"
    assert p.window == [t.raw for t in ts[6:]] and p.head == [] and p.omitted_marker == ""
    assert p.tokens_original == 5 + 110
    assert p.tokens_forwarded == 5 + count(p.state_block) + count(p.summary_block) + 50


def test_window_keeps_at_least_keep_recent_messages() -> None:
    """When the summary covers more than keep_recent allows, the window reaches back to a turn start."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    p = build(oa, head=[], tail=ts, tail_start=0, total_messages=11, total_tokens=110, system_tokens=0,
              summary=Summary(text="s", covers=10, version=1, tokens=1), state_block="", state_tokens=0,
              settings=MemorySettings.model_validate({"message_threshold": 4, "keep_recent": 4}),
              context_budget=10_000)
    assert p.window == [t.raw for t in ts[6:]]  # 4 recent = positions 7..10, aligned down to 6


def test_head_keeps_the_first_messages_without_cutting_a_tool_group() -> None:
    """keep_initial keeps the opening messages, shortened so a tool group is never cut."""
    raws = [{"role": "user", "content": "task"}, call(["a"]), result("a"), {"role": "assistant", "content": "ok"},
            *chat(4), {"role": "user", "content": "q"}]
    ts = turns(oa, raws)
    p = plan_for(ts, cov=8, keep_initial=2)
    assert p.head == [raws[0]]
    p = plan_for(ts, cov=8, keep_initial=3)
    assert p.head == raws[:3]


# ---------------------------------------------------------------- excerpts


def test_excerpts_render_recalled_messages_in_order_without_window_duplicates() -> None:
    """Recalled messages outside head and window are rendered with position, role and time, in
    conversation order; window and head messages are never repeated."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    asked: list[tuple[int, int]] = []

    def recall(start: int, budget: int) -> list[tuple[int, Message]]:
        asked.append((start, budget))
        return [(p, ts[p]) for p in (3, 9, 1, 0, 3)]

    p = plan_for(ts, cov=6, summary="", recall=recall, keep_initial=1, retrieval_budget_tokens=40)
    assert asked == [(6, 40)]
    assert p.excerpts_block == (
        "## Relevant earlier excerpts (verbatim, from earlier in this conversation)\n"
        "[message 1, assistant, 2024-05-01T10:00:00]\nanswer 0\n\n[message 3, assistant]\nanswer 1")


def test_excerpts_stay_within_their_budget() -> None:
    """Excerpts that would overflow retrieval_budget_tokens are left out, most relevant kept first."""
    raws = [*chat(5), {"role": "user", "content": "q"}]
    raws[3] = {"role": "assistant", "content": "long " * 30}
    ts = turns(oa, raws)
    for t in ts:
        t.tokens = count(t.text) + 4  # stored turns carry their real count
    # (a budget the search can use: over the 20 tokens the block's heading is allowed)
    budget = 30
    p = plan_for(ts, cov=6, recall=lambda s, b: [(3, ts[3]), (1, ts[1])], retrieval_budget_tokens=budget)
    assert "[message 1," in p.excerpts_block and "[message 3," not in p.excerpts_block
    assert count(p.excerpts_block) <= budget


def test_excerpts_are_off_when_retrieval_is_disabled() -> None:
    """retrieval.enabled false: recall is never called."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])

    def recall(start: int, budget: int) -> list[tuple[int, Message]]:
        raise AssertionError("called")

    p = plan_for(ts, cov=6, recall=recall, retrieval={"enabled": False})
    assert p.kind == "rewritten" and p.excerpts_block == ""


def test_no_search_when_the_cached_full_history_costs_less_than_the_rewrite() -> None:
    """With the full history warm in the provider's cache and cheaper than the rewrite without
    excerpts, no search is made and the full history goes; cold, the same request is searched and
    rewritten exactly as without the cost model."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}], tokens=20)
    recalled = [(p, ts[p]) for p in (3, 1)]
    chains = [f"chain {i}" for i in range(len(ts))]
    searched: list[int] = []

    def recall(start: int, budget: int) -> list[tuple[int, Message]]:
        searched.append(start)
        return recalled

    def with_cost(last: cost.Forwarded | None) -> Plan:
        return plan_for(ts, cov=6, keep_initial=1, recall=recall, cost_model=True, cost_inputs={
            "system_hash": "system", "chains": chains, "new_tokens": 20, "last": last, "now": 1.0})

    # The previous request forwarded the history up to the newest turn, whole, a second ago.
    warm = with_cost(cost.full_record(("system", 5), chains[:-1], 20 * (len(ts) - 1), 20, now=0.0))
    assert searched == [] and warm.kind == "full" and warm.reason == rewrite.CHEAPER_CACHED
    cold = with_cost(None)
    assert searched == [6] and cold.excerpts_block
    assert cold == plan_for(ts, cov=6, keep_initial=1, recall=lambda s, b: recalled)


# ---------------------------------------------------------------- hard budget


def test_hard_budget_drops_oldest_window_groups_and_marks_them() -> None:
    """Over the budget: excerpts go first, then the oldest turns; the marker counts what is missing
    since the summary and the fold becomes urgent."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    p = plan_for(ts, cov=2, budget=60, recall=lambda s, b: [(0, ts[0])])
    assert p.urgent_fold and p.excerpts_block == ""
    assert p.window == [t.raw for t in ts[8:]]
    assert p.omitted_marker == "[6 earlier messages omitted]"
    assert p.tokens_forwarded <= 60


def test_the_newest_turn_is_never_split_or_dropped() -> None:
    """Even when the newest turn alone overflows, it goes whole, without other layers, and the plan
    says so by costing more than the budget (a delta client's: a whole client's own body goes instead)."""
    raws = [*chat(3), {"role": "user", "content": "do it"}, call(["a", "b"]), result("a"), result("b")]
    ts = turns(oa, raws)
    p = plan_for(ts, cov=2, budget=20, state="- x", cost_inputs={"whole": False})
    assert p.window == raws[6:] and p.head == []
    assert p.state_block == "" and p.summary_block == ""
    assert p.tokens_forwarded > 20 and p.urgent_fold


def test_hard_budget_drops_the_head_then_the_state_then_the_summary() -> None:
    """When the newest turn fits only without other layers, they go in the documented order: the head
    first, then the project state, and the summary last."""
    ts = turns(oa, [*chat(4), {"role": "user", "content": "q"}])
    settings = MemorySettings()
    state_tokens = count(fill(settings.templates.state, state="- use Redis"))
    summary_tokens = count(fill(settings.templates.summary, summary="the story so far", covered=4))
    # system + the omitted-messages marker ("[4 earlier messages omitted]") + the newest turn
    rest = 5 + count(fill(settings.templates.omitted, count=4)) + 10

    no_head = plan_for(ts, cov=4, state="- use Redis", keep_initial=2, budget=rest + state_tokens + summary_tokens)
    assert no_head.head == [] and no_head.state_block and no_head.summary_block
    assert no_head.window == [ts[-1].raw]

    no_state = plan_for(ts, cov=4, state="- use Redis", keep_initial=2, budget=rest + summary_tokens)
    assert no_state.head == [] and no_state.state_block == "" and no_state.summary_block
    assert no_state.tokens_forwarded <= rest + summary_tokens

    nothing = plan_for(ts, cov=4, state="- use Redis", keep_initial=2, budget=rest)
    assert nothing.head == [] and nothing.state_block == "" and nothing.summary_block == ""


def test_a_turn_too_large_for_the_budget_goes_as_sent_unless_the_client_sends_deltas() -> None:
    """Over the gateway's budget even when cut to the newest turn: a client that sent its whole history
    has its own request forwarded when it is within the model's window (the provider may take what the
    gateway's margin does not); a delta client's request is refused, since the rest of its history is
    only in the store, and so is one over the model's whole window."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    settings = MemorySettings.model_validate({"message_threshold": 4, "keep_recent": 2})
    history = History(head=[], tail=ts[2:], tail_start=2, total_messages=len(ts),
                      total_tokens=sum(t.tokens for t in ts), summary=Summary("s", 2, 1, 1))
    for whole, window, refused in ((True, 1000, False), (False, 1000, True), (True, 50, True)):
        inputs = Inputs(dialect=oa, history=history, system_tokens=5, state_block="", state_tokens=0,
                        settings=settings, context_budget=10, count=count, whole=whole, context_window=window)
        outcome = rewrite.plan(inputs).finish()
        assert outcome.plan.reason == rewrite.TOO_LARGE and outcome.refused is refused
        if not refused:
            assert outcome.plan.kind == "full" and outcome.forwarded is not None and outcome.forwarded.full


def test_layers_that_outgrow_the_context_never_push_out_a_history_that_fits() -> None:
    """A summary far longer than the turns it covers (an edit) would leave room for only the newest
    turn; the history fits the context, so it goes as the client sent it."""
    ts = turns(oa, [*chat(4), {"role": "user", "content": "q"}])
    huge = "words " * 400
    p = plan_for(ts, cov=4, summary=huge, budget=200, full_known=True)
    assert p.kind == "full" and p.reason == rewrite.NO_SAVING and p.window == [t.raw for t in ts]
    # Over the context, the hard budget still cuts (here down to the newest turn without the summary).
    cut = plan_for(ts, cov=4, summary=huge, budget=60)
    assert cut.kind == "rewritten" and cut.urgent_fold and cut.window == [ts[-1].raw]


def test_agent_loop_without_user_turns_starts_at_a_clean_cut() -> None:
    """A tail with no user message (one long tool loop) still gets a window that keeps groups whole."""
    raws = [{"role": "user", "content": "task"}]
    for i in range(6):
        raws += [call([f"c{i}"]), result(f"c{i}")]
    ts = turns(oa, raws)
    p = plan_for(ts, cov=5, budget=70)
    assert p.kind == "rewritten"
    start = len(raws) - len(p.window)
    assert start % 2 == 1 and p.window[0]["role"] == "assistant"


def test_a_tail_opening_inside_a_tool_group_is_sent_full() -> None:
    """When no valid window start exists at all, the client's body goes unchanged."""
    ts = turns(oa, [result("x"), result("y")])
    p = build(oa, head=[], tail=ts, tail_start=3, total_messages=5, total_tokens=500, system_tokens=0,
              summary=Summary(text="s", covers=3, version=1, tokens=1), state_block="", state_tokens=0,
              settings=MemorySettings.model_validate({"message_threshold": 1}), context_budget=10_000)
    assert p.kind == "full"


def test_every_plan_says_why_it_is_what_it_is() -> None:
    """Each way a request can go carries its reason: under the thresholds, nothing saved (with a
    summary; before the first fold, because none exists yet), rewritten, cut to the budget, refused as
    too large, and whole because no clean window start exists."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    assert plan_for(ts, message_threshold=30).reason == rewrite.UNDER_THRESHOLD
    assert plan_for(ts).reason == rewrite.SUMMARY_PENDING  # over the thresholds, nothing summarised yet
    assert plan_for(ts, cov=4, summary="word " * 60).reason == rewrite.NO_SAVING  # a summary outweighing its turns
    assert plan_for(ts, cov=6).reason == rewrite.REWRITTEN
    assert plan_for(ts, cov=2, budget=60).reason == rewrite.OVER_BUDGET
    too_large = plan_for(ts, cov=2, budget=10)
    assert too_large.reason == rewrite.TOO_LARGE and too_large.kind == "full"  # the client's body goes as sent
    loose = turns(oa, [result("x"), result("y")])
    p = build(oa, head=[], tail=loose, tail_start=3, total_messages=5, total_tokens=500, system_tokens=0,
              summary=Summary(text="s", covers=3, version=1, tokens=1), state_block="", state_tokens=0,
              settings=MemorySettings.model_validate({"message_threshold": 1}), context_budget=10_000)
    assert p.reason == rewrite.NO_CLEAN_CUT
    assert {rewrite.CHEAPER_CACHED, rewrite.UNDER_THRESHOLD, rewrite.TOO_LARGE} <= set(rewrite.REASONS)


def test_fill_expands_each_field_once() -> None:
    """Template fields are replaced in one pass: values containing braces stay literal."""
    assert fill("{summary} ({covered})", summary="a {covered} {x}", covered=3) == "a {covered} {x} (3)"
    assert fill("{unknown}", summary="s") == "{unknown}"


def _outcome(ts: list[Message], cov: int, picks: list[int], last: cost.Forwarded | None,
             summary: str = "the story so far", now: float = 0.0,
             prices: cost.Prices = cost.DEFAULT_PRICES, hold_max_share: float = 1.0,
             system_tokens: int = 5) -> rewrite.Outcome:
    """Production's two steps for `ts` with a summary over [0, cov), `picks` recalled, after `last`."""
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "keep_recent": 2, "policy": "threshold", "retrieval_max_share": 1.0,
         "retrieval_target_share": 0.0, "retrieval_budget_tokens": 60, "min_saving_share": 0.0,
         "hold_max_share": hold_max_share})
    history = History(head=[], tail=ts[cov:], tail_start=cov, total_messages=len(ts),
                      total_tokens=sum(t.tokens for t in ts),
                      summary=Summary(text=summary, covers=cov, version=1, tokens=count(summary)))
    draft = rewrite.plan(Inputs(dialect=oa, history=history, system_tokens=system_tokens, state_block="",
                                state_tokens=0, settings=settings, context_budget=100_000, count=count, last=last,
                                now=now, prices=prices))
    assert draft.wants is not None
    return draft.finish([(p, ts[p]) for p in picks])


def test_an_excerpt_stays_in_place_byte_for_byte_until_the_layers_change() -> None:
    """Pinned excerpts: the block a request added before its newest turn is forwarded again, unchanged
    and before the same message, by the next request on the same summary; that request quotes only
    what the pinned block does not already hold. A new summary (a fold applied) lets the pins go."""
    ts = turns(oa, [*chat(12), {"role": "user", "content": "question 12"}])
    first = _outcome(ts, 16, [3, 5], None)
    assert first.forwarded is not None and first.forwarded.pins is not None
    block = first.plan.excerpts_block
    assert "[message 3," in block and "[message 5," in block
    body1 = oa.render({"model": "m", "messages": []}, first.plan, cache_control=False)["messages"]
    at = next(i for i, m in enumerate(body1) if m["content"] == block)
    assert body1[at + 1]["content"] == "question 12"

    ts2 = ts + turns(oa, [{"role": "assistant", "content": "answer 12"}, {"role": "user", "content": "question 13"}])
    second = _outcome(ts2, 16, [5, 7, 3], first.forwarded)
    body2 = oa.render({"model": "m", "messages": []}, second.plan, cache_control=False)["messages"]
    assert body2[: len(body1)] == body1  # the whole earlier request is the new one's prefix
    new = second.plan.excerpts_block
    assert "[message 7," in new and "[message 3," not in new and "[message 5," not in new
    assert body2[-2]["content"] == new and body2[-1]["content"] == "question 13"
    assert second.plan.tokens_forwarded == first.plan.tokens_forwarded + 2 * 10 + count(new)
    # The prompt-cache model sees the pinned block as the same item in the same place.
    assert second.forwarded is not None
    assert second.forwarded.items[: len(first.forwarded.items) - 1] == first.forwarded.items[:-1]

    folded = _outcome(ts2, 18, [5, 7, 3], second.forwarded, summary="a newer story")
    assert folded.plan.pinned == []
    assert all(f"[message {p}," in folded.plan.excerpts_block for p in (3, 5, 7))


def test_a_changed_last_turn_keeps_the_pins_before_it() -> None:
    """A request whose newest turn differs from the last request's (edited, regenerated, or a question
    asked off the record) keeps the blocks pinned before earlier turns byte for byte: they are still
    the cached prefix. Only the block at the changed turn goes, and what it quoted may be quoted anew."""
    ts = turns(oa, [*chat(12), {"role": "user", "content": "question 12"}])
    first = _outcome(ts, 16, [3, 5], None)
    ts2 = ts + turns(oa, [{"role": "assistant", "content": "answer 12"}, {"role": "user", "content": "question 13"}])
    second = _outcome(ts2, 16, [7], first.forwarded)
    assert second.forwarded is not None and len(second.forwarded.pins.blocks) == 2
    edited = ts2[:-1] + turns(oa, [{"role": "user", "content": "question 13, asked another way"}])
    third = _outcome(edited, 16, [7, 9], second.forwarded)
    assert [text for _, text in third.plan.pinned] == [first.plan.excerpts_block]
    assert "[message 7," in third.plan.excerpts_block and "[message 9," in third.plan.excerpts_block
    body1 = oa.render({"model": "m", "messages": []}, first.plan, cache_control=False)["messages"]
    body3 = oa.render({"model": "m", "messages": []}, third.plan, cache_control=False)["messages"]
    assert body3[: len(body1)] == body1
    # The cost model sees the same: the first request's items up to its newest turn are still cached.
    assert third.forwarded is not None
    assert third.forwarded.items[: len(first.forwarded.items) - 1] == first.forwarded.items[:-1]
    assert [p.text for p in third.forwarded.pins.blocks] == [first.plan.excerpts_block, third.plan.excerpts_block]


def test_a_retried_turn_keeps_both_blocks_pinned_before_it() -> None:
    """A turn sent again (a retry) keeps its pinned block and may add a second before the same
    message. The next turn forwards both, and the cost model counts both as the cached prefix
    they are, not one of them."""
    ts = turns(oa, [*chat(12), {"role": "user", "content": "question 12"}])
    first = _outcome(ts, 16, [3], None)
    retried = _outcome(ts, 16, [3, 5], first.forwarded)
    assert retried.forwarded is not None
    blocks = retried.forwarded.pins.blocks
    assert [p.at for p in blocks] == [len(ts) - 1] * 2
    ts2 = ts + turns(oa, [{"role": "assistant", "content": "answer 12"}, {"role": "user", "content": "question 13"}])
    nxt = _outcome(ts2, 16, [7], retried.forwarded)
    assert nxt.forwarded is not None and len(nxt.plan.pinned) == 2
    # The retried request's items, its newest turn included, are the next one's prefix.
    assert nxt.forwarded.items[: len(retried.forwarded.items)] == retried.forwarded.items
    assert [p.digest for p in blocks] == [i for i in nxt.forwarded.items if i in {p.digest for p in blocks}]
    billed = dict(zip(nxt.forwarded.items, nxt.forwarded.tokens, strict=True))
    assert [billed[p.digest] for p in blocks] == [p.tokens for p in blocks]  # both counted, at their size
    body = oa.render({"model": "m", "messages": []}, retried.plan, cache_control=False)["messages"]
    assert oa.render({"model": "m", "messages": []}, nxt.plan, cache_control=False)["messages"][: len(body)] == body


def test_pins_go_when_the_cache_has_gone_cold() -> None:
    """Once the provider's cache has expired every pinned block would be written again at full price:
    the request quotes afresh what its question recalls instead of carrying the old blocks."""
    ts = turns(oa, [*chat(12), {"role": "user", "content": "question 12"}])
    first = _outcome(ts, 16, [3, 5], None, now=1000.0)
    assert first.forwarded is not None and first.forwarded.pins is not None
    ts2 = ts + turns(oa, [{"role": "assistant", "content": "answer 12"}, {"role": "user", "content": "question 13"}])
    warm = _outcome(ts2, 16, [7], first.forwarded, now=1000.0 + 60)
    assert len(warm.plan.pinned) == 1 and "[message 7," in warm.plan.excerpts_block
    cold = _outcome(ts2, 16, [7], first.forwarded, now=1000.0 + cost.DEFAULT_PRICES.ttl + 1)
    assert cold.plan.pinned == []
    assert "[message 7," in cold.plan.excerpts_block and "[message 3," not in cold.plan.excerpts_block
    assert cold.plan.tokens_forwarded < warm.plan.tokens_forwarded


def test_pins_go_once_they_grow_the_request_past_the_hold_share() -> None:
    """`hold_max_share` bounds what pins add: a request whose pinned blocks would bring it, with a
    full excerpt budget, past that share of the history quotes afresh instead. The rewrite itself
    (its layers and a full excerpt budget) is never cut by it."""
    ts = turns(oa, [*chat(12), {"role": "user", "content": "question 12"}])
    original = sum(t.tokens for t in ts) + 20 + 5  # the next request's: two more messages, and the system prompt
    first = _outcome(ts, 16, [3, 5], None)
    assert first.forwarded is not None
    ts2 = ts + turns(oa, [{"role": "assistant", "content": "answer 12"}, {"role": "user", "content": "question 13"}])
    kept = _outcome(ts2, 16, [7], first.forwarded)
    assert len(kept.plan.pinned) == 1
    # The share that just holds the request with its pin and a full budget (60 tokens), and one below it.
    room = (kept.plan.tokens_forwarded - count(kept.plan.excerpts_block) + 60) / original
    assert len(_outcome(ts2, 16, [7], first.forwarded, hold_max_share=room + 0.001).plan.pinned) == 1
    tight = _outcome(ts2, 16, [7], first.forwarded, hold_max_share=room - 0.01)
    assert tight.plan.pinned == [] and "[message 7," in tight.plan.excerpts_block
    assert tight.plan.tokens_forwarded < kept.plan.tokens_forwarded
    # The default bounds nothing, even where the system prompt outweighs the history (agent clients).
    assert len(_outcome(ts2, 16, [7], first.forwarded, system_tokens=2 * original).plan.pinned) == 1
    # Even a share of nothing leaves the rewrite its excerpts.
    assert "[message 7," in _outcome(ts2, 16, [7], first.forwarded, hold_max_share=0.0).plan.excerpts_block


def _most_pinned(prices: cost.Prices) -> int:
    """Pinned tokens a request kept, at most, before the pins all went, over turns each recalling
    a message no pin holds."""
    ts = turns(oa, [*chat(40), {"role": "user", "content": "question 40"}])
    for t in ts[16:40]:  # summarised long messages: the rewrite's saving share never binds
        t.tokens = 200
    last, most = None, 0
    for k in range(20):
        out = _outcome(ts, 40, [k % 16], last, prices=prices)
        assert out.forwarded is not None and out.forwarded.pins is not None
        if last is not None and not out.plan.pinned:
            return most
        most = max(most, sum(p.tokens for p in out.forwarded.pins.blocks[:-1]))  # what this request kept
        last = out.forwarded
        ts = ts + turns(oa, [{"role": "assistant", "content": f"answer {40 + k}"},
                             {"role": "user", "content": f"question {41 + k}"}])
    raise AssertionError("the pins never went")


def test_pins_stay_up_to_the_pin_cap_then_all_go() -> None:
    """Letting pins go writes the window after the first of them again and has later questions
    quote the same messages anew, while keeping them costs a cached read: at Claude's prices (reads a
    tenth of a write) they accumulate past three excerpt budgets, up to four, then all go at once; at
    gpt-4o's (reads half a write), past one and a half, up to two."""
    budget = 60  # _outcome's excerpt budget; each turn's new block holds ~30 tokens
    claude = cost.prices(Settings().price("claude-sonnet-4"))  # the built-in pricing table's
    gpt4o = cost.prices(Settings().price("gpt-4o"))
    assert 3 * budget < _most_pinned(claude) <= 4 * budget
    assert 1.5 * budget < _most_pinned(gpt4o) <= 2 * budget


def test_the_pin_cap_is_the_write_read_ratio_within_two_and_four_budgets() -> None:
    assert rewrite.pin_cap(cost.Prices(read=0.1, write=1.25)) == 4
    assert rewrite.pin_cap(cost.Prices(read=0.1, write=2.0)) == 4  # Anthropic's 1-hour cache
    assert rewrite.pin_cap(cost.Prices(read=0.3, write=1.0)) == pytest.approx(10 / 3)
    assert rewrite.pin_cap(cost.Prices(read=0.5, write=1.0)) == 2
    assert rewrite.pin_cap(cost.Prices(read=1.0, write=0.5)) == 2  # reads dearer than writes: as before
    assert rewrite.pin_cap(cost.Prices(read=0.0, write=1.0)) == 4  # reads free


def test_pinned_excerpts_render_before_their_message_in_every_dialect() -> None:
    """Each API shape puts a pinned block before the message it was placed before, and this request's
    own block before its newest turn."""
    window = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
              {"role": "user", "content": "q2"}]
    plan = Plan(kind="rewritten", state_block="", summary_block="", head=[], omitted_marker="", window=window,
                excerpts_block="NEW", tokens_original=100, tokens_forwarded=50, pinned=[(0, "OLD")])
    chat_msgs = oa.render({"messages": []}, plan, cache_control=False)["messages"]
    assert [m["content"] for m in chat_msgs] == ["OLD", "q1", "a1", "NEW", "q2"]
    items = rs.render({"input": []}, plan, cache_control=False)["input"]
    texts = [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"] for i in items]
    assert texts == ["OLD", "q1", "a1", "NEW", "q2"]
    msgs = an.render({"messages": []}, plan, cache_control=False)["messages"]
    assert [b["text"] for b in msgs[0]["content"]][:2] == ["OLD", "q1"]
    assert [b["text"] for b in msgs[2]["content"]][:2] == ["NEW", "q2"]


def _summary_mark(body: dict[str, Any]) -> Any:
    plan = Plan(kind="rewritten", state_block="", summary_block="SUMMARY", head=[], omitted_marker="",
                window=body["messages"], excerpts_block="", tokens_original=100, tokens_forwarded=50)
    system = an.render(body, plan, cache_control=True)["system"]
    assert system[-1]["text"] == "SUMMARY"
    return system[-1].get("cache_control")


def test_the_anthropic_breakpoint_counts_the_top_level_one_and_keeps_the_ttl_order() -> None:
    """The breakpoint after the summary is added only while Anthropic would accept it: within 4 with
    the request's top-level `cache_control` (automatic caching) counted, and never a 5-minute one before
    a client's 1-hour one (a 1-hour one when the client's later breakpoints are; none when its earlier
    ones are 5-minute and its later ones 1-hour). Either mistake is a 400 from Anthropic."""
    five, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    tools = [{"name": "t", "input_schema": {"type": "object"}, "cache_control": five}]
    system = [{"type": "text", "text": f"S{i}", "cache_control": five} for i in (1, 2)]
    user = [{"role": "user", "content": "q"}]
    assert _summary_mark({"messages": user, "system": system, "tools": tools}) == five  # 3 + ours
    assert _summary_mark({"messages": user, "system": system, "tools": tools, "cache_control": five}) is None
    marked = [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": hour}]}]
    assert _summary_mark({"messages": marked}) == hour
    assert _summary_mark({"messages": user, "cache_control": hour}) == hour
    assert _summary_mark({"messages": marked, "system": [system[0]]}) is None
    assert _summary_mark({"messages": user, "system": [{"type": "text", "text": "S", "cache_control": hour}]}) == five


def test_a_held_fold_leaves_the_excerpt_budget_as_the_applied_fold_would() -> None:
    """The excerpts fill up to a share of the history less the other layers; the longer window a held
    fold forwards (rewrite.keep_layers) does not eat into them."""
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "keep_recent": 2, "policy": "threshold", "retrieval_max_share": 1.0,
         "retrieval_target_share": 0.5, "retrieval_budget_tokens": 10, "min_saving_share": 0.0})
    ts = turns(oa, [*chat(40), {"role": "user", "content": "question 40"}], tokens=50)

    def wants(cov: int, held_window: int) -> rewrite.Wanted:
        history = History(head=[], tail=ts[cov:], tail_start=cov, total_messages=len(ts),
                          total_tokens=sum(t.tokens for t in ts),
                          summary=Summary(text="story", covers=cov, version=1, tokens=1))
        draft = rewrite.plan(Inputs(dialect=oa, history=history, system_tokens=5, state_block="", state_tokens=0,
                                    settings=settings, context_budget=100_000, count=count,
                                    held_window=held_window))
        assert draft.wants is not None
        return draft.wants

    applied, held = wants(60, 0), wants(52, 8 * 50)
    assert held.window_start == 52 and applied.window_start == 60
    assert held.budget == applied.budget > wants(52, 0).budget


def test_a_turn_that_recalls_nothing_does_not_make_the_rewrite_look_cheaper() -> None:
    """Policy cost, warm cache, the full history forwarded last: the rewrite wins only if its later
    turns write no excerpts. A turn that wants excerpts but recalls none (reach_back) is weighed as if
    the next turns fill what the search may fill, as those that reach back do: the full history goes."""
    ts = turns(oa, [*chat(25), {"role": "user", "content": "question 25"}], tokens=100)
    chains = chain_hashes([t.hash for t in ts])
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "keep_recent": 2, "policy": "cost", "retrieval_target_share": 0.0,
         "retrieval_budget_tokens": 2_000, "retrieval_max_share": 1.0, "min_saving_share": 0.0})
    last = cost.full_record(("sys", 5), chains[:-2], sum(t.tokens for t in ts[:-2]), 100, 0.0)
    cov = 40
    history = History(head=[], tail=ts[cov:], tail_start=cov, total_messages=len(ts),
                      total_tokens=sum(t.tokens for t in ts), summary=Summary(text="story", covers=cov, version=1,
                                                                                 tokens=1))

    def outcome(picks: list[int]) -> rewrite.Outcome:
        draft = rewrite.plan(Inputs(dialect=oa, history=history, system_tokens=5, state_block="", state_tokens=0,
                                    settings=settings, context_budget=100_000, count=count, system_hash="sys",
                                    chains=chains, new_tokens=100, last=last, now=10.0))
        assert draft.wants is not None
        return draft.finish([(p, ts[p]) for p in picks])

    assert outcome([]).plan.reason == rewrite.CHEAPER_CACHED
    assert outcome([3]).plan.reason == rewrite.CHEAPER_CACHED  # a short block says no more
    # Without excerpts wanted (retrieval off), the same conversation is cheaper rewritten.
    no_recall = settings.model_copy(update={"retrieval": settings.retrieval.model_copy(update={"enabled": False})})
    draft = rewrite.plan(Inputs(dialect=oa, history=history, system_tokens=5, state_block="", state_tokens=0,
                                settings=no_recall, context_budget=100_000, count=count, system_hash="sys",
                                chains=chains, new_tokens=100, last=last, now=10.0))
    assert draft.wants is None and draft.finish().plan.reason == rewrite.REWRITTEN


def test_turns_that_recall_little_let_the_rewrite_win_later() -> None:
    """The later turns' excerpts are judged by what this conversation's searched turns wrote: from
    the worst case (the search budget) down, by each turn's new block. A conversation whose turns
    keep recalling nothing switches to the rewrite after some turns; one whose turns recall most of
    the budget keeps its cached full history longer."""
    ts = turns(oa, [*chat(25), {"role": "user", "content": "question 25"}], tokens=100)
    chains = chain_hashes([t.hash for t in ts])
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "keep_recent": 2, "policy": "cost", "retrieval_target_share": 0.0,
         "retrieval_budget_tokens": 2_000, "retrieval_max_share": 1.0, "min_saving_share": 0.0})
    cov = 40
    history = History(head=[], tail=ts[cov:], tail_start=cov, total_messages=len(ts),
                      total_tokens=sum(t.tokens for t in ts), summary=Summary(text="story", covers=cov, version=1,
                                                                                 tokens=1))

    def replay(picks: list[int], turns_: int) -> list[str]:
        last = cost.full_record(("sys", 5), chains[:-2], sum(t.tokens for t in ts[:-2]), 100, 0.0)
        reasons = []
        for k in range(turns_):
            draft = rewrite.plan(Inputs(dialect=oa, history=history, system_tokens=5, state_block="",
                                        state_tokens=0, settings=settings, context_budget=100_000, count=count,
                                        system_hash="sys", chains=chains, new_tokens=100, last=last,
                                        now=10.0 + k))
            assert draft.wants is not None
            out = draft.finish([(p, ts[p]) for p in picks])
            reasons.append(out.plan.reason)
            # The next turn meets the same prefix cached (the full history as before: the test holds
            # the history still) and this turn's estimate.
            assert out.forwarded is not None
            last = replace(last, at=10.0 + k, excerpt_rate=out.forwarded.excerpt_rate)
        return reasons

    quiet = replay([], 12)
    assert quiet[0] == rewrite.CHEAPER_CACHED and quiet[-1] == rewrite.REWRITTEN
    busy = replay(list(range(2, 38, 2)), 12)  # every turn recalls a block of most of the budget
    assert busy[: quiet.index(rewrite.REWRITTEN) + 1] == [rewrite.CHEAPER_CACHED] * (quiet.index(rewrite.REWRITTEN) + 1)


def _held_fold_case(**overrides: float) -> tuple[
        list[Message], Callable[[int, int, str, cost.Forwarded | None, float], Inputs]]:
    """Messages of 100 tokens (by `count`, as in the excerpts quoting them) and Inputs on the first
    `upto` of them, summarised over [0, cov), for the held-fold tests under `policy: cost`."""
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "keep_recent": 2, "policy": "cost", "retrieval_max_share": 1.0,
         "retrieval_target_share": 0.0, "retrieval_budget_tokens": 2000, "min_saving_share": 0.0, **overrides})
    pad = " ".join(["lorem"] * 98)
    ts = turns(oa, [{**m, "content": f"{m['content']} {pad}"} for m in chat(60)], tokens=100)
    ts += turns(oa, [{"role": "user", "content": "question 60"}])

    def inputs(upto: int, cov: int, summary: str, last: cost.Forwarded | None, now: float) -> Inputs:
        history = History(head=[], tail=ts[cov:upto], tail_start=cov, total_messages=upto,
                          total_tokens=sum(t.tokens for t in ts[:upto]),
                          summary=Summary(text=summary, covers=cov, version=1, tokens=count(summary)))
        return Inputs(dialect=oa, history=history, system_tokens=5, state_block="", state_tokens=0,
                      settings=settings, context_budget=100_000, count=count, last=last, now=now)

    return ts, inputs


def test_a_held_fold_counts_the_pinned_excerpts_applying_it_would_write_again() -> None:
    """Cache-aware folding weighs the held layers against the fold's: pins belong to the layout they
    were quoted in, so applying the fold drops them and the next search writes their excerpts anew,
    where keeping reads them from the cache. Pins that outweigh what the fold saves keep the warm
    conversation on its cached layers."""
    ts, inputs = _held_fold_case()
    # A request on the summary over [0, 60) quotes ten earlier turns (~1,000 tokens), pinned after it.
    first = rewrite.plan(inputs(81, 60, "the story so far", None, 0.0)).finish([(p, ts[p]) for p in range(2, 32, 3)])
    assert first.forwarded is not None and first.forwarded.pins is not None
    # The next request, a fold over [0, 76) finished meanwhile: it takes 1,600 tokens of window out of
    # every later request, but applying it writes its prefix and ~1,000 tokens of excerpts again,
    # where this conversation's searched turns have written ~100 new excerpt tokens each.
    last = replace(first.forwarded, excerpt_rate=100.0)
    kept = inputs(83, 60, "the story so far", last, 30.0)
    applied = inputs(83, 76, "a newer story", last, 30.0)
    assert rewrite.plan(applied, kept).inputs is kept, "the held layers and their pins stay while the cache is warm"
    # Turns that each write a whole block of new excerpts anyway lose nothing with the pins: the fold goes in.
    fresh = replace(first.forwarded, excerpt_rate=1000.0)
    assert rewrite.plan(replace(applied, last=fresh), replace(kept, last=fresh)).inputs is not kept
    # So it does once the cache is cold: both are written whole.
    cold = cost.DEFAULT_PRICES.ttl + 31.0
    assert rewrite.plan(replace(applied, now=cold), replace(kept, now=cold)).inputs is not kept


def test_a_held_fold_goes_in_once_holding_has_cost_what_applying_would() -> None:
    """Ski rental: a warm conversation keeps its cached layers while the reads its held window has
    cost so far (the window grew one turn at a time: about a triangle of reads) are less than the
    writes applying the fold takes; then the fold goes in, cache still warm. Waiting longer only
    pays off when the cache goes cold, which applies it for nothing."""
    ts, inputs = _held_fold_case()
    first = rewrite.plan(inputs(81, 60, "the story so far", None, 0.0)).finish([])
    assert first.forwarded is not None

    def holds(cov: int, held: int | None = None) -> bool:
        kept = inputs(83, 60, "the story so far", first.forwarded, 30.0)
        applied = inputs(83, cov, "a newer story", first.forwarded, 30.0)
        if held is None:
            held = sum(t.tokens for t in ts[60:cov])  # what memory.py measures of the held messages
        return rewrite.plan(applied, replace(kept, held_window=held)).inputs.history.tail_start == 60

    # Folds over 2, 10, 16 and 20 more messages: ~200 to ~2,000 tokens held over as many messages.
    assert [holds(cov) for cov in (62, 70, 76, 80)] == [True, True, False, False]
    # The same request: what decides is the reads paid so far, not what the next few would cost.
    # Ten messages held; applying would bill ~1,170 tokens' worth more than holding, against
    # ~0.1 x held x 10 / 4 of reads paid so far.
    assert holds(70, held=4_000) and not holds(70, held=5_000)


def test_a_held_fold_goes_in_once_holding_grows_the_request_past_the_hold_share() -> None:
    """`hold_max_share`: the held window is kept while the request with it and a full excerpt budget
    stays within that share of the full request; past it the fold is applied, however much the
    cached layers would save. 1.0 bounds nothing."""
    for share, held in ((1.0, True), (0.8, True), (0.5, False), (0.3, False)):
        _, inputs = _held_fold_case(hold_max_share=share, fold_batch=2)
        first = rewrite.plan(inputs(81, 60, "the story so far", None, 0.0)).finish([])
        assert first.forwarded is not None and first.forwarded.pins is None  # the held window alone
        kept = inputs(83, 60, "the story so far", first.forwarded, 30.0)
        applied = inputs(83, 76, "a newer story", first.forwarded, 30.0)
        # The held request: ~2,300 tokens of window; with a budget of 2,000, 0.52 of the 8,305-token request.
        assert (rewrite.plan(applied, kept).inputs is kept) is held, share


def test_a_held_fold_searches_the_past_the_applied_fold_would() -> None:
    """Keeping the cached layers never forwards less of the past than applying the fold: the held
    request searches as the applied one would (up to the applied window's first position), and what
    it finds in its own longer window is present already, not quoted again."""
    ts, inputs = _held_fold_case()
    first = rewrite.plan(inputs(81, 60, "the story so far", None, 0.0)).finish([(p, ts[p]) for p in range(2, 32, 3)])
    assert first.forwarded is not None
    last = replace(first.forwarded, excerpt_rate=100.0)
    kept = inputs(83, 60, "the story so far", last, 30.0)
    applied = inputs(83, 76, "a newer story", last, 30.0)
    alone = rewrite.plan(applied)
    draft = rewrite.plan(applied, kept)
    assert draft.inputs is kept  # the held layers are forwarded (see the test above)
    assert alone.wants is not None and draft.wants is not None
    held_start = 83 - len(draft.plan.window)
    assert held_start < alone.wants.window_start == draft.wants.window_start
    # A message of the held window the search ranks first is there already: not quoted again.
    inside = held_start + 2
    done = draft.finish([(inside, ts[inside]), (40, ts[40])])
    assert f"[message {inside}," not in done.plan.excerpts_block and "[message 40," in done.plan.excerpts_block
