"""The conversation store, on a real Redis, on `memory://` (fakeredis, same Lua) and on Redis Cluster."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import StoreSettings
from gateway.keys import ConvRef
from gateway.model import Message, Summary
from gateway.reconcile import chain_hashes
from gateway.store import Store, StoreUnavailable, _cluster_nodes, open_store
from tests.conftest import free_port


def turn(label: str, role: str = "user", tokens: int = 3) -> Message:
    import hashlib

    return Message(raw={"role": role, "content": label}, role=role, text=label, tokens=tokens,
                hash=hashlib.blake2b(label.encode(), digest_size=16).hexdigest())


def turns(prefix: str, n: int) -> list[Message]:
    return [turn(f"{prefix}{i}", "user" if i % 2 == 0 else "assistant") for i in range(n)]


REF = ConvRef("tenant-1", "conv{1}:a")


# ---- the store under test ---------------------------------------------------------------------


def _url(request: pytest.FixtureRequest, backend: str) -> str:
    # Resolved in a sync fixture: async fixtures cannot be requested from inside a running loop.
    if backend == "redis":
        return str(request.getfixturevalue("redis_url"))
    if backend == "cluster":
        return str(request.getfixturevalue("redis_cluster"))
    return "memory://"


async def _open(url: str, ttl: int = 0) -> Store:
    store = await open_store(StoreSettings(url=url, ttl_seconds=ttl))
    if store.cluster:
        from redis.asyncio.cluster import RedisCluster

        await store.redis.flushall(target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    return store


@pytest.fixture(params=["redis", "memory", "cluster"])
def store_url(request: pytest.FixtureRequest) -> str:
    return _url(request, request.param)


@pytest.fixture(params=["redis", "memory"])
def ttl_store_url(request: pytest.FixtureRequest) -> str:
    return _url(request, request.param)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """A store on each backend, empty."""
    s = await _open(store_url)
    yield s
    await s.close()


@pytest.fixture
async def ttl_store(ttl_store_url: str) -> AsyncIterator[Store]:
    """A store whose conversations expire after 100 s of disuse."""
    s = await _open(ttl_store_url, ttl=100)
    yield s
    await s.close()


async def fill(store: Store, ref: ConvRef, items: list[Message]) -> str:
    res = await store.append(ref, items, base_length=0, base_chain="", dialect="openai_chat")
    assert res.ok and res.appended == len(items)
    return res.chain


def count_commands(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of every command the store's client sends from now on."""
    sent: list[str] = []
    original = store.redis.execute_command

    async def spy(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]).upper())
        return await original(*args, **kwargs)

    monkeypatch.setattr(store.redis, "execute_command", spy)
    return sent


# ---- load -------------------------------------------------------------------------------------


async def test_load_of_unknown_conversation_is_empty(store: Store) -> None:
    """An unknown conversation loads as length 0 with nothing in it."""
    view = await store.load(REF, head=3)
    assert (view.length, view.dialect, view.first_hash, view.last_chain, view.summary) == (0, None, None, None, None)
    assert view.head == view.tail == [] and view.tokens_total == 0 and not view.fold_pending


async def test_load_is_one_round_trip_and_returns_only_the_tail(store: Store,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """load sends a single EVALSHA and returns the head asked for plus messages [summary.covers, length)."""
    items = turns("m", 40)
    await fill(store, REF, items)
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("folded", 30, 0, 7, chains[29]))
    await store.load(REF)  # the script is now known to the server (no NOSCRIPT retry below)
    sent = count_commands(store, monkeypatch)
    view = await store.load(REF, head=2)
    assert sent == ["EVALSHA"]
    assert view.length == 40 and view.tail_start == 30
    assert [t.text for t in view.tail] == [t.text for t in items[30:]]
    assert [t.text for t in view.head] == ["m0", "m1"]
    assert view.summary == Summary("folded", 30, 1, 7, chains[29])
    assert [t.chain for t in view.tail] == chains[30:]
    assert view.first_hash == items[0].hash and view.last_chain == chains[-1]
    assert view.tokens_total == 120 and view.dialect == "openai_chat"


async def test_scripts_are_loaded_again_after_the_server_forgot_them(store: Store) -> None:
    """A server that lost its scripts (restart, SCRIPT FLUSH) answers NOSCRIPT once; the store loads them again."""
    await fill(store, REF, turns("m", 2))
    await store.redis.script_flush()
    view = await store.load(REF)
    assert view.length == 2 and [t.text for t in view.tail] == ["m0", "m1"]
    res = await store.append(REF, turns("n", 1), base_length=2, base_chain=view.last_chain or "",
                             dialect="openai_chat")
    assert res.ok and res.length == 3


