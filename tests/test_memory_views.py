"""What a replica knows of a conversation between requests (gateway/views.py) never makes it store or
send the wrong thing: several replicas on one Redis, edits, deletes and folds from elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from memory_helpers import KEY, Chat, Gateway, memory_gateway, plain, reply_text, user_text

from gateway.app import HOOK, SETTINGS, STORE
from gateway.auth import tenant_for
from gateway.keys import ConvRef
from gateway.store import open_store
from gateway.summarizer import ExtractiveSummarizer
from gateway.worker import FoldWorker
from tests.memory_helpers import COUNTER


async def _replicas(stack: AsyncExitStack, redis_url: str, n: int, **memory: Any) -> list[Gateway]:
    gateways = [await stack.enter_async_context(memory_gateway(redis_url, memory=memory)) for _ in range(n)]
    for g in gateways:
        g.fake.responder = reply_text
        await g.views_live()
    return gateways


async def _settle(*gateways: Gateway) -> None:
    for g in gateways:
        await g.settle()


async def _known(g: Gateway, conv: str, present: bool) -> None:
    """Wait until replica `g` knows (or no longer knows) the conversation."""
    ref = ConvRef(tenant_for(KEY), conv)
    for _ in range(200):
        if (g.app[HOOK].caches.views.get(ref) is not None) == present:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"replica still {'does not know' if present else 'knows'} {conv}")


async def test_replicas_taking_turns_store_every_turn_once(redis_url: str) -> None:
    """A conversation whose requests alternate between two replicas, each planning from what it last
    knew (behind the store by the other's turn), stores exactly the client's history after every turn,
    and every forwarded request ends with its newest turn."""
    async with AsyncExitStack() as stack:
        a, b = await _replicas(stack, redis_url, 2)
        msgs: list[dict[str, Any]] = []
        for i in range(16):
            g = (a, b)[i % 2]
            chat = Chat(g, "openai", "alternating")
            msgs.append({"role": "user", "content": user_text(i)})
            headers, text = await chat.send(msgs, stream=i % 3 == 0)
            assert plain(chat.forwarded())[-1] == msgs[-1]
            msgs.append({"role": "assistant", "content": text})
            await _settle(a, b)
            assert plain(await chat.stored()) == msgs, f"after turn {i}"
        assert headers["x-gateway-context"] == "rewritten"


async def test_back_to_back_requests_of_one_client_store_no_duplicates(redis_url: str) -> None:
    """A client that sends its next request while the gateway is still recording its previous turn
    (planned from the view that record is about to leave) gets every turn stored once."""
    async with memory_gateway(redis_url) as g:
        g.fake.responder = reply_text
        await g.views_live()
        client, msgs = g.openai(), [{"role": "system", "content": "Be brief."}]
        for i in range(12):
            msgs.append({"role": "user", "content": user_text(i)})
            # No waiting for the recording between turns: the SDK call returns with the reply.
            raw = await client.chat.completions.with_raw_response.create(
                model="gpt-test", messages=msgs, extra_headers={"X-Conversation-Id": "hasty"})
            msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        await g.settle()
        assert await g.messages("hasty") == msgs[1:]


async def test_edits_and_deletes_reach_the_other_replicas(redis_url: str) -> None:
    """A summary or state edit, or a delete, made through one replica's API is what another replica's
    next request of that conversation uses: it stops planning from what it knew."""
    async with AsyncExitStack() as stack:
        a, b = await _replicas(stack, redis_url, 2)
        msgs: list[dict[str, Any]] = []
        for i in range(8):
            chat_b = Chat(b, "openai", "edited")
            msgs.append({"role": "user", "content": user_text(i)})
            _, text = await chat_b.send(msgs)
            msgs.append({"role": "assistant", "content": text})
            await _settle(a, b)
        await _known(b, "edited", True)

        assert (await a.api("PUT", "edited/summary", json={"text": "The team chose Redis Cluster."}))[0] == 200
        await _known(b, "edited", False)
        msgs.append({"role": "user", "content": user_text(8)})
        headers, text = await chat_b.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        assert headers["x-gateway-context"] == "rewritten"
        assert "The team chose Redis Cluster." in chat_b.injected()

        await _known(b, "edited", True)
        assert (await a.api("PUT", "edited/state", json={"constraints": ["Never log credentials"]}))[0] == 200
        await _known(b, "edited", False)
        msgs.append({"role": "user", "content": user_text(9)})
        _, text = await chat_b.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        assert "Never log credentials" in chat_b.injected()

        await _known(b, "edited", True)
        assert (await a.api("DELETE", "edited"))[0] == 200
        await _known(b, "edited", False)
        msgs.append({"role": "user", "content": user_text(10)})
        headers, _ = await chat_b.send(msgs)
        assert "The team chose Redis Cluster." not in chat_b.injected()
        assert "Never log credentials" not in chat_b.injected()


@asynccontextmanager
async def _folded_elsewhere(redis_url: str, *, announce: bool) -> AsyncIterator[tuple[Gateway, Chat, list[Any], str]]:
    """A gateway without fold workers, 8 turns of one conversation, then a fold of it by a worker on
    another process's store connection (announced or not): (gateway, chat, history, summary text)."""
    async with memory_gateway(redis_url, memory={"worker": {"in_process": 0}}) as g:
        g.fake.responder = reply_text
        await g.views_live()
        chat, msgs = Chat(g, "openai", "far-fold"), []
        await _talk(chat, msgs, range(8))
        elsewhere = await open_store(g.app[SETTINGS].store)  # its own connections and origin
        try:
            if not announce:
                async def silent(ref: ConvRef, kind: str = "edited") -> None:
                    return None

                elsewhere.announce = silent  # type: ignore[method-assign]
            await FoldWorker(elsewhere, g.app[SETTINGS], ExtractiveSummarizer(COUNTER.count)).run(burst=True)
        finally:
            await elsewhere.close()
        summary, _, _ = await g.app[STORE].get_summary(ConvRef(tenant_for(KEY), "far-fold"))
        assert summary is not None
        yield g, chat, msgs, summary.text


async def _talk(chat: Chat, msgs: list[dict[str, Any]], turns: range) -> None:
    for i in turns:
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})


