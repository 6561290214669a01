"""Shared fixtures: a private `redis-server` on a free port for the whole session.

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

import pytest
import redis.asyncio as aioredis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
