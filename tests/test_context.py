"""context.py: boundaries, the full/rewritten decision, layers, excerpts and the hard budget."""

from __future__ import annotations

from typing import Any

from gateway.config import MemorySettings
from gateway.context import align_boundary, build_plan, clean_cuts, fill
from gateway.model import Plan, Summary, Turn
from gateway.shape import Shape, content_hash, shape_for

oa = shape_for("openai_chat")
an = shape_for("anthropic")
rs = shape_for("openai_responses")


def count(text: str) -> int:
    return len(text.split())


def turns(shape: Shape, raws: list[dict[str, Any]], tokens: int = 10) -> list[Turn]:
    return [Turn(raw=r, role=shape.role(r), text=shape.text(r), tokens=tokens, hash=content_hash(shape, r),
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


def plan_for(ts: list[Turn], *, cov: int = 0, summary: str = "the story so far", state: str = "",
             budget: int = 100_000, recall: Any = None, shape: Shape = oa, full_known: bool = False,
             worth_recalling: Any = None, **mem: Any) -> Plan:
    settings = MemorySettings.model_validate(
        {"message_threshold": 4, "token_threshold": 10_000, "keep_recent": 2, **mem})
    state_block = fill(settings.templates.state, state=state) if state else ""
    return build_plan(
        shape, head=ts[: max(settings.keep_initial, cov) if full_known else settings.keep_initial],
        tail=ts[cov:], tail_start=cov, total_messages=len(ts), total_tokens=sum(t.tokens for t in ts),
        system_tokens=5, summary=Summary(text=summary, covers=cov, version=1, tokens=count(summary)) if cov else None,
        state_block=state_block, state_tokens=count(state_block), settings=settings, context_budget=budget,
        count=count, recall=recall, worth_recalling=worth_recalling,
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
    """"full" is chosen only when every message is known (so a delta client can be served from the
    plan); otherwise a summary that saves nothing is still forwarded in place of what it covers."""
    ts = turns(oa, [*chat(2), {"role": "user", "content": "q"}])
    big = "word " * 40
    assert plan_for(ts, cov=2, summary=big, full_known=True).kind == "full"

    def never(start: int, budget: int) -> list[tuple[int, Turn]]:
        raise AssertionError("searched for a plan that goes full either way")

    assert plan_for(ts, cov=2, summary=big, full_known=True, recall=never, keep_initial=1).kind == "full"
    p = plan_for(ts, cov=2, summary=big)
    assert p.kind == "rewritten" and p.window == [t.raw for t in ts[2:]]


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
    p = build_plan(oa, head=[], tail=ts, tail_start=0, total_messages=11, total_tokens=110, system_tokens=0,
                   summary=Summary(text="s", covers=10, version=1, tokens=1), state_block="", state_tokens=0,
                   settings=MemorySettings.model_validate({"message_threshold": 4, "keep_recent": 4}),
                   context_budget=10_000, count=count, recall=None)
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

    def recall(start: int, budget: int) -> list[tuple[int, Turn]]:
        asked.append((start, budget))
        return [(p, ts[p]) for p in (3, 9, 1, 0, 3)]

    p = plan_for(ts, cov=6, recall=recall, keep_initial=1, retrieval_budget_tokens=40)
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
    p = plan_for(ts, cov=6, recall=lambda s, b: [(3, ts[3]), (1, ts[1])], retrieval_budget_tokens=20)
    assert "[message 1," in p.excerpts_block and "[message 3," not in p.excerpts_block
    assert count(p.excerpts_block) <= 20


def test_excerpts_are_off_when_retrieval_is_disabled() -> None:
    """retrieval.enabled false: recall is never called."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])

    def recall(start: int, budget: int) -> list[tuple[int, Turn]]:
        raise AssertionError("called")

    p = plan_for(ts, cov=6, recall=recall, retrieval={"enabled": False})
    assert p.kind == "rewritten" and p.excerpts_block == ""


def test_worth_recalling_sees_the_plan_without_excerpts_and_can_skip_the_search() -> None:
    """worth_recalling gets exactly the plan build_plan returns without excerpts; False skips recall,
    True changes nothing."""
    ts = turns(oa, [*chat(5), {"role": "user", "content": "q"}])
    recalled = [(p, ts[p]) for p in (3, 1)]
    plain = plan_for(ts, cov=6, keep_initial=1)
    full = plan_for(ts, cov=6, keep_initial=1, recall=lambda s, b: recalled)
    drafts: list[Plan] = []

    def never(start: int, budget: int) -> list[tuple[int, Turn]]:
        raise AssertionError("searched")

    skipped = plan_for(ts, cov=6, keep_initial=1, recall=never, worth_recalling=lambda d: drafts.append(d) or False)
    assert drafts == [plain] and skipped == plain
    kept = plan_for(ts, cov=6, keep_initial=1, recall=lambda s, b: recalled, worth_recalling=lambda d: True)
    assert kept == full and kept.excerpts_block


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
    says so by costing more than the budget."""
    raws = [*chat(3), {"role": "user", "content": "do it"}, call(["a", "b"]), result("a"), result("b")]
    ts = turns(oa, raws)
    p = plan_for(ts, cov=2, budget=20, state="- x")
    assert p.window == raws[6:] and p.head == []
    assert p.state_block == "" and p.summary_block == ""
    assert p.tokens_forwarded > 20 and p.urgent_fold


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
    p = build_plan(oa, head=[], tail=ts, tail_start=3, total_messages=5, total_tokens=500, system_tokens=0,
                   summary=Summary(text="s", covers=3, version=1, tokens=1), state_block="", state_tokens=0,
                   settings=MemorySettings.model_validate({"message_threshold": 1}), context_budget=10_000, count=count)
    assert p.kind == "full"


def test_fill_expands_each_field_once() -> None:
    """Template fields are replaced in one pass: values containing braces stay literal."""
    assert fill("{summary} ({covered})", summary="a {covered} {x}", covered=3) == "a {covered} {x} (3)"
    assert fill("{unknown}", summary="s") == "{unknown}"
