"""Mistakes a config can hold that only show when its keys are read together, or against the address
the gateway will listen on. `gateway check-config` and `gateway serve` refuse them, one line each.

The schema (`config.py`) checks each key alone; these checks need the whole picture: which upstream
names a dialect can reach, what each provider's SDK takes as `base_url`, whether the `llm`
summarizer has a key of its own, and whether an upstream is the gateway itself (a request would
then loop through it; at run time the proxy's hop marker stops such a loop at once, this stops it
before the first request).
"""

from __future__ import annotations

import ipaddress
import socket

from yarl import URL

from gateway.config import Settings
from gateway.transport import Endpoint, Timeouts, proxy_for

KNOWN_UPSTREAMS = ("openai", "anthropic")  # the dialects route to these names only
# The providers' own API hosts: never reached without a key (a local OpenAI-compatible server may be).
PROVIDER_HOSTS = frozenset({"api.openai.com", "api.anthropic.com"})
_WILDCARD = frozenset({"0.0.0.0", "::", ""})


def redact_url(url: str) -> str:
    """A URL fit for logs and problem lines (a store's, an upstream's, a proxy's): its credentials
    replaced, a password or a token given as the user alone."""
    try:
        parsed = URL(url)
    except ValueError:
        return "<unparseable url>"
    if parsed.password:
        return str(parsed.with_password("***"))
    return str(parsed.with_user("***")) if parsed.user else url


def problems(settings: Settings, listen: tuple[str, int] | None = None) -> list[str]:
    """One `dotted.key: why` line per mistake; `listen`: the (host, port) `serve` binds, if known."""
    out = []
    if settings.requires_client_keys() and not settings.auth.keys:
        out.append("auth.keys: required when an upstreams.<name>.api_key is configured "
                   "(the gateway must not lend its upstream key to anyone who can reach the port)")
    for name, up in settings.upstreams.items():
        if name not in KNOWN_UPSTREAMS:
            out.append(f"upstreams.{name}: unknown upstream (known: {', '.join(KNOWN_UPSTREAMS)}); "
                       "an OpenAI-compatible server goes under upstreams.openai")
            continue
        path = URL(up.base_url).path.rstrip("/")
        if name == "anthropic" and path.endswith("/v1"):
            out.append(f"upstreams.anthropic.base_url: {redact_url(up.base_url)} ends in /v1, but the Anthropic SDK's "
                       "base_url has none (https://api.anthropic.com); drop the /v1")
        if name == "openai" and not path.endswith("/v1"):
            out.append(f"upstreams.openai.base_url: {redact_url(up.base_url)} does not end in /v1, as the OpenAI SDK's "
                       "base_url does (https://api.openai.com/v1); add the /v1")
    summarizer = settings.memory.summarizer
    if settings.memory.enabled and summarizer.mode == "llm":
        target = settings.upstreams.get(summarizer.upstream)
        if target is None or not target.api_key:
            out.append(f"memory.summarizer.mode: llm needs upstreams.{summarizer.upstream}.api_key (the summarizer "
                       "never uses a client's key); set it, or use mode: extractive")
    for name, up in settings.upstreams.items():
        if name in KNOWN_UPSTREAMS:
            try:
                proxy_for(Endpoint.of(up.base_url, Timeouts(1, 1, 1)))
            except ValueError as exc:
                # Read at the first call otherwise: every request to this upstream would fail.
                out.append(f"upstreams.{name}: the proxy environment (HTTPS_PROXY / HTTP_PROXY / ALL_PROXY) "
                           f"names {exc}")
    if listen is not None:
        for name, up in settings.upstreams.items():
            if points_at(up.base_url, listen):
                out.append(f"upstreams.{name}.base_url: {redact_url(up.base_url)} is the gateway's own address "
                           f"({listen[0]}:{listen[1]}); requests would loop through it; it must be "
                           "the provider's address")
    return out


def needs_key(base_url: str) -> bool:
    """Does the upstream at `base_url` refuse every request without a key (a provider's own host)?"""
    try:
        host = (URL(base_url).host or "").lower().rstrip(".")
    except ValueError:
        return False
    return any(host == h or host.endswith("." + h) for h in PROVIDER_HOSTS)  # (eu.api.openai.com too)


def warnings(settings: Settings) -> list[str]:
    """What a config allows but a user most likely did not mean; `check-config` and `serve` say it."""
    out = []
    if settings.auth.keys:
        for name, up in settings.upstreams.items():
            if name in KNOWN_UPSTREAMS and not up.api_key:
                tail = ("its requests without one are refused (401)" if needs_key(up.base_url)
                        else "without one they go with no credential (as a local server may want)")
                out.append(f"upstreams.{name}.api_key is unset while clients use gateway keys: a client reaches "
                           f"{name} only with its own provider key sent apart from its gateway key (that one in "
                           f"X-Gateway-Key); {tail}")
    return out


def paid_summaries(settings: Settings) -> str | None:
    """Said when folds make paid calls: an upstream api_key turns the llm summarizer on by default."""
    summarizer = settings.memory.summarizer
    if not settings.memory.enabled or settings.summarizer_mode() != "llm":
        return None
    return (f"folds call {summarizer.model} with upstreams.{summarizer.upstream}.api_key (billed to that key); "
            "memory.summarizer.mode: extractive makes none")


def _addresses(host: str, port: int) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def points_at(base_url: str, listen: tuple[str, int]) -> bool:
    """Does `base_url` reach the socket the gateway listens on?"""
    url = URL(base_url)
    host, port = url.host or "", url.explicit_port or (443 if url.scheme == "https" else 80)
    if port != listen[1]:
        return False  # no name resolution for the usual case: a provider on 443
    targets = _addresses(host, port)
    if listen[0] in _WILDCARD:
        local = _addresses(socket.gethostname(), port) | {"127.0.0.1", "::1"}
        return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in targets)
    return bool(targets & _addresses(listen[0], port))