async def test_load_with_a_project_reads_its_state_in_the_same_script(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a cluster the project's shared state comes back in the same single EVALSHA."""
    store = await open_store(StoreSettings(url="memory://"))
    ref = ConvRef("t", "c", project="proj")
    assert await store.put_state(ref, {"items": [1]}, expect_version=None)
    await store.load(ref)
    sent = count_commands(store, monkeypatch)
    view = await store.load(ref)
    assert sent == ["EVALSHA"]
    assert (view.state, view.state_version) == ({"items": [1]}, 1)
    await store.close()


async def test_head_beyond_the_summary_comes_from_the_tail(store: Store) -> None:
    """Asking for more head messages than the summary covers still returns the first `head` messages."""
    items = turns("m", 10)
    await fill(store, REF, items)
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 2, 0, 1, chains[1]))
    view = await store.load(REF, head=4)
    assert [t.text for t in view.head] == ["m0", "m1", "m2", "m3"]
    assert view.tail_start == 2 and len(view.tail) == 8
    view = await store.load(REF, head=50)
    assert len(view.head) == 10


# ---- append -----------------------------------------------------------------------------------


async def test_append_computes_the_same_chains_as_python(store: Store) -> None:
    """Chains computed by the Lua script equal reconcile.chain_hashes over the stored hashes."""
    items = turns("m", 7)
    last = await fill(store, REF, items[:3])
    res = await store.append(REF, items[3:], base_length=3, base_chain=last, dialect="anthropic")
    assert (res.ok, res.length, res.appended, res.start) == (True, 7, 4, 3)
    expected = chain_hashes([t.hash for t in items])
    assert await store.chains(REF) == expected
    assert res.chain == expected[-1]
    stored = await store.messages(REF)
    assert [(t.raw, t.role, t.text, t.tokens, t.hash) for t in stored] == \
        [(t.raw, t.role, t.text, t.tokens, t.hash) for t in items]
    assert [t.chain for t in stored] == expected
    assert (await store.load(REF)).dialect == "anthropic"


async def test_append_rejects_a_branched_base(store: Store) -> None:
    """An append whose base chain differs from the stored chain at base_length-1 stores nothing."""
    await fill(store, REF, turns("m", 4))
    other = chain_hashes([t.hash for t in turns("x", 4)])
    res = await store.append(REF, [turn("new")], base_length=4, base_chain=other[-1], dialect="openai_chat")
    assert (res.ok, res.reason, res.appended, res.length) == (False, "branched", 0, 4)
    res = await store.append(REF, [turn("new")], base_length=9, base_chain="", dialect="openai_chat")
    assert (res.ok, res.reason) == (False, "branched")
    assert len(await store.chains(REF)) == 4


async def test_concurrent_appends_store_exactly_the_union(store: Store) -> None:
    """50 concurrent requests on one base store all their turns once each, with consistent chains."""
    base = await fill(store, REF, turns("m", 4))
    batches = [[turn(f"u{i}"), turn(f"a{i}", "assistant")] for i in range(50)]
    results = await asyncio.gather(*(
        store.append(REF, b, base_length=4, base_chain=base, dialect="openai_chat") for b in batches))
    assert all(r.ok and r.appended == 2 for r in results)
    stored = await store.messages(REF)
    assert len(stored) == 104
    texts = [t.text for t in stored[4:]]
    assert sorted(texts) == sorted(t.text for b in batches for t in b)
    for i in range(0, 100, 2):  # each request's turns stay together, in order
        assert texts[i][0] == "u" and texts[i + 1] == "a" + texts[i][1:]
    assert await store.chains(REF) == chain_hashes([t.hash for t in stored])
    view = await store.load(REF)
    assert view.length == 104 and view.last_chain == chain_hashes([t.hash for t in stored])[-1]
    assert view.tokens_total == 104 * 3


async def test_retry_stores_nothing_twice(store: Store) -> None:
    """Re-sending an append that was already stored (even behind other requests' turns) stores nothing."""
    base = await fill(store, REF, turns("m", 2))
    mine = [turn("u-mine"), turn("a-mine", "assistant")]
    first = await store.append(REF, mine, base_length=2, base_chain=base, dialect="openai_chat")
    again = await store.append(REF, mine, base_length=2, base_chain=base, dialect="openai_chat")
    assert (again.ok, again.appended, again.length, again.start) == (True, 0, 4, 2)
    await store.append(REF, [turn("u-other"), turn("a-other", "assistant")], base_length=2, base_chain=base,
                       dialect="openai_chat")
    await store.append(REF, mine, base_length=2, base_chain=base, dialect="openai_chat")
    assert [t.text for t in await store.messages(REF)] == ["m0", "m1", "u-mine", "a-mine", "u-other", "a-other"]
    assert first.chain == (await store.chains(REF))[3]
    assert (await store.load(REF)).tokens_total == 18


