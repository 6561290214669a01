"""The `gateway` command: check-config, serve, and lazy dispatch to worker / eval / demo."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from gateway import cli
from gateway.testing import FakeUpstream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_check_config_names_wrong_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """check-config prints each wrong key with why and exits 1."""
    p = tmp_path / "bad.yaml"
    p.write_text("memory:\n  keep_recnt: 5\n  message_threshold: -1\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    err = capsys.readouterr().err
    assert "memory.keep_recnt: unknown key" in err
    assert "memory.message_threshold" in err


@pytest.mark.parametrize(("base_url", "why"), [
    ("https://u:S3cretPw@host:99999/v1", "Port out of range"), ("http://[::1/v1", "Invalid IPv6 URL"),
    ("http:///v1", "names no host")])
def test_check_config_names_a_base_url_that_is_no_url(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      base_url: str, why: str) -> None:
    """A base_url with a port past 65535 or a broken host was a traceback from the config checks (and
    would have failed every request); it is a line naming the key, without the URL's password."""
    p = tmp_path / "bad.yaml"
    p.write_text(f'upstreams:\n  openai:\n    base_url: "{base_url}"\n')
    assert cli.main(["check-config", str(p)]) == 1
    err = capsys.readouterr().err
    assert "upstreams.openai.base_url" in err and why in err
    assert "Traceback" not in err and "S3cretPw" not in err


def test_check_config_ok_prints_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A valid config exits 0 with a short summary that shows no secret."""
    p = tmp_path / "ok.yaml"
    p.write_text("upstreams:\n  openai:\n    api_key: sk-secret-upstream\nauth:\n  keys: [sk-gw-0123456789]\n"
                 "store:\n  url: redis://:hunter2@localhost:6379/0\n")
    assert cli.main(["check-config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "configuration OK" in out and "own api_key" in out
    assert "sk-secret-upstream" not in out and "hunter2" not in out
    # That key turned the llm summarizer on (its default): the summary says folds now make paid calls.
    assert "note:       folds call gpt-4o-mini with upstreams.openai.api_key (billed to that key)" in out


def test_check_config_takes_the_file_as_its_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway check-config FILE` checks FILE, as --config FILE does; two different files are refused."""
    p = tmp_path / "bad.yaml"
    p.write_text("memory:\n  keep_recnt: 5\n")
    assert cli.main(["check-config", str(p)]) == 1
    assert "memory.keep_recnt: unknown key" in capsys.readouterr().err
    ok = tmp_path / "ok.yaml"
    ok.write_text("memory:\n  keep_recent: 5\n")
    assert cli.main(["check-config", str(ok)]) == 0
    assert str(ok) in capsys.readouterr().out
    assert cli.main(["check-config", str(ok), "--config", str(p)]) == 2
    assert "name one" in capsys.readouterr().err


def test_check_config_upstream_key_requires_client_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An upstream api_key without auth.keys is rejected: nobody could use the gateway, or everybody could."""
    p = tmp_path / "c.yaml"
    p.write_text("upstreams:\n  anthropic:\n    api_key: sk-ant-x\n")
    assert cli.main(["check-config", "--config", str(p)]) == 1
    assert "auth.keys" in capsys.readouterr().err


def test_check_config_reads_gateway_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Without --config, check-config validates the file named by GATEWAY_CONFIG."""
    p = tmp_path / "bad.yaml"
    p.write_text("servr: {}\n")
    monkeypatch.setenv("GATEWAY_CONFIG", str(p))
    assert cli.main(["check-config"]) == 1
    assert "servr: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "module", "attrs"), [
    (["worker", "--config", "w.yaml"], "gateway.worker", {"config": "w.yaml"}),
    (["eval", "data.jsonl", "--summarizer", "llm", "--settle", "--json", "o.json", "--limit", "3", "--data-clock",
      "--one-replay"],
     "gateway.eval", {"dataset": "data.jsonl", "summarizer": "llm", "settle": True, "json": "o.json", "limit": 3,
                      "data_clock": True, "one_replay": True, "ttl": None}),
    (["demo", "--turns", "12", "--serve", "--port", "9000"], "gateway.demo",
     {"turns": 12, "serve": True, "port": 9000}),
    (["stats", "--url", "http://h:1", "--key", "k"], "gateway.savings", {"url": "http://h:1", "key": "k"}),
])
def test_subcommands_dispatch(monkeypatch: pytest.MonkeyPatch, argv: list[str], module: str,
                                     attrs: dict[str, object]) -> None:
    """worker / eval / demo / stats call `<module>.main(args)` with their parsed options and return its exit code."""
    seen = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda args: seen.append(args) or 7)
    assert cli.main(argv) == 7
    for key, value in attrs.items():
        assert getattr(seen[0], key) == value


