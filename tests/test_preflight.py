"""Config mistakes that only show together, refused by `gateway check-config` and `gateway serve` with
one clear line each; and a request that loops back through the gateway, stopped at once."""

from __future__ import annotations

import socket
from pathlib import Path

import anthropic
import openai
import pytest
from aiohttp import web

from gateway import cli, preflight
from gateway.app import METRICS, create_app
from gateway.config import parse_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("yaml_text", "line"), [
    ("upstreams:\n  antropic:\n    base_url: https://api.anthropic.com\n",
     "upstreams.antropic: unknown upstream (known: openai, anthropic)"),
    ("upstreams:\n  anthropic:\n    base_url: https://api.anthropic.com/v1\n",
     "upstreams.anthropic.base_url: https://api.anthropic.com/v1 ends in /v1"),
    ("upstreams:\n  openai:\n    base_url: http://localhost:11434\n",
     "upstreams.openai.base_url: http://localhost:11434 does not end in /v1"),
    ("memory:\n  summarizer:\n    mode: llm\n",
     "memory.summarizer.mode: llm needs upstreams.openai.api_key"),
])
def test_check_config_refuses_each_mistake_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       yaml_text: str, line: str) -> None:
    """check-config exits 1 and names the key and the fix in one line; serve refuses the same file."""
    p = tmp_path / "g.yaml"
    p.write_text(yaml_text)
    assert cli.main(["check-config", "--config", str(p)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "configuration is invalid:" and len(err) == 2 and line in err[1]
    assert cli.main(["serve", "--config", str(p), "--port", str(free_port())]) == 1
    assert line in capsys.readouterr().err


def test_serve_refuses_an_upstream_that_is_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An upstream base_url that resolves to the address serve would listen on is refused before start-up."""
    port = free_port()
    p = tmp_path / "g.yaml"
    p.write_text(f"upstreams:\n  openai:\n    base_url: http://localhost:{port}/v1\n")
    assert cli.main(["serve", "--config", str(p), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"upstreams.openai.base_url: http://localhost:{port}/v1 is the gateway's own address" in err
    assert cli.main(["check-config", "--config", str(p)]) == 0  # listens on 8080: no loop there


def test_yaml_errors_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A YAML syntax error, and a wrong key, are reported as file:line."""
    p = tmp_path / "broken.yaml"
    p.write_text("server:\n  port: 8080\nmemory:\n  keep_recent: [1, 2\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    assert f"{p}:5:1: not valid YAML" in capsys.readouterr().err
    p.write_text("server:\n  port: 8080\nmemory:\n  keep_recnt: 5\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    assert f"{p}:4: memory.keep_recnt: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_a_request_that_loops_back_gets_a_508_at_once(sdk: str) -> None:
    """With an upstream pointing at the gateway itself, a call fails at its first return, in the caller's
    dialect, and the SDK does not retry it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    settings = parse_settings({"upstreams": {"openai": {"base_url": base + "/v1"}, "anthropic": {"base_url": base}},
                               "memory": {"enabled": False}})
    app = create_app(settings, memory=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        if sdk == "openai":
            oc = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-loop", max_retries=2)
            with pytest.raises(openai.APIStatusError) as oe:
                await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await oc.close()
            status, body = oe.value.status_code, oe.value.body
            assert isinstance(body, dict) and "loop detected" in body["message"]
        else:
            ac = anthropic.AsyncAnthropic(base_url=base, api_key="sk-loop", max_retries=2)
            with pytest.raises(anthropic.APIStatusError) as ae:
                await ac.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            await ac.close()
            status, body = ae.value.status_code, ae.value.body
            assert isinstance(body, dict) and body["type"] == "error" and "loop detected" in body["error"]["message"]
        assert status == 508
        text = app[METRICS].render()[0].decode()
        looped = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("gateway_requests_total{") and 'status="508"' in line)
        assert looped == 2  # the client's request and its one return; no retries, no 100 hops
    finally:
        await runner.cleanup()


def test_check_config_names_every_mistake_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo and the mistakes seen only with keys read together come out in one run, each as file:line,
    a near miss with the key it likely meant; not one more per fix."""
    p = tmp_path / "g.yaml"
    p.write_text("memory:\n  keep_recnet: 5\nupstreams:\n  openai:\n    base_url: http://127.0.0.1:9911\n"
                 "  azure:\n    base_url: http://x/v1\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    err = capsys.readouterr().err.splitlines()[1:]
    assert err[0].strip() == f"{p}:2: memory.keep_recnet: unknown key (did you mean keep_recent?)"
    assert err[1].strip().startswith(f"{p}:5: upstreams.openai.base_url: http://127.0.0.1:9911 does not end in /v1")
    assert err[2].strip().startswith(f"{p}:6: upstreams.azure: unknown upstream")
    assert len(err) == 3


def test_check_config_warns_of_an_upstream_gateway_keys_leave_keyless(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Gateway keys and OpenAI's key only: the config is valid, but check-config says that Anthropic
    requests need the client's own key beside its gateway key."""
    p = tmp_path / "g.yaml"
    p.write_text("upstreams:\n  openai:\n    api_key: sk-upstream-1\nauth:\n  keys: [gw-client-1]\n")
    assert cli.main(["check-config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "warning:    upstreams.anthropic.api_key is unset while clients use gateway keys" in out
    assert "refused (401)" in out and "upstreams.openai.api_key is unset" not in out


def test_every_unknown_key_is_named_and_a_wrong_value_is_not_taken_for_another_mistake(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nine unknown keys (one in a list entry) and an unknown upstream: all ten named in one run. A wrong
    value is not replaced by its default for the checks of keys read together: keys that are there but
    too short do not also read as "auth.keys: required"."""
    typos = "".join(f"  typo_{i}: 1\n" for i in range(8))
    p = tmp_path / "g.yaml"
    p.write_text(f"memory:\n{typos}auth:\n  keys:\n    - {{key: gw-client-key-0001, tenant: a, tenants: b}}\n"
                 "upstreams:\n  azure:\n    base_url: http://x/v1\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    err = capsys.readouterr().err
    assert all(f"memory.typo_{i}: unknown key" in err for i in range(8))
    assert "auth.keys.0.tenants: unknown key (did you mean tenant?)" in err
    assert "upstreams.azure: unknown upstream" in err
    p.write_text("upstreams:\n  openai:\n    api_key: sk-upstream-1\nauth:\n  keys: [short]\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    err = capsys.readouterr().err
    assert "auth.keys" in err and "required when" not in err


def test_provider_hosts_need_a_key() -> None:
    """The providers' own hosts, however spelled, refuse a keyless request; other hosts may not."""
    for url in ("https://api.openai.com/v1", "https://API.OpenAI.com./v1", "https://eu.api.openai.com/v1",
                "https://api.anthropic.com"):
        assert preflight.needs_key(url), url
    for url in ("http://localhost:11434/v1", "https://api.openai.com.example.org/v1", "https://notapi.openai.com/v1"):
        assert not preflight.needs_key(url), url
