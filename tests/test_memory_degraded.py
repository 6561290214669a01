"""The store goes away mid-conversation and comes back: requests never fail because of it."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from conftest import RedisProcess
from memory_helpers import KEY, Chat, Gateway, memory_gateway, plain, reply_text, user_text


async def _store_errors(g: Gateway) -> float:
    async with g.http.get(g.url + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^gateway_store_errors_total (\S+)$", text, re.M)
    assert m is not None, text
    return float(m.group(1))


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_store_outage_degrades_then_memory_resumes(redis_process: RedisProcess, dialect: str) -> None:
    """With the store down, requests still succeed, forwarded unchanged and marked `degraded` (and counted
    in /metrics); once the store is back, memory resumes by itself."""
    async with memory_gateway(redis_process.url) as g:
        g.fake.responder = reply_text
        chat, msgs = Chat(g, dialect, "outage"), []
        for i in range(4):
            msgs.append({"role": "user", "content": user_text(i)})
            headers, text = await chat.send(msgs)
            msgs.append({"role": "assistant", "content": text})
            await g.settle()
        assert headers["x-gateway-context"] in ("full", "rewritten")
        errors_before = await _store_errors(g)

        redis_process.kill()
        for i in range(4, 8):  # well past the rewrite threshold: only the store's absence keeps it whole
            msgs.append({"role": "user", "content": user_text(i)})
            started = time.monotonic()
            headers, text = await chat.send(msgs, stream=i % 2 == 0)
            assert time.monotonic() - started < 5
            assert headers["x-gateway-context"] == "degraded"
            assert text == reply_text({"messages": msgs})
            body: dict[str, Any] = g.last(chat.path).body
            assert plain(chat.forwarded()) == msgs and "Summary" not in str(body)
            assert int(headers["x-gateway-tokens-saved"]) == 0
            # The full set of headers, as on every request that names a conversation: sent as it came.
            assert headers["x-gateway-cost-original"] == headers["x-gateway-cost-forwarded"]
            assert int(headers["x-gateway-cost-original"]) > 0 and 0 < float(headers["x-gateway-window-used"]) < 1
            msgs.append({"role": "assistant", "content": text})
        raw = (b'{"model": "gpt-test",  "messages": [{"role": "user", "content": "caf\\u00e9"}],\n'
               b' "temperature": 0.50}')
        async with g.http.post(g.url + "/v1/chat/completions", data=raw, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                "X-Conversation-Id": "outage-raw"}) as r:
            assert r.status == 200 and r.headers["x-gateway-context"] == "degraded"
        assert g.fake.requests[-1].raw == raw  # byte for byte
        assert await _store_errors(g) >= errors_before + 5
        status, err = await g.api("GET", "outage")
        assert status == 503 and err["error"]["message"] == "the conversation store is unreachable"

        redis_process.start()  # same port, empty (no persistence)
        msgs.append({"role": "user", "content": user_text(8)})
        deadline = time.monotonic() + 10
        while True:  # the client reconnects on its own; give it a moment
            headers, text = await chat.send(msgs)
            if headers["x-gateway-context"] != "degraded" or time.monotonic() > deadline:
                break
        assert headers["x-gateway-context"] in ("full", "rewritten")
        msgs.append({"role": "assistant", "content": text})
        await g.settle()
        assert plain(await chat.stored()) == msgs  # the client's history, stored again from its request
        for i in range(9, 12):
            msgs.append({"role": "user", "content": user_text(i)})
            headers, text = await chat.send(msgs)
            msgs.append({"role": "assistant", "content": text})
            await g.settle()
        assert headers["x-gateway-context"] == "rewritten"
        assert "## Summary of the earlier conversation" in chat.injected()
        assert len(await chat.stored()) == len(msgs)
