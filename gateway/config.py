"""Typed configuration: loaded from YAML once at start-up, validated, passed down explicitly.

`load_settings(path)` expands `${VAR}` / `${VAR:-default}` in the YAML text, then validates it
against `Settings`. Unknown keys are errors (a typo must not silently fall back to a default), and
`ConfigError.problems` names each wrong key with its dotted path and why, for `gateway check-config`.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from yarl import URL

from gateway import embed  # light: the model's runtime is imported only when the switch is on

DEFAULT_CONFIG_ENV = "GATEWAY_CONFIG"
# The variables the shipped config/gateway.yaml reads (`${GATEWAY_STORE_URL:-memory://}`, ...), read the
# same way when no config file is given: set, they would otherwise do nothing, and a user who set
# GATEWAY_OPENAI_BASE_URL to a local server would send prompts to the real provider.
DEFAULT_ENV: dict[str, tuple[str, ...]] = {
    "GATEWAY_HOST": ("server", "host"),
    "GATEWAY_PORT": ("server", "port"),
    "GATEWAY_SHUTDOWN_GRACE_SECONDS": ("server", "shutdown_grace_seconds"),
    "GATEWAY_STORE_URL": ("store", "url"),
    "GATEWAY_OPENAI_BASE_URL": ("upstreams", "openai", "base_url"),
    "GATEWAY_ANTHROPIC_BASE_URL": ("upstreams", "anthropic", "base_url"),
    "GATEWAY_IN_PROCESS_WORKERS": ("memory", "worker", "in_process"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # `gateway serve` on a shared store (Redis) starts a second process (gateway/offload.py) that serves
    # every request whose body is over offload_body_bytes, so parsing it never holds the event loop
    # that serves the rest. false: one process serves all (as always on the embedded memory:// store).
    offload: bool = True
    offload_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # The offload process's /healthz is asked this often, and given this long to answer; unanswered 3
    # times in a row (stopped, deadlocked: found within 6x this), it is killed and another started.
    offload_health_seconds: float = Field(5.0, ge=1, le=300)
    # A request head must arrive within this of its first byte (slow-header sockets are closed).
    header_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    # A request body must arrive within this once its head is in (else 408 in the caller's dialect).
    body_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    # Client connections held at once; more are closed on arrival. Keep it under the process's file
    # descriptor limit less the upstream and store pools (1,024 is a common limit).
    max_connections: int = Field(768, ge=1, le=1_000_000)
    # An idle keep-alive connection is closed after this.
    keepalive_timeout_seconds: float = Field(75.0, gt=0, le=3600)
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # SIGTERM: how long in-flight requests, streams and running folds may take to finish.
    shutdown_grace_seconds: float = Field(30.0, ge=0)


class StoreSettings(_Strict):
    url: str = "memory://"
    # 0 keeps conversations forever; otherwise every key of a conversation expires this long after
    # its last use (refreshed on every request).
    ttl_seconds: int = Field(0, ge=0)
    key_prefix: str = "gw"
    # Connections to Redis (to each node of a cluster) this process may hold. When all are in use a
    # command waits up to pool_wait_seconds for one (back-pressure), then fails as "busy"; a request
    # whose turn could not be stored then is retried in the background (retry_queue_size of them).
    pool_size: int = Field(100, ge=1)
    pool_wait_seconds: float = Field(5.0, ge=0)
    # The wait of the recording of an answered turn (no client waits on it) and of its retries.
    record_wait_seconds: float = Field(30.0, ge=0)
    retry_queue_size: int = Field(10_000, ge=0)
    retry_queue_bytes: int = Field(256 << 20, ge=0)

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        schemes = ("memory://", "redis://", "rediss://", "redis+cluster://", "unix://")
        if not v.startswith(schemes):
            raise ValueError(f"must start with one of {', '.join(schemes)}")
        return v


class UpstreamSettings(_Strict):
    # Exactly the value one would give that provider's SDK as base_url.
    base_url: str
    # When set, the gateway uses its own credential upstream and requires its own client keys.
    api_key: str | None = None
    connect_timeout: float = Field(10.0, gt=0)
    # Longest silence between two chunks of a response (a stream may legitimately pause).
    read_timeout: float = Field(600.0, gt=0)
    total_timeout: float = Field(900.0, gt=0)
    pool_size: int = Field(100, ge=1)

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        # `api_key: ${OPENAI_API_KEY:-}` with the variable unset reads "": no key of the gateway's own,
        # so each client's key is forwarded (an empty key would otherwise reach the provider as none).
        return v if v and v.strip() else None

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        try:
            url = URL(v)
            url.port  # noqa: B018 (an out-of-range port raises only when read)
        except ValueError as exc:  # a port past 65535, a bad IPv6 literal: said here, not as a traceback later
            raise ValueError(f"is not a valid URL ({exc})") from None
        if not url.host:
            raise ValueError("names no host")
        return v.rstrip("/")


def _default_upstreams() -> dict[str, UpstreamSettings]:
    return {
        "openai": UpstreamSettings(base_url="https://api.openai.com/v1"),
        "anthropic": UpstreamSettings(base_url="https://api.anthropic.com"),
    }


class ClientKey(_Strict):
    key: str = Field(min_length=8)
    tenant: str = Field(min_length=1)


class AuthSettings(_Strict):
    keys: list[ClientKey] = Field(default_factory=list)
    admin_token: str | None = None

    @field_validator("keys", mode="before")
    @classmethod
    def _plain_keys(cls, v: Any) -> Any:
        # `keys: [sk-gw-abc, …]` is shorthand: each plain key is its own tenant, named by a digest of
        # the whole key (a tail of it would be shared by keys ending alike, and show part of a secret
        # in logs and store keys).
        if isinstance(v, list):
            return [{"key": k, "tenant": f"key-{hashlib.sha256(k.encode()).hexdigest()[:16]}"}
                    if isinstance(k, str) else k for k in v]
        return v

    @field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[ClientKey]) -> list[ClientKey]:
        seen: dict[str, str] = {}
        for k in keys:
            if seen.setdefault(k.key, k.tenant) != k.tenant:
                raise ValueError("one key is given to two tenants")
        return keys


class ConversationSettings(_Strict):
    headers: list[str] = Field(default_factory=lambda: ["X-Conversation-Id"], min_length=1)
    project_headers: list[str] = Field(default_factory=lambda: ["X-Project-Id"])
    memory_header: str = "X-Memory"
    # auto: full-history clients are detected by the stored hash chain, otherwise turns are appended.
    history: Literal["auto", "full", "delta"] = "auto"


class SummarizerSettings(_Strict):
    # None: `llm` when the summarizer's upstream has a configured api_key, else `extractive`.
    mode: Literal["llm", "extractive"] | None = None
    upstream: Literal["openai", "anthropic"] = "openai"
    model: str = "gpt-4o-mini"
    max_tokens: int = Field(1024, ge=64)


class RetrievalSettings(_Strict):
    enabled: bool = True
    # No new excerpts when a message of the recent window matches the question at least this many times
    # as well as the best earlier one (raw BM25): it asks about what the window holds. 0: always recall.
    reach_back: float = Field(1.0, ge=0)
    # Excerpts scoring under this share of the best one are left out even when the budget has room
    # (smaller requests; questions that need many weakly matching messages lose some). 0: fill the budget.
    min_relevance: float = Field(0.0, ge=0, le=1)
    # Hybrid retrieval: fuse the lexical ranking with a packaged embedding model's (gateway/embed.py;
    # needs the `embeddings` extra). Stored messages are embedded in the background, the question on
    # the request path.
    embeddings: bool = False
    # Memory this process's search indexes may hold (an index of 500 coding-assistant messages holds
    # ~2 MB). Past it the least recently used go; such a conversation is read from the store and
    # indexed again at its next request, which then waits ~0.1 ms per message.
    index_cache_mb: int = Field(512, ge=1)

    @field_validator("embeddings")
    @classmethod
    def _extra_installed(cls, on: bool) -> bool:
        if on and not embed.available():
            raise ValueError("needs the `embeddings` extra: pip install 'memory-gateway[embeddings]'")
        return on


class WorkerSettings(_Strict):
    # `gateway serve` runs this many fold workers in-process; 0 leaves folding to `gateway worker`.
    in_process: int = Field(1, ge=0)
    # Child processes those workers hand a local (extractive) fold's CPU to, so it never holds the
    # serving process's interpreter lock; 0: a thread of the serving process. `gateway worker` uses threads.
    fold_processes: int = Field(1, ge=0, le=16)
    concurrency: int = Field(4, ge=1)
    claim_idle_ms: int = Field(60_000, ge=1000)
    max_failures: int = Field(3, ge=1)
    breaker_seconds: float = Field(60.0, ge=0)
    retry_base_seconds: float = Field(1.0, ge=0)


class TemplateSettings(_Strict):
    state: str = "## Project state (maintained by the memory gateway)\n{state}"
    summary: str = "## Summary of the earlier conversation ({covered} messages)\n{summary}"
    excerpts: str = (
        "## Relevant earlier excerpts (verbatim, from earlier in this conversation)\n{excerpts}"
    )
    omitted: str = "[{count} earlier messages omitted]"


class MemorySettings(_Strict):
    enabled: bool = True
    message_threshold: int = Field(30, ge=1)
    token_threshold: int = Field(8000, ge=1)
    # A request with more messages than this is relayed unchanged and not stored (reason
    # `too-many-messages`): each message costs the event loop some microseconds to check, count and
    # store, so one import of hundreds of thousands would stall every other request for seconds.
    max_messages: int = Field(20_000, ge=1)
    # Likewise for content parts (a message's content items, and a tool result's): relayed unchanged,
    # not stored (reason `too-many-parts`).
    max_parts: int = Field(20_000, ge=1)
    keep_recent: int = Field(10, ge=1)
    keep_initial: int = Field(0, ge=0)
    fold_batch: int = Field(10, ge=1)
    fold_tokens: int = Field(6000, ge=1)
    max_summary_tokens: int = Field(600, ge=50)
    # The summary's timeline (a line per session or task, older lines merged, never dropped) within
    # this many tokens or 1% of those it covers, up to 4,000 (timeline.budget), besides
    # max_summary_tokens; 0: none.
    timeline_tokens: int = Field(800, ge=0)
    state_budget_tokens: int = Field(500, ge=0)
    # Excerpts get at least this many tokens (the floor of a long conversation's budget)…
    retrieval_budget_tokens: int = Field(4000, ge=0)
    # …and grow with the history: up to what brings the whole rewritten request to this share of
    # the full history (a 500K-token conversation keeps more of its past than a 100K one).
    retrieval_target_share: float = Field(0.09, ge=0, le=1)
    # Excerpts never take more than this share of what the full history would cost, so a short
    # conversation is not padded with its own past…
    retrieval_max_share: float = Field(0.1, ge=0, le=1)
    # …nor more than this share of the model's context budget (its context_window x budget_ratio,
    # less the request's output tokens), so the window and the answer keep their room.
    retrieval_context_share: float = Field(0.5, ge=0, le=1)
    # A rewrite that would save less than this share of the full history is not made: the client's
    # request goes as sent (no-saving). Short conversations are not rewritten into something barely smaller.
    min_saving_share: float = Field(0.2, ge=0, lt=1)
    # What is held for the prompt cache (excerpts pinned by earlier turns; under policy cost, a
    # finished fold not applied yet) may grow a rewritten request up to this share of the full
    # request (system prompt included), no further: past it the fold goes in and the pins go. The
    # rewrite itself, its layers and a full excerpt budget, is never cut by it. 1.0: no bound.
    hold_max_share: float = Field(1.0, ge=0, le=1)
    budget_ratio: float = Field(0.8, gt=0, le=1)
    # Anthropic: add a cache_control breakpoint after the summary block (within the limit of 4).
    cache_control: bool = True
    # cost: over the thresholds, forward the full history instead of the rewrite whenever the
    # request's model would bill it less once its prompt cache is counted (gateway/cost.py, prices
    # from `pricing`). threshold: rewrite whenever over the thresholds.
    policy: Literal["cost", "threshold"] = "cost"
    summarizer: SummarizerSettings = Field(default_factory=SummarizerSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    templates: TemplateSettings = Field(default_factory=TemplateSettings)

    @model_validator(mode="before")
    @classmethod
    def _cost_model_alias(cls, data: Any) -> Any:
        # `cost_model: true|false` (before `policy`) still reads as `policy: cost|threshold`.
        if isinstance(data, dict) and "cost_model" in data:
            data = dict(data)
            flag = data.pop("cost_model")
            if not isinstance(flag, bool):
                raise ValueError("cost_model: must be true or false (it is now `policy: cost | threshold`)")
            data.setdefault("policy", "cost" if flag else "threshold")
        return data


class ModelSettings(_Strict):
    context_window: int = Field(128_000, ge=1024)
    encoding: Literal["cl100k_base", "o200k_base"] | None = None


class PriceSettings(_Strict):
    """What a provider bills for one model: USD per million tokens, and its prompt cache as factors of
    the input price (the cost model works in fresh-input-token equivalents)."""

    provider: Literal["openai", "anthropic", "other"] = "other"
    input_usd_per_mtok: float = Field(0.0, ge=0)
    output_usd_per_mtok: float = Field(0.0, ge=0)
    cache_read: float = Field(1.0, ge=0)  # a cached prefix token
    cache_write: float = Field(1.0, ge=0)  # a token newly written to the cache (Anthropic: 5-minute cache)
    cache_write_1h: float = Field(1.0, ge=0)  # ... to a 1-hour cache (Anthropic `cache_control.ttl: 1h`)
    cache_ttl_seconds: float = Field(300.0, ge=0)  # how long an unused cache stays warm (0: no caching)
    cache_min_tokens: int = Field(0, ge=0)  # a shorter prompt prefix is never cached


def _default_models() -> dict[str, ModelSettings]:
    m = ModelSettings
    return {
        "gpt-4o": m(context_window=128_000, encoding="o200k_base"),
        "gpt-4o-mini": m(context_window=128_000, encoding="o200k_base"),
        "gpt-4.1": m(context_window=1_047_576, encoding="o200k_base"),
        "gpt-4.1-mini": m(context_window=1_047_576, encoding="o200k_base"),
        "gpt-5": m(context_window=400_000, encoding="o200k_base"),
        "o3": m(context_window=200_000, encoding="o200k_base"),
        "gpt-3.5-turbo": m(context_window=16_385),
        "claude-opus-4": m(context_window=200_000),
        "claude-sonnet-4": m(context_window=200_000),
        "claude-3-5-haiku": m(context_window=200_000),
        "claude-haiku-4": m(context_window=200_000),
        "default": m(context_window=128_000),
    }


def _default_pricing() -> dict[str, PriceSettings]:
    """Published list prices (USD per million tokens) of the current families. OpenAI: no cache write
    premium; cached input at 50% (gpt-4o, o1), 25% (gpt-4.1, o3, o4-mini) or 10% (gpt-5) of input; a
    cache is kept 5-10 minutes idle (300 s assumed). Anthropic: reads 0.1x, writes 1.25x (5-minute
    cache) or 2x (1-hour), 300 s. Both cache only prefixes of 1,024 tokens or more (Haiku: 2,048)."""

    def openai(inp: float, out: float, read: float) -> PriceSettings:
        return PriceSettings(provider="openai", input_usd_per_mtok=inp, output_usd_per_mtok=out, cache_read=read,
                             cache_write=1.0, cache_write_1h=1.0, cache_ttl_seconds=300,
                             cache_min_tokens=1024)

    def anthropic(inp: float, out: float, least: int = 1024) -> PriceSettings:
        return PriceSettings(provider="anthropic", input_usd_per_mtok=inp, output_usd_per_mtok=out, cache_read=0.1,
                             cache_write=1.25, cache_write_1h=2.0, cache_ttl_seconds=300, cache_min_tokens=least)

    return {
        "gpt-4o": openai(2.5, 10, 0.5),
        "gpt-4o-mini": openai(0.15, 0.6, 0.5),
        "gpt-4.1": openai(2, 8, 0.25),
        "gpt-4.1-mini": openai(0.4, 1.6, 0.25),
        "gpt-4.1-nano": openai(0.1, 0.4, 0.25),
        "gpt-5": openai(1.25, 10, 0.1),
        "gpt-5-mini": openai(0.25, 2, 0.1),
        "gpt-5-nano": openai(0.05, 0.4, 0.1),
        "o1": openai(15, 60, 0.5),
        "o3": openai(2, 8, 0.25),
        "o4-mini": openai(1.1, 4.4, 0.25),
        # No prompt caching.
        "gpt-3.5-turbo": PriceSettings(provider="openai", input_usd_per_mtok=0.5, output_usd_per_mtok=1.5,
                                       cache_ttl_seconds=0),
        "claude-opus-4": anthropic(15, 75),
        "claude-opus-4-5": anthropic(5, 25),
        "claude-sonnet-4": anthropic(3, 15),
        "claude-3-7-sonnet": anthropic(3, 15),
        "claude-haiku-4": anthropic(1, 5, 2048),
        "claude-3-5-haiku": anthropic(0.8, 4, 2048),
        "claude-3-haiku": anthropic(0.25, 1.25, 2048),
        # Any other model: no price, and no prompt caching assumed (the rewrite, being smaller, is the
        # cheaper request). Start-up and check-config name the models that fall here.
        "default": PriceSettings(cache_ttl_seconds=0),
    }


# Pricing keys of the old flat `pricing:` section, which priced every model like Anthropic.
_OLD_PRICING = ("cache_read_factor", "cache_write_factor", "cache_ttl_seconds")


class Settings(_Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    upstreams: dict[str, UpstreamSettings] = Field(default_factory=_default_upstreams)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    conversation: ConversationSettings = Field(default_factory=ConversationSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    models: dict[str, ModelSettings] = Field(default_factory=_default_models)
    pricing: dict[str, PriceSettings] = Field(default_factory=_default_pricing)

    @field_validator("upstreams", mode="before")
    @classmethod
    def _merge_upstreams(cls, v: Any) -> Any:
        # A config that only sets upstreams.openai keeps the default anthropic upstream.
        if isinstance(v, dict):
            merged: dict[str, Any] = {k: u.model_dump() for k, u in _default_upstreams().items()}
            for name, cfg in v.items():
                if isinstance(cfg, dict) and name in merged:
                    merged[name] = {**merged[name], **cfg}
                else:
                    merged[name] = cfg
            return merged
        return v

    @model_validator(mode="before")
    @classmethod
    def _prices_moved(cls, data: Any) -> Any:
        # Prices used to sit in `models:` (input/output USD) and `pricing:` was one flat set of cache
        # factors. Model prices still read (into `pricing:`); the flat factors are an error that says
        # where they went, since applying one provider's factors to every model is the bug they had.
        if not isinstance(data, dict):
            return data
        pricing = data.get("pricing")
        if isinstance(pricing, dict):
            old = [k for k in _OLD_PRICING if k in pricing and not isinstance(pricing[k], dict)]
            if old:
                raise ValueError(f"pricing.{old[0]}: pricing is now per model (pricing.<model>.cache_read, "
                                 "cache_write, cache_write_1h, cache_ttl_seconds); see config/gateway.yaml")
        models = data.get("models")
        if isinstance(models, dict):
            moved: dict[str, Any] = {}
            kept: dict[str, Any] = {}
            for name, entry in models.items():
                if isinstance(entry, dict):
                    prices = {k: entry[k] for k in ("input_usd_per_mtok", "output_usd_per_mtok") if k in entry}
                    if prices:
                        moved[name] = prices
                        entry = {k: v for k, v in entry.items() if k not in prices}
                kept[name] = entry
            if moved:
                pricing = dict(pricing) if isinstance(pricing, dict) else {}
                for name, prices in moved.items():
                    own = pricing.get(name)
                    pricing[name] = {**prices, **own} if isinstance(own, dict) else prices
                data = {**data, "models": kept, "pricing": pricing}
        return data

    @field_validator("models", mode="before")
    @classmethod
    def _merge_models(cls, v: Any) -> Any:
        if isinstance(v, dict):
            merged: dict[str, Any] = {k: m.model_dump() for k, m in _default_models().items()}
            merged.update(v)
            return merged
        return v

    @field_validator("pricing", mode="before")
    @classmethod
    def _merge_pricing(cls, v: Any) -> Any:
        # An entry named like a built-in one changes only the fields it gives (e.g. a longer TTL).
        if isinstance(v, dict):
            merged: dict[str, Any] = {k: p.model_dump() for k, p in _default_pricing().items()}
            for name, entry in v.items():
                if isinstance(entry, dict) and name in merged:
                    merged[name] = {**merged[name], **entry}
                else:
                    merged[name] = entry
            return merged
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        for name in ("openai", "anthropic"):
            if name not in self.upstreams:
                raise ValueError(f"upstreams.{name} is required")
        if self.memory.summarizer.upstream not in self.upstreams:
            raise ValueError("memory.summarizer.upstream names an upstream that is not configured")
        return self

    # Derived views, computed from validated data (never stored twice).

    def requires_client_keys(self) -> bool:
        """An operator key upstream must never be lent to whoever can reach the port."""
        return any(u.api_key for u in self.upstreams.values())

    def summarizer_mode(self) -> Literal["llm", "extractive"]:
        mode = self.memory.summarizer.mode
        if mode is not None:
            return mode
        return "llm" if self.upstreams[self.memory.summarizer.upstream].api_key else "extractive"

    def model_label(self, name: str | None) -> str:
        """The configured model name `name` falls under, or "other": a metric label of bounded cardinality."""
        if name:
            if name in self.models:
                return name
            best = max((k for k in self.models if name.startswith(k)), key=len, default=None)
            if best is not None:
                return best
        return "other"

    def model(self, name: str | None) -> ModelSettings:
        """Settings of the longest configured model name that prefixes `name` (dated ids match)."""
        return self.models[_longest(self.models, name)]

    def price(self, name: str | None) -> PriceSettings:
        """Prices of the longest `pricing` pattern that prefixes `name`; `default` for an unknown model."""
        return self.pricing[_longest(self.pricing, name)]

    def price_key(self, name: str | None) -> str:
        """The `pricing` entry `name` falls under ("default" when none)."""
        return _longest(self.pricing, name)

    def priced(self, name: str | None) -> bool:
        """Whether `pricing` knows `name` (it does not fall back to `default`)."""
        return _longest(self.pricing, name) != "default"

    def unpriced_models(self) -> list[str]:
        """Configured model names (`models:` entries, the summarizer's model) `pricing` does not know."""
        names = [k for k in self.models if k != "default"] + [self.memory.summarizer.model]
        return sorted({n for n in names if not self.priced(n)})


def _longest(table: dict[str, Any], name: str | None) -> str:
    """The key of `table` that is `name`, else the longest one prefixing it, else "default"."""
    if name:
        if name in table:
            return name
        best = max((k for k in table if name.startswith(k)), key=len, default=None)
        if best is not None:
            return best
    return "default"


class ConfigError(Exception):
    """The configuration is invalid; `problems` holds one `dotted.key: why` line per error."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


def expand_env(text: str, env: dict[str, str] | None = None) -> str:
    """Replace `${VAR}` and `${VAR:-default}`; an unset VAR without default is an error."""
    env = dict(os.environ) if env is None else env
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        value = env.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                missing.append(name)
                return ""
            return default
        return value

    out = _VAR.sub(sub, text)
    if missing:
        raise ConfigError([f"${{{n}}}: environment variable is not set and has no default" for n in missing])
    return out


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            near = difflib.get_close_matches(str(err["loc"][-1]), _keys_at(err["loc"][:-1]), n=1, cutoff=0.75)
            if near:
                msg += f" (did you mean {near[0]}?)"
        problems.append(f"{loc}: {msg}")
    return problems


def _keys_at(path: tuple[Any, ...]) -> list[str]:
    """The keys the schema knows under `path` (a mapping of names, as `upstreams`, steps over the name)."""
    node: Any = Settings
    for part in path:
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(str(part))
            if field is None:
                return []
            node = field.annotation
        elif get_origin(node) is dict:
            node = get_args(node)[1]
        elif get_origin(node) is list:
            node = get_args(node)[0]
        else:
            return []
        if get_origin(node) is Union:  # `X | None`
            node = next((a for a in get_args(node) if a is not type(None)), node)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _lenient(data: dict[str, Any]) -> Settings | None:
    """The settings without the unknown keys, so the checks that read keys together still run and
    `check-config` names every mistake at once; None when another error is there too (a wrong value
    left at its default would have the checks report what is not so: "auth.keys: required" for keys
    that are there but too short)."""
    data = copy.deepcopy(data)
    while True:
        try:
            return Settings.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors()
            if any(err["type"] != "extra_forbidden" for err in errors):
                return None
            # Deepest and highest list positions first, so that no removal shifts another's place.
            locs = sorted((err["loc"] for err in errors), key=lambda loc: [(1, p) if isinstance(p, int)
                                                                          else (0, str(p)) for p in loc],
                          reverse=True)
            if not sum(_drop(data, loc) for loc in locs):
                return None
        except ValueError:
            return None


def _drop(data: Any, loc: tuple[Any, ...]) -> bool:
    """Remove the deepest key of `loc` that `data` holds; whether one was."""
    node, parent, key = data, None, None
    for part in loc:
        held = (part in node) if isinstance(node, dict) else (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if not held:
            break
        parent, key, node = node, part, node[part]
    if parent is None:
        return False
    del parent[key]
    return True


def parse_settings(data: Any) -> Settings:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping of sections"])
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from exc


def default_env() -> dict[str, str]:
    """The `DEFAULT_ENV` variables a load without a config file reads: those set and not empty."""
    out = {}
    for name in DEFAULT_ENV:
        value = os.environ.get(name)
        # Kubernetes gives every pod GATEWAY_PORT=tcp://10.0.0.7:80 when a Service named "gateway" exists:
        # an address, not a port to listen on.
        if value and not (name == "GATEWAY_PORT" and "://" in value):
            out[name] = value
    return out


def resolve_path(path: str | os.PathLike[str] | None) -> Path | None:
    if path:
        return Path(path)
    env = os.environ.get(DEFAULT_CONFIG_ENV)
    return Path(env) if env else None


def load_settings(path: str | os.PathLike[str] | None = None,
                  checks: Callable[[Settings], list[str]] | None = None, *, environ: bool = False) -> Settings:
    """Settings from `path`, else from $GATEWAY_CONFIG, else the built-in defaults (`environ`: with the
    variables of `DEFAULT_ENV`, for the commands that run a deployment: not `eval`, whose replay must not
    reach the store a shell's GATEWAY_STORE_URL names). `checks`: problems seen only with the keys read
    together, reported with the schema's own, all at once (an unknown key left out for them)."""
    resolved = resolve_path(path)
    if resolved is None:
        data: dict[str, Any] = {}
        source: dict[str, str] = {}
        for name, value in (default_env() if environ else {}).items():
            key_path = DEFAULT_ENV[name]
            node = data
            for part in key_path[:-1]:
                node = node.setdefault(part, {})
            node[key_path[-1]] = value
            source[".".join(key_path)] = name
        try:
            return _validated(data, checks)
        except ConfigError as exc:
            raise ConfigError([_from_env(p, source) for p in exc.problems]) from exc
    try:
        text = resolved.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{resolved}: cannot read ({exc.strerror})"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{resolved}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(resolved)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([f"{where}: not valid YAML: {problem}"]) from exc
    try:
        return _validated(_expand_tree(data), checks)
    except ConfigError as exc:
        raise ConfigError([_with_line(resolved, text, p) for p in exc.problems]) from exc


def _validated(data: Any, checks: Callable[[Settings], list[str]] | None) -> Settings:
    try:
        settings = parse_settings(data)
    except ConfigError as exc:
        problems = list(exc.problems)
        lenient = _lenient(data) if isinstance(data, dict) and checks is not None else None
        if lenient is not None and checks is not None:
            problems += [p for p in checks(lenient) if p not in problems]
        raise ConfigError(problems) from exc
    if checks is not None:
        problems = checks(settings)
        if problems:
            raise ConfigError(problems)
    return settings


def _from_env(problem: str, source: dict[str, str]) -> str:
    """A problem with a key set from the environment (no config file) names the variable."""
    dotted = problem.partition(": ")[0]
    name = source.get(dotted)
    return f"{problem} (from ${name})" if name else problem


def _with_line(path: Path, text: str, problem: str) -> str:
    """`file:line: dotted.key: why` when the key's line can be found in the YAML text."""
    dotted, sep, _ = problem.partition(": ")
    if not sep or dotted.startswith(("(", "$")):
        return f"{path}: {problem}"
    try:
        node: Any = yaml.compose(text)
    except yaml.YAMLError:
        return f"{path}: {problem}"
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if k.value == part), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return f"{path}:{line}: {problem}" if line else f"{path}: {problem}"


def _expand_tree(node: Any) -> Any:
    """Expand `${VAR}` in string values only: never in comments, and a value cannot inject YAML."""
    if isinstance(node, str):
        return expand_env(node)
    if isinstance(node, dict):
        return {k: _expand_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_tree(v) for v in node]
    return node
