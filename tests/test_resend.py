"""The resend parser: a body that resends a known history parses exactly as orjson parses it whole."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memory_helpers import loop_turns

from gateway.resend import HOT_SECONDS, ResendParser, estimate_held


def _message(i: int, text: str = "") -> dict[str, Any]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": text or f"message {i}"}


def _body(messages: list[dict[str, Any]], **members: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **members})


def test_a_resent_history_parses_as_a_whole_parse_and_reuses_the_earlier_items() -> None:
    """Each call equals orjson.loads; the items sent before are handed out as the same objects."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(6)]
    first = parser.loads("c", _body(history, stream=True), "messages")
    history += [_message(6), _message(7)]
    second = parser.loads("c", _body(history, stream=True), "messages")
    assert second == orjson.loads(_body(history, stream=True))
    assert all(a is b for a, b in zip(first["messages"], second["messages"][:6], strict=True))
    assert second["messages"] is not first["messages"]  # a fresh list every time


def test_members_before_the_history_may_change_between_calls() -> None:
    """`stream` put before the history on one call and not the next (as the OpenAI SDK does), another
    model: the known items are still found, and the result is still exactly orjson's."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(4)]
    parsed = parser.loads("c", orjson.dumps({"model": "m", "messages": history}), "messages")
    for i, head in enumerate(({"model": "m", "stream": True}, {"model": "other"}, {"temperature": 0.5})):
        history.append(_message(4 + i))
        raw = orjson.dumps({**head, "messages": history, "max_tokens": 10})
        again = parser.loads("c", raw, "messages")
        assert again == orjson.loads(raw) and list(again) == list(orjson.loads(raw))
        assert all(a is b for a, b in zip(parsed["messages"], again["messages"], strict=False))
        parsed = again


def test_a_body_that_does_not_resend_the_known_items_is_parsed_whole() -> None:
    """An edited earlier message, or another body under the same key, parses as orjson parses it."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(6)]
    parser.loads("c", _body(history), "messages")
    edited = [*history[:2], _message(2, "edited"), *history[3:], _message(6)]
    assert parser.loads("c", _body(edited), "messages") == orjson.loads(_body(edited))
    regenerated = history[:5]
    assert parser.loads("c", _body(regenerated), "messages") == orjson.loads(_body(regenerated))


@pytest.mark.parametrize("tail", [b",{\"role\":\"user\"", b",{]", b"]", b"],\"x\":1}}", b",1]]}", b"]}garbage"])
def test_an_invalid_continuation_raises_what_orjson_raises(tail: bytes) -> None:
    """A body that starts like a known one but does not end as JSON gets orjson's own error."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(4)]
    raw = _body(history)
    parser.loads("c", raw, "messages")
    prefix = raw[: raw.rindex(b"]")]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(prefix + tail)
    with pytest.raises(orjson.JSONDecodeError):
        parser.loads("c", prefix + tail, "messages")


def test_members_after_the_history_with_brackets_and_a_client_key_like_the_sentinel() -> None:
    """Tools after the history hold `]`; a NUL in a key is parsed whole; duplicates: the last wins."""
    parser = ResendParser(min_bytes=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"required": ["a]"], "x": [[1], []]}}}]
    history = [_message(i) for i in range(4)]
    for extra in ({"tools": tools}, {"tools": tools, "\x00": [0]}, {"model": "other"}):
        history.append(_message(len(history), "text with ], } and \" and \\u0000 and é"))
        raw = orjson.dumps({"model": "m", "messages": history, **extra})
        assert parser.loads("c", raw, "messages") == orjson.loads(raw)
    dup = _body(history)[:-1] + b',"messages":[]}'
    assert parser.loads("c", dup, "messages") == orjson.loads(dup)


def test_a_history_key_nested_before_the_history_is_not_taken_for_it() -> None:
    """`"messages":[` inside an earlier member (nested, or inside a string) does not mislead the parser."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(3)]
    decoy = {"messages": [{"role": "user", "content": "decoy"}], "note": '"messages":[{"role":"user"}]'}
    for _ in range(3):
        history.append(_message(len(history)))
        raw = orjson.dumps({"meta": decoy, "messages": history, "stream": True})
        assert parser.loads("c", raw, "messages") == orjson.loads(raw)
    assert parser.loads("c", raw, "messages")["messages"][0] is parser.loads("c", raw, "messages")["messages"][0]


