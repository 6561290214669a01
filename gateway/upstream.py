"""The edge towards the providers: which endpoint and request target a call goes to, and header filtering.

`upstreams.openai.base_url` is what one gives the OpenAI SDK (it includes `/v1`), while
`upstreams.anthropic.base_url` is what one gives the Anthropic SDK (it does not), so an incoming
`/v1/...` path maps to `{openai base}/...` and to `{anthropic base}/v1/...`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from multidict import CIMultiDict
from yarl import URL

from gateway.config import Settings, UpstreamSettings
from gateway.dialects import dialect_for_upstream
from gateway.preflight import needs_key
from gateway.transport import Endpoint, Timeouts

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
# Request headers the gateway sets itself or must not pass on. Accept-Encoding: the gateway reads
# the stream it relays, so it asks upstream for identity. Content-Encoding: aiohttp decodes a
# compressed request body as it reads it, and the body forwarded is the decoded one (or a rewrite).
# Credentials are set per mode by `auth`. X-Gateway-Hop: the proxy sets it anew, with its own id
# appended (loop detection). X-Gateway-Offload-Call: between the gateway and its offload process only.
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "content-encoding", "accept-encoding", "x-gateway-key",
                              "cookie", "x-gateway-hop", "x-gateway-offload-call"}
_CREDENTIALS = frozenset({"authorization", "x-api-key"})
# Response headers aiohttp recomputes for the body it sends. Content-Encoding stays: the transport
# removes it when it decoded the body, and a body it could not decode goes out with its encoding.
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server", "set-cookie"}


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    endpoint: Endpoint
    prefix: str  # the base URL's path, to which the incoming path is appended (OpenAI form: its /v1 removed)
    api_key: str | None
    strip_v1: bool
    auth: Mapping[str, str]  # the configured key in this provider's header form (empty: forward the client's)
    needs_key: bool = False  # the provider's own host: a request without any key is refused here, not there

    def target(self, path_qs: str) -> str:
        """The request target upstream for the client's raw (already encoded) path and query."""
        tail = path_qs[3:] if self.strip_v1 and path_qs.startswith("/v1") else path_qs
        return self.prefix + tail



def make_upstream(name: str, cfg: UpstreamSettings) -> Upstream:
    timeouts = Timeouts(connect=cfg.connect_timeout, read=cfg.read_timeout, total=cfg.total_timeout)
    dialect = dialect_for_upstream(name)
    return Upstream(
        name=name,
        endpoint=Endpoint.of(cfg.base_url, timeouts, cfg.pool_size),
        prefix=URL(cfg.base_url).raw_path.rstrip("/"),
        api_key=cfg.api_key,
        strip_v1=dialect.base_has_v1,
        auth=dialect.auth_headers(cfg.api_key) if cfg.api_key else {},
        needs_key=needs_key(cfg.base_url),
    )


def upstreams(settings: Settings) -> dict[str, Upstream]:
    return {name: make_upstream(name, cfg) for name, cfg in settings.upstreams.items()}


def _connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    value = headers.get("Connection")
    if not value:
        return frozenset()
    return frozenset(t.strip().lower() for t in value.split(","))


def request_headers(incoming: Mapping[str, str], extra: Mapping[str, str], *,
                    keep_credentials: bool) -> list[tuple[str, str]]:
    """Headers to send upstream; the client's credential headers go as they came only when kept."""
    named = _connection_named(incoming)
    drop = _DROP_REQUEST if keep_credentials else _DROP_REQUEST | _CREDENTIALS
    if extra:
        drop = drop | {name.lower() for name in extra}
    out = [(name, value) for name, value in incoming.items() if name.lower() not in drop and name.lower() not in named]
    out.append(("Accept-Encoding", "identity"))
    out.extend(extra.items())
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
