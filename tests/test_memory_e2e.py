"""End to end through the official SDKs: long conversations are rewritten truthfully, the rewritten
prefix is cache-stable, requests outside the memory path are untouched, and an impossible turn is refused.

The gateway is the real app (memory on, small thresholds) over real Redis and `memory://`, in front of
a fake upstream that records what it receives.
"""

from __future__ import annotations

import itertools
from typing import Any

import anthropic
import openai
import orjson
import pytest
from memory_helpers import (
    ANTHROPIC_MODEL,
    COUNTER,
    KEY,
    OPENAI_MODEL,
    SYSTEM,
    Gateway,
    anthropic_turn,
    block_text,
    count_breakpoints,
    gw,  # noqa: F401 (fixture)
    gw_redis,  # noqa: F401 (fixture)
    history_tokens,
    memory_gateway,
    openai_turn,
    reply_text,
    store_url,  # noqa: F401 (fixture)
    token_headers,
    user_text,
)

from gateway.app import PROXY, SETTINGS, STORE
from gateway.summarizer import ExtractiveSummarizer
from gateway.worker import FoldWorker

SUMMARY_HEAD = "## Summary of the earlier conversation"
TURNS = 40  # user turns: 80 messages


def _close(a: int, b: int, rel: float = 0.03) -> bool:
    return abs(a - b) <= max(4, rel * b)


async def test_long_openai_conversation_is_rewritten(gw: Gateway) -> None:  # noqa: F811
    """An 80-message chat (streamed and not) is forwarded as system prompt + summary + recent turns,
    and the token headers tell the truth about what was saved."""
    gw.fake.responder = reply_text
    client = gw.openai()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    rewritten = 0
    for i in range(TURNS):
        msgs.append({"role": "user", "content": user_text(i)})
        headers, text = await openai_turn(gw, client, "long-oa", msgs, stream=i % 2 == 1)
        assert text == reply_text({"messages": msgs})
        await gw.settle()
        kind, original, forwarded, saved = token_headers(headers)
        assert original - forwarded == saved
        assert _close(original, history_tokens([m["content"] for m in msgs[1:]], SYSTEM), 0.02)
        fwd = gw.last("/chat/completions").body["messages"]
        assert fwd[0] == {"role": "system", "content": SYSTEM}
        assert fwd[-1] == msgs[-1]
        if i >= 6:
            assert kind == "rewritten", i
        if kind == "rewritten":
            rewritten += 1
            assert forwarded < original
            assert fwd[1]["role"] == "system" and fwd[1]["content"].startswith(SUMMARY_HEAD)
            injected = [m for m in fwd[1:] if m["role"] == "system"]
            sent = (COUNTER.count(SYSTEM) + sum(COUNTER.count(m["content"]) for m in injected)
                    + sum(COUNTER.count_message(m["content"]) for m in fwd if m["role"] != "system"))
            assert _close(forwarded, sent), (forwarded, sent)
        else:
            assert fwd == msgs
        msgs.append({"role": "assistant", "content": text})
    assert rewritten >= TURNS - 6
    assert len(fwd) < len(msgs) / 4 and forwarded < original / 2
    status, info = await gw.api("GET", "long-oa")
    assert status == 200 and info["messages"] == 2 * TURNS and info["summary"]["covers"] >= 2 * TURNS - 12


async def test_long_anthropic_conversation_is_rewritten(gw: Gateway) -> None:  # noqa: F811
    """An 80-message Messages conversation (messages.stream and create) keeps the client's system prompt
    first, carries the summary in `system`, and forwards a fraction of the history."""
    gw.fake.responder = reply_text
    client = gw.anthropic()
    msgs: list[dict[str, Any]] = []
    for i in range(TURNS):
        msgs.append({"role": "user", "content": user_text(i)})
        headers, message = await anthropic_turn(gw, client, "long-an", msgs, system=SYSTEM, stream=i % 2 == 0)
        text = message.content[0].text
        assert text == reply_text({"messages": msgs})
        await gw.settle()
        kind, original, forwarded, saved = token_headers(headers)
        assert original - forwarded == saved
        assert _close(original, history_tokens([m["content"] for m in msgs], SYSTEM), 0.02)
        body = gw.last("/messages").body
        if i >= 6:
            assert kind == "rewritten", i
        if kind == "rewritten":
            assert forwarded < original
            system = body["system"]
            assert system[0] == {"type": "text", "text": SYSTEM}
            assert system[-1]["text"].startswith(SUMMARY_HEAD) and system[-1]["cache_control"] == {"type": "ephemeral"}
            assert user_text(i) in block_text(body["messages"][-1]["content"])
            assert body["messages"][0]["role"] == "user"
            assert all(a["role"] != b["role"] for a, b in zip(body["messages"], body["messages"][1:], strict=False))
        else:
            assert body["system"] == SYSTEM and body["messages"] == msgs
        msgs.append({"role": "assistant", "content": text})
    assert len(body["messages"]) < len(msgs) / 4 and forwarded < original / 2