async def test_a_fold_from_another_process_is_announced_to_the_replicas(redis_url: str) -> None:
    """A fold worker in another process announces its summary: a replica that knows the conversation
    reloads it at once, so its very next request carries the new summary."""
    async with _folded_elsewhere(redis_url, announce=True) as (g, chat, msgs, text):
        ref = ConvRef(tenant_for(KEY), "far-fold")
        for _ in range(200):
            view = g.app[HOOK].caches.views.get(ref)
            if view is not None and view.summary is not None and view.summary.text == text:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the replica never took the announced summary")
        await _talk(chat, msgs, range(8, 9))
        assert text[:80] in chat.injected()
        assert plain(await chat.stored()) == msgs


async def test_an_unannounced_fold_reaches_the_second_request_at_the_latest(redis_url: str) -> None:
    """Without the announcement (lost), the first request's record learns of the new summary version
    and reloads: the request after it carries the summary, never a later one."""
    async with _folded_elsewhere(redis_url, announce=False) as (_, chat, msgs, text):
        seen = []
        for i in range(8, 10):
            await _talk(chat, msgs, range(i, i + 1))
            seen.append(text[:80] in chat.injected())
        assert seen == [False, True]
        assert plain(await chat.stored()) == msgs


async def test_a_fold_elsewhere_brings_the_project_state_to_its_other_conversations(redis_url: str) -> None:
    """A fold in another process updates a project's shared state; the replica's next request of
    another conversation of that project carries the new state (the fold's announcement reloads it)."""
    async with memory_gateway(redis_url, memory={"worker": {"in_process": 0}}) as g:
        g.fake.responder = reply_text
        await g.views_live()
        project = {"extra_headers": {"X-Project-Id": "ledger"}}
        a, b = Chat(g, "openai", "proj-a"), Chat(g, "openai", "proj-b")
        a_msgs: list[dict[str, Any]] = []
        b_msgs: list[dict[str, Any]] = []
        for i in range(4):
            b_msgs.append({"role": "user", "content": user_text(i)})
            _, text = await b.send(b_msgs, **project)
            b_msgs.append({"role": "assistant", "content": text})
        for i in range(8):
            said = "We decided to use PostgreSQL 16 for the billing ledger." if i == 1 else user_text(i)
            a_msgs.append({"role": "user", "content": said})
            _, text = await a.send(a_msgs, **project)
            a_msgs.append({"role": "assistant", "content": text})
        assert "PostgreSQL 16" not in b.injected()
        elsewhere = await open_store(g.app[SETTINGS].store)
        try:
            await FoldWorker(elsewhere, g.app[SETTINGS], ExtractiveSummarizer(COUNTER.count)).run(burst=True)
        finally:
            await elsewhere.close()
        ref_b = ConvRef(tenant_for(KEY), "proj-b", "ledger")
        for _ in range(200):
            view = g.app[HOOK].caches.views.get(ref_b)
            if view is not None and "PostgreSQL 16" in str(view.state):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the project's other conversation never took the new state")
        b_msgs.append({"role": "user", "content": user_text(4)})
        headers, _ = await b.send(b_msgs, **project)
        assert headers["x-gateway-context"] == "rewritten"
        assert "PostgreSQL 16" in b.injected()


async def test_a_conversation_whose_folds_fall_behind_is_planned_without_reloading_its_backlog(
        redis_url: str) -> None:
    """No worker folds (in_process 0): 600 unfolded messages, past what a view used to keep. The
    conversation's next requests are planned from what this replica knows, not by reading the
    whole backlog back from the store on every request, and still store every turn."""
    async with memory_gateway(redis_url, memory={"worker": {"in_process": 0}}) as g:
        g.fake.responder = reply_text
        await g.views_live()
        chat = Chat(g, "openai", "backlog")
        msgs: list[dict[str, Any]] = []
        for i in range(300):
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": user_text(i)})
        msgs.append({"role": "user", "content": user_text(300)})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        for i in range(301, 601):
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": user_text(i)})
        _, text = await chat.send(msgs)  # 601 + 1 messages: the view's tail is past 512
        msgs.append({"role": "assistant", "content": text})
        store = g.app[STORE]
        loads = 0
        load = store.load

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal loads
            loads += 1
            return await load(*args, **kwargs)

        store.load = counted  # type: ignore[method-assign]
        for i in range(602, 605):
            msgs.append({"role": "user", "content": user_text(i)})
            _, text = await chat.send(msgs)
            msgs.append({"role": "assistant", "content": text})
        assert loads == 0
        assert plain(await chat.stored()) == msgs
