"""The upstream client through an egress proxy: a real CONNECT proxy on port 0, real TLS upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trustme
from aiohttp import web

from gateway.testing import serve_app
from gateway.transport import Endpoint, HTTPClient, Timeouts, UpstreamError

FAST = Timeouts(connect=2, read=5, total=10)
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@dataclass
class ProxyLog:
    heads: list[str] = field(default_factory=list)  # the first request head of each connection
    credentials: str | None = None  # required Proxy-Authorization value, when set


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


@asynccontextmanager
async def forward_proxy(log: ProxyLog) -> AsyncIterator[str]:
    """An HTTP forward proxy: CONNECT tunnels, and plain requests in absolute form; loopback only."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        log.heads.append(head)
        method, target, _ = head.split("\r\n", 1)[0].split(" ", 2)
        if log.credentials is not None and f"proxy-authorization: {log.credentials}" not in head.lower():
            writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
            writer.close()
            return
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            authority = target.split("://", 1)[1].split("/", 1)[0]
            host, _, port = authority.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            up_writer.write(head.encode("latin-1"))  # absolute form: the server takes it as is
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


def echo_app() -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "host": request.headers.get("Host"),
                                  "echo": (await request.read()).decode(),
                                  "proxy_auth": request.headers.get("Proxy-Authorization")})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@asynccontextmanager
async def tls_upstream(ca: trustme.CA) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    """An https echo server with a certificate for 127.0.0.1, and a client context trusting it."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    async with serve_app(echo_app(), ssl_context=server_ctx) as base:
        yield base.replace("http://", "https://"), trusting


async def test_https_upstream_goes_through_a_connect_tunnel(ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTPS_PROXY set, an https upstream is reached through CONNECT, with the proxy's Basic
    credentials on the CONNECT only, and TLS verified end to end with the upstream's certificate."""
    log = ProxyLog(credentials="basic dxnlcjpwqhnz")  # user:p@ss, lower-cased as the proxy compares
    async with tls_upstream(ca) as (url, trusting), forward_proxy(log) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"http://user:p%40ss@{proxy}")
        client = HTTPClient(ssl_context=trusting)
        try:
            endpoint = Endpoint.of(url, FAST)
            for _ in range(2):
                resp = await client.request(endpoint, "POST", "/v1/chat/completions", [], b'{"a":1}')
                answer = json.loads(await resp.read())
                resp.release()
                assert resp.status == 200 and answer["echo"] == '{"a":1}' and answer["proxy_auth"] is None
                assert answer["path"] == "/v1/chat/completions" and answer["host"] == endpoint.host_header
        finally:
            await client.close()
    port = url.rsplit(":", 1)[1]
    assert len(log.heads) == 1  # one tunnel, kept alive for the second call
    assert log.heads[0].startswith(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n")


async def test_https_upstream_refuses_a_certificate_it_does_not_trust_through_the_tunnel(
        ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the tunnel, the upstream's certificate is still checked: an untrusted one fails."""
    log = ProxyLog()
    async with tls_upstream(ca) as (url, _), forward_proxy(log) as proxy:
        monkeypatch.setenv("https_proxy", f"http://{proxy}")
        client = HTTPClient()
        try:
            with pytest.raises(UpstreamError, match="could not connect"):
                await client.request(Endpoint.of(url, FAST), "GET", "/", [])
        finally:
            await client.close()
    assert [h.split(" ", 1)[0] for h in log.heads] == ["CONNECT"]


async def test_http_upstream_goes_through_the_proxy_in_absolute_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY set, an http upstream's calls go to the proxy with their full URL and the
    proxy's credentials; the upstream gets its own Host."""
    log = ProxyLog(credentials="basic ywxpy2u6c2vjcmv0")  # alice:secret
    async with serve_app(echo_app()) as base, forward_proxy(log) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://alice:secret@{proxy}")
        client = HTTPClient()
        try:
            endpoint = Endpoint.of(base, FAST)
            resp = await client.request(endpoint, "GET", "/v1/models?x=1", [])
            answer = json.loads(await resp.read())
            resp.release()
        finally:
            await client.close()
    assert resp.status == 200 and answer["path"] == "/v1/models" and answer["host"] == endpoint.host_header
    assert log.heads[0].startswith(f"GET {base}/v1/models?x=1 HTTP/1.1\r\n")


async def test_no_proxy_hosts_are_reached_directly(ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host NO_PROXY names (here by CIDR) is called directly, the proxy never sees it."""
    log = ProxyLog()
    async with tls_upstream(ca) as (url, trusting), forward_proxy(log) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy}")
        monkeypatch.setenv("NO_PROXY", "example.com, 127.0.0.0/8")
        client = HTTPClient(ssl_context=trusting)
        try:
            resp = await client.request(Endpoint.of(url, FAST), "GET", "/", [])
            await resp.read()
            resp.release()
        finally:
            await client.close()
    assert resp.status == 200 and log.heads == []


async def test_a_refused_tunnel_is_an_upstream_error(ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy that refuses the CONNECT (407 without credentials) fails the call as an UpstreamError
    naming the proxy's answer (the gateway answers 502)."""
    async with tls_upstream(ca) as (url, trusting), forward_proxy(ProxyLog(credentials="basic x")) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy}")
        client = HTTPClient(ssl_context=trusting)
        try:
            with pytest.raises(UpstreamError, match="407 Proxy Authentication Required"):
                await client.request(Endpoint.of(url, FAST), "GET", "/", [])
        finally:
            await client.close()


def test_a_proxy_the_gateway_cannot_use_is_refused_at_start_and_never_logs_its_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """A SOCKS proxy in the environment made every upstream call a 500, and the error logged the proxy's
    URL with its password. `check-config` (and so `serve`) refuses it, with the password masked."""
    from gateway import cli

    monkeypatch.setenv("HTTP_PROXY", "socks5://alice:S3cretProxyPass@127.0.0.1:1080")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    cfg = tmp_path / "g.yaml"
    cfg.write_text("upstreams:\n  openai:\n    base_url: http://127.0.0.1:9/v1\n")
    assert cli.main(["check-config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "upstreams.openai" in err and "socks5://***@127.0.0.1:1080" in err
    assert "S3cret" not in err and "alice" not in err
