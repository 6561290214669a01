"""Hostile input on every route: never a gateway 5xx, a 4xx in the caller's shape, stored history intact.

One gateway (memory on, real Redis, a fake upstream on port 0) runs in a thread of its own for the
module; hypothesis drives thousands of requests at it through a plain HTTP client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.memory_helpers import KEY, memory_gateway

CONVERSATIONS = ("fz-a", "fz-b")  # seeded before the run: their history must survive every rejection
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


class Served:
    """The gateway on a loop in a background thread; `request` is a blocking HTTP call to it."""

    def __init__(self, store_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready: Future[str] = Future()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(store_url),),
                                       daemon=True)
        self.thread.start()
        url = self.ready.result(timeout=30)
        self.host, self.port = url.removeprefix("http://").split(":")

    async def _main(self, store_url: str) -> None:
        self.stop = asyncio.Event()
        try:
            async with memory_gateway(store_url) as g:
                self.gateway = g
                self.ready.set_result(g.url)
                await self.stop.wait()
        except BaseException as exc:  # surface a start-up failure to the test instead of hanging
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                conn.putheader(name, value.encode("utf-8", "surrogateescape"))
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def history(self, conv: str) -> list[Any]:
        status, raw = self.request("GET", f"/gateway/conversations/{quote(conv, safe='')}/messages?limit=1000",
                                   headers={"Authorization": f"Bearer {KEY}"})
        return orjson.loads(raw)["data"] if status == 200 else []


@pytest.fixture(scope="module")
def served(redis_server: str) -> Iterator[Served]:
    s = Served(redis_server)
    try:
        for conv in CONVERSATIONS:  # a stored history for rejected requests to leave alone
            for i in range(3):
                body = {"model": "gpt-test", "messages": [{"role": "user", "content": f"seed {j} of {conv}"}
                                                          for j in range(i + 1)]}
                status, raw = s.request("POST", "/v1/chat/completions", orjson.dumps(body), {
                    "Authorization": f"Bearer {KEY}", "X-Conversation-Id": conv,
                    "Content-Type": "application/json"})
                assert status == 200, raw
        yield s
    finally:
        s.close()


# --- strategies ------------------------------------------------------------------------------------

big_ints = st.one_of(st.integers(), st.sampled_from([2**64, -(2**64), 10**23, -1, 0]))
scalars = st.one_of(st.none(), st.booleans(), big_ints, st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
part_types = st.one_of(st.sampled_from(["text", "image_url", "input_text", "output_text", "tool_use",
                                        "tool_result", "image", "thinking", "function_call"]), json_values)


def deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "text", "text": "bottom"}
    for _ in range(levels):
        node = {"type": "tool_result", "tool_use_id": "t", "content": [node]}
    return node


parts = st.fixed_dictionaries({"type": part_types}, optional={
    "text": json_values, "content": json_values, "image_url": json_values, "id": json_values,
    "name": json_values, "input": json_values, "source": json_values, "cache_control": json_values})
contents = st.one_of(st.text(max_size=30), st.lists(st.one_of(parts, json_values), max_size=3), json_values)
messages = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool",
                                                                   "developer"]), json_values)},
                                 optional={"content": contents, "tool_calls": json_values, "name": json_values,
                                           "tool_call_id": json_values, "type": json_values})
histories = st.one_of(st.lists(st.one_of(messages, json_values), max_size=5), json_values)
bodies = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.sampled_from(["gpt-test", "claude-test"]), json_values),
    "messages": histories, "input": st.one_of(histories, st.text(max_size=20)), "system": contents,
    "stream": st.one_of(st.booleans(), json_values), "max_tokens": json_values, "tools": json_values,
    "instructions": json_values, "stream_options": json_values, "previous_response_id": json_values})
# Control characters are not HTTP: the server's parser refuses them before any route runs.
conv_ids = st.one_of(st.sampled_from(CONVERSATIONS), st.text(
    st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12).filter(lambda s: s.strip() == s))
header_sets = st.fixed_dictionaries({"Content-Type": st.sampled_from(
    ["application/json"] * 8 + ["text/plain", "application/json; charset=utf-8", ""])}, optional={
    "X-Conversation-Id": conv_ids, "anthropic-version": st.sampled_from(["2023-06-01", "x"]),
    "X-Memory": st.sampled_from(["off", "on", "?"])})
JSON = {"Content-Type": "application/json"}
credentials = st.sampled_from([{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {},
                               {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}])


def _check(status: int, raw: bytes, anthropic: bool) -> None:
    assert status < 500, (status, raw[:300])
    if 400 <= status < 500:
        err = orjson.loads(raw)
        if anthropic:
            assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
        else:
            assert isinstance(err["error"]["message"], str) and isinstance(err["error"]["type"], str), err


FUZZ = settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@FUZZ
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]),
       body=st.one_of(bodies, json_values), headers=header_sets, cred=credentials)
@example(route="/v1/chat/completions", body={"model": "m", "messages": [
    {"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, headers={**JSON, "X-Conversation-Id": "fz-a"},
    cred={"Authorization": f"Bearer {KEY}"})
@example(route="/v1/chat/completions", body={"model": "m", "messages": [{"role": "assistant", "tool_calls": 5}]},
         headers={**JSON, "X-Conversation-Id": "fz-a"}, cred={"Authorization": f"Bearer {KEY}"})
@example(route="/v1/responses", body={"model": "m", "input": [
    {"role": "user", "content": "x"}, {"type": "reasoning", "id": "rs", "summary": 5}]},
    headers={**JSON, "X-Conversation-Id": "fz-a"}, cred={"Authorization": f"Bearer {KEY}"})
@example(route="/v1/chat/completions", body={"model": "m", "messages": {}},
         headers={**JSON, "X-Conversation-Id": "fz-b"}, cred={"Authorization": f"Bearer {KEY}"})
@example(route="/v1/messages", body="DEEP", headers={**JSON, "X-Conversation-Id": "fz-b"},
         cred={"Authorization": f"Bearer {KEY}"})
@example(route="/v1/chat/completions", body="DEEP", headers={**JSON, "X-Conversation-Id": "fz-a"},
         cred={"Authorization": f"Bearer {KEY}"})
def test_model_routes_never_fail_on_any_body(served: Served, route: str, body: Any, headers: dict[str, str],
                                             cred: dict[str, str]) -> None:
    """Any JSON body on a model route: relayed or a 4xx in the caller's dialect; a rejection stores nothing."""
    conv = headers.get("X-Conversation-Id")
    before = served.history(conv) if conv in CONVERSATIONS else None
    anthropic = route.startswith("/v1/messages")
    if body == "DEEP":  # built here: hypothesis cannot print a value nested this deep
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [deep(300)]}]}
    status, raw = served.request("POST", route, json.dumps(body).encode(), {**headers, **cred})  # orjson: 255 levels
    _check(status, raw, anthropic)
    if before is not None and status >= 400:
        assert served.history(conv) == before