def test_pretty_printed_bodies_parse_exactly() -> None:
    """White space anywhere (json.dumps with an indent) changes nothing in the result."""
    parser = ResendParser(min_bytes=0)
    history = [_message(i) for i in range(3)]
    for _ in range(3):
        history.append(_message(len(history)))
        raw = json.dumps({"messages": history, "model": "m"}, indent=2).encode()
        assert parser.loads("c", raw, "messages") == orjson.loads(raw)


def test_memory_is_bounded_and_a_hot_set_is_not_thrashed() -> None:
    """Past `max_bytes` only conversations unused for HOT_SECONDS make room: more long conversations
    than fit are parsed whole, and the ones kept stay kept, instead of each evicting the next."""
    now = [0.0]
    body = _body([_message(i, "x" * 100) for i in range(8)])
    one = ResendParser(min_bytes=0)
    one.loads(0, body, "messages")
    parser = ResendParser(max_bytes=int(one._bytes * 2.5), min_bytes=0, clock=lambda: now[0])
    for _ in range(3):
        for k in range(4):
            assert parser.loads(k, body, "messages") == orjson.loads(body)
            now[0] += 1
    assert list(parser._known) == [0, 1] and parser._bytes <= parser.max_bytes
    now[0] += HOT_SECONDS
    parser.loads(0, body, "messages")
    parser.loads(3, body, "messages")  # 1 has not been used for HOT_SECONDS: it makes room
    assert list(parser._known) == [0, 3]


def test_after_a_burst_the_conversations_that_go_on_are_learned_at_their_second_request() -> None:
    """A burst of conversations fills the bound and stops: those that go on (each requested again
    since the burst's last use of the ones kept) are learned at their second request, not HOT_SECONDS
    later, while a set of conversations requested in turn is still not thrashed (test above)."""
    now = [0.0]
    body = _body([_message(i, "x" * 100) for i in range(8)])
    one = ResendParser(min_bytes=0)
    one.loads(0, body, "messages")
    parser = ResendParser(max_bytes=int(one._bytes * 2.5), min_bytes=0, clock=lambda: now[0])
    for k in range(6):  # the burst: 0 and 1 kept
        parser.loads(k, body, "messages")
        now[0] += 0.1
    assert list(parser._known) == [0, 1]
    for _ in range(2):
        for k in (7, 8):  # two new conversations go on, a request each in turn
            assert parser.loads(k, body, "messages") == orjson.loads(body)
            now[0] += 0.01
    assert list(parser._known) == [7, 8]
    parser.loads(7, body, "messages")
    assert list(parser._known) == [8, 7]  # learned: its next body is parsed around what it holds


