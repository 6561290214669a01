"""Every response of a conversation says why its context is what it is (`x-gateway-reason`)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from gateway import app as app_module
from tests.memory_helpers import (
    Gateway,
    Lines,
    gw,  # noqa: F401 (fixture)
    loop_turns,
    memory_gateway,
    openai_turn,
    store_url,  # noqa: F401 (fixture)
    user_text,
)


async def test_each_decision_names_its_reason(gw: Gateway) -> None:  # noqa: F811
    """Short → under-threshold; over the thresholds → rewritten; X-Memory: off → memory-off."""
    client = gw.openai()
    history: list[dict[str, Any]] = []
    seen: list[tuple[str, str]] = []
    for i in range(10):
        history.append({"role": "user", "content": user_text(i)})
        headers, reply = await openai_turn(gw, client, "why", history)
        history.append({"role": "assistant", "content": reply})
        seen.append((headers["x-gateway-context"], headers["x-gateway-reason"]))
        await gw.settle()
    assert seen[0] == ("full", "under-threshold")
    assert seen[-1] == ("rewritten", "rewritten")
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[*history, {"role": "user", "content": "and now?"}],
        extra_headers={"X-Conversation-Id": "why", "X-Memory": "off"})
    assert (raw.headers["x-gateway-context"], raw.headers["x-gateway-reason"]) == ("passthrough", "memory-off")


async def test_a_request_over_max_messages_is_relayed_and_not_stored(redis_url: str) -> None:
    """More messages than memory.max_messages: the body goes upstream as sent, the answer comes back,
    the reason says why, and nothing is stored (processing them would hold the event loop)."""
    async with memory_gateway(redis_url, memory={"max_messages": 40}) as g:
        client = g.openai()
        many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(41)]
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-test", messages=many, extra_headers={"X-Conversation-Id": "import"})
        assert raw.parse().choices[0].message.content
        assert (raw.headers["x-gateway-context"], raw.headers["x-gateway-reason"]) == ("passthrough",
                                                                                       "too-many-messages")
        assert g.last("/chat/completions").body["messages"] == many
        assert (await g.api("GET", "import"))[0] == 404
        headers, _ = await openai_turn(g, client, "import", many[:40])  # at the limit: kept as usual
        assert headers["x-gateway-reason"] != "too-many-messages"
        assert (await g.api("GET", "import"))[1]["messages"] == 41


async def test_a_request_over_max_parts_is_relayed_and_not_stored(redis_url: str) -> None:
    """More content parts than memory.max_parts, in one message or in a tool result's own content
    (Anthropic): relayed as sent, reason too-many-parts, nothing stored; at the limit, kept as usual.
    (Each part costs the event loop microseconds: a million of them stalled every request for seconds.)"""
    async with memory_gateway(redis_url, memory={"max_parts": 30}) as g:
        client = g.anthropic()
        use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]}

        def result(n: int) -> dict[str, Any]:
            return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                 "content": [{"type": "text", "text": f"f{i}"} for i in range(n)]}]}

        wide = [{"role": "user", "content": [{"type": "text", "text": f"p{i}"} for i in range(31)]}]
        for conv, messages in (("wide", wide), ("deep", [{"role": "user", "content": "ls"}, use, result(30)])):
            raw = await client.messages.with_raw_response.create(
                model="claude-test", max_tokens=5, messages=messages, extra_headers={"X-Conversation-Id": conv})
            assert raw.headers["x-gateway-reason"] == "too-many-parts", conv
            assert g.last("/messages").body["messages"] == messages
            assert (await g.api("GET", conv))[0] == 404
        ok = [{"role": "user", "content": "ls"}, use, result(27)]  # 1 + 1 + 1 + 27 parts: at the limit
        raw = await client.messages.with_raw_response.create(
            model="claude-test", max_tokens=5, messages=ok, extra_headers={"X-Conversation-Id": "ok"})
        assert raw.headers["x-gateway-reason"] != "too-many-parts"
        await g.settle()
        status, _ = await g.api("GET", "ok")
        assert status == 200
        # The parts counted are those of the request's new messages (the resent ones were counted then).
        grown = [*ok, {"role": "assistant", "content": "done"}, {"role": "user", "content": "and these?"}]
        raw = await client.messages.with_raw_response.create(
            model="claude-test", max_tokens=5, messages=grown, extra_headers={"X-Conversation-Id": "ok"})
        assert raw.headers["x-gateway-reason"] != "too-many-parts"
        await g.settle()
        grown += [{"role": "assistant", "content": "done"}, wide[0]]
        raw = await client.messages.with_raw_response.create(
            model="claude-test", max_tokens=5, messages=grown, extra_headers={"X-Conversation-Id": "ok"})
        assert raw.headers["x-gateway-reason"] == "too-many-parts"
        await g.settle()
        assert (await g.api("GET", "ok"))[1]["messages"] == len(ok) + 3  # the turn of many parts is not stored


async def test_a_delta_clients_turn_memory_cannot_take_is_refused_not_relayed_with_a_hole(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends only new turns has its history in the gateway alone: a turn over max_parts or
    max_messages relayed as sent would reach the model without that history and be missing from the
    store. It gets a 400 in its dialect instead (its request log line says why), and what is stored
    stays as it was; whether the client was configured as delta or seen sending new turns only
    (history: auto)."""
    lines = Lines()
    monkeypatch.setattr(app_module, "get_logger", lambda name="gateway": lines)
    for mode in ("delta", "auto"):
        async with memory_gateway(redis_url, memory={"max_parts": 30, "max_messages": 40},
                                  conversation={"history": mode}) as g:
            client = g.anthropic()
            conv = f"delta-{mode}"
            for i in range(3):  # each request carries the new turn only
                turn = [{"role": "user", "content": user_text(i)}]
                raw = await client.messages.with_raw_response.create(
                    model="claude-test", max_tokens=5, messages=turn, extra_headers={"X-Conversation-Id": conv})
                assert raw.status_code == 200
                await g.settle()
            stored = (await g.api("GET", conv))[1]["messages"]
            assert stored == 6
            wide = [{"role": "user", "content": [{"type": "text", "text": f"p{i}"} for i in range(31)]}]
            many = [{"role": "user", "content": f"m{i}"} for i in range(41)]
            for messages, limit in ((wide, "max_parts"), (many, "max_messages")):
                with pytest.raises(anthropic.BadRequestError) as err:
                    await client.messages.create(model="claude-test", max_tokens=5, messages=messages,
                                                 extra_headers={"X-Conversation-Id": conv})
                assert f"memory.{limit}" in str(err.value) and "only new turns" in str(err.value), mode
                assert err.value.body["type"] == "error"  # Anthropic's error shape
                logged = lines.events("request")[-1]
                assert logged["status"] == 400 and f"memory.{limit}" in logged["error"], mode
            await g.settle()
            assert (await g.api("GET", conv))[1]["messages"] == stored
            if mode == "auto":
                # This process forgets its view (an edit through the API drops it; so do a restart and an
                # eviction): the client's style is read from the store, and the turn is refused still.
                status, _ = await g.api("PUT", f"{conv}/state", json={"goal": "ship it"})
                assert status == 200
                with pytest.raises(anthropic.BadRequestError):
                    await client.messages.create(model="claude-test", max_tokens=5, messages=wide,
                                                 extra_headers={"X-Conversation-Id": conv})
                # Relayed, as before: a conversation not seen as delta; a whole history (it carries a
                # reply) on one seen as delta; the id reused by another API.
                raw = await client.messages.with_raw_response.create(
                    model="claude-test", max_tokens=5, messages=wide, extra_headers={"X-Conversation-Id": "fresh"})
                assert raw.headers["x-gateway-reason"] == "too-many-parts"
                whole = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(41)]
                raw = await client.messages.with_raw_response.create(
                    model="claude-test", max_tokens=5, messages=whole, extra_headers={"X-Conversation-Id": conv})
                assert raw.headers["x-gateway-reason"] == "too-many-messages"
                chat = await g.openai().chat.completions.with_raw_response.create(
                    model="gpt-test", messages=many, extra_headers={"X-Conversation-Id": conv})  # type: ignore[arg-type]
                assert chat.headers["x-gateway-reason"] == "too-many-messages"


