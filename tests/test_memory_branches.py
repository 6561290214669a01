"""Branches are kept: what an edit (or a request with another history) takes off the stored history
is moved aside, readable through the conversation API, expiring with the conversation, never deleted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from memory_helpers import (  # noqa: F401
    Chat,
    Gateway,
    gw,
    memory_gateway,
    plain,
    reply_text,
    store_url,
    user_text,
)

from gateway.app import HOOK
from gateway.config import StoreSettings
from gateway.keys import ConvRef
from gateway.model import Message
from gateway.store import open_store

DIALECTS = ["openai", "anthropic"]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_edit_keeps_the_abandoned_turns_readable(gw: Gateway, dialect: str) -> None:  # noqa: F811
    """After an earlier message is edited, the turns it replaced are listed as a branch, with their
    position, and read back whole; the history is the edited one."""
    g = gw
    g.fake.responder = reply_text
    chat, msgs = Chat(g, dialect, "kept"), []
    for i in range(3):
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})
    edited = [*msgs[:2], {"role": "user", "content": "Actually: what about the cluster mode?"}]
    _, text = await chat.send(edited)
    assert plain(await chat.stored()) == [*edited, {"role": "assistant", "content": text}]

    status, listed = await g.api("GET", "kept/branches")
    assert status == 200 and [(b["id"], b["at"], b["messages"]) for b in listed["data"]] == [(1, 2, 4)]
    status, page = await g.api("GET", "kept/branches/1/messages")
    assert status == 200 and page["total"] == 4
    assert plain([d["message"] for d in page["data"]]) == msgs[2:]
    assert [d["index"] for d in page["data"]] == [2, 3, 4, 5]
    status, _ = await g.api("GET", "kept/branches/2/messages")
    assert status == 404
    # Digits int() refuses ("²", superscript two, passes str.isdigit) and one too long to convert.
    for number in ("%C2%B2", "1" * 5000):
        status, err = await g.api("GET", f"kept/branches/{number}/messages")
        assert status == 404 and err["error"]["type"] == "not_found_error"


async def test_abandoned_branches_expire_with_the_conversation_and_go_with_it(redis_url: str) -> None:
    """A branch's keys take the conversation's TTL, refreshed when it is used, and a delete removes them."""
    store = await open_store(StoreSettings(url=redis_url, ttl_seconds=1000))
    ref = ConvRef("t", "ttl-branch")

    def turn(i: int) -> Message:
        return Message(raw={"role": "user", "content": f"m{i}"}, role="user", text=f"m{i}", tokens=3, hash=f"h{i}")

    try:
        first = await store.append(ref, [turn(0), turn(1)], base_length=0, base_chain="", dialect="openai_chat")
        chains = await store.chains(ref)
        branched = await store.branch(ref, at=1, base_chain=chains[0], turns=[turn(2)], dialect="openai_chat")
        assert first.ok and branched.ok
        kept: Any = await store.branches(ref)
        assert [(b["at"], b["count"]) for b in kept] == [(1, 1)]
        assert [m.text for m in await store.branch_messages(kept[0], ref)] == ["m1"]
        for key in (store.keys.branches(ref), store.keys.abandoned(ref)):
            assert 0 < await store.redis.ttl(key) <= 1000
        await store.redis.expire(store.keys.branches(ref), 5)
        await store.load(ref)
        assert await store.redis.ttl(store.keys.branches(ref)) > 5  # refreshed like every other key
        await store.delete(ref)
        assert await store.redis.exists(store.keys.branches(ref), store.keys.abandoned(ref)) == 0
    finally:
        await store.close()


async def test_a_run_with_resent_history_is_not_placed_after_other_writers_turns(redis_url: str) -> None:
    """Concurrent writers' turns land after each other's, but a run that also carries resent history
    the store holds in another order is refused (the caller branches), not stored a second time."""
    store = await open_store(StoreSettings(url=redis_url))
    ref = ConvRef("t", "own")

    def turn(name: str) -> Message:
        role = "assistant" if name.startswith("a") else "user"
        return Message(raw={"role": role, "content": name}, role=role, text=name, tokens=1, hash=f"h-{name}")

    try:
        await store.append(ref, [turn("u0"), turn("a0")], base_length=0, base_chain="", dialect="openai_chat")
        base = (await store.chains(ref))[-1]
        for pair in (["z", "az"], ["y", "ay"]):  # two writers on base 2
            assert (await store.append(ref, [turn(n) for n in pair], base_length=2, base_chain=base,
                                       dialect="openai_chat", own=2)).ok
        late = [turn(n) for n in ("y", "ay", "w", "aw")]  # y's turn resent, then its own turn w
        refused = await store.append(ref, late, base_length=2, base_chain=base, dialect="openai_chat", own=2)
        assert not refused.ok and refused.reason == "branched"
        assert [m.text for m in await store.messages(ref)] == ["u0", "a0", "z", "az", "y", "ay"]
    finally:
        await store.close()


async def test_concurrent_writers_on_one_conversation_lose_and_repeat_nothing(redis_url: str) -> None:
    """20 clients on one conversation, each resending the shared history plus its own turn, against
    an instant upstream: every turn is stored, on the history or a branch it kept, none twice on one."""
    async with memory_gateway(redis_url) as g:
        shared: list[dict[str, Any]] = []
        sent: list[str] = []

        async def writer(w: int) -> None:
            for i in range(3):
                text = f"writer {w} turn {i}"
                _, reply = await Chat(g, "openai", "crowd").send([*shared, {"role": "user", "content": text}])
                sent.append(text)
                shared.extend([{"role": "user", "content": text}, {"role": "assistant", "content": reply}])

        await asyncio.gather(*(writer(w) for w in range(20)))
        await g.settle()
        await asyncio.wait_for(g.app[HOOK].backlog.join(), timeout=30)
        histories = [[m["content"] for m in await g.messages("crowd") if m["role"] == "user"]]
        _, listed = await g.api("GET", "crowd/branches")
        for b in listed["data"]:
            _, page = await g.api("GET", f"crowd/branches/{b['id']}/messages?limit=1000")
            histories.append([d["message"]["content"] for d in page["data"] if d["role"] == "user"])
        assert set(sent) <= {t for h in histories for t in h}
        assert [h for h in histories if len(h) != len(set(h))] == []


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_an_edit_takes_what_the_abandoned_turns_stated_out_of_the_state(gw: Gateway,  # noqa: F811
                                                                             dialect: str) -> None:
    """Decisions stated only in turns an edit moved aside are no longer forwarded as project state
    (they came back in every rewritten request of the new branch); the ones before the edit stay."""
    g = gw
    g.fake.responder = reply_text
    chat, msgs = Chat(g, dialect, "edited-state"), []
    for i in range(14):
        msgs.append({"role": "user", "content": f"We decided to use the codename SECRET{i}x. {user_text(i)}"})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        await g.settle()
    assert any(f"SECRET{i}x" in chat.injected() for i in range(2, 14))  # in the state or the summary
    edited = [*msgs[:4], {"role": "user", "content": "Actually, let us start over on the naming."}]
    for i in range(8):
        _, text = await chat.send(edited)
        edited.append({"role": "assistant", "content": text})
        edited.append({"role": "user", "content": f"Follow-up {i}, nothing decided yet. {user_text(i)}"})
        await g.settle()
    headers, _ = await chat.send(edited)
    assert headers["x-gateway-context"] == "rewritten"
    injected = chat.injected()
    assert "SECRET0x" in injected or "SECRET1x" in injected  # stated before the edit: kept
    assert not any(f"SECRET{i}x" in injected for i in range(2, 14))
    _, info = await g.api("GET", "edited-state")
    assert not any(f"SECRET{i}x" in info["state_rendered"] for i in range(2, 14))