def test_a_cache_full_of_hot_conversations_does_not_walk_each_new_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """Learning a body walks all it parsed to (as long again as parsing it whole). With the room
    left by hot conversations short of what a body holds, but over twice its bytes, the parser
    once walked every new conversation's body only to find it did not fit: it learns from the
    conversation it keeps what a body holds per byte, and declines the others at once."""
    import gateway.resend as resend

    now = [0.0]
    body = _body([_message(i, "x" * 100) for i in range(8)])
    one = ResendParser(min_bytes=0)
    one.loads(0, body, "messages")
    per_body = one._bytes
    assert per_body > 2 * len(body)  # the objects outweigh their JSON
    # Room for one conversation and most of a second: more than twice the body's bytes, not all it holds.
    parser = ResendParser(max_bytes=per_body + (per_body + 2 * len(body)) // 2, min_bytes=0, clock=lambda: now[0])
    walks = [0]
    real_held = resend.held

    def counting(value: Any) -> int:
        walks[0] += 1
        return real_held(value)

    monkeypatch.setattr(resend, "held", counting)
    for k in range(10):
        assert parser.loads(k, body, "messages") == orjson.loads(body)
        now[0] += 1
    assert list(parser._known) == [0]
    assert walks[0] == 1  # the one kept; none of the nine that do not fit (each walked before)


_PARTS = [{"type": "text", "text": "p.1"}] * 40
_PROSE = "word " * 60


@pytest.mark.parametrize("contents", [
    pytest.param([_PARTS] * 200, id="many-small-parts"),
    pytest.param([_PROSE] * 200, id="prose"),
    pytest.param(['def f(x):\n    return {"a": [x, "{b}"], \'c\': [{"d": 1}]}\n' * 20] * 200, id="quoted-code"),
    pytest.param(["naïve café 東京 " * 30] * 200, id="non-ascii"),
    pytest.param([_PROSE] * 100 + [_PARTS] * 20 + [_PROSE] * 100, id="mixed"),
])
def test_the_room_check_estimates_what_a_body_holds(contents: list[Any]) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": c} for c in contents]})
    parser = ResendParser(min_bytes=0)
    parser.loads("c", body, "messages")
    assert 0.75 * parser._bytes <= estimate_held(body) <= 1.3 * parser._bytes


def test_one_body_of_many_small_parts_does_not_turn_ordinary_bodies_away() -> None:
    """The room check before learning estimates each body's own weight: it once used the last body
    measured, so one body of many small content parts (over 10x its bytes) made the parser decline
    every ordinary body (about 3x) that fit, which then went unremembered."""
    dense = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": f"p{i}.{j}"} for j in range(40)]} for i in range(300)]})
    ordinary = [orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"conversation {k}: " + "word " * 60} for _ in range(300)]}) for k in range(3)]
    probe = ResendParser(min_bytes=0)
    probe.loads(0, dense, "messages")
    dense_size = probe._bytes
    probe = ResendParser(min_bytes=0)
    probe.loads(0, ordinary[0], "messages")
    ordinary_size = probe._bytes
    assert dense_size > 10 * len(dense) and ordinary_size < 4 * len(ordinary[0])
    room = dense_size + 3 * ordinary_size + ordinary_size // 10
    parser = ResendParser(max_bytes=room, min_bytes=0, clock=lambda: 0.0)
    parser.loads("dense", dense, "messages")
    for k, body in enumerate(ordinary):
        assert parser.loads(k, body, "messages") == orjson.loads(body)
    assert list(parser._known) == ["dense", 0, 1, 2]


@pytest.mark.parametrize("parts", [1, 40])
def test_the_bound_counts_the_parsed_objects_not_only_the_bytes(parts: int) -> None:
    """What the parser is charged for a conversation covers what it really holds: many small content
    parts parse to objects several times their JSON's size."""
    messages = [{"role": "user", "content": [{"type": "text", "text": f"p{i}.{j}"} for j in range(parts)]}
                for i in range(300)]
    body = orjson.dumps({"model": "m", "messages": messages})
    parser = ResendParser(min_bytes=0)
    tracemalloc.start()
    try:
        parser.loads("c", body, "messages")
        holding = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert parser._bytes >= holding > 0
    assert parser._bytes <= 2 * holding + len(body)


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from(list("ab]}[{\",\\ \né\x00"))),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(
    before=st.dictionaries(st.sampled_from(["model", "system", "a]", "tools"]), _json_value, max_size=2),
    after=st.dictionaries(st.sampled_from(["stream", "tools", "max_tokens", "model"]), _json_value, max_size=3),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), _json_value), min_size=1, max_size=6),
    indent=st.sampled_from([None, 1]),
    scalars=st.booleans(),
    read=st.sampled_from(["loads", "aloads"]),
)
def test_any_sequence_of_bodies_parses_as_orjson_parses_it(before: dict[str, Any], after: dict[str, Any],
                                                           steps: list[tuple[int, int, Any]],
                                                           indent: int | None, scalars: bool, read: str) -> None:
    """Appends, retries, truncations and edits, with arbitrary members around the history: always
    exact, parsed around known items (`loads`) or read item by item with them (`aloads`, as a long
    body is), with items of any type."""
    parser = ResendParser(min_bytes=0, split_bytes=0)
    history: list[Any] = [{"role": "user", "content": "start"}]
    for grow, cut, value in steps:
        item = value if scalars else {"role": "user", "content": value}
        history = history[: max(1, len(history) - cut)] + [item] * grow
        members = {**before, "messages": history, **{k: v for k, v in after.items() if k not in before}}
        raw = json.dumps(members, indent=indent, ensure_ascii=False).encode()
        got = parser.loads("c", raw, "messages") if read == "loads" else _aloads(parser, "c", raw)
        assert got == orjson.loads(raw)