async def test_a_turn_over_the_gateways_budget_goes_to_the_provider_as_sent(redis_url: str) -> None:
    """A newest turn over the gateway's budget (budget_ratio x the window, less max output) is not
    refused: the client's own request goes upstream as sent, marked too-large, and is stored."""
    async with memory_gateway(redis_url, models={"gpt-test": {"context_window": 2000}}) as g:
        client = g.openai()
        big = [{"role": "user", "content": "lorem ipsum dolor " * 400}]  # ~1,200 tokens; budget 1600 - 500
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-test", messages=big, max_tokens=500, extra_headers={"X-Conversation-Id": "big-turn"})
        assert raw.parse().choices[0].message.content
        assert (raw.headers["x-gateway-context"], raw.headers["x-gateway-reason"]) == ("full", "too-large")
        assert g.last("/chat/completions").body["messages"] == big
        assert (await g.api("GET", "big-turn"))[1]["messages"] == 2


def test_parts_are_counted_wherever_a_body_holds_them() -> None:
    """Tool calls, a tool result inside a tool result, system blocks, Responses outputs and
    instructions, a chat system message's parts: all count against max_parts, on one budget."""
    from gateway.validate import body_parts_over

    many = [{"type": "text", "text": "a"}] * 11
    bodies = {
        "tool_calls": ("messages", {"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}] * 11}]}),
        "nested result": ("messages", {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "content": [{"type": "tool_result", "content": many}]}]}]}),
        "system blocks": ("messages", {"system": many, "messages": []}),
        "responses output": ("input", {"input": [{"type": "function_call_output", "output": many}]}),
        "instructions": ("input", {"instructions": many, "input": []}),
        "chat system": ("messages", {"messages": [{"role": "system", "content": many}]}),
        "split": ("messages", {"system": many[:6], "messages": [{"role": "user", "content": many[:6]}]}),
    }
    for name, (field, body) in bodies.items():
        assert body_parts_over(body, field, 10), name
        assert not body_parts_over(body, field, 20), name


