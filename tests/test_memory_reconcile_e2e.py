"""Reconciliation through the SDKs: whatever the client resends (its whole history, only its new turns,
a retry, a regenerated reply, an edited message), the stored conversation is exactly the client's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from memory_helpers import (
    Chat,
    Gateway,
    gw,  # noqa: F401 (fixture)
    gw_redis,  # noqa: F401 (fixture)
    memory_gateway,
    plain,
    reply_text,
    store_url,  # noqa: F401 (fixture)
    user_text,
    without_excerpts,
)

DIALECTS = ["openai", "anthropic"]


async def _talk(chat: Chat, msgs: list[dict[str, Any]], turns: range, *, settle: bool = False) -> None:
    for i in turns:
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(msgs, stream=i % 2 == 1)
        msgs.append({"role": "assistant", "content": text})
        if settle:
            await chat.g.settle()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_each_turn_stores_exactly_the_new_messages(gw: Gateway, dialect: str) -> None:  # noqa: F811
    """A client resending its whole history adds just its new user message and the reply per turn."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, dialect, "extend"), []
    for i in range(10):
        await _talk(chat, msgs, range(i, i + 1))
        status, info = await gw.api("GET", "extend")
        assert status == 200 and info["messages"] == 2 * (i + 1)
    await gw.settle()
    assert plain(await chat.stored()) == msgs


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_delta_client_is_sent_the_stored_history(redis_url: str, dialect: str) -> None:
    """With `conversation.history: delta` the client sends only its new turn and the model still sees
    the conversation: in full while short, then summary + recent turns."""
    async with memory_gateway(redis_url, conversation={"history": "delta"}) as g:
        g.fake.responder = reply_text
        chat, logical = Chat(g, dialect, "delta"), []
        for i in range(12):
            new = {"role": "user", "content": user_text(i)}
            headers, text = await chat.send([new], stream=i % 2 == 0)
            await g.settle()
            logical += [new, {"role": "assistant", "content": text}]
            fwd = plain(chat.forwarded())
            fwd = without_excerpts(fwd) if dialect == "openai" else fwd  # Anthropic's are inside the turn
            if headers["x-gateway-context"] == "full":
                assert fwd == logical[:-1]  # everything stored so far, then the new message
            else:
                assert headers["x-gateway-context"] == "rewritten" and i >= 3
                assert "## Summary of the earlier conversation" in chat.injected()
                assert user_text(i) in fwd[-1]["content"] and fwd[-2] == logical[-3]
                assert len(fwd) < len(logical) - 1
        assert headers["x-gateway-context"] == "rewritten"
        assert plain(await chat.stored()) == logical


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_auto_mode_takes_a_short_request_as_new_turns(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """In auto mode a client that switches to sending only its new message is served the stored history."""
    gw_redis.fake.responder = reply_text
    chat, msgs = Chat(gw_redis, dialect, "auto"), []
    await _talk(chat, msgs, range(2))
    new = {"role": "user", "content": user_text(2)}
    headers, text = await chat.send([new])
    assert headers["x-gateway-context"] == "full"
    assert plain(chat.forwarded()) == [*msgs, new]
    assert plain(await chat.stored()) == [*msgs, new, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_retry_stores_nothing_twice(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Resending an identical request (one after the other, or several at once) stores the turn once."""
    gw_redis.fake.responder = reply_text
    chat, msgs = Chat(gw_redis, dialect, "retry"), []
    await _talk(chat, msgs, range(3))
    msgs.append({"role": "user", "content": user_text(3)})
    _, text = await chat.send(msgs)
    _, again = await chat.send(msgs, stream=True)
    assert again == text
    await asyncio.gather(*(chat.send(msgs) for _ in range(5)))
    assert plain(await chat.stored()) == [*msgs, {"role": "assistant", "content": text}]
    # A late retry of an older turn (one the summary already covers) changes nothing either.
    await gw_redis.settle()
    assert (await gw_redis.api("GET", "retry"))[1]["summary"]["covers"] > 3
    await chat.send(msgs[:3])
    assert len(await chat.stored()) == 8


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_regenerate_replaces_the_last_reply(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Asking again with the same history and getting a different answer keeps only the new answer."""
    g = gw_redis
    g.fake.responder = reply_text
    chat, msgs = Chat(g, dialect, "regen"), []
    await _talk(chat, msgs, range(3))
    g.fake.responder = None
    g.fake.reply = "A regenerated, different answer."
    _, text = await chat.send(msgs[:-1])  # the client drops the last reply and asks again
    assert text == g.fake.reply
    stored = plain(await chat.stored())
    assert stored == [*msgs[:-1], {"role": "assistant", "content": text}]
    # The conversation goes on from the regenerated answer.
    msgs[-1] = {"role": "assistant", "content": text}
    await _talk(chat, msgs, range(3, 4))
    assert plain(await chat.stored()) == msgs


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_editing_an_earlier_message_branches(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Editing an earlier user message makes the stored history the edited one, later turns dropped."""
    g = gw_redis
    g.fake.responder = reply_text
    chat, msgs = Chat(g, dialect, "edit"), []
    await _talk(chat, msgs, range(4))
    edited = [*msgs[:2], {"role": "user", "content": "Actually, forget that: what about the cluster mode?"}]
    headers, text = await chat.send(edited)
    assert headers["x-gateway-context"] == "full" and plain(chat.forwarded()) == edited
    assert plain(await chat.stored()) == [*edited, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_editing_the_last_message_replaces_it(gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Editing the newest user message after its answer arrived replaces that turn, not adds to it."""
    g = gw_redis
    g.fake.responder = reply_text
    chat, msgs = Chat(g, dialect, "edit-last"), []
    await _talk(chat, msgs, range(3))
    edited = [*msgs[:-2], {"role": "user", "content": "Rather: how does the fold worker recover?"}]
    _, text = await chat.send(edited)
    assert plain(chat.forwarded()) == edited
    assert plain(await chat.stored()) == [*edited, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_branch_inside_the_summary_drops_it(gw: Gateway, dialect: str) -> None:  # noqa: F811
    """An edit inside the part the summary covers drops that summary: the abandoned branch never
    reaches the model again."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, dialect, "drop"), []
    await _talk(chat, msgs, range(10), settle=True)
    _, info = await gw.api("GET", "drop")
    assert info["summary"]["covers"] >= 8 and "Turn 3" in info["summary"]["text"]
    edited = [*msgs[:2], {"role": "user", "content": "Let us restart from here with the cluster mode."}]
    headers, text = await chat.send(edited)
    await gw.settle()
    assert headers["x-gateway-context"] == "full"
    assert "Summary" not in chat.injected() and "Turn 3" not in str(gw.last(chat.path).body)
    assert plain(chat.forwarded()) == edited
    _, info = await gw.api("GET", "drop")
    assert info["messages"] == 4 and info["summary"] is None
    assert plain(await chat.stored()) == [*edited, {"role": "assistant", "content": text}]
    # And the next turns build on the new branch only.
    msgs = [*edited, {"role": "assistant", "content": text}]
    await _talk(chat, msgs, range(20, 26), settle=True)
    _, info = await gw.api("GET", "drop")
    assert info["summary"] is not None and "Turn 3:" not in info["summary"]["text"]
    assert plain(await chat.stored()) == msgs


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_delta_client_repeating_its_first_message_is_not_taken_for_a_regenerate(
        redis_url: str, dialect: str) -> None:
    """Auto mode: a client that has been sending only its new turns, and now sends its first message
    again ("hi", "continue"), gets that turn appended, not the conversation rewound to its start;
    also on a replica that has not served the conversation before (what it knows comes from Redis)."""
    logical: list[dict[str, Any]] = []
    async with memory_gateway(redis_url) as one, memory_gateway(redis_url) as other:
        for g, text in ((one, "hi"), (one, user_text(1)), (one, user_text(2)), (one, "hi"), (other, "hi")):
            g.fake.responder = reply_text
            chat = Chat(g, dialect, "again")
            new = {"role": "user", "content": text}
            _, answer = await chat.send([new])
            forwarded = plain(chat.forwarded())
            if g is one:
                assert forwarded == [*logical, new]
            else:  # new to this replica's cost model, so possibly rewritten: never the first turn alone
                assert forwarded[-1] == new and len(forwarded) > 1
            logical += [new, {"role": "assistant", "content": answer}]
        assert plain(await chat.stored()) == logical


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_delta_client_sending_several_new_messages_at_once_gets_them_appended(
        gw_redis: Gateway, dialect: str) -> None:  # noqa: F811
    """Auto mode: a client seen sending only its new turns that sends more of them at once than a
    short request holds (queued user messages) gets them stored after its conversation, not taken
    for a whole history that replaces it."""
    gw_redis.fake.responder = reply_text
    chat, logical = Chat(gw_redis, dialect, "batch"), []
    for batch in ([user_text(0)], [user_text(1)], [user_text(i) for i in range(2, 8)]):
        new = [{"role": "user", "content": text} for text in batch]
        _, answer = await chat.send(new)
        assert plain(chat.forwarded()) == [*logical, *new]
        logical += [*new, {"role": "assistant", "content": answer}]
    assert plain(await chat.stored()) == logical
