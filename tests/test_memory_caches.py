"""The memory path's in-process caches give what computing afresh gives, and skip the work."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from memory_helpers import OPENAI_MODEL, Chat, memory_gateway, reply_text, user_text

from gateway import caches, rewrite, state
from gateway.app import HOOK
from gateway.config import Settings
from gateway.memory import Memory
from gateway.store import open_store
from gateway.tokens import TokenCounter

_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")  # arrival times in excerpt headers


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

    monkeypatch.setattr(caches.state, "render", spy)
    ledger = state.Ledger(decisions=[state.Item(id="i1", text="Use Redis Cluster", source=3)],
                          constraints=[state.Item(id="i2", text="Never log API keys", source=5)], seq=2).dump()
    block, tokens = mem.blocks.state_block(ledger, "gpt-test")
    assert "Use Redis Cluster" in block and tokens == mem.tokens.count(block, "gpt-test")
    fresh = settings.memory.templates.state.format(
        state=real(state.Ledger.model_validate(ledger), settings.memory.state_budget_tokens,
                   lambda s: mem.tokens.count(s, "gpt-test")))
    assert block == fresh
    assert mem.blocks.state_block(dict(ledger), "gpt-test") == (block, tokens)
    assert len(renders) == 1
    edited = state.Ledger.model_validate(ledger)
    edited.decisions[0].text = "Use Redis Sentinel"
    assert "Use Redis Sentinel" in mem.blocks.state_block(edited.dump(), "gpt-test")[0]
    assert len(renders) == 2
    assert mem.blocks.state_block(None, "gpt-test") == mem.blocks.state_block({}, "gpt-test") == ("", 0)
    await store.close()


async def _weighed_conversation(monkeypatch: pytest.MonkeyPatch, *, skip: bool) -> tuple[list[Any], int]:
    """(per turn: context, original and forwarded tokens, forwarded body; index syncs and searches) for one scripted
    conversation, with the search skipped when the full history wins, or always made."""
    if not skip:
        monkeypatch.setattr(rewrite, "rewrite_may_win", lambda *args: True)
    # A cache read at half price: the full history wins while it is short, the rewrite afterwards.
    half = {OPENAI_MODEL: {"cache_read": 0.5, "cache_write": 1.25, "cache_ttl_seconds": 300}}
    async with memory_gateway("memory://", memory={"policy": "cost"}, pricing=half) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True  # reports cache reads, as a provider does
        recall = g.app[HOOK].caches.recall
        calls: list[str] = []
        real_search, real_sync = recall.search, recall.sync
        monkeypatch.setattr(recall, "search", lambda *a, **k: calls.append("search") or real_search(*a, **k))
        monkeypatch.setattr(recall, "sync", lambda *a, **k: calls.append("sync") or real_sync(*a, **k))
        chat, msgs, seen = Chat(g, "openai", "weigh"), [], []
        for i in range(16):
            msgs.append({"role": "user", "content": user_text(i) + " details" * 100})
            headers, text = await chat.send(msgs)
            msgs.append({"role": "assistant", "content": text})
            await g.settle()
            body = _STAMP.sub("T", orjson.dumps(g.last(chat.path).body).decode())
            seen.append((headers["x-gateway-context"], headers["x-gateway-tokens-original"],
                         headers["x-gateway-tokens-forwarded"], body))
    return seen, len(calls)


async def test_leaving_out_the_search_when_the_full_history_wins_forwards_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cost model on, leaving out the index sync and search for rewrites the full history beats
    forwards the same bodies and headers as searching first, and does leave them out."""
    skipped, fewer = await _weighed_conversation(monkeypatch, skip=True)
    searched, more = await _weighed_conversation(monkeypatch, skip=False)
    assert skipped == searched
    kinds = [s[0] for s in skipped]
    assert "full" in kinds[4:] and "rewritten" in kinds
    assert fewer < more


async def test_an_import_held_for_its_cache_is_copied_off_the_loop_and_an_edit_meanwhile_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite held for the provider's cache keeps its messages without their raw bodies: for an
    import of thousands (~1.5 ms a thousand) the copies are made in a thread; if an edit lands
    meanwhile, nothing is held (the edit must reach the next request)."""
    import asyncio

    from gateway.keys import ConvRef
    from gateway.model import Message
    from gateway.recall import RecallCache

    msgs = tuple(Message(raw={"role": "user", "content": f"m{i}"}, role="user", text=f"m{i}", tokens=3,
                         hash=f"h{i}", chain=f"c{i}") for i in range(1500))
    held = caches.Held(None, None, "", 0, 0, msgs)
    ref = ConvRef("t", "imported")
    cache = caches.ConversationCaches(live=True, recall=RecallCache(1 << 20))
    where: list[bool] = []
    to_thread = asyncio.to_thread

    async def spy(fn: Any, *args: Any) -> Any:
        where.append(True)
        return await to_thread(fn, *args)

    monkeypatch.setattr(caches.asyncio, "to_thread", spy)
    await cache.hold(ref, held, cache.edits)
    kept = cache.held[caches.conv_key(ref)].tail
    assert where == [True]
    assert [(m.text, m.chain, m.raw) for m in kept] == [(m.text, m.chain, {}) for m in msgs]

    async def edited_meanwhile(fn: Any, *args: Any) -> Any:
        cache.channel_changed()  # what an edit, or a gap in the change channel, does
        return await to_thread(fn, *args)

    monkeypatch.setattr(caches.asyncio, "to_thread", edited_meanwhile)
    await cache.hold(ConvRef("t", "other"), held, cache.edits)
    assert caches.conv_key(ConvRef("t", "other")) not in cache.held


async def test_an_older_hold_that_finishes_last_does_not_replace_a_newer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rewrites of one import held while their copies are made in threads: the first request's
    copies come back last, and the held layers stay the second request's."""
    import asyncio

    from gateway.keys import ConvRef
    from gateway.model import Message
    from gateway.recall import RecallCache

    def held(n: int, state: str) -> caches.Held:
        msgs = tuple(Message(raw={"role": "user", "content": f"m{i}"}, role="user", text=f"m{i}", tokens=3,
                             hash=f"h{i}", chain=f"c{i}") for i in range(n))
        return caches.Held(None, None, state, 1, 0, msgs)

    ref = ConvRef("t", "imported")
    cache = caches.ConversationCaches(live=True, recall=RecallCache(1 << 20))
    to_thread = asyncio.to_thread
    slow = asyncio.Event()
    calls = 0

    async def first_one_slow(fn: Any, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            await slow.wait()
        return await to_thread(fn, *args)

    monkeypatch.setattr(caches.asyncio, "to_thread", first_one_slow)
    older = asyncio.create_task(cache.hold(ref, held(1500, "older"), cache.edits))
    await asyncio.sleep(0.01)
    await cache.hold(ref, held(1600, "newer"), cache.edits)
    slow.set()
    await older
    kept = cache.held[caches.conv_key(ref)]
    assert kept.state_block == "newer" and len(kept.tail) == 1600
