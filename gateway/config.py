"""Typed configuration: loaded from YAML once at start-up, validated, passed down explicitly.

`load_settings(path)` expands `${VAR}` / `${VAR:-default}` in the YAML text, then validates it
against `Settings`. Unknown keys are errors (a typo must not silently fall back to a default), and
`ConfigError.problems` names each wrong key with its dotted path and why, for `gateway check-config`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_CONFIG_ENV = "GATEWAY_CONFIG"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class StoreSettings(_Strict):
    url: str = "memory://"
    # 0 keeps conversations forever; otherwise every key of a conversation expires this long after
    # its last use (refreshed on every request).
    ttl_seconds: int = Field(0, ge=0)
    key_prefix: str = "gw"

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

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
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
        # `keys: [sk-gw-abc, …]` is shorthand: each plain key is its own tenant.
        if isinstance(v, list):
            return [{"key": k, "tenant": f"key-{k[-6:]}"} if isinstance(k, str) else k for k in v]
        return v


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


class WorkerSettings(_Strict):
    # `gateway serve` runs this many fold workers in-process; 0 leaves folding to `gateway worker`.
    in_process: int = Field(1, ge=0)
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
    keep_recent: int = Field(10, ge=1)
    keep_initial: int = Field(0, ge=0)
    fold_batch: int = Field(10, ge=1)
    fold_tokens: int = Field(6000, ge=1)
    max_summary_tokens: int = Field(600, ge=50)
    state_budget_tokens: int = Field(500, ge=0)
    retrieval_budget_tokens: int = Field(4000, ge=0)
    # Excerpts never take more than this share of what the full history would cost, so a short
    # conversation is not padded with its own past.
    retrieval_max_share: float = Field(0.1, ge=0, le=1)
    budget_ratio: float = Field(0.8, gt=0, le=1)
    # Anthropic: add a cache_control breakpoint after the summary block (within the limit of 4).
    cache_control: bool = True
    # Forward the full history instead of the rewrite whenever the provider would bill it less
    # once its prompt cache is counted (see gateway/cost.py).
    cost_model: bool = True
    summarizer: SummarizerSettings = Field(default_factory=SummarizerSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    templates: TemplateSettings = Field(default_factory=TemplateSettings)


class ModelSettings(_Strict):
    context_window: int = Field(128_000, ge=1024)
    input_usd_per_mtok: float = Field(0.0, ge=0)
    output_usd_per_mtok: float = Field(0.0, ge=0)
    encoding: Literal["cl100k_base", "o200k_base"] | None = None


class PricingSettings(_Strict):
    cache_read_factor: float = Field(0.1, ge=0)
    cache_write_factor: float = Field(1.25, ge=0)
    cache_ttl_seconds: float = Field(300.0, ge=0)


def _default_models() -> dict[str, ModelSettings]:
    m = ModelSettings
    return {
        "gpt-4o": m(context_window=128_000, input_usd_per_mtok=2.5, output_usd_per_mtok=10, encoding="o200k_base"),
        "gpt-4o-mini": m(context_window=128_000, input_usd_per_mtok=0.15, output_usd_per_mtok=0.6,
                         encoding="o200k_base"),
        "gpt-4.1": m(context_window=1_047_576, input_usd_per_mtok=2, output_usd_per_mtok=8, encoding="o200k_base"),
        "gpt-4.1-mini": m(context_window=1_047_576, input_usd_per_mtok=0.4, output_usd_per_mtok=1.6,
                          encoding="o200k_base"),
        "gpt-5": m(context_window=400_000, input_usd_per_mtok=1.25, output_usd_per_mtok=10, encoding="o200k_base"),
        "o3": m(context_window=200_000, input_usd_per_mtok=2, output_usd_per_mtok=8, encoding="o200k_base"),
        "gpt-3.5-turbo": m(context_window=16_385, input_usd_per_mtok=0.5, output_usd_per_mtok=1.5),
        "claude-opus-4": m(context_window=200_000, input_usd_per_mtok=15, output_usd_per_mtok=75),
        "claude-sonnet-4": m(context_window=200_000, input_usd_per_mtok=3, output_usd_per_mtok=15),
        "claude-3-5-haiku": m(context_window=200_000, input_usd_per_mtok=0.8, output_usd_per_mtok=4),
        "claude-haiku-4": m(context_window=200_000, input_usd_per_mtok=1, output_usd_per_mtok=5),
        "default": m(context_window=128_000),
    }


class Settings(_Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    upstreams: dict[str, UpstreamSettings] = Field(default_factory=_default_upstreams)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    conversation: ConversationSettings = Field(default_factory=ConversationSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    models: dict[str, ModelSettings] = Field(default_factory=_default_models)
    pricing: PricingSettings = Field(default_factory=PricingSettings)

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

    @field_validator("models", mode="before")
    @classmethod
    def _merge_models(cls, v: Any) -> Any:
        if isinstance(v, dict):
            merged: dict[str, Any] = {k: m.model_dump() for k, m in _default_models().items()}
            merged.update(v)
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

    def model(self, name: str | None) -> ModelSettings:
        """Settings of the longest configured model name that prefixes `name` (dated ids match)."""
        if name:
            if name in self.models:
                return self.models[name]
            best = max((k for k in self.models if name.startswith(k)), key=len, default=None)
            if best is not None:
                return self.models[best]
        return self.models["default"]


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
        problems.append(f"{loc}: {msg}")
    return problems


def parse_settings(data: Any) -> Settings:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping of sections"])
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from exc


def resolve_path(path: str | os.PathLike[str] | None) -> Path | None:
    if path:
        return Path(path)
    env = os.environ.get(DEFAULT_CONFIG_ENV)
    return Path(env) if env else None


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Settings from `path`, else from $GATEWAY_CONFIG, else the built-in defaults."""
    resolved = resolve_path(path)
    if resolved is None:
        return Settings()
    try:
        text = resolved.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{resolved}: cannot read ({exc.strerror})"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{resolved}: not valid YAML ({exc})"]) from exc
    return parse_settings(_expand_tree(data))


def _expand_tree(node: Any) -> Any:
    """Expand `${VAR}` in string values only: never in comments, and a value cannot inject YAML."""
    if isinstance(node, str):
        return expand_env(node)
    if isinstance(node, dict):
        return {k: _expand_tree(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_tree(v) for v in node]
    return node