async def test_append_from_a_base_behind_the_store_skips_what_is_stored(store: Store) -> None:
    """A client's next request planned before its previous turn was recorded carries that turn again:
    the turns already stored right after its base are not stored twice, the rest follow them."""
    base = await fill(store, REF, turns("m", 2))
    previous = [turn("u1"), turn("a1", "assistant")]
    await store.append(REF, previous, base_length=2, base_chain=base, dialect="openai_chat")
    nxt = [turn("u2"), turn("a2", "assistant")]
    res = await store.append(REF, [*previous, *nxt], base_length=2, base_chain=base, dialect="openai_chat")
    assert (res.ok, res.length, res.appended, res.start) == (True, 6, 2, 4)
    stored = await store.messages(REF)
    assert [t.text for t in stored] == ["m0", "m1", "u1", "a1", "u2", "a2"]
    assert res.chain == chain_hashes([t.hash for t in stored])[-1]
    assert (await store.load(REF)).tokens_total == 6 * 3  # the skipped turns are not counted twice
    again = await store.append(REF, [*previous, *nxt], base_length=2, base_chain=base, dialect="openai_chat")
    assert (again.ok, again.appended, again.length) == (True, 0, 6)


async def test_append_behind_the_store_after_a_sibling_keeps_the_union(store: Store) -> None:
    """Already-stored turns are skipped; the new ones still land after a concurrent request's turns."""
    base = await fill(store, REF, turns("m", 2))
    mine = [turn("u1"), turn("a1", "assistant")]
    await store.append(REF, mine, base_length=2, base_chain=base, dialect="openai_chat")
    await store.append(REF, [turn("u-other"), turn("a-other", "assistant")], base_length=4,
                       base_chain=(await store.chains(REF))[-1], dialect="openai_chat")
    res = await store.append(REF, [*mine, turn("u2")], base_length=2, base_chain=base, dialect="openai_chat")
    assert (res.ok, res.appended) == (True, 1)
    assert [t.text for t in await store.messages(REF)] == ["m0", "m1", "u1", "a1", "u-other", "a-other", "u2"]


async def test_writes_report_the_summary_state_and_fold_flag(store: Store) -> None:
    """Append and branch answer with the summary and state versions and the fold flag as they are after
    the call, so a caller can tell whether what it knows of the conversation is current."""
    base = await fill(store, REF, turns("m", 4))
    res = await store.append(REF, [turn("x")], base_length=4, base_chain=base, dialect="openai_chat")
    assert (res.summary_version, res.state_version, res.fold_queued) == (0, 0, False)
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 2, 0, 1, chains[1]))
    assert await store.put_state(REF, {"items": []}, expect_version=None)
    assert await store.enqueue_fold(REF)
    res = await store.append(REF, [turn("y")], base_length=5, base_chain=chains[-1], dialect="openai_chat")
    assert (res.summary_version, res.state_version, res.fold_queued) == (1, 1, True)
    refused = await store.append(REF, [turn("z")], base_length=9, base_chain="", dialect="openai_chat")
    assert (refused.ok, refused.summary_version, refused.state_version) == (False, 1, 1)
    res = await store.branch(REF, at=1, base_chain=chains[0], turns=[], dialect="openai_chat")
    assert res.summary_version == 2  # the summary covered the dropped messages
    project = ConvRef("tenant-1", "conv-p", "proj")
    assert await store.put_state(project, {"items": []}, expect_version=None)
    res = await store.append(project, [turn("p")], base_length=0, base_chain="", dialect="openai_chat")
    assert res.state_version == (-1 if store.cluster else 1)  # a project's state is in another slot


async def test_large_append_is_batched(store: Store) -> None:
    """A first request carrying thousands of messages is stored whole (RPUSH in batches)."""
    items = turns("m", 2500)
    await fill(store, REF, items)
    assert await store.chains(REF) == chain_hashes([t.hash for t in items])


async def test_time_is_kept(store: Store) -> None:
    """A turn's time survives the round trip."""
    t = turn("dated")
    t.time = "2023-05-08T13:56:00"
    await fill(store, REF, [t])
    assert (await store.messages(REF))[0].time == "2023-05-08T13:56:00"


