"""Cache-aware folding as a user sees it: under `policy: cost`, a fold that finished while the
provider's prompt cache is warm waits; the request keeps the summary block the cache holds, byte for
byte, and the fold's summary goes in once the cache has gone cold. An edit is never held back."""

from __future__ import annotations

from typing import Any

from memory_helpers import (
    Chat,
    Gateway,
    memory_gateway,
    reply_text,
    store_url,  # noqa: F401 (fixture)
)

from gateway import cost
from gateway.app import HOOK

MEMORY = {"policy": "cost", "message_threshold": 6, "keep_recent": 4, "fold_batch": 4,
          "retrieval": {"enabled": False}}


def long_turn(i: int) -> str:
    """A long user turn (about 400 tokens): the rewrite pays for itself at Claude's cache prices."""
    return f"Turn {i}: " + " ".join(f"detail {i}-{k} of the ingest pipeline, stage {k % 7}." for k in range(60))


class Clock:
    def __init__(self, g: Gateway) -> None:
        self.now = 1000.0
        g.app[HOOK].clock = lambda: self.now


async def turn(g: Gateway, chat: Chat, msgs: list[dict[str, Any]], clock: Clock, step: float) -> tuple[Any, str]:
    clock.now += step
    msgs.append({"role": "user", "content": long_turn(len(msgs) // 2)})
    headers, text = await chat.send(msgs, model="claude-sonnet-4")
    msgs.append({"role": "assistant", "content": text})
    await g.settle()
    return headers, chat.injected()


async def stored_summary(g: Gateway, conv: str) -> str:
    status, info = await g.api("GET", conv)
    assert status == 200
    return info["summary"]["text"] if info["summary"] else ""


async def test_a_fold_waits_for_a_cold_cache_and_an_edit_does_not(store_url: str) -> None:  # noqa: F811
    async with memory_gateway(store_url, memory=MEMORY) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True
        clock, chat, msgs = Clock(g), Chat(g, "openai", "held"), []
        injected = ""
        for _ in range(20):  # until a rewrite carries a summary
            headers, injected = await turn(g, chat, msgs, clock, 10)
            if headers["x-gateway-context"] == "rewritten" and "## Summary" in injected:
                break
        assert "## Summary" in injected, "the conversation was never rewritten with a summary"

        held = injected
        for _ in range(6):  # folds finish meanwhile: the warm requests keep the cached layers
            headers, injected = await turn(g, chat, msgs, clock, 10)
            assert headers["x-gateway-context"] == "rewritten"
            assert injected == held
        newer = await stored_summary(g, "held")
        assert newer and newer not in held, "no fold finished during the warm turns"
        # What the held layers left out is still forwarded verbatim: every message of this conversation
        # since the held summary's coverage is in the request.
        forwarded = [m["content"] for m in chat.forwarded()]
        assert forwarded[-1] == msgs[-2]["content"] and msgs[-12]["content"] in forwarded

        clock.now += cost.DEFAULT_PRICES.ttl + 1  # the provider's cache has expired: the fold goes in
        headers, injected = await turn(g, chat, msgs, clock, 0)
        assert headers["x-gateway-context"] == "rewritten"
        assert injected != held and (await stored_summary(g, "held")).split("\n")[0] in injected

        # An edit goes into the very next request, warm or not.
        text = "The user is building an ingest pipeline in seven stages."
        status, _ = await g.api("PUT", "held/summary", json={"text": text})
        assert status == 200
        headers, injected = await turn(g, chat, msgs, clock, 10)
        assert text in injected


async def _rewritten_with_summary(g: Gateway, chat: Chat, msgs: list[dict[str, Any]], clock: Clock) -> str:
    injected = ""
    for _ in range(20):
        headers, injected = await turn(g, chat, msgs, clock, 10)
        if headers["x-gateway-context"] == "rewritten" and "## Summary" in injected:
            return injected
    raise AssertionError("the conversation was never rewritten with a summary")


async def test_an_edit_made_while_a_request_is_planned_reaches_the_next_one(store_url: str) -> None:  # noqa: F811
    """A request planned across an edit does not hold the layers it planned from: the edit goes into
    the next request even though the provider's cache is warm."""
    memory = {**MEMORY, "retrieval": {"enabled": True}, "retrieval_budget_tokens": 400, "min_saving_share": 0.0}
    async with memory_gateway(store_url, memory=memory) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True
        clock, chat, msgs = Clock(g), Chat(g, "openai", "race"), []
        await _rewritten_with_summary(g, chat, msgs, clock)
        hook = g.app[HOOK]
        recall, edits = hook._recall, []
        text = "EDITED: the user builds an ingest pipeline in seven stages."

        async def edited_meanwhile(*args: Any, **kwargs: Any) -> Any:
            if not edits:  # the edit lands while this request awaits its excerpts
                edits.append(await g.api("PUT", "race/summary", json={"text": text}))
            return await recall(*args, **kwargs)

        hook._recall = edited_meanwhile
        await turn(g, chat, msgs, clock, 10)
        hook._recall = recall
        assert edits and edits[0][0] == 200, "the request never searched for excerpts"
        _, injected = await turn(g, chat, msgs, clock, 10)
        assert text in injected


async def test_no_layers_are_held_while_the_change_channel_is_down(store_url: str) -> None:  # noqa: F811
    """Edits made on another replica arrive on the change channel: while it is down (and for what was
    held before it went down) a finished fold goes in at once."""
    async with memory_gateway(store_url, memory=MEMORY) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True
        clock, chat, msgs = Clock(g), Chat(g, "openai", "gap"), []
        held = await _rewritten_with_summary(g, chat, msgs, clock)
        hook = g.app[HOOK]
        assert hook.caches.held, "nothing was held"
        hook.follower.views.set_live(False)
        hook.follower.channel()  # what the follower does when the channel drops
        assert not hook.caches.held
        for _ in range(6):
            _, injected = await turn(g, chat, msgs, clock, 10)
            if injected != held:
                break
        assert injected != held and (await stored_summary(g, "gap")).split("\n")[0] in injected
