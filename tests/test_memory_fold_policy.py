"""When the request path queues folds: only for conversations that get rewritten, and once per fold."""

from __future__ import annotations

from typing import Any

import pytest
from memory_helpers import Chat, Gateway, memory_gateway, user_text

from gateway.app import STORE

# Rewritten from 12 messages on; a fold is due once 4 messages aged out of a 4-message window.
POLICY: dict[str, Any] = {"message_threshold": 12, "token_threshold": 100_000, "keep_recent": 4, "fold_batch": 4}


async def grow(chat: Chat, msgs: list[dict[str, Any]], until: int) -> None:
    """Extend `msgs` turn by turn (user, then the gateway's reply) until it holds `until` messages."""
    while len(msgs) < until:
        msgs.append({"role": "user", "content": user_text(len(msgs))})
        _, reply = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": reply})


async def conversation(g: Gateway, conv: str) -> dict[str, Any]:
    status, info = await g.api("GET", conv)
    assert status == 200, info
    return info  # type: ignore[no-any-return]


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_conversation_under_the_thresholds_is_never_folded(redis_url: str, dialect: str) -> None:
    """Under both rewrite thresholds nothing is summarised (requests go whole); past them folds begin."""
    async with memory_gateway(redis_url, memory=POLICY) as g:
        chat, msgs = Chat(g, dialect, "short"), []
        await grow(chat, msgs, 10)
        await g.settle()
        info = await conversation(g, "short")
        assert info["messages"] == 10 and info["summary"] is None and not info["fold_pending"]
        assert await g.app[STORE].redis.xlen(g.app[STORE].keys.fold_stream()) == 0

        await grow(chat, msgs, 16)
        await g.settle()
        info = await conversation(g, "short")
        assert info["summary"] is not None and info["summary"]["covers"] >= 4


async def test_a_queued_fold_is_not_queued_again_by_every_request(redis_url: str) -> None:
    """While a fold is queued (no worker has taken it), later requests do not ask Redis to queue it again."""
    async with memory_gateway(redis_url, memory={**POLICY, "worker": {"in_process": 0}}) as g:
        store = g.app[STORE]
        calls: list[bool] = []
        enqueue = store.enqueue_fold

        async def counting(ref: Any, *, urgent: bool = False) -> bool:
            calls.append(urgent)
            return bool(await enqueue(ref, urgent=urgent))

        store.enqueue_fold = counting
        chat, msgs = Chat(g, "openai", "queued"), []
        await grow(chat, msgs, 24)
        info = await conversation(g, "queued")
        assert info["fold_pending"] and info["summary"] is None
        assert calls == [False]
        assert await store.redis.xlen(store.keys.fold_stream()) == 1
