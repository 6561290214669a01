"""The memory path's in-process caches give what computing afresh gives, and skip the work."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import memory, state
from gateway.config import Settings
from gateway.memory import Memory
from gateway.store import open_store
from gateway.tokens import TokenCounter


async def test_state_block_is_rendered_once_per_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state block is rendered once per ledger content (and model encoding), then reused as is."""
    settings = Settings()
    store = await open_store(settings.store)
    mem = Memory(settings, store, TokenCounter(settings.models))
    renders: list[Any] = []
    real = state.render

    def spy(ledger: state.Ledger, budget: int, count: Any) -> str:
        renders.append(ledger)
        return real(ledger, budget, count)

    monkeypatch.setattr(memory.state, "render", spy)
    ledger = state.Ledger(decisions=[state.Item(id="i1", text="Use Redis Cluster", source=3)],
                          constraints=[state.Item(id="i2", text="Never log API keys", source=5)], seq=2).dump()
    block, tokens = mem._state_block(ledger, "gpt-test")
    assert "Use Redis Cluster" in block and tokens == mem.tokens.count(block, "gpt-test")
    fresh = settings.memory.templates.state.format(
        state=real(state.Ledger.model_validate(ledger), settings.memory.state_budget_tokens,
                   lambda s: mem.tokens.count(s, "gpt-test")))
    assert block == fresh
    assert mem._state_block(dict(ledger), "gpt-test") == (block, tokens)
    assert len(renders) == 1
    edited = state.Ledger.model_validate(ledger)
    edited.decisions[0].text = "Use Redis Sentinel"
    assert "Use Redis Sentinel" in mem._state_block(edited.dump(), "gpt-test")[0]
    assert len(renders) == 2
    assert mem._state_block(None, "gpt-test") == mem._state_block({}, "gpt-test") == ("", 0)
    await store.close()