raw_bodies = st.one_of(st.binary(max_size=48), st.sampled_from([
    b'{"model": "m", "messages": [', b'{"model": "m"}\xff', b'\xef\xbb\xbf{"model": "m"}', b"[1, 2]", b"1e400",
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', b"", b"null", b'"x"',
    b'{"model": 1e400, "messages": []}', b'{"a": 1, "a": 2}']))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages"]), raw=raw_bodies,
       conv=st.sampled_from([*CONVERSATIONS, None]), cred=credentials)
def test_model_routes_never_fail_on_bytes_that_are_not_json(served: Served, route: str, raw: bytes,
                                                            conv: str | None, cred: dict[str, str]) -> None:
    """Any bytes as a model route's body (truncated JSON, not UTF-8, a BOM, a lone surrogate, 1e400,
    no body): relayed or a 4xx in the caller's dialect; a rejection stores nothing."""
    before = served.history(conv) if conv is not None else None
    headers = {**JSON, **cred, **({"X-Conversation-Id": conv} if conv else {})}
    status, answer = served.request("POST", route, raw, headers)
    _check(status, answer, route.startswith("/v1/messages"))
    if before is not None and status >= 400:
        assert served.history(conv) == before


@FUZZ
@given(conv=st.one_of(conv_ids, st.text(max_size=10)), query=st.dictionaries(
    st.sampled_from(["offset", "limit", "q", "x"]),
    st.one_of(big_ints.map(str), st.text(max_size=6)), max_size=3),
    op=st.sampled_from(["get", "messages", "state", "summary", "fold"]), body=json_values, cred=credentials,
    anthropic=st.booleans())
@example(conv="fz-a", query={"offset": "99999999999999999999999"}, op="messages", body=None,
         cred={"Authorization": f"Bearer {KEY}"}, anthropic=False)
@example(conv="fz-a", query={"limit": "-5", "offset": "-1"}, op="messages", body=None,
         cred={"Authorization": f"Bearer {KEY}"}, anthropic=True)
def test_conversation_api_never_fails_on_any_input(served: Served, conv: str, query: dict[str, str], op: str,
                                                   body: Any, cred: dict[str, str], anthropic: bool) -> None:
    """Any id, query and body on the conversation API: an answer or a 4xx in the caller's dialect."""
    base = f"/gateway/conversations/{quote(conv, safe='')}"
    qs = "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
    method, path = {"get": ("GET", base), "messages": ("GET", base + "/messages"), "state": ("PUT", base + "/state"),
                    "summary": ("PUT", base + "/summary"), "fold": ("POST", base + "/fold")}[op]
    headers = {**cred, **(ANTHROPIC_HEADERS if anthropic else {})}
    seeded = conv in CONVERSATIONS
    before = served.history(conv) if seeded else None
    status, raw = served.request(method, f"{path}?{qs}" if qs else path,
                                 json.dumps(body).encode() if method != "GET" else None, headers)
    _check(status, raw, anthropic)
    if before is not None:
        assert served.history(conv) == before  # the API never rewrites stored messages


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       path=st.one_of(st.sampled_from(["/healthz", "/readyz", "/metrics", "/v1/models", "/v1/../../admin",
                                       "/v1/%2e%2e/%2e%2e/x", "//v1//models", "/v1/conversations",
                                       "/gateway/conversations", "/gateway/stats", "/dashboard"]),
                      st.text(alphabet="/v1abc.%2e{}?=&", max_size=20).map(lambda s: "/" + s)),
       anthropic=st.booleans(), cred=credentials)
def test_any_path_and_method_never_fails(served: Served, method: str, path: str, anthropic: bool,
                                         cred: dict[str, str]) -> None:
    """Any method on any path (health, metrics, models, odd and climbing paths): never a gateway 5xx,
    and a 4xx the gateway answers is in the caller's dialect."""
    status, raw = served.request(method, path, b"" if method in ("POST", "PUT", "PATCH") else None,
                                 {**cred, **(ANTHROPIC_HEADERS if anthropic else {})})
    _check(status, raw, anthropic)
