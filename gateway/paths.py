"""What a request names, made canonical at the edge: its path, and the conversation it belongs to.

Paths: aiohttp routes the path as it came, dot segments included, so `/v1/../../admin` matched the
`/v1/*` pass-through and reached the upstream outside its `base_url`. `canonical` resolves dot
segments (also percent-encoded ones) and empty segments before routing, and refuses a path that
climbs above the root; `forwardable` refuses encoded slashes a provider could decode and climb with.

Conversation ids: a header's bytes that are not UTF-8 reach the app as lone surrogates, which no
log line, JSON document or Redis key can hold. `conversation_id` writes each such byte as `%XX`,
the very text aiohttp gives for the same bytes percent-encoded in the conversation API's path,
so the id round-trips through the API. An id of `.` or `..` can only be sent percent-encoded
(clients resolve the plain ones), so in the API's id segment an encoded dot segment is the id.
"""

from __future__ import annotations

import codecs

_DOTS = {".": ".", "%2e": ".", "..": "..", ".%2e": "..", "%2e.": "..", "%2e%2e": ".."}
_ID_PARENT = ["gateway", "conversations"]  # the segments before the conversation API's id


def canonical(raw_path: str) -> str | None:
    """`raw_path` (encoded, with its query) with dot and empty segments resolved; None when it climbs
    above the root. Other segments keep their encoding byte for byte."""
    path, sep, query = raw_path.partition("?")
    if "//" not in path and "." not in path and "%2" not in path:  # the common case: nothing to resolve
        return raw_path
    out: list[str] = []
    segments = path.split("/")
    dots: str | None = None
    for segment in segments[1:]:
        dots = _DOTS.get(segment.lower())
        if dots is not None and out == _ID_PARENT and segment not in (".", ".."):
            dots = None  # `/gateway/conversations/%2E%2E`: the conversation named "..", not a step up
        if dots == ".." and not out:
            return None
        if dots == "..":
            out.pop()
        elif dots is None and segment:
            out.append(segment)
    trailing = "/" if out and (not segments[-1] or dots) else ""
    return "/" + "/".join(out) + trailing + sep + query


def forwardable(raw_path: str) -> bool:
    """Whether a path may go upstream: no encoded slash or backslash for the provider to decode."""
    low = raw_path.partition("?")[0].lower()
    return "%2f" not in low and "%5c" not in low and "\\" not in low


def _percent(exc: UnicodeError) -> tuple[str, int]:
    assert isinstance(exc, UnicodeDecodeError)
    return "".join(f"%{b:02X}" for b in exc.object[exc.start:exc.end]), exc.end


codecs.register_error("gateway-percent", _percent)


def conversation_id(value: str) -> str:
    """The header's conversation id as text any store or log holds (bytes not UTF-8 as `%XX`)."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte decoded to: not from the wire
            raw = value.encode("utf-8", "replace")
        return raw.decode("utf-8", "gateway-percent")
    return value
