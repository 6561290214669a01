"""The conversation API (/gateway/conversations/{id}) on a live gateway: what it reports matches what the
memory path does, and its edits reach the next forwarded request."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
from memory_helpers import (
    KEY,
    Chat,
    Gateway,
    gw,  # noqa: F401 (fixture)
    gw_redis,  # noqa: F401 (fixture)
    openai_turn,
    plain,
    reply_text,
    store_url,  # noqa: F401 (fixture)
    user_text,
)

from gateway import state
from gateway.app import drain_background


async def _talk(chat: Chat, msgs: list[dict[str, Any]], turns: range, *, settle: bool = True) -> Any:
    headers = None
    for i in turns:
        msgs.append({"role": "user", "content": user_text(i)})
        headers, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})
        if settle:
            await chat.g.settle()
    return headers


def _is_openai_error(body: Any, kind: str = "invalid_request_error") -> bool:
    return (isinstance(body, dict) and set(body) == {"error"} and body["error"]["type"] == kind
            and isinstance(body["error"]["message"], str) and body["error"]["message"] != "")


async def test_get_reports_stats_summary_state_and_window(gw: Gateway) -> None:  # noqa: F811
    """GET /gateway/conversations/{id} tells how many messages are stored, what the summary covers, which
    messages are the verbatim window, and what the memory saved."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "stats"), []
    await _talk(chat, msgs, range(10))
    status, info = await gw.api("GET", "stats")
    assert status == 200
    assert info["id"] == "stats" and info["dialect"] == "openai_chat" and info["messages"] == 20
    assert info["tokens"] > 0 and info["fold_pending"] is False
    summary = info["summary"]
    assert summary["covers"] >= 12 and summary["version"] >= 1 and summary["edited"] is False
    assert summary["tokens"] > 0 and "Turn 0" in summary["text"]
    assert info["window"] == {"start": summary["covers"], "end": 20, "keep_recent": 4}
    assert 20 - summary["covers"] >= 4
    stats = info["stats"]
    assert stats["requests"] == 10 and stats["input_tokens"] > 0 and stats["output_tokens"] > 0
    assert stats["tokens_original"] - stats["tokens_forwarded"] == stats["tokens_saved"] > 0
    assert isinstance(info["state"], dict) and isinstance(info["state_rendered"], str)
    assert (await gw.api("GET", "never-used"))[0] == 404


async def test_messages_pages_and_rejects_bad_bounds(gw_redis: Gateway) -> None:  # noqa: F811
    """GET .../messages pages through the stored history with offset/limit; bad values are a 400."""
    g = gw_redis
    g.fake.responder = reply_text
    chat, msgs = Chat(g, "anthropic", "pages"), []
    await _talk(chat, msgs, range(5), settle=False)
    status, page = await g.api("GET", "pages/messages?offset=3&limit=4")
    assert status == 200 and page["total"] == 10 and page["offset"] == 3 and page["limit"] == 4
    assert [d["index"] for d in page["data"]] == [3, 4, 5, 6]
    assert plain([d["message"] for d in page["data"]]) == msgs[3:7]
    assert [d["role"] for d in page["data"]] == ["assistant", "user", "assistant", "user"]
    assert all(d["tokens"] > 0 and d["time"] for d in page["data"])
    status, page = await g.api("GET", "pages/messages?offset=8")
    assert status == 200 and [d["index"] for d in page["data"]] == [8, 9]
    assert (await g.api("GET", "pages/messages?offset=50"))[1]["data"] == []
    for query in ("offset=-1", "limit=0", "limit=1001", "offset=abc", "limit=1.5"):
        status, body = await g.api("GET", f"pages/messages?{query}")
        assert status == 400 and _is_openai_error(body), (query, body)