# -- prompt cache --------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_rewritten_prefix_is_byte_stable_between_folds(redis_url: str, dialect: str) -> None:
    """Two rewritten requests with no fold in between send byte-identical system + state + summary
    prefixes, so the provider's prompt cache hits."""
    # Folds run only when the test says so: a worker of our own, in burst mode.
    async with memory_gateway(redis_url, memory={"worker": {"in_process": 0}}) as g:
        g.fake.responder = reply_text
        folder = FoldWorker(g.app[STORE], g.app[SETTINGS], ExtractiveSummarizer(COUNTER.count))
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}] if dialect == "openai" else []
        prefixes: list[tuple[int, bytes]] = []  # (folds done before, prefix bytes) per rewritten request
        folds = 0
        for i in range(16):
            msgs.append({"role": "user", "content": user_text(i)})
            if dialect == "openai":
                headers, text = await openai_turn(g, g.openai(), "cache", msgs)
            else:
                headers, message = await anthropic_turn(g, g.anthropic(), "cache", msgs, system=SYSTEM)
                text = message.content[0].text
            msgs.append({"role": "assistant", "content": text})
            if i == 0:  # the conversation exists now: its state can be edited
                edit = {"decisions": ["Use Redis streams for folds"]}
                assert (await g.api("PUT", "cache/state", json=edit))[0] == 200
            body = g.last().body
            if headers["x-gateway-context"] == "rewritten":
                prefix = body["messages"][:2] if dialect == "openai" else body["system"]
                assert "Use Redis streams for folds" in orjson.dumps(prefix).decode()
                prefixes.append((folds, orjson.dumps(prefix)))
            if i % 4 == 3:  # fold now and then, not after every turn
                await folder.run(burst=True)
                folds += 1
        pairs = [(a, b) for a, b in itertools.pairwise(prefixes) if a[0] == b[0]]
        assert len(pairs) >= 4
        assert all(a[1] == b[1] for a, b in pairs)
        assert len({p[1] for p in prefixes}) >= 2  # each fold did change the summary


async def test_anthropic_breakpoints_never_exceed_four(gw_redis: Gateway) -> None:  # noqa: F811
    """The gateway adds its cache breakpoint after the summary only while the request has fewer than 4."""
    g = gw_redis
    g.fake.responder = reply_text
    tools = [{"name": "lookup", "description": "look up", "input_schema": {"type": "object"},
              "cache_control": {"type": "ephemeral"}}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    for conv, client_marks in (("bp-2", 2), ("bp-4", 4)):
        msgs: list[dict[str, Any]] = []
        for i in range(12):
            mark = {"cache_control": {"type": "ephemeral"}} if client_marks == 4 else {}
            # Two more breakpoints on the newest user message when the client uses all 4.
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"context {i}", **mark},
                                                     {"type": "text", "text": user_text(i), **mark}]})
            headers, message = await anthropic_turn(g, g.anthropic(), conv, msgs, system=system, tools=tools)
            await g.settle()
            body = g.last("/messages").body
            total = count_breakpoints(body["tools"]) + count_breakpoints(body["system"]) + count_breakpoints(
                body["messages"])
            assert total <= 4
            if headers["x-gateway-context"] == "rewritten":
                summary = body["system"][-1]
                assert summary["text"].startswith(SUMMARY_HEAD)
                assert ("cache_control" in summary) is (client_marks == 2)
                assert total == (3 if client_marks == 2 else 4)
            # Older turns carry no breakpoint (cache_control does not change a message's identity).
            msgs[-1] = {"role": "user", "content": [{"type": "text", "text": f"context {i}"},
                                                    {"type": "text", "text": user_text(i)}]}
            msgs.append({"role": "assistant", "content": message.content[0].text})
        assert headers["x-gateway-context"] == "rewritten"


# -- outside the memory path ---------------------------------------------------------------------

RAW_BODIES = {
    "/v1/chat/completions": b'{"model":  "gpt-test",\n "messages": [{"role": "user", "content": "caf\\u00e9"}],'
                            b' "temperature": 0.50 }',
    "/v1/messages": b'{ "model": "claude-test", "max_tokens": 16,\n "messages": [{"content": "hi",'
                    b' "role": "user"}] }',
}


@pytest.mark.parametrize("path", list(RAW_BODIES))
async def test_no_conversation_id_forwards_bytes(gw_redis: Gateway, path: str) -> None:  # noqa: F811
    """Without a conversation id the upstream receives exactly the client's bytes, and nothing is stored."""
    raw = RAW_BODIES[path]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    for _ in range(8):  # well past the rewrite threshold, had it been a conversation
        async with gw_redis.http.post(gw_redis.url + path, data=raw, headers=headers) as r:
            assert r.status == 200
            assert "x-gateway-context" not in r.headers
        assert gw_redis.fake.requests[-1].raw == raw
    await gw_redis.settle()
    assert [k async for k in gw_redis.app[STORE].redis.scan_iter("gw:{*")] == []  # no conversation keys


