"""Faults with real processes: `gateway serve` (and `gateway worker`) as subprocesses, a real
redis-server this module starts (with an append-only file, so it can be killed and restarted), a
fake upstream on port 0 in the test process.

Each scenario asserts no 5xx made by the gateway (an upstream failure relayed, or reported as the
upstream's 502/504, is the provider's) and nothing lost: the stored history, read back through
the conversation API, holds every user turn that was answered 2xx, once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from redis import asyncio as aioredis

from gateway.keys import Keys
from gateway.testing import FakeUpstream
from tests.conftest import RedisProcess, free_port

KEY = "sk-fault-client-0001"
GATEWAY_KEY = "gw-fault-key-0001"
UPSTREAM_ERRORS = {502, 504}  # the gateway naming an upstream failure, in the caller's dialect


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own, persistent, so kill -9 loses nothing acknowledged."""
    r = RedisProcess(tmp_path, persistent=True)
    r.start()
    try:
        yield r
    finally:
        r.kill()


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)


@contextlib.asynccontextmanager
async def gateway(config: dict[str, Any], command: str = "serve") -> AsyncIterator[tuple[str, Path]]:
    """`gateway serve` on a free port with `config`; yields its URL and its log file."""
    tmp = Path(tempfile.mkdtemp(prefix="gw-fault-"))
    (tmp / "gw.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = spawn([sys.executable, "-m", "gateway", command, "--config", str(tmp / "gw.yaml"), "--port", str(port)],
                 tmp / "gw.log")
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                assert proc.poll() is None, (tmp / "gw.log").read_text()[-3000:]
                await asyncio.sleep(0.05)
        yield url, tmp / "gw.log"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def config(redis: RedisProcess, fake: FakeUpstream, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "store": {"url": redis.url},
        "upstreams": {"openai": {"base_url": fake.openai_base_url, "read_timeout": 2.0, "total_timeout": 5.0},
                      "anthropic": {"base_url": fake.anthropic_base_url}},
        "memory": {"message_threshold": 6, "keep_recent": 4, "fold_batch": 4, "cost_model": False,
                   "worker": {"retry_base_seconds": 0, "claim_idle_ms": 1000}},
        "server": {"log_level": "warning"},
    }
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


class Client:
    """One conversation's client: resends the history it was answered, records what was answered."""

    def __init__(self, http: aiohttp.ClientSession, url: str, conv: str, key: str = KEY) -> None:
        self.http, self.url, self.conv, self.key = http, url, conv, key
        self.history: list[dict[str, Any]] = []
        self.answered: list[str] = []
        self.statuses: list[int] = []

    async def turn(self, text: str, *, stream: bool = False) -> int:
        body: dict[str, Any] = {"model": "gpt-test", "messages": [*self.history, {"role": "user", "content": text}]}
        if stream:
            body["stream"] = True
        headers = {"Authorization": f"Bearer {self.key}", "X-Conversation-Id": self.conv}
        try:
            async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
                raw = await r.read()
                status = r.status
        except aiohttp.ClientError:
            self.statuses.append(-1)
            return -1
        self.statuses.append(status)
        if status == 200:
            if stream:
                if b"[DONE]" not in raw:
                    return -2  # the stream was cut: not an answer
                reply = "".join(_stream_text(raw))
            else:
                reply = orjson.loads(raw)["choices"][0]["message"]["content"]
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            self.answered.append(text)
        return status

    async def stored(self) -> list[str]:
        async with self.http.get(f"{self.url}/gateway/conversations/{self.conv}/messages?limit=1000",
                                 headers={"Authorization": f"Bearer {self.key}"}) as r:
            assert r.status == 200, await r.text()
            page = await r.json()
        return [d["message"]["content"] for d in page["data"] if d["role"] == "user"]

    def no_gateway_5xx(self, relayed: frozenset[int] = frozenset()) -> None:
        """No 5xx but the upstream's own (`relayed`) or the gateway naming an upstream failure."""
        assert not [s for s in self.statuses if s >= 500 and s not in UPSTREAM_ERRORS | relayed], self.statuses


