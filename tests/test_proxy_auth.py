"""Credentials: forwarded as they came, or replaced by the gateway's own key behind gateway client keys;
tenants; and never a credential in the logs."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest

from gateway import logs
from gateway.app import PROXY, create_app
from gateway.auth import ANONYMOUS, Authenticator, AuthError, tenant_for
from gateway.testing import FakeUpstream, serve_app

UPSTREAM_OPENAI = "sk-upstream-openai-SECRET1"
UPSTREAM_ANTHROPIC = "sk-upstream-anthropic-SECRET2"
GATEWAY_KEY = "gw-client-key-SECRET3"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


@pytest.fixture
async def forwarding(fake: FakeUpstream) -> AsyncIterator[str]:
    async with serve_app(create_app(fake.settings(), memory=False)) as url:
        yield url


@pytest.fixture
async def keyed(fake: FakeUpstream) -> AsyncIterator[str]:
    settings = fake.settings(
        upstreams={"openai": {"api_key": UPSTREAM_OPENAI}, "anthropic": {"api_key": UPSTREAM_ANTHROPIC}},
        auth={"keys": [{"key": GATEWAY_KEY, "tenant": "team-a"}]})
    async with serve_app(create_app(settings, memory=False)) as url:
        yield url


def all_header_values(fake: FakeUpstream) -> str:
    return " ".join(v for r in fake.requests for v in r.headers.values())


async def test_bearer_forwarded_as_it_came(forwarding: str, fake: FakeUpstream) -> None:
    """Without an upstream key the client's Bearer credential (OpenAI, anthropic >= 2) goes upstream unchanged."""
    c = anthropic.AsyncAnthropic(base_url=forwarding, auth_token="sk-ant-user-1", max_retries=0,
                                 default_headers={"anthropic-version": "2026-10-21"})
    await c.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    got = fake.requests[-1].headers
    assert got["Authorization"] == "Bearer sk-ant-user-1"
    assert got["anthropic-version"] == "2026-10-21"


async def test_x_api_key_forwarded_as_it_came(forwarding: str, fake: FakeUpstream) -> None:
    """An older SDK's x-api-key with anthropic-version 2023-06-01 goes upstream unchanged."""
    async with aiohttp.ClientSession() as s, s.post(forwarding + "/v1/messages", json={"messages": MESSAGES},
                                                    headers={"x-api-key": "sk-ant-old",
                                                             "anthropic-version": "2023-06-01"}) as r:
        assert r.status == 200
    got = fake.requests[-1].headers
    assert got["x-api-key"] == "sk-ant-old" and "Authorization" not in got


async def test_gateway_key_replaced_by_upstream_key(keyed: str, fake: FakeUpstream) -> None:
    """In gateway-key mode each upstream gets the configured key in its own header form, never the gateway key."""
    await openai.AsyncOpenAI(base_url=keyed + "/v1", api_key=GATEWAY_KEY, max_retries=0).chat.completions.create(
        model="m", messages=MESSAGES)
    assert fake.requests[-1].headers["Authorization"] == f"Bearer {UPSTREAM_OPENAI}"
    await anthropic.AsyncAnthropic(base_url=keyed, api_key=GATEWAY_KEY, max_retries=0).messages.create(
        model="m", max_tokens=8, messages=MESSAGES)
    got = fake.requests[-1].headers
    assert got["x-api-key"] == UPSTREAM_ANTHROPIC and "Authorization" not in got
    assert GATEWAY_KEY not in all_header_values(fake)


async def test_gateway_key_in_its_own_header(keyed: str, fake: FakeUpstream) -> None:
    """The gateway key may come in X-Gateway-Key; it is not forwarded."""
    async with aiohttp.ClientSession() as s, s.post(keyed + "/v1/chat/completions", json={"messages": MESSAGES},
                                                    headers={"X-Gateway-Key": GATEWAY_KEY}) as r:
        assert r.status == 200
    assert "X-Gateway-Key" not in fake.requests[-1].headers
    assert GATEWAY_KEY not in all_header_values(fake)