async def test_put_state_reaches_the_next_request_and_survives_folds(gw: Gateway) -> None:  # noqa: F811
    """Project state edited through the API is in the next forwarded request's state block and is still
    there after later folds."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "state"), []
    await _talk(chat, msgs, range(5))
    edits = {"decisions": ["Store conversations in Redis Cluster", "Fold with the extractive summarizer"],
             "constraints": "Never send the API key to the summarizer"}
    status, body = await gw.api("PUT", "state/state", json=edits)
    assert status == 200 and "Store conversations in Redis Cluster" in str(body["state"])
    headers = await _talk(chat, msgs, range(5, 6))
    assert headers["x-gateway-context"] == "rewritten"
    injected = chat.injected()
    assert "## Project state" in injected
    for text in ("Store conversations in Redis Cluster", "Fold with the extractive summarizer",
                 "Never send the API key to the summarizer"):
        assert text in injected
    version = (await gw.api("GET", "state"))[1]["summary"]["version"]
    await _talk(chat, msgs, range(6, 12))
    _, info = await gw.api("GET", "state")
    assert info["summary"]["version"] > version  # folds happened since the edit
    assert "Never send the API key to the summarizer" in info["state_rendered"]
    assert "Store conversations in Redis Cluster" in chat.injected()
    status, err = await gw.api("PUT", "state/state", json={"moods": ["x"]})
    assert status == 400 and "unknown kinds ['moods']" in err["error"]["message"]
    assert "values" not in err["error"]["message"]  # only what is wrong
    assert (await gw.api("PUT", "state/state", json={"decisions": [1, 2]}))[0] == 400


async def test_put_summary_is_used_by_the_next_request(gw_redis: Gateway) -> None:  # noqa: F811
    """A summary written through the API replaces the generated one in the next forwarded request."""
    g = gw_redis
    g.fake.responder = reply_text
    chat, msgs = Chat(g, "anthropic", "summ"), []
    await _talk(chat, msgs, range(6))
    _, before = await g.api("GET", "summ")
    text = "The user is building a Redis-backed memory gateway and prefers terse answers."
    status, body = await g.api("PUT", "summ/summary", json={"text": text})
    assert status == 200 and body["summary"]["edited"] is True and body["summary"]["text"] == text
    assert body["summary"]["covers"] == before["summary"]["covers"]
    assert body["summary"]["version"] == before["summary"]["version"] + 1
    headers = await _talk(chat, msgs, range(6, 7), settle=False)
    assert headers["x-gateway-context"] == "rewritten"
    assert text in chat.injected() and before["summary"]["text"] not in chat.injected()
    _, after = await g.api("GET", "summ")
    assert after["summary"]["edited"] is True and after["summary"]["text"] == text
    for bad in ({"text": 5}, {"summary": "x"}, ["x"]):
        status, err = await g.api("PUT", "summ/summary", json=bad)
        assert status == 400 and _is_openai_error(err)


async def test_a_summary_edit_stays_at_the_head_through_later_folds(gw: Gateway) -> None:  # noqa: F811
    """Folds after a summary edit keep its text verbatim at the summary's head and summarise after it
    (the extractive fold used to compress the edit away once the summary grew past its cap)."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "kept-edit"), []
    await _talk(chat, msgs, range(16))
    text = "HAND-EDIT: the user ships the billing service on PostgreSQL 16 and wants terse answers."
    status, body = await gw.api("PUT", "kept-edit/summary", json={"text": text})
    assert status == 200 and body["summary"]["edited"] is True
    version = body["summary"]["version"]
    await _talk(chat, msgs, range(16, 40))
    summary = (await gw.api("GET", "kept-edit"))[1]["summary"]
    assert summary["version"] >= version + 2  # folds committed since the edit
    assert summary["edited"] is True and summary["covers"] > body["summary"]["covers"]
    # The edit, then what was folded since (the turns' own words).
    assert summary["text"].startswith(text) and "Turn 30" in summary["text"][len(text):]
    assert text in chat.injected()