def _stream_text(raw: bytes) -> list[str]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or ():
                out.append((choice.get("delta") or {}).get("content") or "")
    return out


async def settled(client: Client, *, seconds: float = 20.0) -> list[str]:
    """The stored user turns once they equal what was answered (recording runs after the answer)."""
    deadline = time.monotonic() + seconds
    while True:
        stored = await client.stored()
        if stored == client.answered or time.monotonic() > deadline:
            return stored
        await asyncio.sleep(0.1)


async def test_redis_killed_and_restarted_under_traffic(redis: RedisProcess) -> None:
    """Redis kill -9 and restart mid-conversation: every answer 200, and the history is whole afterwards."""
    async with FakeUpstream(reply="Noted.") as fake, gateway(config(redis, fake)) as (url, _), \
            aiohttp.ClientSession() as http:
        clients = [Client(http, url, f"redis-kill-{i}") for i in range(3)]
        for i in range(20):
            if i == 8:
                redis.kill()
            if i == 12:
                redis.start()
                await asyncio.sleep(0.5)
            await asyncio.gather(*(c.turn(f"{c.conv} turn {i}") for c in clients))
        for c in clients:
            c.no_gateway_5xx()
            assert set(c.statuses) == {200}
            # The outage's turns come back with the next resent history.
            assert await settled(c) == c.answered


async def test_upstream_errors_timeouts_and_drops(redis: RedisProcess) -> None:
    """Upstream 5xx, a timeout and a stream cut mid-way are relayed as the upstream's; retries store each turn once."""
    async with FakeUpstream(reply="Noted. All clear.") as fake, gateway(config(redis, fake)) as (url, _), \
            aiohttp.ClientSession() as http:
        c = Client(http, url, "upstream-faults")
        await c.turn("first")
        fake.error_status, fake.error_count = 503, 1
        assert await c.turn("second") == 503  # relayed
        assert await c.turn("second") == 200  # the client's retry
        fake.latency = 3.0  # past the gateway's 2 s read timeout
        assert await c.turn("third") == 504
        fake.latency = 0.0
        assert await c.turn("third") == 200
        fake.drop_after = 2
        assert await c.turn("fourth", stream=True) == -2  # cut mid-stream: an error frame, no [DONE]
        fake.drop_after = None
        assert await c.turn("fourth", stream=True) == 200
        for i in range(4):
            assert await c.turn(f"more {i}") == 200
        c.no_gateway_5xx(relayed=frozenset({503}))
        assert await settled(c) == c.answered


async def test_client_disconnects_leave_the_history_whole(redis: RedisProcess) -> None:
    """Clients that hang up mid-answer (plain and streamed) store nothing half-done; the rest is kept once."""
    async with FakeUpstream(reply="Noted.") as fake, gateway(config(redis, fake)) as (url, _), \
            aiohttp.ClientSession() as http:
        c = Client(http, url, "hang-ups")
        await c.turn("one")
        fake.latency = 1.0
        for stream in (False, True):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3):
                    await c.turn("abandoned", stream=stream)
        fake.latency = 0.0
        for i in range(6):
            assert await c.turn(f"after {i}") == 200
        c.no_gateway_5xx()
        assert await settled(c) == c.answered


