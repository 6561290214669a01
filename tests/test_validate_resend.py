"""A resent history is checked only where it is new, and what is new is always checked."""

from __future__ import annotations

import json
from typing import Any

from gateway import validate
from tests.memory_helpers import KEY, memory_gateway


def _chat(n: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(n):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"})
    return {"model": "gpt-test", "messages": msgs}


def test_skipped_positions_are_not_read_and_the_rest_are() -> None:
    """A bad message inside `skip` is not read again; one outside it, or a bad system message, is refused."""
    body = _chat(6)
    body["messages"][2]["content"] = [{"type": ["text"]}]
    assert validate.problem("openai_chat", body, range(1, 5)) is None
    assert validate.problem("openai_chat", body, range(3, 5)) == "messages[2].content[0].type must be a string"
    body = _chat(6)
    body["messages"][0]["content"] = 5  # the leading system message lies before the skipped history
    assert validate.problem("openai_chat", body, range(1, 7)) == (
        "messages[0].content must be a string or an array or null")


def test_a_responses_items_output_and_reasoning_summary_are_checked_and_named() -> None:
    """A reasoning item's summary that is not an array of parts was a 500 (hashing iterated it); it is
    a 400 naming it, and a bad part of a tool's output is named as the output's, not the content's."""
    def body(item: dict[str, Any]) -> dict[str, Any]:
        return {"model": "m", "input": [{"role": "user", "content": "x"}, item]}

    assert validate.problem("openai_responses", body({"type": "reasoning", "id": "rs", "summary": 5})) == (
        "input[1].summary must be an array or null")
    assert validate.problem("openai_responses", body({"type": "reasoning", "id": "rs", "summary": [7]})) == (
        "input[1].summary[0] must be an object")
    bad_output = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "a"}, 3]}
    assert validate.problem("openai_responses", body(bad_output)) == "input[1].output[1] must be an object"
    fine = {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "thought"}]}
    assert validate.problem("openai_responses", body(fine)) is None


async def test_a_resent_history_is_checked_where_it_is_new(redis_url: str) -> None:
    """After valid turns, a new message of the wrong type, or an earlier one edited into one, is a 400;
    nothing is stored."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "resent"}
    async with memory_gateway(redis_url) as g:
        body = _chat(1)
        for _ in range(3):
            async with g.http.post(f"{g.url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                reply = (await r.json())["choices"][0]["message"]
            body["messages"] += [{"role": reply["role"], "content": reply["content"]},
                                 {"role": "user", "content": "and then?"}]
        await g.settle()
        stored = await g.messages("resent")

        bad_new = {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": [{"type": ["x"]}]}]}
        edited = {**body, "messages": [body["messages"][0], {"role": "user", "content": {"nested": 1}},
                                       *body["messages"][2:]]}
        for bad in (bad_new, edited):
            async with g.http.post(f"{g.url}/v1/chat/completions", json=bad, headers=headers) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        await g.settle()
        assert await g.messages("resent") == stored


def _with_deep(body: dict[str, Any]) -> bytes:
    """`body` as JSON with its "DEEP" string a list nested 1,000 levels (no encoder writes that)."""
    return json.dumps(body).replace('"DEEP"', "[" * 1000 + '"leaf"' + "]" * 1000).encode()


async def test_nesting_past_the_interpreter_limit_is_a_400_or_relayed_never_a_500(redis_url: str) -> None:
    """A body over the resend parser's 16 KiB, nested 1,000 levels in a tool result, is refused as too
    deep (it used to 500 comparing what it parsed); tool-call arguments that are a JSON string nested
    1,000 levels (a string: not checked for depth) are hashed as sent, in both dialects."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "deep", "anthropic-version": "2023-06-01"}
    deep_args = "[" * 1000 + "]" * 1000
    async with memory_gateway(redis_url) as g:
        pad = {"role": "user", "content": "x " * 9000}
        use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}
        done = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
        for conv, turns, want in (
            ("deep-list", [pad, use, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "DEEP"}]}], 400),
            ("deep-input", [pad, {**use, "content": [{**use["content"][0], "input": deep_args}]}, done], 200),
        ):
            body = {"model": "claude-test", "max_tokens": 5, "messages": turns}
            async with g.http.post(f"{g.url}/v1/messages", data=_with_deep(body),
                                   headers={**headers, "X-Conversation-Id": conv,
                                            "Content-Type": "application/json"}) as r:
                assert r.status == want, await r.text()
                if want == 400:
                    assert (await r.json())["type"] == "error"
        chat = {"model": "gpt-test", "messages": [
            pad, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
        async with g.http.post(f"{g.url}/v1/chat/completions", json=chat, headers=headers) as r:
            assert r.status == 200, await r.text()


async def test_a_member_nested_past_what_can_be_written_back_is_a_400_when_rewritten(redis_url: str) -> None:
    """Only the history is checked for depth at the edge. A `tools` array nested 300 levels passes
    while the conversation goes whole; once the turn is rewritten (the body is written back), it is a
    400 in the caller's dialect, not a 500."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "deep-tools"}
    async with memory_gateway(redis_url, memory={"message_threshold": 4, "keep_recent": 2, "fold_batch": 2}) as g:
        body = _chat(11)
        for m in body["messages"][1:]:
            m["content"] += " filler words to fold" * 40
        for turn in (9, 11):  # stored and folded, then the next turn is rewritten
            part = {**body, "messages": body["messages"][:turn + 1]}
            async with g.http.post(f"{g.url}/v1/chat/completions", json=part, headers=headers) as r:
                assert r.status == 200
            await g.settle()
        raw = json.dumps(body).replace('"messages"', '"tools": ' + "[" * 300 + "]" * 300 + ', "messages"', 1)
        async with g.http.post(f"{g.url}/v1/chat/completions", data=raw,
                               headers={**headers, "Content-Type": "application/json"}) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
            assert error["type"] == "invalid_request_error" and "nested" in error["message"]
        async with g.http.post(f"{g.url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200 and r.headers["x-gateway-context"] == "rewritten"


def test_string_bytes_reads_a_bounded_part_of_any_message() -> None:
    """The estimate that sends a message's work to a thread sums its strings (a picture's data URL
    is one), reads at most `nodes` of it, and takes a message of more nodes for a long one."""
    from gateway.validate import string_bytes

    picture = {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                           {"type": "image_url", "image_url": {"url": "x" * 3_000_000}}]}
    assert string_bytes(picture) == len("user") + len("text") + len("what is it?") + len("image_url") + 3_000_000
    assert string_bytes({"role": "user", "content": "hi"}) == 6
    many = {"role": "user", "content": [{"type": "text", "text": "a"}] * 1_000_000}
    assert string_bytes(many) == 1 << 20 and string_bytes({str(i): 1 for i in range(1_000_000)}) == 1 << 20