async def test_the_clients_history_style_is_kept_until_a_request_shows_another(store: Store) -> None:
    """What a request showed of how its client sends history is loaded with the conversation (the
    next request, on any replica, reconciles with it); an append that shows nothing keeps it."""
    assert (await store.load(REF)).client is None
    first = turns("a", 2)
    await store.append(REF, first, base_length=0, base_chain="", dialect="openai_chat")
    assert (await store.load(REF)).client is None
    chains = chain_hashes([t.hash for t in first])
    await store.append(REF, turns("b", 2), base_length=2, base_chain=chains[-1], dialect="openai_chat",
                       client="delta")
    view = await store.load(REF)
    assert (view.client, view.length) == ("delta", 4)
    await store.append(REF, turns("c", 2), base_length=4, base_chain=view.last_chain or "", dialect="openai_chat")
    view = await store.load(REF)
    assert (view.client, view.length) == ("delta", 6)
    await store.append(REF, turns("d", 2), base_length=6, base_chain=view.last_chain or "", dialect="openai_chat",
                       client="full")
    assert (await store.load(REF)).client == "full"


async def test_messages_ranges(store: Store) -> None:
    """messages(start, stop) returns the half-open range [start, stop)."""
    await fill(store, REF, turns("m", 6))
    assert [t.text for t in await store.messages(REF, 2, 4)] == ["m2", "m3"]
    assert [t.text for t in await store.messages(REF, 4)] == ["m4", "m5"]
    assert await store.messages(REF, 3, 3) == []


# ---- branch -----------------------------------------------------------------------------------


async def test_branch_truncates_and_drops_a_summary_of_the_abandoned_branch(store: Store) -> None:
    """A branch keeps [0, at), appends the new turns, and drops a summary covering beyond `at`."""
    items = turns("m", 20)
    await fill(store, REF, items)
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 12, 0, 5, chains[11]))
    await store.put_summary(REF, "by hand", 3)
    assert await store.pinned_summary(REF) == ("by hand", 3)
    new = [turn("edited"), turn("reply", "assistant", tokens=10)]
    res = await store.branch(REF, at=8, base_chain=chains[7], turns=new, dialect="openai_chat")
    assert (res.ok, res.length, res.appended, res.start) == (True, 10, 2, 8)
    view = await store.load(REF)
    assert view.summary is None and view.tail_start == 0
    assert [t.text for t in view.tail] == [*(t.text for t in items[:8]), "edited", "reply"]
    expected = chain_hashes([t.hash for t in [*items[:8], *new]])
    assert await store.chains(REF) == expected and view.last_chain == expected[-1] == res.chain
    assert view.tokens_total == 8 * 3 + 3 + 10
    summary, version, _ = await store.get_summary(REF)
    assert summary is None and version == 3
    assert await store.pinned_summary(REF) == ("", 0)  # the edit described the abandoned branch too


async def test_branch_keeps_a_summary_within_the_kept_prefix(store: Store) -> None:
    """A summary covering no more than `at` messages survives the branch unchanged."""
    await fill(store, REF, turns("m", 10))
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 4, 0, 5, chains[3]))
    assert (await store.branch(REF, at=4, base_chain=chains[3], turns=[turn("x")], dialect="openai_chat")).ok
    view = await store.load(REF)
    assert view.summary == Summary("s", 4, 1, 5, chains[3]) and view.length == 5


async def test_branch_at_zero_replaces_everything(store: Store) -> None:
    """Branching at 0 replaces the whole history, including message 0's hash."""
    await fill(store, REF, turns("m", 5))
    new = turns("n", 2)
    assert (await store.branch(REF, at=0, base_chain="", turns=new, dialect="openai_chat")).ok
    view = await store.load(REF)
    assert view.first_hash == new[0].hash and [t.text for t in view.tail] == ["n0", "n1"]
    assert view.tokens_total == 6
    assert (await store.branch(REF, at=0, base_chain="", turns=[], dialect="openai_chat")).ok
    view = await store.load(REF)
    assert (view.length, view.first_hash, view.last_chain, view.tokens_total) == (0, None, None, 0)


async def test_branch_rejects_a_moved_base(store: Store) -> None:
    """A branch whose kept prefix no longer matches (another branch won) changes nothing."""
    await fill(store, REF, turns("m", 6))
    res = await store.branch(REF, at=3, base_chain="f" * 40, turns=[turn("x")], dialect="openai_chat")
    assert (res.ok, res.reason, res.length) == (False, "branched", 6)
    assert len(await store.chains(REF)) == 6


# ---- folds and summaries ----------------------------------------------------------------------


async def test_commit_fold_fails_after_another_fold(store: Store) -> None:
    """Two folds built on the same summary version: the second commit loses."""
    await fill(store, REF, turns("m", 20))
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("a", 10, 0, 5, chains[9]))
    assert not await store.commit_fold(REF, expect_version=0, summary=Summary("b", 12, 0, 5, chains[11]))
    assert await store.commit_fold(REF, expect_version=1, summary=Summary("c", 14, 0, 5, chains[13]))
    view = await store.load(REF)
    assert view.summary is not None and (view.summary.text, view.summary.version) == ("c", 2)