async def test_a_responses_string_input_is_one_user_turn_of_the_conversation(redis_url: str) -> None:
    """A string `input` is one user message, as the API reads it. A client that sends only its new turn
    that way (here after three as lists) had it relayed alone, without its history, and not stored; it
    now gets its history and the turn is kept. A first request with a string goes as it came."""
    async with memory_gateway(redis_url, conversation={"history": "delta"}) as g:
        client = g.openai()
        headers = {"X-Conversation-Id": "strings"}
        for text in ("one", "two", "three"):
            await client.responses.create(model="gpt-test", input=[{"role": "user", "content": text}],
                                          extra_headers=headers)
            await g.settle()
        raw = await client.responses.with_raw_response.create(model="gpt-test", input="four", extra_headers=headers)
        assert raw.headers["x-gateway-reason"] != "not-rewritable"
        sent = g.last("/v1/responses").body["input"]
        said = [i["content"] for i in sent if i.get("role") == "user"]
        assert said[0] == "one" and said[-1] == "four" and len(said) == 4
        await g.settle()
        stored = await g.messages("strings")
        assert len(stored) == 8 and stored[6] == {"role": "user", "content": "four"}
    async with memory_gateway(redis_url) as g:
        raw = await g.openai().responses.with_raw_response.create(model="gpt-test", input="hello",
                                                                  extra_headers={"X-Conversation-Id": "first"})
        assert raw.headers["x-gateway-reason"] == "under-threshold"
        assert g.last("/v1/responses").body["input"] == "hello"  # as the client sent it
        await g.settle()
        assert len(await g.messages("first")) == 2


def test_a_responses_string_input_is_counted_as_one_message_not_its_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts check read a string input as the list sent and split it into its characters: 3M
    characters took 0.3 s and 338 MB on the event loop. It counts the one message the string is."""
    from gateway import memory, validate
    from gateway.dialects import dialect_named

    seen: list[int] = []
    real = validate.body_parts_over

    def spy(body: Any, field: str, limit: int, items: list[Any]) -> bool:
        seen.append(len(items))
        return real(body, field, limit, items)

    monkeypatch.setattr(validate, "body_parts_over", spy)
    dialect = dialect_named("openai_responses")
    body = {"model": "m", "input": "x" * 1_000_000}
    history = dialect.history(body)
    assert history is not None
    memory._check(dialect, body, history, 20_000, 0)
    assert seen == [1]


async def test_a_history_refused_as_too_long_is_read_for_a_reply_with_the_loop_served() -> None:
    """Whether a refused history carries a reply (is it a full-history client's?) is read in
    slices: such a history may hold millions of items, each a Python step."""
    from gateway.dialects import dialect_named
    from gateway.memory import _carries_a_reply_served

    anthropic = dialect_named("anthropic")
    users = [{"role": "user", "content": "x"}] * 50_000
    async with loop_turns() as turns:
        assert await _carries_a_reply_served(anthropic, [*users, {"role": "assistant", "content": "y"}])
        assert not await _carries_a_reply_served(anthropic, users)
    assert turns[0] >= 20
