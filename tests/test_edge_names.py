"""The edge's names and identities: no credential keeps no memory, the admin token stays in the
gateway, paths never climb out of the upstream's base_url, and conversation ids of any bytes
round-trip through the conversation API."""

from __future__ import annotations

import asyncio
import io
from urllib.parse import quote

import aiohttp
import pytest
from yarl import URL

from gateway import logs, paths
from tests.memory_helpers import KEY, Gateway, memory_gateway

ADMIN = "gw-admin-token-SECRET9"
CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "remember the launch is on Friday"}]}


async def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request written byte for byte (header bytes no client library would send)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    top, _, payload = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, payload


async def test_no_credential_keeps_no_memory(redis_url: str) -> None:
    """Two clients without a credential never share a tenant: passed through, nothing stored, no API access."""
    async with memory_gateway(redis_url) as g:
        async with g.http.post(f"{g.url}/v1/chat/completions", json=CHAT,
                               headers={"X-Conversation-Id": "shared"}) as r:
            assert r.status == 200
            assert r.headers["x-gateway-context"] == "passthrough"
            assert r.headers["x-gateway-reason"] == "no-credential"
        await g.settle()
        async with g.http.get(f"{g.url}/gateway/conversations/shared/messages") as r:
            assert r.status == 401
        status, _ = await g.api("GET", "shared/messages")  # nor under a real credential's tenant
        assert status == 404  # an unknown conversation: nothing was stored for anyone


