"""Redis bytes per conversation, measured on a real redis-server.

    python scripts/measure_redis_bytes.py [--sizes 100,1000,5000] [--data FILE ...]

For each data set and size, one conversation of that many messages is written the way users write
it: through the gateway app (memory on, default thresholds, in-process extractive folds) by the
OpenAI wire format, one user message per request (`conversation.history: delta`; the stored
records are the same when clients resend the whole history, which costs the client, not Redis),
each answered by the data set's next assistant message. Once every fold has settled, it prints
`MEMORY USAGE <key> SAMPLES 0` (exact: every element counted) of each of the conversation's keys,
their sum, the bytes of message text, and the ratio. The redis-server is this script's own (a free
port, no persistence); its version is printed.

Data: the replay files in ../shared/data/ (LongMemEval: chat, ~1 KB a message; BEAM: coding
assistant with code, ~2 KB a message); a size beyond one conversation continues with the next.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

from gateway import logs, worker
from gateway.app import create_app, drain_background
from gateway.keys import ConvRef, Keys
from gateway.testing import FakeUpstream, serve_app

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
DEFAULT_DATA = [DATA / "longmemeval_s_dev.jsonl", DATA / "beam500k_dev.jsonl"]
KEY = "sk-gw-measure-0001"
TENANT = "measure"


def pairs(path: Path) -> Iterator[tuple[str, str]]:
    """(user, assistant) message pairs in file order, across conversations."""
    with path.open() as f:
        for line in f:
            msgs = orjson.loads(line)["messages"]
            for a, b in itertools.pairwise(msgs):
                if a["role"] == "user" and b["role"] == "assistant":
                    yield str(a["content"]), str(b["content"])


def start_redis(workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (apt-get install -y redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("redis-server did not start")
            time.sleep(0.05)


async def fill(url: str, conversation: str, turns: list[tuple[str, str]]) -> int:
    """Write `turns` through the gateway; the text bytes (UTF-8) of the messages sent and answered."""
    replies = iter([a for _, a in turns])
    async with FakeUpstream(responder=lambda body: next(replies)) as fake:
        settings = fake.settings(store={"url": url}, auth={"keys": [{"key": KEY, "tenant": TENANT}]},
                                 conversation={"history": "delta"},
                                 memory={"summarizer": {"mode": "extractive"}, "worker": {"in_process": 1}})
        app = create_app(settings)
        text_bytes = 0
        async with serve_app(app) as base, aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": conversation}
            for user, assistant in turns:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": user}]}
                async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        raise SystemExit(f"gateway answered {r.status}: {await r.text()}")
                text_bytes += len(user.encode()) + len(assistant.encode())
            await drain_background(app)
            await worker.settle(app, timeout=600)
    return text_bytes


async def usage(client: aioredis.Redis, keys: list[str]) -> dict[str, int]:
    out = {}
    for key in keys:
        n: Any = await client.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
        if n is not None:
            out[key.rsplit(":", 1)[1]] = int(n)
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,5000", help="messages per conversation, comma-separated")
    p.add_argument("--data", nargs="+", type=Path, default=DEFAULT_DATA)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    logs.configure("console", "warning")  # one line per request would bury the table
    workdir = tempfile.mkdtemp(prefix="gw-measure-")
    proc, port = start_redis(workdir)
    url = f"redis://127.0.0.1:{port}/0"
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("server")
        print(f"redis-server {info['redis_version']} (allocator {(await client.info('memory'))['mem_allocator']})")
        keys = Keys()
        for path in args.data:
            all_pairs = list(pairs(path))
            print(f"\n{path.name}: {2 * len(all_pairs)} messages available")
            print(f"{'messages':>8} {'total B':>11} {'B/message':>10} {'text B':>11} {'x text':>7}  per key (bytes)")
            for size in sizes:
                if size > 2 * len(all_pairs):
                    print(f"{size:>8}  (not enough messages)")
                    continue
                ref = ConvRef(TENANT, f"{path.stem}-{size}")
                started = time.monotonic()
                text = await fill(url, ref.conversation, all_pairs[: size // 2])
                parts = await usage(client, [*keys.conversation_keys(ref), keys.fold_lock(ref)])
                total = sum(parts.values())
                detail = " ".join(f"{k}={v}" for k, v in parts.items())
                print(f"{size:>8} {total:>11,} {total / size:>10,.0f} {text:>11,} {total / text:>7.2f}  {detail}"
                      f"  ({time.monotonic() - started:.0f} s)")
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
