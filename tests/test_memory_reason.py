"""Every response of a conversation says why its context is what it is (`x-gateway-reason`)."""

from __future__ import annotations

from typing import Any

from tests.memory_helpers import (
    Gateway,
    gw,  # noqa: F401 (fixture)
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
