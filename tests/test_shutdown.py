"""Graceful shutdown of real `gateway serve` and `gateway worker` processes (SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from test_cli import start_gateway
from test_summarizer import FakeUpstream as SummarizerUpstream
from test_worker import add, numbered

from gateway import worker
from gateway.config import parse_settings
from gateway.keys import ConvRef
from gateway.store import open_store
from gateway.summarizer import build_summarizer
from gateway.testing import FakeUpstream
from gateway.tokens import TokenCounter

# 24 words streamed one per 0.25 s: about six seconds in flight.
LONG_REPLY = " ".join(f"word{i}" for i in range(24))


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return str(path)


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        # A SYN that lands in the backlog while the listener closes is answered with a reset, not a refusal.
        return True
    writer.close()
    return False


async def _wait_refused(port: int, within: float = 10.0) -> None:
    for _ in range(int(within / 0.05)):
        if await _refused(port):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} still accepts connections")


async def test_sigterm_finishes_the_inflight_stream_and_refuses_new_connections(tmp_path: Path) -> None:
    """SIGTERM mid-stream: the listener closes at once, the stream still ends whole, and the process exits 0."""
    async with FakeUpstream(reply=LONG_REPLY, chunk_delay=0.25) as fake:
        cfg = _config(tmp_path, f"server:\n  shutdown_grace_seconds: 30\n"
                                f"upstreams:\n  openai:\n    base_url: {fake.openai_base_url}\n")
        port, proc = await start_gateway("--config", cfg)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-client-shutdown",
                                    max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "tell me a long story"}], stream=True,
                extra_headers={"X-Conversation-Id": "shutdown-1"})
            pieces: list[str] = []
            async for chunk in stream:
                pieces.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
                if len("".join(pieces).split()) == 2:
                    proc.send_signal(signal.SIGTERM)
                    await _wait_refused(port)
                    assert len("".join(pieces).split()) < 24, "the stream ended before the listener closed"
            assert "".join(pieces) == LONG_REPLY
            code = await asyncio.wait_for(proc.wait(), timeout=30)
        finally:
            await client.close()
            if proc.returncode is None:
                proc.kill()
            out = (await proc.communicate())[0].decode()
    assert code == 0, out
    assert '"event":"draining"' in out and '"status":200' in out


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, fake: FakeUpstream, grace: float) -> AsyncIterator[tuple[int, Any]]:
    """`gateway serve` with `grace` seconds to drain, in front of `fake`: (port, process), killed if still up."""
    cfg = _config(tmp_path, f"server:\n  shutdown_grace_seconds: {grace}\n"
                            f"upstreams:\n  openai:\n    base_url: {fake.openai_base_url}\n")
    port, proc = await start_gateway("--config", cfg)
    try:
        yield port, proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()


async def test_a_stream_longer_than_the_grace_period_is_cut(tmp_path: Path) -> None:
    """A stream still running when server.shutdown_grace_seconds is over is cut then, not at twice the
    grace (aiohttp's runner waits its timeout twice); the process still exits 0."""
    async with FakeUpstream(reply=LONG_REPLY, chunk_delay=2.0) as fake, _serving(tmp_path, fake, 3) as (port, proc), \
            aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": "Bearer sk-x"},
                json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
        await r.content.readline()
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # 24 chunks at 2 s would take 48 s: cut at the grace period, 3 s (it was 6).
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
        assert time.monotonic() - t0 < 4.5
        code = await asyncio.wait_for(proc.wait(), timeout=20)
    assert code == 0


async def test_an_answer_that_comes_within_the_grace_period_is_delivered(tmp_path: Path) -> None:
    """Grace 3 s: a provider answering 2.2 s after SIGTERM (past half the grace, where aiohttp's runner
    first gives up waiting) still reaches the client."""
    async with FakeUpstream(reply="late but whole", latency=3.2) as fake, _serving(tmp_path, fake, 3) as (port, proc):
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(http.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": "Bearer sk-x"},
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            r = await call
            assert r.status == 200
            assert (await r.json())["choices"][0]["message"]["content"] == "late but whole"
        code = await asyncio.wait_for(proc.wait(), timeout=20)
    assert code == 0


async def test_sigterm_hands_a_workers_unfinished_fold_back(tmp_path: Path, redis_url: str) -> None:
    """`gateway worker` stopped mid-fold exits 0 and hands the job back: another worker takes it at once,
    without waiting memory.worker.claim_idle_ms."""
    summarizer_up = await SummarizerUpstream().start()
    summarizer_up.gate = asyncio.Event()  # the fold's summarizer call never answers while the worker lives
    cfg = _config(tmp_path, f"""
server: {{shutdown_grace_seconds: 0.5}}
store: {{url: "{redis_url}"}}
upstreams: {{openai: {{base_url: "{summarizer_up.url}/v1", api_key: gw-own-key}}}}
auth: {{keys: [sk-gw-shutdown-0001]}}
memory:
  summarizer: {{mode: llm, upstream: openai, model: gpt-4o-mini}}
  worker: {{concurrency: 1, claim_idle_ms: 600000}}
""")
    settings = parse_settings({"store": {"url": redis_url},
                               "upstreams": {"openai": {"base_url": f"{summarizer_up.url}/v1", "api_key": "k"}},
                               "memory": {"summarizer": {"mode": "llm"}, "worker": {"claim_idle_ms": 600000}}})
    store = await open_store(settings.store)
    ref = ConvRef("tenant-a", "conv-shutdown")
    await add(store, ref, numbered(0, 20))
    assert await store.enqueue_fold(ref)
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CONFIG"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "worker", "--config", cfg, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await asyncio.wait_for(summarizer_up.entered.wait(), timeout=30)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), timeout=30)
        out = (await proc.communicate())[0].decode()
        assert code == 0, out
        assert '"event":"fold.handed_back"' in out
        assert (await store.load(ref)).summary is None and await worker.queued(store) == 1
        summarizer_up.gate.set()
        counter = TokenCounter(settings.models)
        summarizer = build_summarizer(settings, lambda text: counter.count(text, "gpt-4o-mini"))
        # claim_idle_ms is ten minutes: only a handed-back job is reclaimed by this one pass.
        await worker.FoldWorker(store, settings, summarizer, name="rescuer").run(burst=True)
        await summarizer.close()
        view = await store.load(ref)
        assert view.summary is not None and view.summary.covers == 10
        assert await worker.queued(store) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        summarizer_up.gate.set()
        await store.close()
        await summarizer_up.close()


async def _gateway_that_folded(tmp_path: Path, redis_url: str,
                               fake: FakeUpstream) -> tuple[asyncio.subprocess.Process, int]:
    """A `gateway serve` (default fold settings) that has folded a conversation, and the pid of the
    process the fold was computed in (from its `fold.ok` line)."""
    cfg = _config(tmp_path, f"""
store: {{url: "{redis_url}"}}
upstreams: {{openai: {{base_url: "{fake.openai_base_url}"}}}}
memory: {{message_threshold: 6, keep_recent: 4, fold_batch: 4}}
""")
    port, proc = await start_gateway("--config", cfg)
    assert proc.stdout is not None
    messages: list[dict[str, str]] = []
    async with aiohttp.ClientSession() as http:
        for i in range(5):
            messages.append({"role": "user", "content": f"Turn {i}: we decided to use port {8000 + i}."})
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 headers={"Authorization": "Bearer sk-client-folds", "X-Conversation-Id": "c"},
                                 json={"model": "gpt-4o-mini", "messages": messages}) as r:
                assert r.status == 200
                reply = (await r.json())["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line, "the gateway exited before folding"
        if b'"event":"fold.ok"' in line:
            return proc, int(json.loads(line)["process"])


async def _exited(pid: int) -> None:
    """Return once process `pid` (not a child of this one) has exited: its pidfd turns readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(fd, gone.set)
    try:
        await gone.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_sigterm_stops_the_fold_processes(tmp_path: Path, redis_url: str) -> None:
    """`gateway serve` folds in a child process (its pid in the `fold.ok` line is not the gateway's);
    SIGTERM stops that child with the gateway, which exits 0."""
    async with FakeUpstream() as fake:
        proc, child = await _gateway_that_folded(tmp_path, redis_url, fake)
        try:
            assert child != proc.pid
            os.kill(child, 0)  # alive while the gateway runs
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), timeout=30)
        finally:
            if proc.returncode is None:
                proc.kill()
            out = (await proc.communicate())[0].decode()
    assert code == 0, out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


async def test_a_killed_gateway_leaves_no_fold_process_behind(tmp_path: Path, redis_url: str) -> None:
    """SIGKILL to `gateway serve`: its fold process exits too (it does not linger holding the gateway's
    output open, nor wait forever for jobs)."""
    async with FakeUpstream() as fake:
        proc, child = await _gateway_that_folded(tmp_path, redis_url, fake)
        proc.kill()
        await asyncio.wait_for(proc.communicate(), timeout=30)  # EOF: no child holds the gateway's stdout
        await asyncio.wait_for(_exited(child), timeout=30)