async def test_commit_fold_fails_after_a_branch(store: Store) -> None:
    """A fold of a prefix that a branch has since replaced does not commit."""
    await fill(store, REF, turns("m", 20))
    chains = await store.chains(REF)
    assert (await store.branch(REF, at=5, base_chain=chains[4], turns=turns("b", 10), dialect="openai_chat")).ok
    assert not await store.commit_fold(REF, expect_version=0, summary=Summary("stale", 10, 0, 5, chains[9]))
    assert (await store.load(REF)).summary is None


async def test_commit_fold_after_a_dropped_summary(store: Store) -> None:
    """After a branch dropped the summary, a fold of the new history commits with or without its version."""
    await fill(store, REF, turns("m", 20))
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 10, 0, 5, chains[9]))
    assert (await store.branch(REF, at=5, base_chain=chains[4], turns=turns("b", 10), dialect="openai_chat")).ok
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("new", 8, 0, 5, chains[7]))
    view = await store.load(REF)
    assert view.summary is not None and (view.summary.version, view.summary.covers) == (3, 8)


async def test_manual_summary_edit_wins_over_an_inflight_fold(store: Store) -> None:
    """put_summary keeps coverage, bumps the version and marks the edit; a fold built before it loses."""
    await fill(store, REF, turns("m", 20))
    chains = await store.chains(REF)
    assert await store.commit_fold(REF, expect_version=0, summary=Summary("s", 10, 0, 5, chains[9]))
    edited = await store.put_summary(REF, "by hand", 3)
    assert edited == Summary("by hand", 10, 2, 3, chains[9])
    assert not await store.commit_fold(REF, expect_version=1, summary=Summary("x", 12, 0, 5, chains[11]))
    summary, version, was_edited = await store.get_summary(REF)
    assert summary == edited and version == 2 and was_edited
    # A later fold keeps the edit flag: the worker keeps the edit's text at the summary's head.
    assert await store.commit_fold(REF, expect_version=2, summary=Summary("by hand\n\nmore", 12, 0, 7, chains[11]))
    assert (await store.get_summary(REF))[2] and await store.pinned_summary(REF) == ("by hand", 3)


# ---- state, stats, fold queue, delete ---------------------------------------------------------


async def test_state_compare_and_set(store: Store) -> None:
    """put_state with an expected version succeeds only on that version; None writes unconditionally."""
    assert await store.get_state(REF) == (None, 0)
    assert await store.put_state(REF, {"a": 1}, expect_version=0)
    assert not await store.put_state(REF, {"a": 2}, expect_version=0)
    assert await store.put_state(REF, {"a": 3}, expect_version=1)
    assert await store.put_state(REF, {"a": 4}, expect_version=None)
    assert await store.get_state(REF) == ({"a": 4}, 3)
    view = await store.load(REF)
    assert (view.state, view.state_version) == ({"a": 4}, 3)


async def test_project_state_is_shared_by_its_conversations(store: Store) -> None:
    """Conversations of one project load the same state; other conversations do not see it."""
    a, b = ConvRef("t", "a", "proj"), ConvRef("t", "b", "proj")
    assert await store.put_state(a, {"goal": "ship"}, expect_version=None)
    await fill(store, b, turns("m", 2))
    view = await store.load(b)
    assert (view.state, view.state_version, view.length) == ({"goal": "ship"}, 1, 2)
    assert (await store.load(ConvRef("t", "b"))).state is None


async def test_stats_counters(store: Store) -> None:
    """add_stats increments integer counters that load and stats() return."""
    await fill(store, REF, turns("m", 2))
    await store.add_stats(REF, requests=1, tokens_saved=100)
    await store.add_stats(REF, requests=1)
    assert await store.stats(REF) == {"requests": 2, "tokens_saved": 100}
    assert (await store.load(REF)).stats == {"requests": 2, "tokens_saved": 100}


async def test_append_and_branch_add_their_stats_stored_or_refused(store: Store) -> None:
    """Stats passed to append or branch are added in the same call, also when the base check refuses the turns."""
    first = turns("m", 2)
    res = await store.append(REF, first, base_length=0, base_chain="", dialect="openai_chat",
                             stats={"requests": 1, "tokens_saved": 7})
    assert res.ok and res.appended == 2
    refused = await store.append(REF, turns("x", 1), base_length=1, base_chain="not-the-chain",
                                 dialect="openai_chat", stats={"requests": 1})
    assert not refused.ok and refused.reason == "branched"
    chains = await store.chains(REF)
    res = await store.branch(REF, at=1, base_chain=chains[0], turns=turns("b", 3), dialect="openai_chat",
                             stats={"requests": 1, "tokens_saved": -2, "input_tokens": 0})
    assert res.ok and res.length == 4
    assert await store.stats(REF) == {"requests": 3, "tokens_saved": 5, "input_tokens": 0}
    assert [t.text for t in (await store.load(REF)).tail] == ["m0", "b0", "b1", "b2"]


