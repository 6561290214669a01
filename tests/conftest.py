"""Shared fixtures: a private `redis-server` on a free port for the whole session, and a private
three-primary Redis Cluster on loopback for the tests that need one.

Tests never share state with the machine's Redis on 6379: each session starts its own server
(no persistence) and every test gets a freshly flushed database.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis


@pytest.fixture(autouse=True)
def _no_deployment_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's shell set up for a deployment (GATEWAY_STORE_URL, GATEWAY_PORT, ...) must not reach
    the gateways the tests start without a config file."""
    from gateway.config import DEFAULT_CONFIG_ENV, DEFAULT_ENV

    for name in (*DEFAULT_ENV, DEFAULT_CONFIG_ENV):
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server of one test's own, on a fixed port, that the test can kill -9 and restart.
    `persistent`: append-only with fsync on every write, so a kill loses nothing; else it restarts empty."""

    def __init__(self, workdir: Path, *, persistent: bool = False) -> None:
        self.port = free_port()
        self.workdir, self.persistent = workdir, persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed (.ci/run installs it)"
        durability = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *durability,
             "--dir", str(self.workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own (not persistent), which the test may kill and restart."""
    server = RedisProcess(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a redis-server started for this test session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: `apt-get install -y redis-server` (.ci/run does this)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="gw-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def redis_url(redis_server: str) -> AsyncIterator[str]:
    """The session's Redis, flushed before the test."""
    client = aioredis.Redis.from_url(redis_server)
    await client.flushall()
    await client.aclose()
    yield redis_server


# ---- Redis Cluster on loopback ----------------------------------------------------------------


def _cluster_port() -> int:
    # The cluster bus listens on port + 10000: both must be free.
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[str]:
    """A three-primary Redis Cluster on loopback, as a `redis+cluster://` URL."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server / redis-cli not installed: `apt-get install -y redis-server` (.ci/run does this)")
    workdir = tempfile.mkdtemp(prefix="gw-cluster-")
    ports = [_cluster_port() for _ in range(3)]
    procs = [
        subprocess.Popen(
            [binary, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"{workdir}/nodes-{p}.conf", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in ports
    ]
    try:
        for p in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", p), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"cluster node on {p} did not start")
                    time.sleep(0.05)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + 20
        while True:
            infos = [subprocess.run([cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True).stdout
                     for p in ports]
            if all("cluster_state:ok" in i for i in infos):
                break
            if time.monotonic() > deadline:
                pytest.fail("cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
