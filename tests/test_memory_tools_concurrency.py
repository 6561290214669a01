"""Tool-call groups through the memory path, many concurrent requests on one conversation, and tenants
that share a conversation id."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from memory_helpers import (
    OTHER_KEY,
    Chat,
    Gateway,
    anthropic_turn,
    gw,  # noqa: F401 (fixture)
    gw_redis,  # noqa: F401 (fixture)
    openai_turn,
    plain,
    reply_text,
    store_url,  # noqa: F401 (fixture)
    user_text,
)

from gateway.testing import ToolCall

# -- tool calls ----------------------------------------------------------------------------------


def _calls(r: int) -> list[ToolCall]:
    """Two parallel calls per round, with ids the test can follow."""
    return [ToolCall("get_weather", {"city": f"City{r}", "units": "metric"}, id=f"call_{r}w"),
            ToolCall("get_time", {"zone": f"Zone/{r}"}, id=f"call_{r}t")]


def _check_openai_groups(msgs: list[dict[str, Any]]) -> int:
    """Every tool result directly follows (with its siblings) the assistant message that called it, and
    every call is answered before the conversation moves on. Returns the number of results."""
    results, open_ids = 0, set()
    for i, m in enumerate(msgs):
        if m["role"] == "tool":
            j = i - 1
            while msgs[j]["role"] == "tool":
                j -= 1
            caller = msgs[j]
            assert caller["role"] == "assistant", msgs
            assert m["tool_call_id"] in {c["id"] for c in caller.get("tool_calls") or []}, msgs
            open_ids.discard(m["tool_call_id"])
            results += 1
        else:
            assert not open_ids, (open_ids, msgs)
            open_ids = {c["id"] for c in m.get("tool_calls") or []}
    return results


def _check_anthropic_groups(msgs: list[dict[str, Any]]) -> int:
    """Every tool_result block answers a tool_use of the assistant message right before it, and every
    tool_use is answered by the next message. Returns the number of results."""
    results = 0
    for i, m in enumerate(msgs):
        blocks = m["content"] if isinstance(m["content"], list) else []
        uses = {b["id"] for b in blocks if b.get("type") == "tool_use"}
        answered = {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"}
        if answered:
            prev = msgs[i - 1]
            assert i > 0 and prev["role"] == "assistant", msgs
            assert answered == {b["id"] for b in prev["content"] if b.get("type") == "tool_use"}, msgs
            results += len(answered)
        if uses:
            nxt = msgs[i + 1]["content"]
            assert {b.get("tool_use_id") for b in nxt if isinstance(b, dict)} >= uses, msgs
    return results


async def test_openai_tool_calls_round_trip(gw: Gateway) -> None:  # noqa: F811
    """Assistant tool calls and tool results are stored and forwarded whole; a rewrite never separates a
    result from its call."""
    gw.fake.responder = reply_text
    client = gw.openai()
    system = {"role": "system", "content": "Use the tools."}
    msgs: list[dict[str, Any]] = []
    contexts = []
    for r in range(8):
        msgs.append({"role": "user", "content": user_text(r) + f" What is the weather in City{r}?"})
        gw.fake.tool_calls = _calls(r)
        raw = await gw.openai().chat.completions.with_raw_response.create(
            model="gpt-test", messages=[system, *msgs], extra_headers={"X-Conversation-Id": "tools-oa"})
        message = raw.parse().choices[0].message
        assert [c.id for c in message.tool_calls or []] == [f"call_{r}w", f"call_{r}t"]
        msgs.append(message.model_dump(exclude_none=True))
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": f'{{"result": "{c.function.name} ok {r}"}}'}
                 for c in message.tool_calls or []]
        gw.fake.tool_calls = []
        headers, text = await openai_turn(gw, client, "tools-oa", [system, *msgs], stream=r % 2 == 1)
        await gw.settle()
        fwd = gw.last("/chat/completions").body["messages"]
        assert fwd[-2:] == msgs[-2:]  # the newest group is whole, in the client's own bytes
        assert _check_openai_groups(fwd) >= 2
        contexts.append(headers["x-gateway-context"])
        msgs.append({"role": "assistant", "content": text})
    assert contexts.count("rewritten") >= 5
    stored = await gw.messages("tools-oa")
    assert len(stored) == len(msgs) and _check_openai_groups(stored) == 16
    for got, sent in zip(stored, msgs, strict=True):
        assert got["role"] == sent["role"] and got.get("tool_call_id") == sent.get("tool_call_id")
        assert [c["id"] for c in got.get("tool_calls") or []] == [c["id"] for c in sent.get("tool_calls") or []]
        assert [c["function"] for c in got.get("tool_calls") or []] == [
            c["function"] for c in sent.get("tool_calls") or []]


async def test_anthropic_tool_use_round_trip(gw: Gateway) -> None:  # noqa: F811
    """tool_use and tool_result blocks are stored and forwarded whole, each result right after its call,
    also in rewritten requests."""
    gw.fake.responder = reply_text
    client = gw.anthropic()
    msgs: list[dict[str, Any]] = []
    contexts = []
    for r in range(8):
        msgs.append({"role": "user", "content": user_text(r) + f" What is the weather in City{r}?"})
        gw.fake.tool_calls = _calls(r)
        _, message = await anthropic_turn(gw, client, "tools-an", msgs, system="Use the tools.", stream=r % 2 == 0)
        uses = [b for b in message.content if b.type == "tool_use"]
        assert [b.id for b in uses] == [f"toolu_{r}w", f"toolu_{r}t"] and message.stop_reason == "tool_use"
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"{b.name} ok {r}"} for b in uses]})
        gw.fake.tool_calls = []
        headers, message = await anthropic_turn(gw, client, "tools-an", msgs, system="Use the tools.")
        await gw.settle()
        fwd = gw.last("/messages").body["messages"]
        assert fwd[-1]["content"][-2:] == msgs[-1]["content"]  # results whole (notes may come first)
        assert _check_anthropic_groups(fwd) >= 2
        assert all(a["role"] != b["role"] for a, b in itertools.pairwise(fwd))
        contexts.append(headers["x-gateway-context"])
        msgs.append({"role": "assistant", "content": message.content[0].text})
    assert contexts.count("rewritten") >= 5
    stored = await gw.messages("tools-an")
    assert len(stored) == len(msgs) and _check_anthropic_groups(stored) == 16
    for got, sent in zip(stored, msgs, strict=True):
        if isinstance(sent["content"], list):
            strip = [{k: v for k, v in b.items() if k in ("type", "id", "name", "input", "tool_use_id", "content")}
                     for b in sent["content"]]
            assert [{k: v for k, v in b.items() if k in ("type", "id", "name", "input", "tool_use_id", "content")}
                    for b in got["content"]] == strip


# -- concurrency ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_concurrent_requests_store_the_union(gw: Gateway, dialect: str) -> None:  # noqa: F811
    """50 simultaneous requests on one conversation each store their user message and reply exactly once."""
    gw.fake.responder = reply_text
    chat, history = Chat(gw, dialect, "burst"), []
    for i in range(5):
        history.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(history)
        history.append({"role": "assistant", "content": text})
        await gw.settle()
    news = [{"role": "user", "content": f"Parallel question number {k}: what about shard {k}?"} for k in range(50)]
    # In flight together, as against a real provider: none is answered before the last one arrives
    # (an answered turn followed by a request without it is an edit, and branches).
    gw.fake.latency = 0.3
    results = await asyncio.gather(*(chat.send([*history, new], stream=k % 2 == 0) for k, new in enumerate(news)))
    assert {h["x-gateway-context"] for h, _ in results} == {"rewritten"}
    for request in gw.fake.requests[-50:]:  # each forwarded request carries its own question only
        assert str(request.body).count("Parallel question") == 1
    await gw.settle()
    stored = plain(await chat.stored())
    assert stored[:10] == history and len(stored) == 10 + 2 * 50
    for new in news:
        at = [i for i, m in enumerate(stored) if m == new]
        assert len(at) == 1, new
        reply = stored[at[0] + 1]
        assert reply["role"] == "assistant" and new["content"] in reply["content"], (new, reply)


# -- tenants -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_tenants_sharing_a_conversation_id_are_isolated(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Two credentials using the same X-Conversation-Id never see each other's turns."""
    g = gw_redis
    g.fake.responder = reply_text
    alice, bob = Chat(g, dialect, "shared"), Chat(g, dialect, "shared", key=OTHER_KEY)
    a_msgs: list[dict[str, Any]] = []
    for i in range(6):
        a_msgs.append({"role": "user", "content": f"Alice secret {i}: the launch code is {1000 + i}."})
        _, text = await alice.send(a_msgs)
        a_msgs.append({"role": "assistant", "content": text})
        await g.settle()
    status, err = await g.api("GET", "shared", key=OTHER_KEY)
    assert status == 404 and err["error"]["type"] == "not_found_error"
    assert (await g.api("GET", "shared/messages", key=OTHER_KEY))[0] == 404
    b_msgs = [{"role": "user", "content": "Bob here: what did we discuss?"}]
    headers, text = await bob.send(b_msgs)
    assert headers["x-gateway-context"] == "full"
    assert "Alice" not in str(g.last(bob.path).body) and plain(bob.forwarded()) == b_msgs
    b_msgs.append({"role": "assistant", "content": text})
    for i in range(5):
        b_msgs.append({"role": "user", "content": user_text(i)})
        _, text = await bob.send(b_msgs)
        b_msgs.append({"role": "assistant", "content": text})
        await g.settle()
        assert "Alice" not in str(g.last(bob.path).body)
    a_msgs.append({"role": "user", "content": "Alice again."})
    headers, _ = await alice.send(a_msgs)
    assert headers["x-gateway-context"] == "rewritten" and "Bob" not in str(g.last(alice.path).body)
    assert (await g.api("GET", "shared", key=OTHER_KEY))[1]["messages"] == len(b_msgs)
    assert (await g.api("GET", "shared"))[1]["messages"] == len(a_msgs) + 1
    assert "Alice" not in str(await bob.stored()) and "Bob" not in str(await alice.stored())
    assert "Alice" not in str((await g.api("GET", "shared", key=OTHER_KEY))[1]["summary"])
