"""The store under load: a full connection pool is back-pressure (a bounded wait), not an outage, and
a turn the store could not take when its request was answered is stored later, never dropped silently."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.app import HOOK, METRICS, STORE, create_app, drain_background
from gateway.backlog import Backlog
from gateway.config import StoreSettings
from gateway.keys import ConvRef
from gateway.store import StoreBusy, StoreUnavailable, open_store, patient
from gateway.testing import FakeUpstream, Responder, serve_app
from tests.conftest import RedisProcess
from tests.memory_helpers import KEY, SMALL

pytestmark = pytest.mark.asyncio


@asynccontextmanager
async def gateway(store: dict[str, Any], responder: Responder | None = None,
                  ) -> AsyncIterator[tuple[Any, str, aiohttp.ClientSession]]:
    """The real app over `store` (settings of the `store` section) and an instant fake upstream."""
    async with FakeUpstream(responder=responder or (lambda body: f"ok: {body['messages'][-1]['content']}"),
                            record=False) as fake:
        settings = fake.settings(store=store, memory={**SMALL, "worker": {"retry_base_seconds": 0}},
                                 server={"shutdown_grace_seconds": 5})
        app = create_app(settings)
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            try:
                yield app, url, http
            finally:
                await drain_background(app)


async def chat(http: aiohttp.ClientSession, url: str, conv: str,
               messages: list[dict[str, str]], **headers: str) -> tuple[int, str, str]:
    """(status, x-gateway-context, reply text) of one chat completion."""
    async with http.post(url + "/v1/chat/completions", json={"model": "gpt-test", "messages": messages},
                         headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": conv, **headers}) as r:
        body = await r.json(content_type=None)
        return r.status, r.headers.get("x-gateway-context", ""), body["choices"][0]["message"]["content"]


def killing_redis_on(redis: RedisProcess, question: str) -> Responder:
    """An upstream that answers "ok: <question>" and kills Redis when asked `question`: after the
    gateway loaded the conversation, before it records the turn."""

    async def responder(body: dict[str, Any]) -> str:
        text = body["messages"][-1]["content"]
        if text == question:
            redis.kill()
        return f"ok: {text}"

    return responder


async def stored(http: aiohttp.ClientSession, url: str, conv: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/gateway/conversations/{conv}/messages?limit=1000",
                        headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status == 404:
            return []
        page = await r.json()
        assert r.status == 200, page
        return [{"role": d["message"]["role"], "content": d["message"]["content"]} for d in page["data"]]


def unrecorded(app: Any, result: str) -> float:
    return float(app[METRICS].unrecorded.labels(result)._value.get())


async def test_many_parallel_conversations_through_a_tiny_pool_store_every_turn(redis_url: str) -> None:
    """40 conversations at once through a pool of 2 connections: requests wait for a connection
    instead of degrading, and every turn of every conversation is stored, in order."""
    async with gateway({"url": redis_url, "pool_size": 2, "pool_wait_seconds": 30}) as (app, url, http):
        convs = [f"pool-{i}" for i in range(40)]
        contexts: list[str] = []

        async def conversation(conv: str) -> list[dict[str, str]]:
            history: list[dict[str, str]] = []
            for turn in range(3):
                history.append({"role": "user", "content": f"{conv} turn {turn}"})
                status, context, reply = await chat(http, url, conv, history)
                assert status == 200
                contexts.append(context)
                history.append({"role": "assistant", "content": reply})
            return history

        sent = await asyncio.gather(*(conversation(c) for c in convs))
        await drain_background(app)
        assert "degraded" not in contexts
        for conv, history in zip(convs, sent, strict=True):
            assert await stored(http, url, conv) == history
        assert app[HOOK].store.redis.connection_pool.max_connections == 2


async def test_a_turn_answered_while_the_store_was_down_is_stored_when_it_returns(tmp_path: Path) -> None:
    """Redis down: the request is forwarded unchanged (degraded), its turn is queued, counted, and
    stored once Redis is back, after the turns stored before."""
    redis = RedisProcess(tmp_path, persistent=True)
    redis.start()
    try:
        async with gateway({"url": redis.url}) as (app, url, http):
            history = [{"role": "user", "content": "first question"}]
            assert (await chat(http, url, "c1", history))[:2] == (200, "full")
            history.append({"role": "assistant", "content": "ok: first question"})
            await drain_background(app)

            redis.kill()
            history.append({"role": "user", "content": "second question"})
            # A replay's own time travels with the queued turn (X-Message-Time), as for one stored at once.
            status, context, reply = await chat(http, url, "c1", history, **{"X-Message-Time": "2024-05-06T07:08:09Z"})
            assert (status, context) == (200, "degraded")
            history.append({"role": "assistant", "content": reply})
            await drain_background(app)
            assert len(app[HOOK].backlog) == 1 and unrecorded(app, "queued") == 1

            redis.start()
            await asyncio.wait_for(app[HOOK].backlog.join(), timeout=30)
            assert await stored(http, url, "c1") == history
            assert unrecorded(app, "recorded") == 1 and unrecorded(app, "dropped") == 0
            async with http.get(f"{url}/gateway/conversations/c1/messages",
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
                times = [d["time"] for d in (await r.json())["data"]]
            assert times[2:] == ["2024-05-06T07:08:09", "2024-05-06T07:08:09"]
    finally:
        redis.kill()


async def test_a_turn_whose_recording_failed_is_stored_later_in_order(tmp_path: Path) -> None:
    """Redis dies while the upstream answers (the request was planned, its recording fails): the
    turn is retried in the background; a delta of later turns sent meanwhile keeps its place after it."""
    redis = RedisProcess(tmp_path, persistent=True)
    redis.start()
    kill_on = "doomed question"
    responder = killing_redis_on(redis, kill_on)

    try:
        async with gateway({"url": redis.url}, responder) as (app, url, http):
            history = [{"role": "user", "content": "first question"}]
            await chat(http, url, "c2", history)
            history.append({"role": "assistant", "content": "ok: first question"})
            await drain_background(app)

            history.append({"role": "user", "content": kill_on})
            status, context, reply = await chat(http, url, "c2", history)
            assert (status, context) == (200, "full")
            history.append({"role": "assistant", "content": reply})
            await drain_background(app)
            assert len(app[HOOK].backlog) == 1

            redis.start()
            await asyncio.wait_for(app[HOOK].backlog.join(), timeout=30)
            assert await stored(http, url, "c2") == history
    finally:
        redis.kill()


async def test_a_delta_turn_sent_while_an_earlier_one_is_queued_is_stored_after_it(tmp_path: Path) -> None:
    """A client that sends only its new turns: turn 2's recording fails and is queued; turn 3 arrives
    once Redis is back but before the queue retried turn 2. Turn 3 queues behind it: stored in order."""
    redis = RedisProcess(tmp_path, persistent=True)
    redis.start()
    kill_on = "second question"
    responder = killing_redis_on(redis, kill_on)

    try:
        async with gateway({"url": redis.url}, responder) as (app, url, http):
            await chat(http, url, "d1", [{"role": "user", "content": "first question"}])
            await drain_background(app)
            backlog = app[HOOK].backlog
            backlog.first_delay = backlog.max_delay = 3.0  # the queue's retry comes well after turn 3
            await chat(http, url, "d1", [{"role": "user", "content": kill_on}])
            await drain_background(app)
            assert len(backlog) == 1

            redis.start()
            assert (await chat(http, url, "d1", [{"role": "user", "content": "third question"}]))[0] == 200
            await drain_background(app)
            await asyncio.wait_for(backlog.join(), timeout=30)
            assert [m["content"] for m in await stored(http, url, "d1")] == [
                "first question", "ok: first question", kill_on, f"ok: {kill_on}",
                "third question", "ok: third question"]
    finally:
        redis.kill()


@pytest.mark.parametrize("bound", [{"retry_queue_size": 1}, {"retry_queue_bytes": 400}])
async def test_a_full_retry_queue_drops_and_counts_the_overflow(tmp_path: Path, bound: dict[str, int]) -> None:
    """With room for one queued turn (by count, or by bytes: each of these requests is charged about
    280), a second unrecorded request is dropped, counted as dropped, and the queued one is still
    stored when the store returns."""
    redis = RedisProcess(tmp_path, persistent=True)
    redis.start()
    try:
        async with gateway({"url": redis.url, **bound}) as (app, url, http):
            await chat(http, url, "warm", [{"role": "user", "content": "hello"}])  # connects the pool
            await drain_background(app)
            redis.kill()
            a = [{"role": "user", "content": "kept"}]
            b = [{"role": "user", "content": "overflow"}]
            assert (await chat(http, url, "a", a))[:2] == (200, "degraded")
            await drain_background(app)
            assert (await chat(http, url, "b", b))[:2] == (200, "degraded")
            await drain_background(app)
            assert unrecorded(app, "queued") == 1 and unrecorded(app, "dropped") == 1

            redis.start()
            await asyncio.wait_for(app[HOOK].backlog.join(), timeout=30)
            assert await stored(http, url, "a") == [*a, {"role": "assistant", "content": "ok: kept"}]
            assert await stored(http, url, "b") == []
    finally:
        redis.kill()


async def test_a_full_pool_is_busy_not_unreachable(redis_url: str, tmp_path: Path) -> None:
    """Every connection held past pool_wait_seconds raises StoreBusy (a StoreUnavailable); a server
    that is down raises StoreUnavailable that is not StoreBusy."""
    store = await open_store(StoreSettings(url=redis_url, pool_size=1, pool_wait_seconds=0.05))
    ref = ConvRef("t", "busy")
    try:
        pool = store.redis.connection_pool
        held = await pool.get_connection()
        try:
            with pytest.raises(StoreBusy):
                await store.load(ref)
        finally:
            await pool.release(held)
        assert (await store.load(ref)).length == 0  # the connection is free again
    finally:
        await store.close()

    down = RedisProcess(tmp_path)  # never started: nothing listens on its port
    store = await open_store(StoreSettings(url=down.url, pool_size=1, pool_wait_seconds=0.05))
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.load(ref)
        assert not isinstance(info.value, StoreBusy)
    finally:
        await store.close()


async def test_idle_fold_workers_leave_the_pool_to_requests_and_busy_is_said_as_busy(redis_url: str) -> None:
    """With `store.pool_size: 1`, the serving process's idle fold worker (which waited for jobs in a
    blocking read holding that connection for a second) leaves it to requests and folds: none is
    store-busy, and the conversation is summarised (it never was: summary-pending throughout). A
    pool that is really full is told as busy: /readyz stays ready, the conversation API answers 503
    "busy" with a Retry-After, not "unreachable"."""
    async with gateway({"url": redis_url, "pool_size": 1, "pool_wait_seconds": 0.3}) as (app, url, http):
        history: list[dict[str, str]] = []
        reasons = []
        for i in range(12):
            history.append({"role": "user", "content": f"turn {i}"})
            async with http.post(url + "/v1/chat/completions", json={"model": "gpt-test", "messages": history},
                                 headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "one-conn"}) as r:
                assert r.status == 200
                reasons.append(r.headers["x-gateway-reason"])
                history.append({"role": "assistant", "content": (await r.json())["choices"][0]["message"]["content"]})
            await asyncio.sleep(0.1)
        assert "store-busy" not in reasons and "degraded" not in reasons, reasons
        assert "rewritten" in reasons, reasons  # folds ran on that one connection too
        await drain_background(app)
        assert len(await stored(http, url, "one-conn")) == len(history)

        pool = app[STORE].redis.connection_pool
        held = await pool.get_connection()
        try:
            async with http.get(url + "/readyz") as r:
                assert r.status == 200 and await r.json() == {"status": "ok", "store": "busy"}
            async with http.get(f"{url}/gateway/conversations/one-conn/messages",
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "busy" in (await r.json())["error"]["message"]
        finally:
            await pool.release(held)
        async with http.get(url + "/readyz") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}


async def test_readiness_does_not_wait_out_pool_wait_seconds(redis_url: str) -> None:
    """With every connection held and `pool_wait_seconds: 30`, /readyz still answers (busy) well
    within a probe's timeout: it waited the whole 30 s, and a probe gives up after a second or so."""
    async with gateway({"url": redis_url, "pool_size": 1, "pool_wait_seconds": 30}) as (app, url, http):
        pool = app[STORE].redis.connection_pool
        held = await pool.get_connection()
        try:
            async with http.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=10)) as r:
                assert r.status == 200 and await r.json() == {"status": "ok", "store": "busy"}
        finally:
            await pool.release(held)


