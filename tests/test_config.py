"""Configuration: the shipped config/gateway.yaml, ${VAR:-default} expansion, and naming wrong keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gateway.config import DEFAULT_ENV, ConfigError, Settings, load_settings

SHIPPED = Path(__file__).resolve().parent.parent / "config" / "gateway.yaml"
ENV_VARS = ("GATEWAY_HOST", "GATEWAY_PORT", "GATEWAY_STORE_URL", "GATEWAY_OPENAI_BASE_URL",
            "GATEWAY_ANTHROPIC_BASE_URL")


def keys(value: Any, prefix: str = "") -> set[str]:
    if not isinstance(value, dict):
        return set()
    out = set()
    for k, v in value.items():
        out.add(prefix + k)
        if prefix + k not in ("models", "pricing"):  # model entries are data, not schema
            out |= keys(v, prefix + k + ".")
    return out


def test_shipped_config_is_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """config/gateway.yaml loads and, with no environment overrides, equals the built-in defaults."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert load_settings(SHIPPED) == Settings()


def test_shipped_config_lists_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key of Settings appears in config/gateway.yaml, so the file documents them all."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    shipped = keys(yaml.safe_load(SHIPPED.read_text()))
    assert keys(Settings().model_dump()) - shipped == set()


def test_variables_in_comments_are_not_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commented-out example naming an unset variable never breaks loading; values are expanded."""
    monkeypatch.delenv("GW_TEST_UNSET", raising=False)
    monkeypatch.setenv("GW_TEST_URL", "redis://example:6379/0")
    path = tmp_path / "gw.yaml"
    path.write_text("# api_key: ${GW_TEST_UNSET}\nstore:\n  url: ${GW_TEST_URL}  # ${GW_TEST_UNSET}\n")
    assert load_settings(path).store.url == "redis://example:6379/0"


def test_env_expansion_with_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """${VAR} takes the environment's value, ${VAR:-default} falls back when unset or empty."""
    monkeypatch.setenv("GW_TEST_PORT", "9191")
    monkeypatch.setenv("GW_TEST_EMPTY", "")
    monkeypatch.delenv("GW_TEST_UNSET", raising=False)
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  port: ${GW_TEST_PORT}\n  host: ${GW_TEST_UNSET:-0.0.0.0}\n"
                 "store:\n  url: ${GW_TEST_EMPTY:-redis://r:6379/1}\n")
    s = load_settings(p)
    assert (s.server.port, s.server.host, s.store.url) == (9191, "0.0.0.0", "redis://r:6379/1")


def test_unset_variable_without_default_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """${VAR} with VAR unset and no default is a configuration error naming the variable."""
    monkeypatch.delenv("GW_TEST_MISSING", raising=False)
    p = tmp_path / "c.yaml"
    p.write_text("upstreams:\n  openai:\n    api_key: ${GW_TEST_MISSING}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    assert any("GW_TEST_MISSING" in problem for problem in info.value.problems)


def test_wrong_keys_are_named(tmp_path: Path) -> None:
    """Each unknown or invalid key is reported with its dotted path and why."""
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  prot: 1\nstore:\n  url: mysql://x\nupstreams:\n  openai:\n    base_url: ftp://x\n")
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    problems = "\n".join(info.value.problems)
    assert "server.prot: unknown key" in problems
    assert "store.url" in problems and "upstreams.openai.base_url" in problems


def test_gateway_config_env_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no path given, GATEWAY_CONFIG names the file."""
    p = tmp_path / "c.yaml"
    p.write_text("server:\n  port: 7001\n")
    monkeypatch.setenv("GATEWAY_CONFIG", str(p))
    assert load_settings(None).server.port == 7001


def test_an_empty_upstream_key_forwards_the_clients_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/gateway.yaml with the provider keys left unset holds no key of its own: clients' keys are forwarded."""
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GATEWAY_STORE_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("GATEWAY_CLIENT_KEY", "gw-key-1")
    settings = load_settings(str(Path(__file__).parent.parent / "deploy" / "gateway.yaml"))
    assert settings.upstreams["openai"].api_key is None
    assert settings.upstreams["anthropic"].api_key is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-own")
    own = load_settings(str(Path(__file__).parent.parent / "deploy" / "gateway.yaml"))
    assert own.upstreams["openai"].api_key == "sk-own"


def test_a_key_given_to_two_tenants_is_refused() -> None:
    """Which tenant a request is would depend on the order of the list: refused at start-up."""
    with pytest.raises(ValidationError, match="two tenants"):
        Settings.model_validate({"auth": {"keys": [{"key": "sk-gw-shared-1", "tenant": "a"},
                                                   {"key": "sk-gw-shared-1", "tenant": "b"}]}})


def test_without_a_config_file_the_shipped_yamls_variables_still_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no config file, the GATEWAY_* variables the shipped config/gateway.yaml reads are read the same
    way (a user who set GATEWAY_OPENAI_BASE_URL to a local server must not reach the real provider); a
    bad value names its variable. The table and the YAML name the same variables for the same keys."""
    shipped = yaml.safe_load((Path(__file__).parent.parent / "config" / "gateway.yaml").read_text())

    def reads(node: Any, path: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
        if isinstance(node, dict):
            return {k: v for key, sub in node.items() for k, v in reads(sub, (*path, key)).items()}
        found = re.findall(r"\$\{(GATEWAY_[A-Z_]+)", node) if isinstance(node, str) else []
        return {name: path for name in found}

    assert reads(shipped) == DEFAULT_ENV
    assert load_settings(None, environ=True) == Settings()
    monkeypatch.setenv("GATEWAY_STORE_URL", "redis://127.0.0.1:6390/0")
    monkeypatch.setenv("GATEWAY_OPENAI_BASE_URL", "http://127.0.0.1:11434/v1")
    monkeypatch.setenv("GATEWAY_PORT", "9099")
    monkeypatch.setenv("GATEWAY_IN_PROCESS_WORKERS", "0")
    monkeypatch.setenv("GATEWAY_HOST", "")  # empty: unset, as ${GATEWAY_HOST:-127.0.0.1} reads it
    got = load_settings(None, environ=True)
    assert got.store.url == "redis://127.0.0.1:6390/0" and got.server.port == 9099
    assert got.upstreams["openai"].base_url == "http://127.0.0.1:11434/v1"
    assert got.upstreams["anthropic"].base_url == Settings().upstreams["anthropic"].base_url
    assert got.memory.worker.in_process == 0 and got.server.host == "127.0.0.1"
    # `gateway eval` loads without them: a replay never writes to a deployment's store.
    assert load_settings(None) == Settings()
    # Kubernetes' service link for a Service named "gateway" is an address, not a port: not read.
    monkeypatch.setenv("GATEWAY_PORT", "tcp://10.0.0.7:80")
    assert load_settings(None, environ=True).server.port == Settings().server.port
    monkeypatch.setenv("GATEWAY_PORT", "eighty")
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ=True)
    first = info.value.problems[0]
    assert first.startswith("server.port: ") and first.endswith("(from $GATEWAY_PORT)")
