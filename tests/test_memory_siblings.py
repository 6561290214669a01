"""Concurrent requests on one base are told from an edit: their turns are stored side by side."""

from __future__ import annotations

import asyncio
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import Settings, parse_settings
from gateway.dialects import dialect_for_path
from gateway.memory import Memory
from gateway.model import Usage
from gateway.proxy import Call, Prepared
from gateway.store import open_store
from gateway.tokens import TokenCounter


def _call(conversation: str, messages: list[dict[str, Any]]) -> Call:
    headers = CIMultiDictProxy(CIMultiDict({"X-Conversation-Id": conversation}))
    body = {"model": "gpt-test", "messages": messages}
    return Call(dialect=dialect_for_path("/v1/chat/completions", headers), path="/v1/chat/completions",
                body=body, raw=b"", headers=headers, credential="k", tenant="t", stream=False)


async def _turn(mem: Memory, messages: list[dict[str, Any]], answer: str) -> None:
    prepared = await mem.prepare(_call("c", messages))
    assert prepared is not None and prepared.on_success is not None
    await prepared.on_success([{"role": "assistant", "content": answer}], Usage())


async def test_a_request_that_arrived_before_a_sibling_was_answered_keeps_the_siblings_turns(
        redis_url: str) -> None:
    """A request that arrived while another on the same base was in flight, and loads the store only
    after that one's turns were stored, appends beside them instead of branching them away."""
    settings: Settings = parse_settings({"store": {"url": redis_url}})
    store = await open_store(settings.store)
    # Not following the change channel: every request loads what the store holds.
    mem = Memory(settings, store, TokenCounter(settings.models))
    base = [{"role": "user", "content": "first question"}]
    await _turn(mem, base, "first answer")
    base = [*base, {"role": "assistant", "content": "first answer"}]

    a = await mem.prepare(_call("c", [*base, {"role": "user", "content": "question A"}]))
    assert a is not None and a.on_success is not None
    # B arrives while A is in flight; its load is held until A's turns are stored.
    gate, real_load = asyncio.Event(), store.load

    async def held_load(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await real_load(*args, **kwargs)

    store.load = held_load  # type: ignore[method-assign]
    b_task = asyncio.create_task(mem.prepare(_call("c", [*base, {"role": "user", "content": "question B"}])))
    await asyncio.sleep(0.01)
    store.load = real_load  # type: ignore[method-assign]
    await a.on_success([{"role": "assistant", "content": "answer A"}], Usage())
    gate.set()
    b: Prepared | None = await b_task
    assert b is not None and b.on_success is not None
    await b.on_success([{"role": "assistant", "content": "answer B"}], Usage())

    ref = mem.conversation_of(_call("c", []))
    assert ref is not None
    stored = [t.text for t in await store.messages(ref)]
    assert stored == ["first question", "first answer", "question A", "answer A", "question B", "answer B"]
    await store.close()