async def test_the_pool_limit_holds_after_the_store_was_down(tmp_path: Path) -> None:
    """Connects that failed while Redis was down give back only the slots they took: afterwards, with
    pool_size connections in use, the next call waits for one to be released and then succeeds
    (an overrun pool would fail it at once as busy)."""
    redis = RedisProcess(tmp_path)
    store = await open_store(StoreSettings(url=redis.url, pool_size=2, pool_wait_seconds=30))
    ref = ConvRef("t", "outage")
    try:
        for _ in range(5):
            with pytest.raises(StoreUnavailable):
                await store.load(ref)
        redis.start()
        pool = store.redis.connection_pool
        held = [await pool.get_connection() for _ in range(2)]
        waiting = asyncio.create_task(store.load(ref))
        for _ in range(20):  # let it run as far as it can: to the slot wait, or to a failure
            await asyncio.sleep(0)
        for c in held:
            await pool.release(c)
        assert (await waiting).length == 0
    finally:
        await store.close()
        redis.kill()


async def test_a_cluster_client_waits_for_a_slot_instead_of_failing(redis_cluster: str) -> None:
    """On Redis Cluster, more concurrent store calls than pool_size wait their turn: none fails."""
    store = await open_store(StoreSettings(url=redis_cluster, pool_size=1, pool_wait_seconds=30))
    try:
        views = await asyncio.gather(*(store.load(ConvRef("t", f"cluster-{i}")) for i in range(50)))
        assert [v.length for v in views] == [0] * 50
    finally:
        await store.close()


