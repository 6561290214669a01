"""The HTTP edge towards the providers: URL joining, header filtering, the pooled client session.

`upstreams.openai.base_url` is what one gives the OpenAI SDK (it includes `/v1`), while
`upstreams.anthropic.base_url` is what one gives the Anthropic SDK (it does not), so an incoming
`/v1/...` path maps to `{openai base}/...` and to `{anthropic base}/v1/...`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from gateway.config import Settings, UpstreamSettings

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Request headers the gateway sets itself or must not pass on. Accept-Encoding: the gateway reads
# the stream it relays, so it asks upstream for identity. Credentials are set per mode by `auth`.
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "x-gateway-key", "cookie"}
_CREDENTIALS = frozenset({"authorization", "x-api-key"})
# Response headers aiohttp recomputes for the body it sends (the body is already decoded).
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "content-encoding", "date", "server", "set-cookie"}


_URL_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    prefix: str  # base_url, to which the incoming path is appended (OpenAI form: its /v1 removed)
    api_key: str | None
    timeout: aiohttp.ClientTimeout
    strip_v1: bool
    # The few hot paths are parsed once; the client's raw (already encoded) path is kept as sent.
    _urls: dict[str, URL] = field(default_factory=dict)

    def url(self, path_qs: str) -> URL:
        url = self._urls.get(path_qs)
        if url is None:
            tail = path_qs[3:] if self.strip_v1 and path_qs.startswith("/v1") else path_qs
            url = URL(self.prefix + tail, encoded=True)
            if len(self._urls) < _URL_CACHE_SIZE:
                self._urls[path_qs] = url
        return url

    def auth_headers(self) -> dict[str, str]:
        """The configured key in this provider's header form (empty: forward the client's)."""
        if not self.api_key:
            return {}
        if self.name == "anthropic":
            return {"x-api-key": self.api_key}
        return {"Authorization": f"Bearer {self.api_key}"}


def make_upstream(name: str, cfg: UpstreamSettings) -> Upstream:
    return Upstream(
        name=name,
        prefix=cfg.base_url,
        api_key=cfg.api_key,
        timeout=aiohttp.ClientTimeout(total=cfg.total_timeout, sock_connect=cfg.connect_timeout,
                                      connect=cfg.connect_timeout, sock_read=cfg.read_timeout),
        # Anthropic-style bases stop before /v1; every other upstream is OpenAI-compatible.
        strip_v1=name != "anthropic",
    )


def upstreams(settings: Settings) -> dict[str, Upstream]:
    return {name: make_upstream(name, cfg) for name, cfg in settings.upstreams.items()}


def _connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    value = headers.get("Connection")
    if not value:
        return frozenset()
    return frozenset(t.strip().lower() for t in value.split(","))


def request_headers(incoming: Mapping[str, str], extra: Mapping[str, str], *,
                    keep_credentials: bool) -> CIMultiDict[str]:
    """Headers to send upstream; the client's credential headers go as they came only when kept."""
    named = _connection_named(incoming)
    drop = _DROP_REQUEST if keep_credentials else _DROP_REQUEST | _CREDENTIALS
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        low = name.lower()
        if low not in drop and low not in named:
            out.add(name, value)
    out["Accept-Encoding"] = "identity"
    out.update(extra)
    return out


def response_headers(upstream: Mapping[str, str], extra: Iterable[tuple[str, str]] = ()) -> CIMultiDict[str]:
    """Everything the provider said (request ids, retry and rate-limit headers) minus hop-by-hop."""
    named = _connection_named(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        low = name.lower()
        if low not in _DROP_RESPONSE and low not in named:
            out.add(name, value)
    for name, value in extra:
        out[name] = value
    return out


def client_session(settings: Settings) -> aiohttp.ClientSession:
    pools = [u.pool_size for u in settings.upstreams.values()]
    connector = aiohttp.TCPConnector(limit=sum(pools), limit_per_host=max(pools), ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        # A proxy shared by many clients must never carry one client's cookies to another.
        cookie_jar=aiohttp.DummyCookieJar(),
        # The client's own User-Agent goes through; aiohttp must not add one.
        skip_auto_headers=("User-Agent",),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=True,
    )