def test_redact_url() -> None:
    """Store URLs are logged without their password."""
    assert cli.redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert cli.redact_url("memory://") == "memory://"
    assert cli.redact_url("https://u:pw@host/v1") == "https://u:***@host/v1"
    assert cli.redact_url("socks5h://tok3n@p:1080") == "socks5h://***@p:1080"  # a token given as the user


def test_check_config_never_prints_an_upstream_password(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An upstream base_url with credentials (a proxy-style URL some providers' gateways take) is shown
    masked by check-config's summary and problem lines (serve prints the same lines)."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text("upstreams:\n  openai:\n    base_url: https://u:S3cretPw@llm.example/v1\n"
                   "  anthropic:\n    base_url: https://u:S3cretPw@llm.example/v1\n")
    assert cli.main(["check-config", str(cfg)]) == 1  # anthropic's base_url takes no /v1
    out = capsys.readouterr()
    assert "S3cretPw" not in out.out + out.err and "https://u:***@llm.example/v1" in out.err


async def start_gateway(*args: str, cwd: Path | None = None) -> tuple[int, asyncio.subprocess.Process]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CONFIG"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "serve", "--port", str(port), *args,
                                                cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            assert proc.returncode is None, "gateway exited at start-up"
            try:
                async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                    if r.status == 200:
                        return port, proc
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    proc.kill()
    raise AssertionError("gateway did not start")


async def stop(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=15)
    return out.decode()


async def test_serve_without_config_says_store_is_not_persistent(tmp_path: Path) -> None:
    """`gateway serve` with no config runs on built-in defaults and logs that its store is in-process only."""
    port, proc = await start_gateway(cwd=tmp_path)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/readyz") as r:
            assert r.status == 200
    finally:
        out = await stop(proc)
    assert "NOT persistent" in out and "memory://" in out


async def test_serve_proxies_to_configured_upstream(tmp_path: Path) -> None:
    """`gateway serve --config` forwards an SDK call to the configured upstream and logs one JSON line for it."""
    async with FakeUpstream(reply="served") as fake:
        cfg = tmp_path / "g.yaml"
        cfg.write_text(f"upstreams:\n  openai:\n    base_url: {fake.openai_base_url}\n")
        port, proc = await start_gateway("--config", str(cfg))
        try:
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli-SECRET", max_retries=0)
            r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "served"
        finally:
            out = await stop(proc)
    assert '"route":"/v1/chat/completions"' in out and '"status":200' in out
    assert "sk-cli-SECRET" not in out


async def _folded(port: int, conv: str) -> None:
    """Wait (up to 20 s) until no fold of `conv` is queued or running, as the conversation API says."""
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-try"}) as s:
        for _ in range(400):
            async with s.get(f"http://127.0.0.1:{port}/gateway/conversations/{conv}") as r:
                if r.status == 200 and not (await r.json())["fold_pending"]:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("the fold did not finish")


async def test_the_fake_upstream_logs_what_the_gateway_forwarded(tmp_path: Path) -> None:
    """`python -m gateway.testing --log FILE`, as the README runs it: a user trying the gateway without a
    provider reads there what it forwarded (here a rewritten request: its summary as a system message)."""
    fake_port, log = free_port(), tmp_path / "forwarded.jsonl"
    fake = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.testing", "--port", str(fake_port),
                                                "--log", str(log), stdout=asyncio.subprocess.PIPE)
    try:
        assert fake.stdout is not None
        await asyncio.wait_for(fake.stdout.readline(), timeout=30)  # "fake upstream on ..."
        cfg = tmp_path / "g.yaml"
        cfg.write_text(f"upstreams:\n  openai:\n    base_url: http://127.0.0.1:{fake_port}/v1\n"
                       "memory:\n  message_threshold: 4\n  keep_recent: 2\n  fold_batch: 2\n")
        port, proc = await start_gateway("--config", str(cfg))
        try:
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-try", max_retries=0)
            history: list[dict[str, str]] = []
            for i in range(9):
                history.append({"role": "user", "content": f"We decided to use PostgreSQL {i + 10} for table {i}. "
                                f"{'It holds the bookings of every climbing gym in the region. ' * 8}"})
                r = await c.chat.completions.create(model="m", messages=history,  # type: ignore[arg-type]
                                                    extra_headers={"X-Conversation-Id": "tried"})
                history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
                await asyncio.sleep(0.2)  # its recording, which queues the fold
                await _folded(port, "tried")
        finally:
            await stop(proc)
    finally:
        fake.terminate()
        await fake.wait()
    lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    assert len(lines) == 9 and all(x["method"] == "POST" and x["path"] == "/v1/chat/completions" for x in lines)
    last = lines[-1]["body"]["messages"]
    assert last[-1] == history[-2]  # the newest turn, as sent
    assert any(m["role"] == "system" and "## Summary of the earlier conversation" in m["content"] for m in last)


def test_demo_port_without_serve_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway demo --port N` alone would tour on a port of its own and ignore N: it says so instead."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--port", "8087"])
    assert exit_.value.code == 2 and "--port goes with --serve" in capsys.readouterr().err