async def test_a_summary_edit_is_bounded(gw: Gateway) -> None:  # noqa: F811
    """A summary edit over 20,000 characters is a 400 in the caller's format, and the summary is unchanged."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "big-edit"), []
    await _talk(chat, msgs, range(16))
    before = (await gw.api("GET", "big-edit"))[1]["summary"]
    status, err = await gw.api("PUT", "big-edit/summary", json={"text": "word " * 4001})
    assert status == 400 and _is_openai_error(err) and "20000 characters" in err["error"]["message"]
    assert (await gw.api("GET", "big-edit"))[1]["summary"] == before


async def test_post_fold_produces_a_summary(gw: Gateway) -> None:  # noqa: F811
    """POST .../fold queues a fold now: after the workers settle the conversation has a summary."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "fold"), []
    await _talk(chat, msgs, range(3))
    assert (await gw.api("GET", "fold"))[1]["summary"] is None  # too short to fold by itself
    status, body = await gw.api("POST", "fold/fold")
    assert status == 202 and body == {"queued": True}
    await gw.settle()
    _, info = await gw.api("GET", "fold")
    assert info["summary"] is not None and info["summary"]["covers"] > 0 and "Turn 0" in info["summary"]["text"]
    assert info["window"]["start"] == info["summary"]["covers"]


async def test_delete_forgets_the_conversation(gw: Gateway) -> None:  # noqa: F811
    """DELETE removes everything: GET is a 404 and the next request starts a fresh conversation."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "gone"), []
    await _talk(chat, msgs, range(8))
    status, body = await gw.api("DELETE", "gone")
    assert status == 200 and body == {"id": "gone", "deleted": True}
    status, err = await gw.api("GET", "gone")
    assert status == 404 and _is_openai_error(err, "not_found_error")
    assert (await gw.api("GET", "gone/messages"))[0] == 404
    fresh = [{"role": "user", "content": "A brand new start."}]
    headers, text = await chat.send(fresh)
    assert headers["x-gateway-context"] == "full" and plain(chat.forwarded()) == fresh
    assert "Turn 0" not in str(gw.last(chat.path).body)
    await gw.settle()
    _, info = await gw.api("GET", "gone")
    assert info["messages"] == 2 and info["summary"] is None and info["stats"]["requests"] == 1
    assert plain(await chat.stored()) == [*fresh, {"role": "assistant", "content": text}]


@pytest.mark.parametrize(("method", "path"), [("PUT", "state"), ("PUT", "summary")])
async def test_bad_json_is_a_400_in_the_openai_shape(gw_redis: Gateway, method: str, path: str) -> None:  # noqa: F811
    """A body that is not JSON gets a 400 with an OpenAI-style error object, not a 500."""
    gw_redis.fake.responder = reply_text
    await _talk(Chat(gw_redis, "openai", "any"), [], range(1), settle=False)
    await drain_background(gw_redis.app)
    status, body = await gw_redis.api(method, f"any/{path}", data=b"{not json",
                                      headers={"Content-Type": "application/json"})
    assert status == 400 and _is_openai_error(body)
    assert "not valid JSON" in body["error"]["message"]


async def test_a_state_edit_without_the_project_header_reaches_the_projects_requests(gw: Gateway) -> None:  # noqa: F811
    """The dashboard edits a conversation without X-Project-Id: the edit lands in its project's state,
    which the conversation's next request carries."""
    gw.fake.responder = reply_text
    client, msgs = gw.openai(), [{"role": "system", "content": "be brief"}]
    project = {"extra_headers": {"X-Project-Id": "apollo"}}
    for i in range(6):
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await openai_turn(gw, client, "proj", msgs, **project)
        msgs.append({"role": "assistant", "content": text})
        await gw.settle()
    status, _ = await gw.api("PUT", "proj/state", json={"decisions": ["Ship on the Moon base"]})
    assert status == 200
    assert (await gw.api("GET", "proj"))[1]["project"] == "apollo"
    msgs.append({"role": "user", "content": user_text(6)})
    headers, _ = await openai_turn(gw, client, "proj", msgs, **project)
    assert headers["x-gateway-context"] == "rewritten"
    assert "Ship on the Moon base" in str(gw.last("/chat/completions").body)


