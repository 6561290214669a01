"""The gateway's own API under /gateway/: listing, search, stats, admin scope, 404s, and OpenAI's own
/v1/conversations passed through untouched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from memory_helpers import (
    KEY,
    OTHER_KEY,
    Chat,
    Gateway,
    memory_gateway,
    reply_text,
    user_text,
)

from gateway import cli

ADMIN = "admin-token-0123456789"


@pytest.fixture
async def gwa(redis_url: str) -> AsyncIterator[Gateway]:
    async with memory_gateway(redis_url, auth={"admin_token": ADMIN}) as g:
        g.fake.responder = reply_text
        yield g


async def _talk(chat: Chat, turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for i in range(turns):
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        # At a person's pace: the fold a turn queued is done before the next one (the folds run in
        # another process and the fake upstream answers at once, so nothing else orders them).
        await chat.g.settle()
    return msgs


async def _get(g: Gateway, path: str, key: str = KEY, **headers: str) -> tuple[int, Any]:
    async with g.http.get(g.url + path, headers={"Authorization": f"Bearer {key}", **headers}) as r:
        return r.status, await r.json(content_type=None)


async def test_list_is_the_callers_conversations_newest_first_and_paged(gwa: Gateway) -> None:
    """GET /gateway/conversations lists only the caller's conversations, most recently used first, in pages."""
    for conv in ("c-one", "c-two", "c-three"):
        await _talk(Chat(gwa, "openai", conv), 1)
    await _talk(Chat(gwa, "anthropic", "bob-conv", key=OTHER_KEY), 1)
    await _talk(Chat(gwa, "openai", "c-one"), 2)  # used again: now the newest
    status, page = await _get(gwa, "/gateway/conversations?limit=2")
    assert status == 200 and page["total"] == 3
    assert [c["id"] for c in page["data"]] == ["c-one", "c-three"]
    first = page["data"][0]
    assert first["messages"] == 4 and first["requests"] == 3 and first["tokens_original"] > 0
    assert first["last"]["context"] in ("full", "rewritten") and first["last"]["model"] == "gpt-test"
    _, rest = await _get(gwa, "/gateway/conversations?offset=2&limit=2")
    assert [c["id"] for c in rest["data"]] == ["c-two"]
    _, bobs = await _get(gwa, "/gateway/conversations", key=OTHER_KEY)
    assert [c["id"] for c in bobs["data"]] == ["bob-conv"]
    for query in ("limit=0", "limit=1001", "offset=-1", "offset=x"):
        assert (await _get(gwa, f"/gateway/conversations?{query}"))[0] == 400


async def test_admin_token_sees_every_tenant_and_filters_by_one(gwa: Gateway) -> None:
    """The admin token lists all tenants' conversations, `tenant=` narrows it, and it can open any of them."""
    await _talk(Chat(gwa, "openai", "alice-1"), 1)
    await _talk(Chat(gwa, "openai", "bob-1", key=OTHER_KEY), 1)
    _, everyone = await _get(gwa, "/gateway/conversations", key=ADMIN)
    assert everyone["total"] == 2 and {c["id"] for c in everyone["data"]} == {"alice-1", "bob-1"}
    assert everyone["data"][0]["id"] == "bob-1"  # newest first across tenants
    bob_tenant = everyone["data"][0]["tenant"]
    _, only = await _get(gwa, f"/gateway/conversations?tenant={bob_tenant}", key=ADMIN)
    assert [c["id"] for c in only["data"]] == ["bob-1"]
    status, info = await _get(gwa, f"/gateway/conversations/bob-1?tenant={bob_tenant}", key=ADMIN)
    assert status == 200 and info["messages"] == 2
    assert (await _get(gwa, "/gateway/conversations/bob-1", key=ADMIN))[0] == 400  # which tenant?
    assert (await _get(gwa, "/gateway/conversations/bob-1"))[0] == 404  # alice cannot see bob's
    _, stats = await _get(gwa, "/gateway/stats", key=ADMIN)
    assert stats["admin"] is True and stats["requests"] == 2


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "", None), ("DELETE", "", None), ("GET", "/messages", None), ("GET", "/search?q=redis", None),
    ("PUT", "/state", {"goal": "x"}), ("PUT", "/summary", {"text": "x"}), ("POST", "/fold", None)])