def test_a_history_of_more_parts_than_the_memory_path_takes_is_never_remembered() -> None:
    """Remembering a history walks every object it parsed to: a message of many parts is parsed
    (correctly) but neither learned nor extended, as the memory path relays it without reading it."""
    parser = ResendParser(min_bytes=0, max_parts=10)
    parts = [{"type": "text", "text": f"p{i}"} for i in range(11)]
    history = [_message(0), {"role": "assistant", "content": parts}]
    body = _body(history)
    assert parser.loads("c", body, "messages") == orjson.loads(body)
    assert "c" not in parser._known
    history = [_message(0), _message(1)]
    parser.loads("d", _body(history), "messages")
    assert "d" in parser._known  # a small history is learned; a new turn of many parts forgets it
    history.append({"role": "user", "content": parts})
    assert parser.loads("d", _body(history), "messages") == orjson.loads(_body(history))
    assert "d" not in parser._known


# --- long bodies, read a history item at a time (`aloads`) -------------------------------------


def _aloads(parser: ResendParser, key: Any, raw: bytes) -> Any:
    import asyncio

    return asyncio.run(parser.aloads(key, raw, "messages"))


def _served(parse: Any) -> tuple[Any, int]:
    """What `parse()` (a coroutine function) returns, and how many turns another task got meanwhile."""
    import asyncio

    async def main() -> tuple[Any, int]:
        async with loop_turns() as turns:
            out = await parse()
        return out, turns[0]

    return asyncio.run(main())


def _split_whole(raw: bytes) -> Any:
    """What the item-by-item reader alone makes of `raw` (None: it would be parsed whole)."""
    import asyncio

    from gateway.resend import _split

    return asyncio.run(_split(raw, "messages"))


def _same_as_orjson(parser: ResendParser, key: Any, raw: bytes) -> None:
    """`aloads` returns what orjson returns, or raises where orjson raises."""
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            _aloads(parser, key, raw)
        return
    assert _aloads(parser, key, raw) == expected


@settings(max_examples=300, deadline=None)
@given(
    before=st.dictionaries(st.sampled_from(["model", "system", "a]", "tools"]), _json_value, max_size=2),
    after=st.dictionaries(st.sampled_from(["stream", "tools", "max_tokens", "model"]), _json_value, max_size=3),
    items=st.lists(_json_value, max_size=5),
    indent=st.sampled_from([None, 1]),
    cut=st.integers(0, 40),
    insert=st.sampled_from([b"", b",", b"]", b"}", b"\\", b'"', b"1", b"x", b" "]),
)
def test_a_long_body_read_item_by_item_parses_as_orjson_parses_it(
        before: dict[str, Any], after: dict[str, Any], items: list[Any], indent: int | None, cut: int,
        insert: bytes) -> None:
    """Any body (items of any JSON type, strings of quotes, brackets and backslashes, members around
    the history), whole or with a byte changed: the same value, or an error, as orjson gives."""
    members = {**before, "messages": items, **{k: v for k, v in after.items() if k not in before}}
    raw = json.dumps(members, indent=indent, ensure_ascii=False).encode()
    _same_as_orjson(ResendParser(min_bytes=0, split_bytes=0), "c", raw)
    if b"\\u0000" not in raw:  # (the one sign, beside size, that sends a valid body to the whole parse)
        assert _split_whole(raw)[0] == orjson.loads(raw)
    at = len(raw) - 1 - min(cut, len(raw) - 1)
    _same_as_orjson(ResendParser(min_bytes=0, split_bytes=0), "c", raw[:at] + insert + raw[at + 1:])