async def test_summarizer_failing_never_fails_a_request(redis: RedisProcess) -> None:
    """An llm summarizer whose upstream answers 500: folds fail and retry, requests are answered, history kept."""
    async with FakeUpstream(reply="Noted.") as fake:
        cfg = config(redis, fake, auth={"keys": [{"key": GATEWAY_KEY, "tenant": "t"}]})
        cfg["upstreams"]["openai"]["api_key"] = "sk-gateway-own"
        cfg["memory"]["summarizer"] = {"mode": "llm", "upstream": "openai", "model": "gpt-test"}
        async with gateway(cfg) as (url, _), aiohttp.ClientSession() as http:
            c = Client(http, url, "summarizer-down", key=GATEWAY_KEY)
            for i in range(12):
                fake.error_status = None
                assert await c.turn(f"turn {i} with the value {i * 3}") == 200
                fake.error_status, fake.error_count = 500, 1_000  # the next summarizer calls fail
            fake.error_status = None
            c.no_gateway_5xx()
            assert await settled(c) == c.answered


async def _held_fold_jobs(r: Any) -> int:
    """Fold jobs delivered to a worker and not yet acknowledged (a fold under way)."""
    try:
        return int((await r.xpending(Keys().fold_stream(), Keys.FOLD_GROUP))["pending"])
    except aioredis.ResponseError:  # no job queued yet: no group
        return 0


async def test_worker_killed_mid_fold(redis: RedisProcess) -> None:
    """A `gateway worker` killed -9 while it holds a fold job (delivered, not acknowledged): the next
    worker claims it once it has been idle for claim_idle_ms and finishes it; nothing stored is lost."""
    # Long turns: folds of them take long enough that one is usually caught under way.
    filler = " ".join(f"Detail {k}: the billing service on port {9000 + k} keeps tier {k % 7}." for k in range(150))
    async with FakeUpstream(reply="Noted.") as fake:
        cfg = config(redis, fake)
        cfg["memory"]["worker"]["in_process"] = 0
        async with gateway(cfg) as (url, log), aiohttp.ClientSession() as http, \
                aioredis.from_url(redis.url) as r:
            tmp = log.parent
            worker = spawn([sys.executable, "-m", "gateway", "worker", "--config", str(tmp / "gw.yaml")],
                           tmp / "worker.log")
            clients = [Client(http, url, f"fold-kill-{i}") for i in range(4)]

            killed = asyncio.Event()
            turns = [0]

            async def traffic(until: asyncio.Event | None = None, count: int = 4) -> None:
                """`count` turns per client, or (with `until`) turns until it is set."""
                while until is not None or turns[0] < count:
                    if until is not None and until.is_set():
                        return
                    i = turns[0]
                    turns[0] += 1
                    await asyncio.gather(*(c.turn(f"{c.conv} turn {i}: the port is {8000 + i}. {filler}")
                                           for c in clients))

            load = asyncio.create_task(traffic(until=killed))
            try:
                held, deadline = 0, time.monotonic() + 120
                while not held:  # stop the worker while it holds a job, check it still does, kill it
                    while not await _held_fold_jobs(r):
                        if load.done():
                            load.result()
                        assert time.monotonic() < deadline, "no fold was ever caught under way"
                        await asyncio.sleep(0.001)
                    os.kill(worker.pid, signal.SIGSTOP)
                    held = await _held_fold_jobs(r)
                    if not held:
                        os.kill(worker.pid, signal.SIGCONT)
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
                killed.set()
                await load
                count = turns[0] + 4
                worker = spawn([sys.executable, "-m", "gateway", "worker", "--config", str(tmp / "gw.yaml")],
                               tmp / "worker.log")
                await traffic(count=count)
                for c in clients:
                    c.no_gateway_5xx()
                    assert await settled(c) == c.answered
                    deadline = time.monotonic() + 20
                    while True:  # the folds the killed worker held are claimed and finished
                        async with http.get(f"{url}/gateway/conversations/{c.conv}",
                                            headers={"Authorization": f"Bearer {KEY}"}) as resp:
                            info = await resp.json()
                        if info["summary"] is not None and not info["fold_pending"]:
                            break
                        assert time.monotonic() < deadline, info
                        await asyncio.sleep(0.2)
                deadline = time.monotonic() + 20
                while await _held_fold_jobs(r):  # and acknowledged: none is left held by the dead one
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
            finally:
                load.cancel()
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    raise
