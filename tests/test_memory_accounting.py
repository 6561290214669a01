"""Token accounting: what the headers and stats report as saved."""

from __future__ import annotations

from typing import Any

from memory_helpers import KEY, memory_gateway, openai_turn, user_text

from gateway.app import HOOK, STORE
from gateway.auth import tenant_for
from gateway.keys import ConvRef


async def test_saved_tokens_are_net_of_summarizer_cost(redis_url: str) -> None:
    """Summarizer tokens spent on a conversation are deducted once from the savings of the requests that
    follow (from the first one planned knowing of them: a warm conversation learns of them with its next
    record), and never again."""
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

        after = [await turn(user_text(10 + i)) for i in range(3)]
        assert all(h["x-gateway-context"] == "rewritten" for h in after)
        gross = [int(h["x-gateway-tokens-original"]) - int(h["x-gateway-tokens-forwarded"]) for h in after]
        saved = [int(h["x-gateway-tokens-saved"]) for h in after]
        assert sum(gross) - sum(saved) == 150
        assert [g - s for g, s in zip(gross, saved, strict=True)] in ([150, 0, 0], [0, 150, 0])
        stats = await store.stats(ref)
        assert stats["summarizer_tokens_charged"] == 150


async def test_long_turns_fold_by_tokens_before_the_message_batch(redis_url: str) -> None:
    """Messages aged out of the window fold once their tokens reach memory.fold_tokens, even when
    fewer than memory.fold_batch messages have aged out."""
    async with memory_gateway(redis_url, memory={"fold_batch": 50, "fold_tokens": 300, "keep_recent": 4}) as g:
        client = g.openai()
        history: list[dict[str, Any]] = []
        for i in range(5):  # 10 messages: 6 aged out, far below fold_batch, far above 300 tokens
            history.append({"role": "user", "content": f"{user_text(i)} " + "details " * 80})
            _, reply = await openai_turn(g, client, "by-tokens", history)
            history.append({"role": "assistant", "content": reply})
        await g.settle()
        status, info = await g.api("GET", "by-tokens")
        assert status == 200
        assert info["summary"] is not None and info["summary"]["covers"] >= 4


async def test_a_warm_turn_costs_one_script_call_and_a_cold_one_two(redis_url: str, monkeypatch: Any) -> None:
    """A turn of a conversation this gateway has been serving sends the store one EVALSHA: the record
    (turns and stats together), its plan made from what the last record left. A conversation it does
    not know (as after a restart) costs one more, to load."""
    async with memory_gateway(redis_url, memory={"fold_batch": 100, "fold_tokens": 100_000}) as g:
        client = g.openai()
        history: list[dict[str, Any]] = []
        await g.views_live()
        for i in range(3):
            history.append({"role": "user", "content": user_text(i)})
            _, reply = await openai_turn(g, client, "one-call", history)
            history.append({"role": "assistant", "content": reply})
        redis = g.app[STORE].redis
        sent: list[str] = []
        execute, pipeline = redis.execute_command, redis.pipeline

        async def spy(*args: Any, **kwargs: Any) -> Any:
            sent.append(str(args[0]).upper())
            return await execute(*args, **kwargs)

        def no_pipeline(*args: Any, **kwargs: Any) -> Any:
            sent.append("PIPELINE")
            return pipeline(*args, **kwargs)

        monkeypatch.setattr(redis, "execute_command", spy)
        monkeypatch.setattr(redis, "pipeline", no_pipeline)
        history.append({"role": "user", "content": user_text(3)})
        _, reply = await openai_turn(g, client, "one-call", history)  # returns once the recording is done
        history.append({"role": "assistant", "content": reply})
        assert sent == ["EVALSHA"]

        sent.clear()
        g.app[HOOK].caches.views.clear()
        history.append({"role": "user", "content": user_text(4)})
        await openai_turn(g, client, "one-call", history)
        assert sent == ["EVALSHA", "EVALSHA"]
        stats = await g.app[STORE].stats(ConvRef(tenant_for(KEY), "one-call"))
        assert stats["requests"] == 5


def _where_counted(monkeypatch: Any, *watched: str) -> list[bool]:
    """For each time one of `watched` is counted afresh: was it on the event loop's thread?"""
    import asyncio
    import threading

    from gateway.tokens import TokenCounter

    where: list[bool] = []
    real = TokenCounter._fresh

    def spy(self: TokenCounter, enc: Any, text: str) -> int:
        if text in watched:
            try:
                asyncio.get_running_loop()
                where.append(True)
            except RuntimeError:
                where.append(threading.current_thread() is threading.main_thread())
        return real(self, enc, text)

    monkeypatch.setattr(TokenCounter, "_fresh", spy)
    return where