@pytest.mark.parametrize("run", [1, 2, 3, 7, 8, 200])
@pytest.mark.parametrize("escaped_quotes", [0, 3, 300])
def test_strings_of_escapes_across_window_edges_end_where_json_says(run: int, escaped_quotes: int) -> None:
    """A string is read in windows once it has many escaped quotes or a long run of backslashes: a
    run of backslashes that a window's edge cuts, then a quote, ends it only if the run is even."""
    for edge in (4096, 4096 + 8192, 4096 + 8192 + 16384):
        for shift in range(-3, 4):
            text = '"x' * escaped_quotes
            text += "a" * max(0, edge + shift - len(json.dumps(text)) + 1) + "\\" * run + '" tail ]} \\'
            raw = _body([_message(0, text), _message(1)], stream=True)
            _same_as_orjson(ResendParser(min_bytes=0, split_bytes=0), "c", raw)
            assert _split_whole(raw)[0]["messages"][0]["content"] == text


def test_a_long_first_body_is_parsed_with_the_event_loop_served_meanwhile() -> None:
    """A 12 MB first body (600 messages) is not parsed in one call that holds every other request:
    other tasks run while it is read, and the next request's resend is parsed around it."""
    import asyncio

    history = [_message(i, f"message {i}: " + "lorem ipsum dolor sit amet " * 740) for i in range(600)]
    raw = _body(history, stream=True)
    assert len(raw) > 12_000_000
    parser = ResendParser(max_bytes=256 << 20)

    async def main() -> tuple[Any, Any, int]:
        async with loop_turns() as turns:
            first = await parser.aloads("c", raw, "messages")
        again = await parser.aloads("c", _body([*history, _message(600)], stream=True), "messages")
        return first, again, turns[0]

    first, again, turns = asyncio.run(main())
    assert first == orjson.loads(raw)
    assert turns >= 40  # served at least every 256 KB of the 12 MB (at every item, here)
    assert again["messages"][0] is first["messages"][0]  # learned: the resend reuses the parsed items
    assert again["messages"][-1] == _message(600)


@pytest.mark.parametrize("depth", [1020, 1021, 1022, 1023, 1024])
def test_an_item_nested_near_orjsons_limit_is_read_as_orjson_reads_it(depth: int) -> None:
    """orjson refuses a body nested past 1,024 levels, counting the body's object and its history
    array: an item at that depth is refused the same way, one just under it parsed."""
    item = "[" * depth + "]" * depth
    raw = b'{"model": "m", "messages": [' + item.encode() + b', {"role": "user", "content": "x"}]}'
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            _aloads(ResendParser(min_bytes=0, split_bytes=0), "c", raw)
        assert depth > 1022
        return
    body = _aloads(ResendParser(min_bytes=0, split_bytes=0), "c", raw)  # (== would recurse too deep)
    assert len(body["messages"]) == 2 and body["messages"][1] == {"role": "user", "content": "x"}
    assert depth <= 1022


def test_a_history_dense_in_tiny_values_is_read_with_the_loop_served_often() -> None:
    """A history of 200,000 tiny content parts (4 MB) is read in Python steps: the loop is served
    every few thousand of them, not only every 256 KB."""
    parts = [{"type": "text", "text": "x"}] * 200_000
    raw = _body([{"role": "user", "content": parts}, _message(1)])
    body, turns = _served(lambda: ResendParser(max_parts=400_000).aloads(None, raw, "messages"))
    assert body == orjson.loads(raw)
    assert turns >= 200  # (every 4,096 of its 1.2M brackets, strings and scalars)


def test_learned_items_that_are_a_small_part_of_the_body_do_not_keep_the_body() -> None:
    """A body whose history is short (a 200 KB system prompt, one message): what is learned is a
    copy of the history's bytes, so the body is freed; a body that is mostly history is kept as a
    view and counted whole."""
    parser = ResendParser(split_bytes=0, min_bytes=0)
    raw = orjson.dumps({"model": "m", "system": "s" * (200 << 10), "messages": [_message(0)]})
    _aloads(parser, "c", raw)
    kept = parser._known["c"].items_raw
    assert kept.obj is not raw and len(kept.obj) < 1 << 10  # (what a view holds alive: here, a copy)
    assert parser._bytes < 1 << 20
    history = [_message(i, "m" * 1000) for i in range(2000)]
    long = _body(history)
    _aloads(parser, "d", long)
    assert parser._known["d"].items_raw.obj is long and parser._known["d"].size >= len(long)


