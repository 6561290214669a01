"""A resent history is checked only where it is new, and what is new is always checked."""

from __future__ import annotations

from typing import Any

from gateway import validate
from tests.memory_helpers import KEY, memory_gateway


def _chat(n: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(n):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"})
    return {"model": "gpt-test", "messages": msgs}


def test_skipped_positions_are_not_read_and_the_rest_are() -> None:
    """A bad message inside `skip` is not read again; one outside it, or a bad system message, is refused."""
    body = _chat(6)
    body["messages"][2]["content"] = [{"type": ["text"]}]
    assert validate.problem("openai_chat", body, range(1, 5)) is None
    assert validate.problem("openai_chat", body, range(3, 5)) == "messages[2].content[0].type must be a string"
    body = _chat(6)
    body["messages"][0]["content"] = 5  # the leading system message lies before the skipped history
    assert validate.problem("openai_chat", body, range(1, 7)) == (
        "messages[0].content must be a string or an array or null")


async def test_a_resent_history_is_checked_where_it_is_new(redis_url: str) -> None:
    """After valid turns, a new message of the wrong type, or an earlier one edited into one, is a 400;
    nothing is stored."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "resent"}
    async with memory_gateway(redis_url) as g:
        body = _chat(1)
        for _ in range(3):
            async with g.http.post(f"{g.url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                reply = (await r.json())["choices"][0]["message"]
            body["messages"] += [{"role": reply["role"], "content": reply["content"]},
                                 {"role": "user", "content": "and then?"}]
        await g.settle()
        stored = await g.messages("resent")

        bad_new = {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": [{"type": ["x"]}]}]}
        edited = {**body, "messages": [body["messages"][0], {"role": "user", "content": {"nested": 1}},
                                       *body["messages"][2:]]}
        for bad in (bad_new, edited):
            async with g.http.post(f"{g.url}/v1/chat/completions", json=bad, headers=headers) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        await g.settle()
        assert await g.messages("resent") == stored