async def test_a_state_edit_is_bounded_and_repeated_edits_do_not_grow_the_state(gw: Gateway) -> None:  # noqa: F811
    """An edit of more than MAX_EDIT_ITEMS items (or one longer than MAX_EDIT_CHARS) is a 400 and
    changes nothing; edits repeated many times keep the stored state within MAX_ITEMS items."""
    gw.fake.responder = reply_text
    chat, msgs = Chat(gw, "openai", "state"), []
    await _talk(chat, msgs, range(2))
    too_many = {"decisions": [f"decision number {i} use tool{i}" for i in range(state.MAX_EDIT_ITEMS + 1)]}
    status, body = await gw.api("PUT", "state/state", json=too_many)
    assert status == 400 and f"at most {state.MAX_EDIT_ITEMS} items" in body["error"]["message"]
    status, _ = await gw.api("PUT", "state/state", json={"goal": "x" * (state.MAX_EDIT_CHARS + 1)})
    assert status == 400
    assert "decision number" not in str((await gw.api("GET", "state"))[1].get("state"))
    for round_ in range(8):
        # Unrelated statements (near-identical ones would supersede each other).
        edits = {"decisions": [f"round {round_}: use " + " ".join(_word(f"{round_}-{i}-{w}") for w in range(3))
                               for i in range(40)]}
        assert (await gw.api("PUT", "state/state", json=edits))[0] == 200
    stored = (await gw.api("GET", "state"))[1]["state"]
    items = [i for kind in state.KINDS for i in stored.get(kind, [])]
    assert len(items) <= state.MAX_ITEMS
    active = [i["text"] for i in stored["decisions"] if not i.get("superseded_by")]
    assert len(active) == 40 and all(t.startswith("round 7:") for t in active)
    # Items an edit set are never pruned while current: an edit may not take the state past MAX_EDITED.
    more = {"constraints": [f"never {_word(f'c-{i}')} {_word(f'd-{i}')}" for i in range(state.MAX_EDITED - 39)]}
    status, body = await gw.api("PUT", "state/state", json=more)
    assert status == 400 and f"more than {state.MAX_EDITED}" in body["error"]["message"]
    assert (await gw.api("GET", "state"))[1]["state"] == stored


def _word(seed: str) -> str:
    """A made-up word of letters only (a digit in it would make two statements one, updated)."""
    return "".join(chr(ord("a") + int(c, 16)) for c in hashlib.sha256(seed.encode()).hexdigest()[:8])


async def _raw(url: str, method: str, path: str, headers: dict[str, bytes], body: Any = None) -> tuple[int, Any]:
    """A request whose header values go as the bytes given (an HTTP client encodes them as text)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
    raw = head.encode() + b"".join(k.encode() + b": " + v + b"\r\n" for k, v in headers.items()) + b"\r\n" + data
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(raw)
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


async def test_a_project_header_of_bytes_not_utf8_reads_and_edits_its_project(gw: Gateway) -> None:  # noqa: F811
    """X-Project-Id bytes that are not UTF-8 name the same project in the conversation API as on the
    memory path (as %XX): reading and editing the state answer 200 (they were 500s, after the edit was
    written under another key), and the edit reaches the conversation's next request."""
    gw.fake.responder = reply_text
    headers = {"Authorization": f"Bearer {KEY}".encode(), "X-Project-Id": b"\xff\xfe",
               "Content-Type": b"application/json"}
    msgs: list[dict[str, Any]] = []

    async def turn(i: int) -> None:
        msgs.append({"role": "user", "content": user_text(i)})
        status, body = await _raw(gw.url, "POST", "/v1/chat/completions",
                                  {**headers, "X-Conversation-Id": b"bytes-proj"},
                                  {"model": "gpt-4o", "messages": msgs})
        assert status == 200, body
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        await gw.settle()

    for i in range(6):
        await turn(i)
    status, body = await _raw(gw.url, "GET", "/gateway/conversations/bytes-proj", headers)
    assert status == 200 and body["project"] == "%FF%FE", body
    status, body = await _raw(gw.url, "PUT", "/gateway/conversations/bytes-proj/state", headers,
                              {"decisions": ["Ship on the Moon base"]})
    assert status == 200, body
    await turn(6)
    assert "Ship on the Moon base" in str(gw.last("/chat/completions").body)