async def test_enqueue_fold_at_most_once(store: Store) -> None:
    """A conversation has at most one queued fold until fold_done; the job carries t, c, p, u."""
    ref = ConvRef("t", "c", "proj")
    assert await store.enqueue_fold(ref, urgent=True)
    assert not await store.enqueue_fold(ref)
    assert (await store.load(ref)).fold_pending
    entries: Any = await store.redis.xrange(store.keys.fold_stream())
    assert [e[1] for e in entries] == [{b"t": b"t", b"c": b"c", b"p": b"proj", b"u": b"1"}]
    await store.fold_done(ref)
    assert not (await store.load(ref)).fold_pending
    assert await store.enqueue_fold(ref)
    entries = await store.redis.xrange(store.keys.fold_stream())
    assert len(entries) == 2


async def test_stale_fold_flag_is_requeued(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queued flag older than FOLD_FLAG_STALE_MS (a lost job) does not block a new one forever,
    and load does not report it as a pending fold (the request path would never queue again)."""
    assert await store.enqueue_fold(REF)
    assert (await store.load(REF)).fold_pending
    monkeypatch.setattr(Store, "FOLD_FLAG_STALE_MS", 0)
    assert not (await store.load(REF)).fold_pending
    assert await store.enqueue_fold(REF)


async def test_delete_forgets_the_conversation(store: Store) -> None:
    """delete removes every key of the conversation but not the project's shared state."""
    ref = ConvRef("t", "c", "proj")
    await fill(store, ref, turns("m", 3))
    await store.add_stats(ref, requests=1)
    await store.put_state(ref, {"x": 1}, expect_version=None)
    await store.delete(ref)
    view = await store.load(ref)
    assert view.length == 0 and view.stats == {} and view.state == {"x": 1}
    assert await store.redis.exists(*store.keys.conversation_keys(ref)) == 0
    # A fold that ends after the delete adds its summarizer stats: they do not bring a key back.
    await store.add_stats(ref, folds=1, summarizer_tokens_in=10)
    assert await store.redis.exists(*store.keys.conversation_keys(ref)) == 0


# ---- TTL --------------------------------------------------------------------------------------


async def test_ttl_is_set_and_refreshed(ttl_store: Store) -> None:
    """With ttl_seconds every key of the conversation expires, and each append/load refreshes it."""
    store = ttl_store
    ref = ConvRef("t", "c", "proj")
    last = await fill(store, ref, turns("m", 2))
    await store.add_stats(ref, requests=1)
    await store.put_state(ref, {"x": 1}, expect_version=None)
    chains = await store.chains(ref)
    await store.commit_fold(ref, expect_version=0, summary=Summary("s", 1, 0, 1, chains[0]))
    names = [store.keys.meta(ref), store.keys.msgs(ref), store.keys.chains(ref), store.keys.summary(ref),
             store.keys.stats(ref), store.keys.project_state(ref)]
    for name in names:
        assert 0 < await store.redis.ttl(name) <= 100, name
    for name in names:
        await store.redis.expire(name, 5)
    await store.load(ref)
    assert [await store.redis.ttl(n) > 5 for n in names] == [True] * 6
    for name in names:
        await store.redis.expire(name, 5)
    await store.append(ref, [turn("x")], base_length=2, base_chain=last, dialect="openai_chat")
    assert [await store.redis.ttl(n) > 5 for n in names[:5]] == [True] * 5


async def test_no_ttl_by_default(store: Store) -> None:
    """Without ttl_seconds conversations are kept forever."""
    await fill(store, REF, turns("m", 2))
    assert await store.redis.ttl(store.keys.msgs(REF)) == -1


# ---- errors and URLs --------------------------------------------------------------------------


async def test_unreachable_redis_raises_store_unavailable() -> None:
    """A store whose server is down answers ping False and raises StoreUnavailable, so requests degrade."""
    store = await open_store(StoreSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert not await store.ping()
    with pytest.raises(StoreUnavailable):
        await store.load(REF)
    with pytest.raises(StoreUnavailable):
        await store.append(REF, [turn("x")], base_length=0, base_chain="", dialect="openai_chat")
    await store.close()


async def test_ping(store: Store) -> None:
    """ping is True when the store answers."""
    assert await store.ping()


async def test_commands_are_packed_by_hiredis_into_the_same_bytes(redis_url: str) -> None:
    """The store's connections pack commands with hiredis, byte for byte what redis-py's own packer
    writes (a turn's append: keys, numbers, text, JSON records)."""
    from redis.asyncio.connection import Connection

    store = await open_store(StoreSettings(url=redis_url))
    try:
        conn = store.redis.connection_pool.make_connection()
        assert conn.pack_command.__qualname__.startswith("_HiredisPacking")
        args = ("EVALSHA", "a" * 40, 6, *[f"gw:{{t:c}}:{p}" for p in ("meta", "msgs")], 0, 10, "\u00e9t\u00e9",
                -3, b'{"k":12,"x":"caf\xc3\xa9"}', "SET", "CONFIG GET")
        assert b"".join(conn.pack_command(*args)) == b"".join(Connection().pack_command(*args))
        assert b"".join(conn.pack_command("CONFIG GET", "maxmemory")) == b"".join(
            Connection().pack_command("CONFIG GET", "maxmemory"))
    finally:
        await store.close()


async def test_turns_encoded_in_a_thread_go_out_as_the_same_bytes(redis_url: str) -> None:
    """An import's append has thousands of arguments (packing them held the event loop 20-45 ms):
    its turns are put in the wire format in a thread, and the connection sends that as it is,
    after the command's other arguments: the same bytes as redis-py's own packer writes."""
    from redis.asyncio.connection import Connection

    from gateway.store import _encoded

    store = await open_store(StoreSettings(url=redis_url))
    try:
        assert store.encodes
        conn = store.redis.connection_pool.make_connection()
        head: list[Any] = ["EVALSHA", "b" * 40, 1, "gw:{t:c}:msgs", 7, -1, "\u00e9t\u00e9"]
        turns: list[Any] = []
        for i in range(3000):
            turns += [f"h{i}\u00e9", b'{"t":"' + b"z" * (i % 700) + b'"}']
        packed = conn.pack_command(*head, _encoded(turns))
        assert b"".join(packed) == b"".join(Connection().pack_command(*head, *turns))
    finally:
        await store.close()


async def test_turns_of_many_megabytes_are_stored_and_loaded_whole(store: Store) -> None:
    """An import of 2,000 messages of 2 KB and one of 3 MB (records encoded, parsed and packed off
    the event loop past a megabyte) is stored and read back exactly, in order."""
    items = [turn(f"m{i} " + "lorem ipsum " * 170, "user" if i % 2 == 0 else "assistant") for i in range(2000)]
    items.append(turn("x" * (3 << 20) + "\u00e9"))
    await fill(store, REF, items)
    view = await store.load(REF)
    assert [(t.text, t.raw, t.hash) for t in view.tail] == [(t.text, t.raw, t.hash) for t in items]
    assert [t.text for t in await store.messages(REF, 1990)] == [t.text for t in items[1990:]]


async def test_memory_lua_has_redis_sha1hex_as_redis_does(redis_url: str) -> None:
    """memory://'s Lua gets `redis.sha1hex` (added through fakeredis's private runtime), equal to Redis's."""
    script = "return redis.sha1hex(ARGV[1])"
    memory = await open_store(StoreSettings(url="memory://"))
    real = await open_store(StoreSettings(url=redis_url))
    try:
        for text in ("", "abc", "caf\u00e9 " * 50):
            assert await memory.redis.eval(script, 0, text) == await real.redis.eval(script, 0, text)
    finally:
        await memory.close()
        await real.close()


async def test_the_connection_limit_is_the_stores_not_the_librarys(redis_url: str) -> None:
    """The Redis pool holds store.pool_size connections and waits store.pool_wait_seconds for one,
    whatever redis-py's defaults; the URL may say otherwise."""
    store = await open_store(StoreSettings(url=redis_url, pool_size=7, pool_wait_seconds=3))
    limited = await open_store(StoreSettings(url=redis_url + "?max_connections=5"))
    try:
        pool = store.redis.connection_pool
        assert (pool.max_connections, pool.timeout) == (7, 3)
        assert limited.redis.connection_pool.max_connections == 5
    finally:
        await store.close()
        await limited.close()


def test_cluster_url_parsing() -> None:
    """redis+cluster:// URLs give every startup node, and credentials when present."""
    nodes, creds = _cluster_nodes("redis+cluster://u:pw@h1:7000,h2:7001")
    assert [(n.host, n.port) for n in nodes] == [("h1", 7000), ("h2", 7001)] and creds == {
        "username": "u", "password": "pw"}
    nodes, creds = _cluster_nodes("redis+cluster://h1")
    assert [(n.host, n.port) for n in nodes] == [("h1", 6379)] and creds == {}


# ---- model-based: random operation sequences against a plain Python model ---------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(0, 6)),  # turns, staleness of the base
        st.tuples(st.just("retry"), st.just(0), st.just(0)),
        st.tuples(st.just("behind"), st.integers(0, 3), st.integers(1, 6)),  # new turns, stored ones resent
        st.tuples(st.just("bad"), st.integers(1, 2), st.just(0)),  # append on a base that was never stored
        st.tuples(st.just("branch"), st.integers(0, 3), st.integers(0, 12)),  # turns, position
        st.tuples(st.just("fold"), st.integers(0, 12), st.booleans()),  # covers, with a stale version
    ),
    max_size=25,
)


