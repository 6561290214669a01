"""dialect.py: history extraction, text, canonical hashing, tool links and rendering per dialect."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from gateway.dialects import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, content_hash, dialect_named
from gateway.dialects.anthropic import CONTINUE_TEXT
from gateway.model import Plan

oa = OPENAI_CHAT
an = ANTHROPIC
rs = OPENAI_RESPONSES


def plan(**kw: Any) -> Plan:
    base: dict[str, Any] = dict(kind="rewritten", state_block="", summary_block="", head=[], omitted_marker="",
                                window=[], excerpts_block="", tokens_original=0, tokens_forwarded=0)
    base.update(kw)
    return Plan(**base)


# ---------------------------------------------------------------- lookup and body fields


def test_dialect_named_knows_the_three_dialects() -> None:
    """dialect_named returns the dialect whose `name` is the name asked for, and refuses unknown ones."""
    for name in ("openai_chat", "openai_responses", "anthropic"):
        assert dialect_named(name).name == name
    with pytest.raises(KeyError):
        dialect_named("gemini")


def test_openai_history_leaves_out_the_leading_system_prompt() -> None:
    """OpenAI chat history starts after the leading system/developer messages; later ones stay in it."""
    body = {"messages": [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
                         {"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}
    assert oa.history(body) == body["messages"][2:]
    assert oa.system_text(body) == "a\n\nb"
    assert oa.history({"messages": "nope"}) is None


def test_responses_history_is_the_input_and_none_for_server_state() -> None:
    """A Responses request is rewritable with a stateless `input`: a list of items, or a string (one
    user message, as the API reads it)."""
    items = [{"role": "user", "content": "hi"}]
    assert rs.history({"input": items}) == items
    assert rs.history({"input": "hi"}) == items
    assert rs.history({"input": 5}) is None
    assert rs.history({"input": items, "previous_response_id": "resp_1"}) is None
    assert rs.history({"input": items, "conversation": "conv_1"}) is None
    assert rs.system_text({"instructions": "be brief"}) == "be brief"


def test_anthropic_system_text_from_string_or_blocks() -> None:
    """Anthropic's system prompt reads the same as a string or as text blocks."""
    assert an.system_text({"system": "s"}) == "s"
    assert an.system_text({"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "a\n\nb"
    assert an.system_text({}) == ""


def test_model_and_max_output_tokens_per_dialect() -> None:
    """Each dialect reads its own max-output field (Chat: max_completion_tokens before max_tokens)."""
    assert oa.max_output_tokens({"max_tokens": 5, "max_completion_tokens": 9}) == 9
    assert oa.max_output_tokens({"max_tokens": 5}) == 5
    assert an.max_output_tokens({"max_tokens": 7}) == 7
    assert rs.max_output_tokens({"max_output_tokens": 3}) == 3
    assert rs.max_output_tokens({}) is None
    assert oa.model({"model": "gpt-4o"}) == "gpt-4o" and an.model({"model": 3}) is None


# ---------------------------------------------------------------- roles, text, tool links


def test_roles_of_responses_items() -> None:
    """Responses items map to chat roles: calls and reasoning are assistant, outputs are tool."""
    assert rs.role({"type": "function_call", "call_id": "c"}) == "assistant"
    assert rs.role({"type": "function_call_output", "call_id": "c"}) == "tool"
    assert rs.role({"type": "reasoning", "id": "rs_1"}) == "assistant"
    assert rs.role({"role": "user", "content": "x"}) == "user"


def test_text_flattens_parts_calls_and_results() -> None:
    """text() joins text parts, renders tool calls as name(args) and includes tool results' text."""
    msg = {"role": "assistant", "content": "let me look",
           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": 1}'}}]}
    assert oa.text(msg) == 'let me look\ngrep({"q":1})'
    assert oa.text({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "found"}]}) == "found"
    assert an.text({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "out"}]},
        {"type": "text", "text": "and?"}]}) == "out\nand?"
    assert an.text({"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                                      {"type": "tool_use", "id": "t", "name": "ls", "input": {}}]}
                   ) == "ls({})"
    assert rs.text({"type": "function_call", "call_id": "c", "name": "ls", "arguments": "{}"}) == "ls({})"
    assert rs.text({"type": "function_call_output", "call_id": "c", "output": "a.txt"}) == "a.txt"


def test_tool_links_per_dialect() -> None:
    """tool_calls/tool_results give the ids a message opens and answers, in each dialect's fields."""
    assert oa.tool_calls({"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]}) == ("a", "b")
    assert oa.tool_results({"role": "tool", "tool_call_id": "a"}) == ("a",)
    assert an.tool_calls({"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "x",
                                                            "input": {}}]}) == ("u",)
    assert an.tool_results({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u"}]}) == ("u",)
    assert an.tool_calls({"role": "assistant", "content": "text"}) == ()
    assert rs.tool_calls({"type": "function_call", "call_id": "c"}) == ("c",)
    assert rs.tool_results({"type": "function_call_output", "call_id": "c"}) == ("c",)
    assert rs.binds_next({"type": "reasoning"}) and not rs.binds_next({"type": "function_call"})


def test_turn_starts_are_user_messages_with_user_content() -> None:
    """A user message that only carries tool results is not a turn start; one with text is."""
    assert oa.is_turn_start({"role": "user", "content": "x"})
    assert not oa.is_turn_start({"role": "tool", "tool_call_id": "a", "content": "x"})
    assert not an.is_turn_start({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u"}]})
    assert an.is_turn_start({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u"},
                                                         {"type": "text", "text": "also"}]})
    assert rs.is_turn_start({"type": "message", "role": "user", "content": "x"})
    assert not rs.is_turn_start({"type": "function_call_output", "call_id": "c", "output": "x"})


# ---------------------------------------------------------------- canonical form


def test_openai_canonical_ignores_null_and_empty_optional_fields() -> None:
    """refusal=None, annotations=[], content string vs text part: one canonical form."""
    forms: list[dict[str, Any]] = [{"role": "assistant", "content": "hi"},
             {"role": "assistant", "content": "hi", "refusal": None, "annotations": []},
             {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": "hi", "audio": None, "function_call": None, "tool_calls": None}]
    assert len({oa.canonical(f) for f in forms}) == 1
    assert len({content_hash(oa, f) for f in forms}) == 1


def test_openai_canonical_normalises_tool_call_arguments() -> None:
    """Tool-call arguments hash the same whatever key order and spacing; content None equals absent."""
    a: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":[1,2],"b":1}'}}]}
    assert oa.canonical(a) == oa.canonical(b)
    c = copy.deepcopy(a)
    c["tool_calls"][0]["function"]["arguments"] = '{"b": 2}'
    assert oa.canonical(a) != oa.canonical(c)


def test_canonical_keeps_what_a_message_says() -> None:
    """Role, name, text, tool-result id and images all change the canonical form."""
    base = {"role": "user", "content": "hi"}
    others: list[dict[str, Any]] = [
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi", "name": "bob"},
        {"role": "user", "content": "ho"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "hi"}]
    assert len({oa.canonical(m) for m in [base, *others]}) == 1 + len(others)


def test_anthropic_canonical_ignores_cache_control_citations_and_thinking() -> None:
    """String vs text block, cache_control, citations, tool_use input key order and thinking blocks
    do not change an Anthropic message's canonical form."""
    a = {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"},
                                          {"type": "text", "text": "ok", "citations": None},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}]}
    b = {"role": "assistant", "content": [{"type": "text", "text": "ok", "cache_control": {"type": "ephemeral"}},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 2, "b": 1}}]}
    assert an.canonical(a) == an.canonical(b)
    assert an.canonical({"role": "user", "content": "q"}) == an.canonical(
        {"role": "user", "content": [{"type": "text", "text": "q"}]})
    err = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                        "is_error": True}]}
    ok = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom"}]}
    assert an.canonical(err) != an.canonical(ok)
    assert an.canonical(ok) == an.canonical({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "boom"}]}]})


