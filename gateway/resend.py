"""Parse a resent history without parsing again the part that was sent before.

Full-history clients send every earlier message again on every call: parsing the whole body and
then comparing the parsed messages with the previous request's was the one part of the memory
path that grew with the history (measured in docs/architecture.md). The earlier messages are the
same bytes every time, so for each conversation the parser keeps the bytes of the last body's
history items (`items_raw`, first to last) with what they parsed to. A body that holds those
bytes again is parsed around them only:

    head                       | known items                  | tail
    {"model":"m","messages":[  | {...},{...},...,{...}        | ,{new},{new}],"stream":true}

    loads(body) = loads(head + '0]}') without the 0 + known items + what '{"\\u0000":[0' + tail parses to

Why that is exact. A JSON parser's state after the head is "inside the top-level object, at the start
of the history array": `head + "0]}"` parsing to an object whose last member is the history `[0]`
proves it. From that state the known items parse as they did when they were learned (from a body
parsed whole, in which no member of the history's name followed them) and leave the parser just
after an element, the state `{"\\u0000":[0` also leaves a fresh parser in; so the tail is valid, and
means the same, in both. A tail with `\\u0000` in it is parsed whole, so the sentinel key cannot
meet a key of the client's. Duplicate keys resolve as orjson resolves them: the last value wins, in
the first one's place. The members before the history may change from one call to the next
(`stream`, `model`, `temperature`).

Where the history's items end is looked for from the body's end: at the right `]`, the members
after it parse as they did in the whole, and the bytes before it parse to exactly the items.

The earlier history items are handed out again as the same objects, which makes the memory path's
comparison with the previous request a pointer comparison. Callers must not change a parsed body
in place (nothing in the gateway does: the rewrite renders new lists and dicts).
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import orjson

from gateway.validate import parts_over

_SENTINEL = "\x00"
_OPEN = b'{"\\u0000":[0'
_NUL = b"\\u0000"
_SPACE = b" \t\r\n"
_PROBE = 64  # bytes of the known items looked for first; the rest is then compared in place
# The history's bounds are looked for among this many candidates (`"<field>":[` from the start, `]`
# from the end), within this many bytes of either end (the members around the history, e.g. tool
# schemas, may hold a few): a body whose bounds are not found there is parsed whole every time,
# and finding out costs a bounded amount.
_MAX_CANDIDATES = 64
_MAX_AROUND_BYTES = 256 << 10
# A conversation is learned only if that evicts none used this recently, or none used since the
# new one's previous request (it is the busier): with more long conversations than the bound holds,
# each requested in turn, learning each one anew (~2x a whole parse) on every request and evicting
# the next would cost more than parsing whole; a steady set is kept instead. But once a burst of
# conversations has passed, those that go on are learned at their second request, not 30 s later.
HOT_SECONDS = 30.0
SEEN_KEYS = 4096  # conversations whose last request (not learned) is remembered for that
_SAMPLES, _SLICE_BYTES = 4, 4 << 10  # estimate_held reads 16 KB of a body, from 4 places
# Bodies of more bytes (and a known history resent with as many new bytes) are read a member and an
# item at a time with the event loop served between them (`_split`): orjson takes about 1 ms a
# megabyte, all at once.
SPLIT_BYTES = 1 << 20
_SPLIT_YIELD = 256 << 10  # bytes read between two turns of the event loop
# What `_split` reads: a string's opening quote (`_string_end` finds its end, so brackets quoted in
# text are skipped), brackets, and scalars (a history item may be one).
_TOKEN = re.compile(rb'["\[\]{}]|[-0-9tfn][-+.0-9a-zA-Z]*')
_QUOTE_STEPS = 4  # escaped quotes in a string read one by one before it is read in windows
_GAP = re.compile(rb'[ \t\r\n]*,[ \t\r\n]*')
_COLON = re.compile(rb'[ \t\r\n]*:[ \t\r\n]*')
_TRAIL = re.compile(rb'[ \t\r\n]*')
_AFTER_ITEM = re.compile(rb'[ \t\r\n]*[,\]]')
_ORJSON_DEPTH = 1024  # nesting orjson takes: deeper is refused (as orjson refuses it, at once)
_YIELD_TOKENS = 4096  # ... and tokens read between two turns (a history of tiny values is dense in them)
# Strings, brackets and scalars a body may hold, per memory.max_parts (2,000,000 at the default):
# past it the body is refused. Each costs ~1 µs to read and a Python object to hold; an attack's
# body of 10 million tiny values took 20 s of CPU and held the loop in full garbage collections.
VALUES_PER_PART = 100
_OPENERS, _CLOSERS = frozenset(b"[{"), frozenset(b"]}")
# This interpreter's object headers (a str's is 49 bytes on 3.11, 41 on 3.12).
_STR, _DICT, _LIST = sys.getsizeof(""), sys.getsizeof({"role": 0, "content": 0}), sys.getsizeof([])


@dataclass(frozen=True, slots=True)
class _Known:
    # The history items' bytes, from the first one's start to the last one's end (`_kept`).
    items_raw: memoryview
    items: tuple[Any, ...]  # what they parse to
    used: float  # monotonic time of the last body parsed around them
    size: int  # bytes held: the raw bytes and the parsed objects
    objects: int = 0  # of which the parsed objects (`held`)


def held(value: Any) -> int:
    """Bytes the parsed `value` holds. The objects weigh 1.3x (long strings) to over 10x (many small
    parts) their JSON, so the bound counts them rather than the raw bytes. One pass over what was
    just parsed (an iterative walk: no recursion limit whatever the nesting)."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def estimate_held(raw: bytes) -> int:
    """About what learning `raw` would hold (the bytes kept and `held` of their objects), from
    _SAMPLES slices spread over it: checked before the walk that measures it, so a cache kept full
    by hot conversations does not walk every new long body (twice the cost of parsing it) only to
    find that it does not fit. Per body, not per process: one body of many small parts (over 10x
    its bytes) says nothing of the next (about 2-3x). Each string, object and array costs its
    header besides the text, which is counted twice (the bytes and the str)."""
    step = len(raw) // _SAMPLES
    if step <= _SLICE_BYTES:
        sample = raw or b" "
    else:
        sample = b"".join(raw[i * step: i * step + _SLICE_BYTES] for i in range(_SAMPLES))
    # Quotes inside text are escaped, so `{"`, `[{"` and `["` open a JSON object or array where
    # brackets in quoted code do not. Numbers, booleans and null are not counted, nor a string that
    # ends in a backslash told apart: such bodies are underestimated (one walk too many), as are
    # pretty-printed ones.
    strings = (sample.count(b'"') - sample.count(b'\\"')) / 2
    arrays = sample.count(b'[{"') + sample.count(b'["')
    overhead = _STR * strings + _DICT * sample.count(b'{"') + _LIST * arrays
    return int(len(raw) * (2 + overhead / len(sample)))