async def test_a_pasted_file_is_counted_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """Counting a new message's tokens takes ~0.1 µs a character: a pasted file is counted in a
    thread, so the requests of every other conversation are not held meanwhile, and its count is the
    same as counting it anywhere else."""
    from gateway.tokens import TokenCounter

    pasted = "\n".join(f"line {i}: value_{i} = compute({i}, mode='fast')" for i in range(2_000))
    where = _where_counted(monkeypatch, pasted)
    async with memory_gateway(redis_url) as g:
        history = [{"role": "user", "content": pasted}]
        await openai_turn(g, g.openai(), "pasted", history)
        stored = (await g.api("GET", "pasted/messages"))[1]["data"]
    assert where == [False]  # counted once, in a worker thread
    assert stored[0]["tokens"] == TokenCounter({}).count_message(pasted)


async def test_an_import_of_many_messages_is_counted_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """A first request carrying a long history counts it in a thread even when no one message is
    long: 300 messages of 2 KB each are 600 KB to tokenise (tens of ms), which on the event loop
    would hold every other conversation. The stored counts are the usual ones."""
    from gateway.tokens import TokenCounter

    texts = [f"message {i}: " + " ".join(f"word{i}_{j}" for j in range(250)) for i in range(300)]
    assert all(2_000 < len(t) < 4_000 for t in texts)
    where = _where_counted(monkeypatch, *texts)
    async with memory_gateway(redis_url) as g:
        history = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        await openai_turn(g, g.openai(), "imported", history)
        stored = (await g.api("GET", "imported/messages?limit=1000"))[1]["data"]
    assert where == [False] * len(texts)  # each counted once, in a worker thread
    assert [m["tokens"] for m in stored[:300]] == [TokenCounter({}).count_message(t) for t in texts]


async def test_a_long_reply_is_counted_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """A reply of a whole file (256 KB) is counted in a thread too, as a pasted file is: recording it
    does not hold the requests of every other conversation, and its stored count is the usual one."""
    from gateway.tokens import TokenCounter

    answer = "\n".join(f"line {i}: value_{i} = compute({i}, mode='fast')" for i in range(6_000))
    where = _where_counted(monkeypatch, answer)
    async with memory_gateway(redis_url, reply=answer) as g:
        await openai_turn(g, g.openai(), "long-reply", [{"role": "user", "content": "the whole file, please"}])
        stored = (await g.api("GET", "long-reply/messages"))[1]["data"]
    assert len(answer) > 200_000
    assert where == [False]
    assert stored[1]["message"]["content"] == answer
    assert stored[1]["tokens"] == TokenCounter({}).count_message(answer)


async def test_a_long_new_history_is_hashed_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """Each new message is canonicalised and hashed (about 5 ms a megabyte): a first request that
    brings 600 KB of history does that in a thread, so every other conversation is served
    meanwhile, while a resend that adds one turn hashes it in place. The resend is taken as the
    same conversation going on: every message is stored once, in order."""
    import threading

    import gateway.caches

    threads: list[bool] = []
    real = gateway.caches.content_hash

    def spy(dialect: Any, raw: dict[str, Any]) -> str:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(dialect, raw)

    monkeypatch.setattr(gateway.caches, "content_hash", spy)
    texts = [f"message {i}: " + " ".join(f"word{i}_{j}" for j in range(250)) for i in range(300)]
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    async with memory_gateway(redis_url) as g:
        _, reply = await openai_turn(g, g.openai(), "imported", history)
        first = list(threads)
        threads.clear()
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        await openai_turn(g, g.openai(), "imported", history)
        stored = (await g.api("GET", "imported/messages?limit=1000"))[1]["data"]
    assert first == [False] * 300  # all in a worker thread
    assert threads == [True, True]  # a resend's reply and new turn: on the loop (a thread hop costs more)
    assert [m["message"] for m in stored] == [*history, {"role": "assistant", "content": reply}]


async def test_a_long_system_prompt_is_counted_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """A system prompt of a whole manual (300 KB) is counted in a thread, as a pasted file is: a
    30 MB one held every conversation for seconds. The rewrite's accounting is the usual one."""
    from gateway.tokens import TokenCounter

    system = "\n".join(f"rule {i}: always answer in the tone of document section {i}." for i in range(6_000))
    where = _where_counted(monkeypatch, system)
    async with memory_gateway(redis_url) as g:
        history = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
        headers, _ = await openai_turn(g, g.openai(), "manual", history)
    assert len(system) > 300_000
    assert where == [False]  # counted once, in a worker thread
    assert int(headers["x-gateway-tokens-original"]) >= TokenCounter({}).count(system)


