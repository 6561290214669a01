"""Token accounting: what the headers and stats report as saved."""

from __future__ import annotations

from typing import Any

from memory_helpers import KEY, memory_gateway, openai_turn, user_text

from gateway.app import STORE
from gateway.auth import tenant_for
from gateway.keys import ConvRef


async def test_saved_tokens_are_net_of_summarizer_cost(redis_url: str) -> None:
    """Summarizer tokens spent on a conversation are deducted once from the next request's savings."""
    async with memory_gateway(redis_url) as g:
        client = g.openai()
        history: list[dict[str, Any]] = []

        async def turn(text: str) -> Any:
            history.append({"role": "user", "content": text})
            headers, reply = await openai_turn(g, client, "acct", history)
            history.append({"role": "assistant", "content": reply})
            return headers

        for i in range(10):
            await turn(user_text(i))
        await g.settle()
        store = g.app[STORE]
        ref = ConvRef(tenant_for(KEY), "acct")
        await store.add_stats(ref, summarizer_tokens_in=120, summarizer_tokens_out=30)

        first = await turn(user_text(10))
        second = await turn(user_text(11))

        for h in (first, second):
            assert h["x-gateway-context"] == "rewritten"
        gross1 = int(first["x-gateway-tokens-original"]) - int(first["x-gateway-tokens-forwarded"])
        gross2 = int(second["x-gateway-tokens-original"]) - int(second["x-gateway-tokens-forwarded"])
        assert int(first["x-gateway-tokens-saved"]) == gross1 - 150
        assert int(second["x-gateway-tokens-saved"]) == gross2  # charged once, not again
        stats = await store.stats(ref)
        assert stats["summarizer_tokens_charged"] == 150