def test_an_invalid_item_is_reported_at_its_place_in_the_body() -> None:
    """The 400 names where in the body the JSON went wrong, as a byte offset, not the item's own."""
    good = _body([_message(i, "m" * 100) for i in range(50)])
    at = good.rindex(b'":') + 1  # the last item's last colon
    raw = good[:at] + b"@" + good[at + 1:]
    with pytest.raises(orjson.JSONDecodeError) as err:
        _aloads(ResendParser(split_bytes=0, min_bytes=0), "c", raw)
    assert f"at byte {at}" in str(err.value)


def test_long_members_around_the_history_are_read_in_parts_too() -> None:
    """A 2 MB system prompt before the history and 3,000 tools after it (Anthropic's order, a
    client's many tools): the body is read a member and an item at a time, never whole."""
    raw = orjson.dumps({"model": "m", "system": "be brief. " * 200_000,
                        "messages": [_message(i, "m" * 500) for i in range(1000)],
                        "tools": [{"name": f"tool_{i}", "input_schema": {"type": "object", "x": "y" * 600}}
                                  for i in range(3000)], "stream": True})
    assert _split_whole(raw) is not None
    body, turns = _served(lambda: ResendParser().aloads("c", raw, "messages"))
    assert body == orjson.loads(raw) and turns >= 8


def test_a_known_history_with_a_long_new_part_is_read_item_by_item() -> None:
    """A learned history of 1,000 messages resent with 2,000 new ones (3 MB new): the known items are
    taken as they are, the new ones read an item at a time with the loop served, and the next
    resend knows them all."""
    parser = ResendParser()
    history = [_message(i, "m" * 1500) for i in range(1000)]
    first = _aloads(parser, "c", _body(history))
    history += [_message(i, "n" * 1500) for i in range(1000, 3000)]
    raw = _body(history, stream=True)
    body, turns = _served(lambda: parser.aloads("c", raw, "messages"))
    assert body == orjson.loads(raw) and turns >= 8
    assert body["messages"][999] is first["messages"][999]
    assert len(parser._known["c"].items) == 3000


@pytest.mark.parametrize("last, resent", [(b"1", b"12"), (b"1", b"1.5"), (b"tru", b"true"), (b'"a"', b'"a" , 2')])
def test_known_items_are_taken_only_where_they_end_an_item(last: bytes, resent: bytes) -> None:
    """A known history whose last item is a number is not taken as the start of a longer one (`1`
    in `12`): the resent body reads as orjson reads it."""
    parser = ResendParser(min_bytes=0, split_bytes=0)
    first = b'{"model": "m", "messages": [{"role": "user"}, ' + last + b"]}"
    _same_as_orjson(parser, "c", first)
    _same_as_orjson(parser, "c", b'{"model": "m", "messages": [{"role": "user"}, ' + resent + b"]}")


def test_a_body_of_tiny_values_by_the_hundred_thousand_is_read_with_the_loop_served() -> None:
    """`messages: [[], [], ...]` half a million times (an attack's body, at a quarter of its size:
    orjson alone takes seconds over such bodies, all in one call) is read in Python steps with the
    loop served between them;
    a body that ends early, or nests past orjson's depth at its very end, is refused by the reader
    itself, not after a whole parse."""
    raw = b'{"model": "m", "messages": [' + b"[]," * 500_000 + b'[]], "stream": true}'
    body, turns = _served(lambda: ResendParser().aloads(None, raw, "messages"))
    assert len(body["messages"]) == 500_001 and body["stream"] is True
    assert turns >= 200
    for bad in (raw[:-30], raw[:-2] + b', "x": ' + b"[" * 1100 + b"]" * 1100 + b"}"):
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(bad)
        with pytest.raises(orjson.JSONDecodeError):
            _split_whole(bad)
    # Past 100 values per memory.max_parts, the reader stops: the body is refused, not read on.
    from gateway.resend import TooManyValues

    with pytest.raises(TooManyValues):
        _aloads(ResendParser(max_parts=5_000), None, raw)