def test_responses_canonical_ignores_item_ids_and_status() -> None:
    """A Responses output message or function_call equals its echo without id/status/annotations."""
    out = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
           "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}
    assert rs.canonical(out) == rs.canonical({"role": "assistant", "content": "hi"})
    assert rs.canonical(out) == rs.canonical({"type": "message", "role": "assistant", "content": "hi"})
    fc = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": '{"x": 1}',
          "status": "completed"}
    assert rs.canonical(fc) == rs.canonical({"type": "function_call", "call_id": "c", "name": "f",
                                             "arguments": '{"x":1}'})
    assert rs.canonical({"type": "reasoning", "id": "rs_1", "summary": []}) != rs.canonical(
        {"type": "reasoning", "id": "rs_2", "summary": []})


def test_canonical_hash_of_500_messages_is_well_under_a_millisecond_each_way() -> None:
    """Hashing a 500-message history of plain messages takes about a microsecond per message."""
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 30} for i in range(500)]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for m in history:
            content_hash(oa, m)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.003  # ~0.5 ms on a laptop; generous for slow CI machines


# ---------------------------------------------------------------- render


def test_openai_render_layers_in_order_and_leaves_the_body_alone() -> None:
    """Chat render: client system, one state+summary message, head, marker, window with the
    excerpts right before the newest user turn, in a user message of their own (they quote anyone,
    tool output included: never with the system voice); other fields kept; input not mutated."""
    sys_msg = {"role": "system", "content": "S"}
    head = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a0"}]
    window = [{"role": "user", "content": "q1"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c", "content": "r"},
              {"role": "user", "content": "q2"}]
    body = {"model": "gpt-4o", "temperature": 0, "messages": [sys_msg, *head, {"role": "user", "content": "old"},
                                                               {"role": "assistant", "content": "x"}, *window]}
    before = copy.deepcopy(body)
    out = oa.render(body, plan(state_block="ST", summary_block="SU", head=head, omitted_marker="[2 omitted]",
                               window=window, excerpts_block="EX"), cache_control=True)
    assert body == before and out["temperature"] == 0
    assert out["messages"] == [sys_msg, {"role": "system", "content": "ST\n\nSU"}, *head,
                               {"role": "system", "content": "[2 omitted]"}, *window[:3],
                               {"role": "user", "content": "EX"}, window[3]]


def test_openai_render_speaks_developer_when_the_client_does() -> None:
    """Injected notes use the developer role when the client's system prompt is a developer message."""
    body = {"messages": [{"role": "developer", "content": "D"}, {"role": "user", "content": "q"}]}
    out = oa.render(body, plan(summary_block="SU", window=body["messages"][1:]), cache_control=False)
    assert out["messages"][1] == {"role": "developer", "content": "SU"}


def test_anthropic_render_appends_layers_to_system_with_one_breakpoint() -> None:
    """A string system becomes a text block, state and summary follow as blocks, and the summary
    carries the cache_control breakpoint."""
    body = {"model": "claude", "system": "S", "messages": [{"role": "user", "content": "q"}]}
    out = an.render(body, plan(state_block="ST", summary_block="SU", window=body["messages"]), cache_control=True)
    assert out["system"] == [{"type": "text", "text": "S"}, {"type": "text", "text": "ST"},
                             {"type": "text", "text": "SU", "cache_control": {"type": "ephemeral"}}]
    assert body["system"] == "S"
    plain = an.render(body, plan(window=body["messages"]), cache_control=True)
    assert plain["system"] == "S"  # nothing injected: the client's system is untouched


def test_anthropic_render_respects_the_four_breakpoint_limit() -> None:
    """No breakpoint is added when the client already uses four."""
    eph = {"type": "ephemeral"}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": eph}]}]
    body = {"system": [{"type": "text", "text": "S", "cache_control": eph}],
            "tools": [{"name": "a", "cache_control": eph}, {"name": "b", "cache_control": eph}], "messages": msgs}
    out = an.render(body, plan(summary_block="SU", window=msgs), cache_control=True)
    assert out["system"][-1] == {"type": "text", "text": "SU"}


def test_anthropic_render_puts_marker_and_excerpts_inside_user_messages() -> None:
    """The marker opens the first window message; the excerpts follow the newest turn's tool
    results and precede its text."""
    window: list[dict[str, Any]] = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"},
                                     {"type": "text", "text": "q2"}]}]
    out = an.render({"messages": window}, plan(omitted_marker="[3 omitted]", window=window, excerpts_block="EX"),
                    cache_control=False)["messages"]
    assert out[0]["content"] == [{"type": "text", "text": "[3 omitted]"}, {"type": "text", "text": "q1"}]
    assert out[1] is window[1]
    assert [b.get("text", b["type"]) for b in out[2]["content"]] == ["tool_result", "EX", "q2"]
    assert window[0]["content"] == "q1"