async def test_missing_gateway_key_is_401_openai(keyed: str, fake: FakeUpstream) -> None:
    """Without a gateway key an OpenAI caller gets a 401 its SDK raises as AuthenticationError."""
    c = openai.AsyncOpenAI(base_url=keyed + "/v1", api_key="sk-not-a-gateway-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await c.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.body["type"] == "authentication_error"
    assert fake.requests == []


async def test_wrong_gateway_key_is_401_anthropic(keyed: str, fake: FakeUpstream) -> None:
    """A wrong gateway key gets an Anthropic-shaped 401 on an Anthropic route."""
    c = anthropic.AsyncAnthropic(base_url=keyed, api_key="gw-wrong-key-0000", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        await c.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    assert info.value.body["error"]["type"] == "authentication_error"
    assert fake.requests == []


def test_tenant_rules(fake: FakeUpstream) -> None:
    """Tenant: the gateway key's tenant, else sha256(credential)[:16], else anonymous."""
    assert tenant_for(None) == ANONYMOUS
    assert tenant_for("sk-abc") == "1460db1b6902f8b1"
    assert tenant_for("sk-abc", client_tenant="team-a") == "team-a"
    keyed = Authenticator(fake.settings(auth={"keys": [{"key": GATEWAY_KEY, "tenant": "team-a"}]}))
    assert keyed.identify({"x-api-key": GATEWAY_KEY}).tenant == "team-a"
    with pytest.raises(AuthError):
        keyed.identify({"Authorization": "Bearer sk-other"})
    plain = Authenticator(fake.settings())
    assert plain.identify({"Authorization": "Bearer sk-abc"}).tenant == "1460db1b6902f8b1"
    assert plain.identify({}).tenant == ANONYMOUS


async def test_credentials_never_logged(fake: FakeUpstream) -> None:
    """No credential, client's, gateway's or upstream's, appears in the log output, on success or failure."""
    out = io.BytesIO()
    logs.configure("json", "debug", stream=out)
    try:
        settings = fake.settings(upstreams={"openai": {"api_key": UPSTREAM_OPENAI}},
                                 auth={"keys": [{"key": GATEWAY_KEY, "tenant": "team-a"}]})
        async with serve_app(create_app(settings, memory=False)) as url:
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=GATEWAY_KEY, max_retries=0)
            await c.chat.completions.create(model="m", messages=MESSAGES)
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-wrong-SECRET4",
                                         max_retries=0).models.list()
            fake.error_status = 500
            with pytest.raises(openai.InternalServerError):
                await c.chat.completions.create(model="m", messages=MESSAGES)
        async with serve_app(create_app(fake.settings(), memory=False)) as url:
            fake.error_status = None
            await anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant-user-SECRET5", max_retries=0
                                           ).messages.create(model="m", max_tokens=8, messages=MESSAGES)
    finally:
        logs.flush()
        logs.configure("json", "info")
    text = out.getvalue().decode()
    assert text.count('"event":"request"') == 4
    for secret in (UPSTREAM_OPENAI, GATEWAY_KEY, "sk-wrong-SECRET4", "sk-ant-user-SECRET5", "SECRET"):
        assert secret not in text


async def test_with_memory_off_the_conversation_api_is_a_404_and_responses_say_why(forwarding: str) -> None:
    """memory.enabled: false: every /gateway/ route answers 404 naming the setting (not a 500), and a
    request that names a conversation is relayed with `x-gateway-reason: memory-off`."""
    auth = {"Authorization": "Bearer sk-client"}
    async with aiohttp.ClientSession() as http:
        for path in ("/gateway/conversations", "/gateway/stats", "/gateway/conversations/c1",
                     "/gateway/conversations/c1/messages"):
            async with http.get(forwarding + path, headers=auth) as r:
                body = await r.json()
                assert r.status == 404, (path, body)
                assert "memory.enabled" in body["error"]["message"]
        async with http.post(forwarding + "/v1/chat/completions", headers={**auth, "X-Conversation-Id": "c1"},
                             json={"model": "gpt-test", "messages": MESSAGES}) as r:
            assert r.status == 200
            assert r.headers["x-gateway-context"] == "passthrough"
            assert r.headers["x-gateway-reason"] == "memory-off"


async def test_gateway_key_alone_never_reaches_a_provider_keyless(fake: FakeUpstream) -> None:
    """Gateway keys with only OpenAI's key configured: an Anthropic call whose one key is the gateway key
    has no Anthropic credential to send. At Anthropic's own host it gets the gateway's 401 saying so
    (the provider's would read as a wrong gateway key); the OpenAI route still works. A local server
    under the same config (one that may need no key) gets the request with no credential at all."""
    keys = {"keys": [{"key": GATEWAY_KEY, "tenant": "team-a"}]}
    settings = fake.settings(upstreams={"openai": {"api_key": UPSTREAM_OPENAI},
                                        "anthropic": {"base_url": "https://api.anthropic.com"}}, auth=keys)
    async with serve_app(create_app(settings, memory=False)) as url:
        c = anthropic.AsyncAnthropic(base_url=url, api_key=GATEWAY_KEY, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            await c.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        assert "upstreams.anthropic.api_key" in info.value.body["error"]["message"]
        assert "X-Gateway-Key" in info.value.body["error"]["message"]
        assert fake.requests == []
        # The OpenAI route has the gateway's own key.
        await openai.AsyncOpenAI(base_url=url + "/v1", api_key=GATEWAY_KEY, max_retries=0).chat.completions.create(
            model="m", messages=MESSAGES)
        assert fake.requests[-1].headers["Authorization"] == f"Bearer {UPSTREAM_OPENAI}"
    # A provider's host (here the fake, taken for one): the client's own key, sent apart from the
    # gateway key, goes through.
    app = create_app(fake.settings(upstreams={"openai": {"api_key": UPSTREAM_OPENAI}}, auth=keys), memory=False)
    proxy = app[PROXY]
    proxy.upstreams["anthropic"] = dataclasses.replace(proxy.upstreams["anthropic"], needs_key=True)
    async with serve_app(app) as url:
        c = anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant-own-1", max_retries=0,
                                     default_headers={"X-Gateway-Key": GATEWAY_KEY})
        await c.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        assert fake.requests[-1].headers["Authorization"] == "Bearer sk-ant-own-1"  # (anthropic >= 2: Bearer)
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic.AsyncAnthropic(base_url=url, api_key=GATEWAY_KEY, max_retries=0).messages.create(
                model="m", max_tokens=8, messages=MESSAGES)
    local = fake.settings(upstreams={"openai": {"api_key": UPSTREAM_OPENAI}}, auth=keys)
    async with serve_app(create_app(local, memory=False)) as url:
        await anthropic.AsyncAnthropic(base_url=url, api_key=GATEWAY_KEY, max_retries=0).messages.create(
            model="m", max_tokens=8, messages=MESSAGES)
        got = fake.requests[-1].headers
        assert "x-api-key" not in got and "Authorization" not in got
    assert GATEWAY_KEY not in all_header_values(fake)