async def test_unknown_conversation_is_a_404_on_every_verb(gwa: Gateway, method: str, path: str,
                                                           body: Any) -> None:
    """No verb creates or pretends to act on a conversation the store does not hold (fold is not 'queued')."""
    async with gwa.http.request(method, f"{gwa.url}/gateway/conversations/nobody{path}", json=body,
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 404
        err = await r.json()
    assert err["error"]["type"] == "not_found_error"
    assert (await _get(gwa, "/gateway/conversations"))[1]["total"] == 0


async def test_search_finds_stored_messages_best_first(gwa: Gateway) -> None:
    """GET .../search?q= returns the stored messages that match the query, the best match first."""
    msgs = await _talk(Chat(gwa, "openai", "searchable"), 6)
    status, found = await _get(gwa, "/gateway/conversations/searchable/search?q=Lua%20append%20script&limit=3")
    assert status == 200 and found["data"]
    best = found["data"][0]
    assert "the Lua append script" in best["message"]["content"]
    assert best["message"] == msgs[best["index"]]
    assert [d["score"] for d in found["data"]] == sorted((d["score"] for d in found["data"]), reverse=True)
    assert (await _get(gwa, "/gateway/conversations/searchable/search?q="))[0] == 400


async def test_search_reads_only_the_newest_messages_of_a_long_conversation(
        gwa: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation longer than the search reads (api.SEARCH_MAX_MESSAGES, shrunk here) is searched
    in its newest messages, with their positions in the whole conversation (it was a 500)."""
    from gateway import api

    msgs = await _talk(Chat(gwa, "openai", "long-search"), 6)
    monkeypatch.setattr(api, "SEARCH_MAX_MESSAGES", 4)
    status, found = await _get(gwa, "/gateway/conversations/long-search/search?q=window%20risks&limit=10")
    assert status == 200, found
    assert found["data"] and all(d["index"] >= len(msgs) - 4 for d in found["data"])
    assert all(d["message"] == msgs[d["index"]] for d in found["data"])


async def test_stats_totals_match_the_requests_and_draw_a_series(gwa: Gateway) -> None:
    """GET /gateway/stats adds up the caller's requests: tokens original vs forwarded and a time series."""
    await _talk(Chat(gwa, "openai", "long"), 10)
    await gwa.settle()
    _, listed = await _get(gwa, "/gateway/conversations")
    row = listed["data"][0]
    status, stats = await _get(gwa, "/gateway/stats")
    assert status == 200 and stats["admin"] is False and stats["requests"] == 10
    assert stats["tokens_original"] == row["tokens_original"] > stats["tokens_forwarded"] == row["tokens_forwarded"]
    assert stats["tokens_saved"] == stats["tokens_original"] - stats["tokens_forwarded"]
    assert sum(p["requests"] for p in stats["series"]) == 10
    assert sum(p["tokens_original"] for p in stats["series"]) == stats["tokens_original"]
    assert row["summary"]["covers"] > 0 and row["summary"]["folded_at"] is not None
    assert row["last"]["context"] == "rewritten"


async def test_openai_sdk_conversations_reach_the_upstream(gwa: Gateway) -> None:
    """client.conversations.retrieve/delete in the OpenAI SDK go to OpenAI through the gateway, not to its own API."""
    client = gwa.openai()
    before = len(gwa.fake.requests)
    conv = await client.conversations.retrieve("conv_123")
    assert conv.id == "conv_123" and conv.metadata == {"from": "fake upstream"}
    deleted = await client.conversations.delete("conv_123")
    assert deleted.deleted is True and deleted.id == "conv_123"
    got = gwa.fake.requests[before:]
    assert [(r.method, r.path) for r in got] == [("GET", "/v1/conversations/conv_123"),
                                                 ("DELETE", "/v1/conversations/conv_123")]
    assert got[0].headers["Authorization"] == f"Bearer {KEY}"


async def test_gateway_stats_prints_the_savings_table(gwa: Gateway, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`gateway stats --url --key` prints the running gateway's totals and its conversations, newest first;
    an unreachable gateway or a refused key is one line on stderr and exit 1."""
    await _talk(Chat(gwa, "openai", "table-old"), 1)
    await _talk(Chat(gwa, "openai", "table-new"), 14)
    await gwa.settle()
    _, stats = await _get(gwa, "/gateway/stats")
    code = await asyncio.to_thread(cli.main, ["stats", "--url", gwa.url, "--key", KEY])
    out = capsys.readouterr().out
    assert code == 0
    out = out[out.index(f"Memory Gateway at {gwa.url}"):]  # (the test's own log lines go to stdout too)
    tokens = next(line for line in out.splitlines() if line.startswith("tokens"))
    saved = stats["tokens_original"] - stats["tokens_forwarded"]
    assert tokens.split()[1:4] == [f"{stats['tokens_original']:,}", f"{stats['tokens_forwarded']:,}", f"{saved:,}"]
    assert out.index("table-new") < out.index("table-old") and "rewritten" in out
    assert await asyncio.to_thread(cli.main, ["stats", "--url", gwa.url, "--key", ADMIN]) == 0
    assert "(all tenants)" in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, ["stats", "--url", "http://127.0.0.1:9", "--key", KEY]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    for name in ("GATEWAY_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert await asyncio.to_thread(cli.main, ["stats", "--url", gwa.url]) == 1
    assert "answered 401" in (err := capsys.readouterr().err) and "--key" in err  # says what to pass


async def test_plain_gateway_keys_that_end_alike_are_different_tenants(redis_url: str) -> None:
    """`auth.keys: [plain, plain]`: each key is its own tenant, even when two keys share their tail;
    the tenant shows no part of the key."""
    alice, bob = "alice-000000-SECRET", "bob-999999-SECRET"
    async with memory_gateway(redis_url, auth={"keys": [alice, bob]}) as g:
        g.fake.responder = reply_text
        await _talk(Chat(g, "openai", "diary", key=alice), 1)
        assert (await _get(g, "/gateway/conversations/diary/messages", key=alice))[0] == 200
        status, body = await _get(g, "/gateway/conversations/diary/messages", key=bob)
        assert status == 404, body
        _, listed = await _get(g, "/gateway/conversations", key=bob)
        assert listed["total"] == 0
        _, mine = await _get(g, "/gateway/conversations", key=alice)
        assert "SECRET" not in mine["data"][0].get("tenant", "") and "SECRET" not in str(mine)


async def test_requests_that_keep_nothing_list_no_conversation(gwa: Gateway) -> None:
    """A credential the provider refuses (401) adds no tenant and no row to the store's activity, and a
    passthrough (`X-Memory: off`) is counted but lists no conversation the API would answer 404 for."""
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hello"}]}
    gwa.fake.error_status = 401
    for i in range(3):
        async with gwa.http.post(gwa.url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer junk-{i}", "X-Conversation-Id": f"j{i}"}) as r:
            assert r.status == 401
    gwa.fake.error_status = None
    async with gwa.http.post(gwa.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "off-1",
                                      "X-Memory": "off"}) as r:
        assert r.status == 200 and r.headers["x-gateway-reason"] == "memory-off"
    await _talk(Chat(gwa, "openai", "kept"), 1)
    _, everyone = await _get(gwa, "/gateway/conversations", key=ADMIN)
    assert [c["id"] for c in everyone["data"]] == ["kept"]
    # The passthrough still counts in the caller's totals (the savings share is of every request).
    assert (await _get(gwa, "/gateway/stats"))[1]["requests"] == 2
    assert (await _get(gwa, "/gateway/stats", key=ADMIN))[1]["requests"] == 2  # no junk tenant counted