def test_anthropic_render_merges_user_messages_at_the_head_window_join() -> None:
    """A head ending with a user message and a window starting with one become one user message."""
    head = [{"role": "user", "content": "first"}]
    window = [{"role": "user", "content": "now"}]
    out = an.render({"messages": []}, plan(head=head, omitted_marker="[4 omitted]", window=window),
                    cache_control=False)["messages"]
    assert out == [{"role": "user", "content": [{"type": "text", "text": "first"},
                                                {"type": "text", "text": "[4 omitted]"},
                                                {"type": "text", "text": "now"}]}]


def test_anthropic_render_opens_with_a_user_message_when_the_window_does_not() -> None:
    """A window that starts inside an agent loop (assistant first) gets a short user message before it."""
    window = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]
    out = an.render({"messages": window}, plan(window=window), cache_control=False)["messages"]
    assert out[0] == {"role": "user", "content": [{"type": "text", "text": CONTINUE_TEXT}]}
    assert out[1:] == window


def test_responses_render_injects_developer_items_and_keeps_instructions() -> None:
    """Responses render: one developer item for state+summary, marker before the window, excerpts
    as a user item before the newest user item; `instructions` untouched."""
    window = [{"role": "user", "content": "q1"}, {"type": "reasoning", "id": "rs", "summary": []},
              {"type": "message", "role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    body = {"instructions": "S", "input": window, "store": False}
    out = rs.render(body, plan(state_block="ST", summary_block="SU", omitted_marker="M", window=window,
                               excerpts_block="EX"), cache_control=True)

    def dev(t: str) -> dict[str, Any]:
        return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": t}]}

    assert out["instructions"] == "S" and out["store"] is False
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "EX"}]}
    assert out["input"] == [dev("ST\n\nSU"), dev("M"), *window[:3], user, window[3]]