class ResendParser:
    """`orjson.loads` that remembers, per key, the last body's history items (LRU, bounded by the
    bytes they hold, parsed objects included)."""

    def __init__(self, max_bytes: int = 64 << 20, min_bytes: int = 16 << 10,
                 clock: Callable[[], float] = time.monotonic, max_parts: int = 20_000,
                 split_bytes: int = SPLIT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.split_bytes = split_bytes  # longer bodies are read an item at a time by `aloads`
        self.max_parts = max_parts  # memory.max_parts: a history of more is relayed, never remembered
        self.min_bytes = min_bytes  # smaller bodies parse in a few microseconds: not worth remembering
        self.clock = clock
        self._known: OrderedDict[Hashable, _Known] = OrderedDict()
        self._bytes = 0
        self._seen: OrderedDict[Hashable, float] = OrderedDict()  # key -> its last request's time

    def loads(self, key: Hashable | None, raw: bytes, field: str) -> Any:
        """What `orjson.loads(raw)` returns (or raises); `field` names the history array."""
        if key is None or len(raw) < self.min_bytes:
            return orjson.loads(raw)
        known = self._known.get(key)
        if known is not None:
            body = self._resent(key, known, raw, field)
            if body is not None:
                return body
        body = orjson.loads(raw)
        now = self.clock()
        previous = self._seen.pop(key, None)
        self._learn(key, raw, body, field, previous)
        if key not in self._known:
            self._seen[key] = now
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
        return body

    async def aloads(self, key: Hashable | None, raw: bytes, field: str) -> Any:
        """`loads`, with a long body read a member and an item at a time (`_split`), known items
        taken as they are: one orjson call over all of it would hold every other request meanwhile.
        (A body whose new part is short is parsed around the known items, as `loads` does.)"""
        if len(raw) < self.split_bytes:
            return self.loads(key, raw, field)
        known = self._known.get(key) if key is not None else None
        if known is not None and len(raw) - len(known.items_raw) < self.split_bytes:
            body = self._resent(key, known, raw, field)  # (what is new is parsed in one call)
            if body is not None:
                return body
        split = await _split(raw, field, known, VALUES_PER_PART * self.max_parts)
        if split is None:
            return self.loads(key, raw, field)
        body, start, end, items = split
        if key is not None:
            previous = self._seen.pop(key, None)
            self._forget(key)
            if start >= 0 and self._room(estimate_held(raw), previous) and not parts_over(items, self.max_parts):
                # (A walk of every parsed object: ~10 ms for 10,000 messages, in a thread.)
                objects = await asyncio.to_thread(held, items)
                size, view = _kept(raw, start, end, objects)
                if self._room(size, previous):
                    self._put(key, _Known(view, tuple(items), self.clock(), size, objects))
            if key not in self._known:
                self._seen[key] = self.clock()
                if len(self._seen) > SEEN_KEYS:
                    self._seen.popitem(last=False)
        return body

    def _resent(self, key: Hashable, known: _Known, raw: bytes, field: str) -> dict[str, Any] | None:
        """`raw` parsed around the known items it holds; None when it does not hold them as the
        history's first items (then it is parsed whole)."""
        at = raw.find(known.items_raw[:_PROBE], 0, _MAX_AROUND_BYTES + _PROBE)
        if at < 0 or not raw.startswith(known.items_raw, at):
            return None
        head = _head(raw[:at], field)
        if head is None:
            return None
        tail = raw[at + len(known.items_raw):]
        if _NUL in tail:
            return None
        try:
            doc = orjson.loads(_OPEN + tail)
        except orjson.JSONDecodeError:
            return None  # the body is parsed whole, so the caller gets orjson's own error
        new = doc.pop(_SENTINEL)[1:]
        items = (*known.items, *new) if new else known.items
        body = head
        body[field] = list(items)
        body.update(doc)  # a second history member after the first one wins, as in a whole parse
        if field in doc:
            self._forget(key)
        elif not new:
            self._put(key, replace(known, used=self.clock()))
        elif parts_over(new, self.max_parts):
            self._forget(key)
        else:
            end = _items_end(tail, 0, b"[0", [0, *new], after=doc)
            if end is None:
                self._forget(key)
            else:
                objects = known.objects + held(new)
                size, view = _kept(raw, at, at + len(known.items_raw) + end, objects)
                self._put(key, _Known(view, items, self.clock(), size, objects))
        return body

    def _learn(self, key: Hashable, raw: bytes, body: Any, field: str, previous: float | None = None) -> None:
        """Find the history's bounds in a body parsed whole, to parse only around it next time.
        `previous`: when the conversation's last request came (it was not learned then), if known."""
        self._forget(key)
        if not isinstance(body, dict) or not self._room(estimate_held(raw), previous):
            return
        items = body.get(field)
        if not isinstance(items, list) or not items or parts_over(items, self.max_parts):
            return  # (a history of more parts than the memory path takes is not walked to be held)
        start = _items_start(raw, field)
        if start is None:
            return
        names = list(body)
        after = {k: body[k] for k in names[names.index(field) + 1:]}
        end = _items_end(raw, start, b"[", items, after=after)
        if end is not None:
            objects = held(items)
            size, view = _kept(raw, start, end, objects)
            if self._room(size, previous):
                self._put(key, _Known(view, tuple(items), self.clock(), size, objects))

    def _room(self, size: int, previous: float | None = None) -> bool:
        """Would `size` more bytes fit, evicting only conversations not used for HOT_SECONDS, or not
        since `previous` (the newcomer's last request)?"""
        free = self.max_bytes - self._bytes
        if free >= size:
            return True
        stale = self.clock() - HOT_SECONDS
        if previous is not None:
            stale = max(stale, previous)
        for known in self._known.values():  # least recently used first
            if known.used > stale:
                return False
            free += known.size
            if free >= size:
                return True
        return False

    def _put(self, key: Hashable, known: _Known) -> None:
        self._forget(key)
        self._known[key] = known
        self._bytes += known.size
        while self._bytes > self.max_bytes and self._known:
            _, old = self._known.popitem(last=False)
            self._bytes -= old.size

    def _forget(self, key: Hashable) -> None:
        old = self._known.pop(key, None)
        if old is not None:
            self._bytes -= old.size


def _past_space(raw: bytes, start: int, end: int) -> int:
    """The first offset from `start` (up to `end`) that is not JSON white space."""
    m = _TRAIL.match(raw, start, end)
    return m.end() if m else start


class TooManyValues(ValueError):
    """A body of more JSON values than the gateway reads (`VALUES_PER_PART` x memory.max_parts)."""


def _invalid(what: str, at: int) -> orjson.JSONDecodeError:
    """The body's 400, for a part that is not JSON where it lies (`at`, a byte offset in the body)."""
    err = orjson.JSONDecodeError(what, "", 0)
    err.pos, err.args = at, (f"{what} at byte {at}",)
    return err


class _Reader:
    """The tokens of a body (`_TOKEN`; a string whole, its end found by `_string_end`), the event loop
    served every _SPLIT_YIELD bytes and _YIELD_TOKENS tokens, at most `max_values` of them."""

    def __init__(self, raw: bytes, max_values: int) -> None:
        self.raw, self.pos, self.count, self.pause = raw, 0, 0, _SPLIT_YIELD
        self.max_values = max_values

    async def token(self) -> tuple[int, int]:
        """(start, first byte) of the next token; `pos` is then its end."""
        raw = self.raw
        self.count += 1
        if self.count > self.max_values:
            raise TooManyValues(f"the request body holds more than {self.max_values:,} JSON values "
                                f"({VALUES_PER_PART} per memory.max_parts); the gateway does not read it")
        m = _TOKEN.search(raw, self.pos)
        if m is None:
            raise _invalid("unexpected end of data", len(raw))
        at, self.pos = m.start(), m.end()
        c = raw[at]
        if c == 34:  # '"': a quote not after a backslash closes it (the usual string, read here)
            q = raw.find(b'"', self.pos)
            self.pos = q + 1 if q > 0 and raw[q - 1] != 92 else await _string_end(raw, at)
            if self.pos < 0:
                raise _invalid("a string that does not end", at)
        if self.pos > self.pause or not self.count % _YIELD_TOKENS:
            await asyncio.sleep(0)
            self.pause = self.pos + _SPLIT_YIELD
        return at, c

    async def end_of(self, c: int, depth: int) -> int:
        """The end of the value whose first token (`c`) was just read, `depth` levels in the body."""
        if c not in _OPENERS:
            return self.pos
        level = 1
        while level:
            _, c = await self.token()
            if c in _OPENERS:
                level += 1
                if depth + level > _ORJSON_DEPTH:
                    raise _invalid("nested deeper than 1,024 levels", self.pos - 1)
            elif c in _CLOSERS:
                level -= 1
        return self.pos

    def expect(self, gap: re.Pattern[bytes], start: int, end: int) -> None:
        """The bytes between two tokens are `gap` (white space, with a comma or colon), or the body
        is not JSON: in a valid body nothing else lies between tokens."""
        if gap.fullmatch(self.raw, start, end) is None:
            raise _invalid("unexpected character", _past_space(self.raw, start, end))

    async def array(self, depth: int, known: _Known | None = None) -> tuple[list[Any], int, int]:
        """The items of the array whose `[` was just read, each parsed by orjson from its own bytes:
        (items, where the first begins, where the last ends). `known` items are taken as they are
        when the array begins with their bytes."""
        raw, items = self.raw, []
        start = prev = self.pos
        first = True
        if known is not None:
            at = _past_space(raw, start, start + 64)
            end = at + len(known.items_raw)
            # (Followed by a comma or the array's end: the last known item may be a number that
            # goes on, `1` in `12`.)
            if at - start < 64 and raw.startswith(known.items_raw, at) and _AFTER_ITEM.match(raw, end):
                items, start, prev, first = list(known.items), at, end, False
                self.pos = prev
        while True:
            at, c = await self.token()
            if c == 93:  # "]"
                self.expect(_TRAIL, prev, at)
                return items, start, prev
            self.expect(_TRAIL if first else _GAP, prev, at)
            if c == 125:
                self.expect(_TRAIL, at, at + 1)  # (raises: a "}" cannot begin an item)
            if first:
                start, first = at, False
            prev = await self.end_of(c, depth + 1)
            items.append(_item(raw, at, prev))


async def _split(raw: bytes, field: str, known: _Known | None = None,
                 max_values: int = VALUES_PER_PART * 20_000) -> tuple[dict[str, Any], int, int, list[Any]] | None:
    """`orjson.loads(raw)` read a member at a time, and each array member (the history, `tools`,
    ...) an item at a time, with the event loop served between them: (the body, where its history
    items begin and end in `raw`, the items; -1, -1, [] when it has no history array). `known` items
    are taken as they are where the history begins with their bytes. None when the body is not an
    object (then it is parsed whole, and refused by the caller).

    Why the body is the same: each key, value and item is parsed by orjson from its own bytes,
    which in a valid body are found by matching brackets outside strings; what lies between them
    must be white space with a comma or colon. A part orjson refuses is a body it refuses: its
    error is raised (its offset given in the body), without parsing the rest; so is a body that
    ends early, or nests deeper than orjson takes. Keys resolve as orjson resolves them: the last
    value wins, in the first one's place. Past `max_values` tokens, `TooManyValues`."""
    r = _Reader(raw, max_values)
    at, c = await r.token()
    if c != 123:  # "{"
        return None
    r.expect(_TRAIL, 0, at)
    body: dict[str, Any] = {}
    history: tuple[int, int] | None = None
    prev, first = r.pos, True
    while True:
        at, c = await r.token()
        if c == 125:  # "}"
            r.expect(_TRAIL, prev, at)
            break
        r.expect(_TRAIL if first else _GAP, prev, at)
        if c != 34:
            r.expect(_TRAIL, at, at + 1)  # (raises: a key is a string)
        first = False
        key = _item(raw, at, r.pos)
        colon = r.pos
        at, c = await r.token()
        r.expect(_COLON, colon, at)
        if c == 91:  # "[": an array, item by item
            items, start, end = await r.array(1, known if key == field else None)
            body[key] = items
            if key == field:
                history = (start, end)
        else:
            body[key] = _item(raw, at, await r.end_of(c, 1))
            if key == field:
                history = None
        prev = r.pos
    r.expect(_TRAIL, r.pos, len(raw))
    if history is None:
        return body, -1, -1, []
    return body, history[0], history[1], body[field]


async def _string_end(raw: bytes, at: int) -> int:
    """The offset just past the JSON string that opens at `at`; -1 if it does not close. Read at
    memchr speed (a regex reads a string a byte at a time, ~2.5 ns each): the first quote after
    an even run of backslashes closes it. Past _QUOTE_STEPS escaped quotes, or a long run of
    backslashes, in windows of the string with its escaped backslashes, then its escaped quotes,
    blanked (left to right, as a JSON reader pairs them): there, the first quote closes it. The
    loop is served between long windows."""
    q = at
    for _ in range(_QUOTE_STEPS):
        q = raw.find(b'"', q + 1)
        if q < 0:
            return -1
        run = 0
        while raw[q - 1 - run] == 92 and run < _QUOTE_STEPS:  # (raw[at] is a quote: the run stops there)
            run += 1
        if run == _QUOTE_STEPS:
            break
        if run % 2 == 0:
            return q + 1
    pos, size = at + 1, 4 << 10
    while True:
        window = raw[pos: pos + size].replace(b"\\\\", b"__").replace(b'\\"', b"__")
        q = window.find(b'"')
        if q >= 0:
            return pos + q + 1
        if pos + len(window) >= len(raw):
            return -1
        # A backslash left last opens an escape that the next window must begin with.
        pos += len(window) - window.endswith(b"\\")
        if size == _SPLIT_YIELD:
            await asyncio.sleep(0)
        size = min(2 * size, _SPLIT_YIELD)


def _item(raw: bytes, start: int, end: int) -> Any:
    try:
        return orjson.loads(memoryview(raw)[start:end])  # (a slice would copy it first)
    except orjson.JSONDecodeError as exc:
        # Where in the body (the item's line and column would mislead): in bytes, not characters.
        err = orjson.JSONDecodeError(exc.msg, "", 0)
        err.pos = start + len(exc.doc[:exc.pos].encode("utf-8", "surrogatepass"))
        err.args = (f"{exc.msg} at byte {err.pos}",)
        raise err from None


def _kept(raw: bytes, start: int, end: int, objects: int) -> tuple[int, memoryview]:
    """(bytes held, raw[start:end] as kept) for items whose parsed objects hold `objects`: a view of
    the body when they are most of it (a copy of a long history held the event loop ~10 ms per
    30 MB, on every request), else a copy (a view keeps the whole body alive: a long system prompt)."""
    if 2 * (end - start) >= len(raw):
        return len(raw) + objects, memoryview(raw)[start:end]
    return end - start + objects, memoryview(raw[start:end])


def _head(head: bytes, field: str) -> dict[str, Any] | None:
    """The members before the history, when `head` ends just inside the history array's `[`."""
    try:
        doc = orjson.loads(head + b"0]}")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or not doc or next(reversed(doc)) != field or doc[field] != [0]:
        return None
    del doc[field]
    return doc


@cache
def _member(field: str) -> re.Pattern[bytes]:
    return re.compile(b'"' + re.escape(field.encode()) + rb'"[ \t\r\n]*:[ \t\r\n]*\[')


def _items_start(raw: bytes, field: str) -> int | None:
    """The offset of the history's first item in a body: just after a `"<field>":[` that `_head`
    accepts, and any white space."""
    for n, m in enumerate(_member(field).finditer(raw, 0, _MAX_AROUND_BYTES)):
        if n == _MAX_CANDIDATES:
            return None
        if _head(raw[: m.end()], field) is not None:
            start = m.end()
            while start < len(raw) and raw[start] in _SPACE:
                start += 1
            return start
    return None


def _items_end(data: bytes, start: int, lead: bytes, items: list[Any], *, after: dict[str, Any]) -> int | None:
    """Where the history's items, which begin at `start`, end in `data` (a whole body, or a tail
    that goes on from known items); None when that is not found.

    Candidates are the `]` from the end: one closes the history, the others sit in the members
    after it (those fail fast, leaving a closer unmatched). At the right one, `p`, `{"\\u0000":[0` +
    data[p:] parses to the members `after` the history, and `lead + data[start:q] + "]"` (q: before
    any white space at p) to exactly `items`: the bytes from `start` to q are those items.
    """
    hi = len(data)
    lo = max(start, len(data) - _MAX_AROUND_BYTES)
    for _ in range(_MAX_CANDIDATES):
        p = data.rfind(b"]", lo, hi)
        if p < 0:
            return None
        hi = p
        try:
            rest = orjson.loads(_OPEN + data[p:])
            if rest.pop(_SENTINEL, None) != [0] or rest != after:
                continue
        except orjson.JSONDecodeError:
            continue
        except RecursionError:
            return None  # (==) nested past the interpreter's limit: parsed whole, and refused as too deep
        q = p
        while q > start and data[q - 1] in _SPACE:
            q -= 1
        try:
            parsed = orjson.loads(lead + data[start:q] + b"]")
            return q if parsed == items else None
        except (orjson.JSONDecodeError, RecursionError):
            return None
    return None