async def test_a_long_new_turn_after_a_long_history_is_hashed_off_the_event_loop(redis_url: str,
                                                                                 monkeypatch: Any) -> None:
    """One pasted text (300 KB) as the new turn of a resent history of 100 messages is hashed in a
    thread too: its share of the body by message count would say it is small."""
    import threading

    import gateway.caches

    threads: list[bool] = []
    real = gateway.caches.content_hash
    pasted = "the quick brown fox jumps over the lazy dog " * 7_000

    def spy(dialect: Any, raw: dict[str, Any]) -> str:
        if raw.get("content") == pasted:
            threads.append(threading.current_thread() is threading.main_thread())
        return real(dialect, raw)

    monkeypatch.setattr(gateway.caches, "content_hash", spy)
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(99)]
    async with memory_gateway(redis_url) as g:
        _, reply = await openai_turn(g, g.openai(), "paste", history)
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": pasted}]
        await openai_turn(g, g.openai(), "paste", history)
        stored = (await g.api("GET", "paste/messages?limit=1000"))[1]["data"]
    assert len(pasted) > 300_000 and threads == [False]
    assert stored[100]["message"]["content"] == pasted


async def test_a_long_first_history_with_a_bad_message_is_refused_from_the_thread_that_checks_it(
        redis_url: str) -> None:
    """The check of a long new history runs in the thread that hashes it: a bad message among 300
    is still the caller's 400, in its dialect, and nothing is stored."""
    from memory_helpers import conv_headers

    history: list[dict[str, Any]] = [{"role": "user" if i % 2 == 0 else "assistant",
                                      "content": f"message {i}: " + "lorem ipsum " * 200} for i in range(300)]
    history[150] = {"role": "assistant", "content": 5}
    async with memory_gateway(redis_url) as g:
        async with g.http.post(g.url + "/v1/chat/completions", json={"model": "gpt-test", "messages": history},
                               headers={**conv_headers("bad-import"), "Authorization": f"Bearer {KEY}"}) as r:
            status, body = r.status, await r.json()
        stored = await g.api("GET", "bad-import/messages")
    assert status == 400 and "messages[150]" in body["error"]["message"]
    assert stored[0] == 404 and g.fake.requests == []


async def test_pictures_are_hashed_and_stored_off_the_event_loop(redis_url: str, monkeypatch: Any) -> None:
    """Two pictures as data URLs (700 KB each) count a few tokens but are megabytes to hash, encode
    and send: that work is done in threads, not on the event loop, and the messages are stored
    whole."""
    import base64
    import random
    import threading

    import gateway.caches
    import gateway.store

    where: dict[str, list[bool]] = {"hash": [], "record": []}
    real_hash, real_args = gateway.caches.content_hash, gateway.store._turn_args

    def hash_spy(dialect: Any, raw: dict[str, Any]) -> str:
        if isinstance(raw.get("content"), list):
            where["hash"].append(threading.current_thread() is threading.main_thread())
        return real_hash(dialect, raw)

    def args_spy(turns: Any, *rest: Any) -> Any:
        where["record"].append(threading.current_thread() is threading.main_thread())
        return real_args(turns, *rest)

    monkeypatch.setattr(gateway.caches, "content_hash", hash_spy)
    monkeypatch.setattr(gateway.store, "_turn_args", args_spy)
    rng = random.Random(5)
    history: list[dict[str, Any]] = []
    for i in range(2):
        url = "data:image/png;base64," + base64.b64encode(rng.randbytes(525_000)).decode()
        history += [{"role": "user", "content": [{"type": "text", "text": f"what is in picture {i}?"},
                                                 {"type": "image_url", "image_url": {"url": url}}]},
                    {"role": "assistant", "content": f"a cat, number {i}"}]
    history.append({"role": "user", "content": "and both together?"})
    async with memory_gateway(redis_url) as g:
        await openai_turn(g, g.openai(), "pictures", history)
        stored = (await g.api("GET", "pictures/messages"))[1]["data"]
    assert where["hash"] == [False, False]  # both pictures' messages, in a worker thread
    assert where["record"] and not where["record"][0]  # the first request's records: in a thread
    assert [m["message"] for m in stored[:5]] == history