@pytest.mark.parametrize("backend", ["memory", "redis"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_operations_match_a_model(backend: str, redis_server: str, ops: list[tuple[str, int, Any]]) -> None:
    """Any sequence of appends (fresh, stale-based, resending stored turns, retried, invalid), branches
    and folds leaves exactly the history, chains, summary and token total a plain list model predicts."""
    url = redis_server if backend == "redis" else "memory://"
    asyncio.run(_run_model(url, ops))


def _model_append(model: list[Message], base: int, batch: list[Message]) -> int:
    """What an append of `batch` on `base` does to the model; how many turns it adds."""
    skip = 0  # already stored right after the base
    while skip < len(batch) and base + skip < len(model) and model[base + skip].hash == batch[skip].hash:
        skip += 1
    rest, at = batch[skip:], base + skip
    if not rest or any(model[p:p + len(rest)] == rest for p in range(at, len(model) - len(rest) + 1)):
        return 0  # a retry of what is stored
    model.extend(rest)
    return len(rest)


async def _run_model(url: str, ops: list[tuple[str, int, Any]]) -> None:
    store = await open_store(StoreSettings(url=url))
    ref = ConvRef("model", uuid.uuid4().hex)
    model: list[Message] = []
    summary: tuple[int, int] | None = None  # (covers, version)
    version = 0
    last_batch: tuple[int, list[Message]] | None = None
    serial = 0

    def fresh(k: int) -> list[Message]:
        nonlocal serial
        serial += 1
        return [turn(f"t{serial}.{i}", tokens=i + 1) for i in range(k)]

    try:
        for op, a, b in ops:
            chains = chain_hashes([t.hash for t in model])
            if op == "append":
                base = max(0, len(model) - b)
                batch = fresh(a)
                res = await store.append(ref, batch, base_length=base, base_chain=chains[base - 1] if base else "",
                                         dialect="openai_chat")
                assert res.ok and res.appended == a
                model.extend(batch)
                last_batch = (base, batch)
            elif op == "behind" and model:
                # A full-history client whose base is b turns behind the store: it resends them.
                base = max(0, len(model) - b)
                batch = fresh(a)
                res = await store.append(ref, [*model[base:], *batch], base_length=base,
                                         base_chain=chains[base - 1] if base else "", dialect="openai_chat")
                assert res.ok and res.appended == a
                model.extend(batch)
            elif op == "retry" and last_batch is not None:
                base, batch = last_batch
                if base <= len(model) and chain_hashes([t.hash for t in model[:base]]) == chains[:base]:
                    res = await store.append(ref, batch, base_length=base,
                                             base_chain=chains[base - 1] if base else "", dialect="openai_chat")
                    assert res.ok and res.appended == _model_append(model, base, batch)
            elif op == "bad":
                res = await store.append(ref, fresh(a), base_length=len(model) + 1, base_chain="0" * 40,
                                         dialect="openai_chat")
                assert not res.ok and res.reason == "branched"
            elif op == "branch":
                at = min(b, len(model))
                batch = fresh(a)
                res = await store.branch(ref, at=at, base_chain=chains[at - 1] if at else "", turns=batch,
                                         dialect="openai_chat")
                assert res.ok
                model[at:] = batch
                if summary is not None and summary[0] > at:
                    summary, version = None, version + 1
            elif op == "fold":
                covers = min(a, len(model))
                expect = (summary[1] if summary else version) - (1 if b else 0)
                ok = await store.commit_fold(ref, expect_version=expect, summary=Summary(
                    "s", covers, 0, 1, chains[covers - 1] if covers else ""))
                should = summary is None or expect == summary[1]
                assert ok == should
                if ok:
                    version += 1
                    summary = (covers, version)
            view = await store.load(ref, head=2)
            assert await store.chains(ref) == chain_hashes([t.hash for t in model])
            assert view.length == len(model) and view.tokens_total == sum(t.tokens for t in model)
            covers = summary[0] if summary else 0
            assert (view.summary.covers, view.summary.version) == summary if view.summary else summary is None
            assert view.tail_start == covers
            assert [t.hash for t in view.tail] == [t.hash for t in model[covers:]]
            assert [t.hash for t in view.head] == [t.hash for t in model[:2]]
            assert view.first_hash == (model[0].hash if model else None)
    finally:
        await store.delete(ref)
        await store.close()