async def test_the_retry_queue_stores_each_conversation_in_order_once() -> None:
    """Queued turns of one conversation are stored one at a time, in the order queued, each once,
    even when the store refuses some attempts; other conversations go meanwhile."""
    backlog = Backlog(100, first_delay=0, max_delay=0, parallel=4)
    done: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    in_flight: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    refusals = {("a", 0): 3, ("b", 1): 2}

    def record(conv: str, n: int) -> Any:
        async def run() -> None:
            in_flight[conv] += 1
            assert in_flight[conv] == 1, "two entries of one conversation stored at once"
            try:
                await asyncio.sleep(0)  # let the other drainers run meanwhile
                if refusals.get((conv, n), 0):
                    refusals[conv, n] -= 1
                    raise StoreUnavailable("down")
                done[conv].append(n)
            finally:
                in_flight[conv] -= 1
        return run

    for n in range(5):
        for conv in done:
            assert backlog.put(conv, conv, record(conv, n), "StoreUnavailable")
    await asyncio.wait_for(backlog.join(), timeout=10)
    assert done == {conv: [0, 1, 2, 3, 4] for conv in done} and len(backlog) == 0


async def test_a_patient_store_call_waits_longer_for_a_connection(redis_url: str) -> None:
    """Inside `patient(...)` (the recording of an answered turn) a store call outwaits a full pool
    that makes a request's own call give up as busy."""
    store = await open_store(StoreSettings(url=redis_url, pool_size=1, pool_wait_seconds=0.01))
    ref = ConvRef("t", "patient")
    try:
        pool = store.redis.connection_pool
        held = await pool.get_connection()
        with patient(30):
            waiting = asyncio.create_task(store.load(ref))
        with pytest.raises(StoreBusy):  # started after it, gives up after the pool's own wait
            await store.load(ref)
        assert not waiting.done()
        await pool.release(held)
        assert (await waiting).length == 0
    finally:
        await store.close()