async def test_memory_off_header_passes_through(gw_redis: Gateway) -> None:  # noqa: F811
    """`X-Memory: off` forwards the body unchanged, says so in x-gateway-context, and records nothing."""
    g = gw_redis
    raw = RAW_BODIES["/v1/chat/completions"]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
               "X-Conversation-Id": "off-1", "X-Memory": "off"}
    async with g.http.post(g.url + "/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200 and r.headers["x-gateway-context"] == "passthrough"
    assert g.fake.requests[-1].raw == raw
    msgs = [{"role": "user", "content": user_text(i)} for i in range(12)]
    h, _ = await openai_turn(g, g.openai(), "off-1", msgs, extra_headers={"X-Memory": "off"})
    assert h["x-gateway-context"] == "passthrough" and g.fake.requests[-1].body["messages"] == msgs
    await g.settle()
    assert (await g.api("GET", "off-1"))[0] == 404


# -- a turn that cannot fit ----------------------------------------------------------------------

@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_turn_larger_than_context_window_is_refused(redis_url: str, dialect: str) -> None:
    """A newest message that cannot fit the model's window is a clear 400 in the caller's dialect; nothing
    is sent upstream or stored."""
    async with memory_gateway(redis_url, models={"tiny": {"context_window": 2000}}) as g:
        g.fake.responder = reply_text
        conv, huge = "tiny-1", "lorem ipsum dolor " * 1500
        msgs: list[dict[str, Any]] = []
        for i in range(2):
            msgs.append({"role": "user", "content": user_text(i)})
            if dialect == "openai":
                _, text = await openai_turn(g, g.openai(), conv, msgs, model="tiny")
            else:
                text = (await anthropic_turn(g, g.anthropic(), conv, msgs, model="tiny"))[1].content[0].text
            msgs.append({"role": "assistant", "content": text})
        sent = len(g.fake.requests)
        msgs.append({"role": "user", "content": huge})
        if dialect == "openai":
            with pytest.raises(openai.BadRequestError) as oa:
                await openai_turn(g, g.openai(), conv, msgs, model="tiny")
            err = oa.value.body
            assert isinstance(err, dict) and err["type"] == "invalid_request_error"
            assert "context window" in err["message"]
        else:
            with pytest.raises(anthropic.BadRequestError) as an:
                await anthropic_turn(g, g.anthropic(), conv, msgs, model="tiny")
            body = an.value.body
            assert isinstance(body, dict) and body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error" and "context window" in body["error"]["message"]
        await g.settle()
        assert len(g.fake.requests) == sent
        _, info = await g.api("GET", conv)
        assert info["messages"] == 4
        # The same huge message to a model with room is fine.
        msgs[-1] = {"role": "user", "content": huge}
        model = OPENAI_MODEL if dialect == "openai" else ANTHROPIC_MODEL
        if dialect == "openai":
            await openai_turn(g, g.openai(), conv, msgs, model=model)
        else:
            await anthropic_turn(g, g.anthropic(), conv, msgs, model=model)
        assert (await g.api("GET", conv))[1]["messages"] == 6


# -- long bodies: the resent history is parsed from where the last request's ended ----------------

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a [record] by id.",
                                           "parameters": {"type": "object", "required": ["id"],
                                                          "properties": {"id": {"type": "string"}}}}}]


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_bulky_resent_histories_are_parsed_and_stored_exactly(gw: Gateway, dialect: str,  # noqa: F811
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies of tens of KB that resend the history every turn (tools after it, streamed or not, an edit
    midway) are understood exactly: the stored history is always the client's, and most bodies were
    parsed from where the previous one ended."""
    gw.fake.responder = reply_text
    bodies = gw.app[PROXY].bodies
    resent: list[bool] = []
    parse_tail = bodies._resent

    def counted(*args: Any) -> Any:
        body = parse_tail(*args)
        resent.append(body is not None)
        return body

    monkeypatch.setattr(bodies, "_resent", counted)
    msgs: list[dict[str, Any]] = []
    conv = f"bulky-{dialect}"
    for i in range(16):
        if i == 10:  # an edit of an early user turn: the stored conversation branches there
            msgs = [*msgs[:6], {"role": "user", "content": "Edited: " + user_text(3) * 30}]
        else:
            msgs.append({"role": "user", "content": user_text(i) * 30})  # ~6 KB a turn
        if dialect == "openai":
            _, text = await openai_turn(gw, gw.openai(), conv, msgs, stream=i % 2 == 1, tools=TOOLS)
            assert gw.last("/chat/completions").body["tools"] == TOOLS
        else:
            text = (await anthropic_turn(gw, gw.anthropic(), conv, msgs, stream=i % 2 == 1,
                                         system=SYSTEM))[1].content[0].text
        assert text == reply_text({"messages": msgs})
        msgs.append({"role": "assistant", "content": text})
        stored = await gw.messages(conv)  # Anthropic replies are stored as the text blocks they came as
        assert [(m["role"], block_text(m["content"])) for m in stored] == [(m["role"], m["content"]) for m in msgs]
    assert len(orjson.dumps(msgs)) > 40_000
    assert sum(resent) >= 10 and not all(resent)  # the edit was parsed whole