async def test_admin_token_never_goes_upstream(redis_url: str) -> None:
    """The admin token on a model route is refused, not forwarded as the provider key."""
    async with memory_gateway(redis_url, auth={"admin_token": ADMIN}) as g:
        async with g.http.post(f"{g.url}/v1/chat/completions", json=CHAT,
                               headers={"Authorization": f"Bearer {ADMIN}", "X-Conversation-Id": "c"}) as r:
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"
        async with g.http.post(f"{g.url}/v1/messages", json={**CHAT, "max_tokens": 5},
                               headers={"x-api-key": ADMIN}) as r:
            assert r.status == 401
            assert (await r.json())["type"] == "error"
        # Beside a provider key, in the header a provider reads or any other, or in the path or query:
        # refused too, never forwarded.
        anthropic = {"anthropic-version": "2023-06-01"}
        for path, body, headers in [
            ("/v1/messages", {**CHAT, "max_tokens": 5},
             {"Authorization": f"Bearer {KEY}", "x-api-key": ADMIN, **anthropic}),
            ("/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}", "api-key": ADMIN}),
            ("/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}", "X-Note": f"token={ADMIN};"}),
            (f"/v1/chat/completions?key={ADMIN}", CHAT, {"Authorization": f"Bearer {KEY}"}),
            (f"/v1/chat/completions?x=1&key={quote(ADMIN, safe='')}&y=2", CHAT, {"Authorization": f"Bearer {KEY}"}),
            ("/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}", ADMIN: "1"}),
        ]:
            async with g.http.post(f"{g.url}{path}", json=body, headers=headers) as r:
                assert r.status == 401, (path, headers)
        async with g.http.get(f"{g.url}/v1/models/{ADMIN}", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 401
        assert all(ADMIN not in v for req in g.fake.requests for v in req.headers.values())
        assert all(ADMIN not in req.path + req.query_string for req in g.fake.requests)
        for note in (ADMIN[:-1], f"{ADMIN}x", f"admin {ADMIN[1:]}"):  # the token's own value only, found by digest
            async with g.http.post(f"{g.url}/v1/chat/completions", json=CHAT,
                                   headers={"Authorization": f"Bearer {KEY}", "X-Note": note}) as r:
                assert r.status == 200


@pytest.mark.parametrize("path", ["/v1/../../admin", "/v1/%2e%2e/%2E%2E/admin", "/v1/../../../etc/passwd",
                                  "/v1/a%2F..%2F..%2Fadmin", "/v1/x%5C..%5Cadmin"])
async def test_paths_never_climb_out_of_the_base_url(redis_url: str, path: str) -> None:
    """A path that climbs (plain, encoded, or by an encoded slash) is a 400 and never reaches the upstream."""
    async with memory_gateway(redis_url) as g:
        before = len(g.fake.requests)
        status, _, body = await raw_request(g.url, f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                                                   f"Authorization: Bearer {KEY}\r\n".encode())
        assert status == 400, body
        assert b'"error"' in body
        assert len(g.fake.requests) == before


async def test_paths_are_normalised_before_routing(redis_url: str) -> None:
    """Dot and empty segments are resolved first: `//v1/./chat//completions` is the chat route, with memory."""
    async with memory_gateway(redis_url) as g:
        status, headers, body = await raw_request(
            g.url, f"POST //v1/./chat//completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   "X-Conversation-Id: norm\r\nContent-Type: application/json\r\n".encode(),
            b'{"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}')
        assert status == 200, body
        assert headers["x-gateway-context"] == "full"
        assert g.fake.requests[-1].path == "/v1/chat/completions"
        await g.settle()
        assert len(await g.messages("norm")) == 2


def test_canonical_paths() -> None:
    """Dot segments resolve, empty ones collapse, encodings stay, climbing is refused."""
    assert paths.canonical("/v1/models?x=1") == "/v1/models?x=1"
    assert paths.canonical("/v1/a/../models") == "/v1/models"
    assert paths.canonical("//v1//models/") == "/v1/models/"
    assert paths.canonical("/v1/%2e/models/%7Bx%7D") == "/v1/models/%7Bx%7D"
    assert paths.canonical("/v1/../..") is None


async def converse(g: Gateway, conv_header: bytes) -> None:
    body = b'{"model": "gpt-test", "messages": [{"role": "user", "content": "hello"}]}'
    status, _, raw = await raw_request(g.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                              b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                                              b"Content-Type: application/json\r\n"
                                              b"X-Conversation-Id: " + conv_header + b"\r\n", body)
    assert status == 200, raw


@pytest.mark.parametrize("conv", [b"{weird}", b"a/b", b"100%", b"caf\xc3\xa9 {x}", b"\xff\xfe-raw", b"%41",
                                  b"..", b"."])
async def test_ids_of_any_bytes_round_trip(redis_url: str, conv: bytes) -> None:
    """An id of any bytes (braces, slash, percent, UTF-8, not UTF-8) is logged, stored, folded, read and deleted."""
    out = io.BytesIO()
    logs.configure("json", "info", stream=out)
    try:
        await _round_trip(redis_url, conv)
    finally:
        logs.flush()
        logs.configure("json", "info")
    requests = [line for line in out.getvalue().decode().splitlines()
                if '"event":"request"' in line and '"route":"/v1/chat/completions"' in line]
    assert len(requests) == 1, out.getvalue()[-2000:]


async def _round_trip(redis_url: str, conv: bytes) -> None:
    async with memory_gateway(redis_url) as g:
        await converse(g, conv)
        await g.settle()
        # The id as the API spells it: its bytes percent-encoded in the path (dots too when they are
        # the whole id, which a client would otherwise resolve as a dot segment).
        path = "%2E" * len(conv) if conv in (b".", b"..") else quote(conv, safe="")
        async with aiohttp.ClientSession() as http:
            url = f"{g.url}/gateway/conversations/{path}"
            auth = {"Authorization": f"Bearer {KEY}"}
            async with http.get(URL(url + "/messages", encoded=True), headers=auth) as r:
                assert r.status == 200, await r.text()
                assert [d["message"]["content"] for d in (await r.json())["data"]] == ["hello", "Noted."]
            async with http.post(URL(url + "/fold", encoded=True), headers=auth) as r:
                assert r.status == 202
            async with http.delete(URL(url, encoded=True), headers=auth) as r:
                assert r.status == 200
            async with http.get(URL(url + "/messages", encoded=True), headers=auth) as r:
                assert r.status == 404  # forgotten: unknown to the API from now on
