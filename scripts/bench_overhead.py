"""Latency the gateway adds, and its throughput, against a fake upstream with fixed latency.

Starts the fake upstream (`python -m gateway.testing --latency-ms 20`) and `gateway serve` each in
its own process, then sends N chat completions at fixed concurrency, straight to the fake and
through the gateway, streamed and not, and prints per-percentile added latency (gateway minus
direct) and requests/s.

    python scripts/bench_overhead.py                         # 2000 requests, concurrency 1, 10, 50
    python scripts/bench_overhead.py --requests 500 --concurrency 10
    python scripts/bench_overhead.py --conversation-turns 40 --store redis://127.0.0.1:6379/15

`--conversation-turns N` sends an X-Conversation-Id (one conversation per client slot) and a history
of N messages, with the memory layer on; without it the gateway runs as a plain proxy (memory off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    latencies: list[float]
    seconds: float

    def pct(self, p: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds


def _words(rng: random.Random, n: int) -> str:
    # Zipf-like draws from a 5,000-word vocabulary: the shape of real text, so the retrieval
    # index sees realistic posting lists (identical filler in every message would not be).
    return " ".join(f"w{min(int(rng.paretovariate(1.1)), 5000)}" for _ in range(n))


def body_for(turns: int, stream: bool) -> bytes:
    rng = random.Random(turns)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"Message {i}: " + _words(rng, 40 if role == "user" else 120)})
    messages.append({"role": "user", "content": "And now, about " + _words(rng, 8) + "?"})
    return orjson.dumps({"model": "gpt-4o-mini", "messages": messages, "stream": stream,
                         **({"stream_options": {"include_usage": True}} if stream else {})})


async def load(url: str, body: bytes, n: int, concurrency: int, conversation: bool) -> Run:
    latencies: list[float] = []
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(slot: int) -> None:
            nonlocal remaining
            headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
            if conversation:
                headers["X-Conversation-Id"] = f"bench-{slot}"
            while remaining > 0:
                remaining -= 1
                t = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    async for _ in resp.content.iter_any():
                        pass
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return Run(latencies, time.perf_counter() - t0)


async def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if proc.poll() is not None:
                raise SystemExit(f"process exited early: {proc.args}")
            try:
                async with s.get(url) as r:
                    await r.read()
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux), to report CPU per request."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", default="1,10,50", help="comma-separated levels")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--modes", default="json,stream")
    p.add_argument("--conversation-turns", type=int, default=0)
    p.add_argument("--store", default="memory://")
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    fake_port, gw_port = free_port(), free_port()
    memory = args.conversation_turns > 0
    config = workdir / "gateway.yaml"
    config.write_text(
        f"upstreams:\n  openai:\n    base_url: http://127.0.0.1:{fake_port}/v1\n"
        f"store:\n  url: {args.store}\nmemory:\n  enabled: {str(memory).lower()}\n"
        "server:\n  log_level: info\n")
    fake = start([sys.executable, "-m", "gateway.testing", "--port", str(fake_port),
                  "--latency-ms", str(args.latency_ms)], workdir / "fake.log")
    gateway = start([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(gw_port)],
                    workdir / "gateway.log")
    try:
        await wait_up(f"http://127.0.0.1:{fake_port}/v1/models", fake)
        await wait_up(f"http://127.0.0.1:{gw_port}/healthz", gateway)
        direct = f"http://127.0.0.1:{fake_port}/v1/chat/completions"
        proxied = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        print(f"{args.requests} requests per run, upstream latency {args.latency_ms:g} ms, "
              f"{os.cpu_count()} CPUs, memory {'on (' + args.store + ')' if memory else 'off'}, "
              f"history {args.conversation_turns} messages")
        print(f"{'mode':<7}{'conc':>5} | {'direct p50/p90/p99 ms':>24} | {'gateway p50/p90/p99 ms':>24} | "
              f"{'added p50/p90/p99 ms':>22} | {'rps direct':>10} {'rps gw':>8} | gw CPU/req")
        for conc in (int(c) for c in args.concurrency.split(",")):
            for mode in args.modes.split(","):
                body = body_for(args.conversation_turns, mode == "stream")
                await load(direct, body, args.warmup, conc, False)
                await load(proxied, body, args.warmup, conc, memory)
                d = await load(direct, body, args.requests, conc, False)
                cpu0 = cpu_seconds(gateway.pid)
                g = await load(proxied, body, args.requests, conc, memory)
                cpu = (cpu_seconds(gateway.pid) - cpu0) / args.requests * 1000
                ms = [(d.pct(q) * 1000, g.pct(q) * 1000) for q in (50, 90, 99)]
                print(f"{mode:<7}{conc:>5} | {'/'.join(f'{a:.2f}' for a, _ in ms):>24} | "
                      f"{'/'.join(f'{b:.2f}' for _, b in ms):>24} | "
                      f"{'/'.join(f'{b - a:.2f}' for a, b in ms):>22} | {d.rps:>10.0f} {g.rps:>8.0f} | {cpu:.2f} ms",
                      flush=True)
        lines = (workdir / "gateway.log").read_bytes().splitlines()
        overhead = [orjson.loads(x)["gateway_ms"] for x in lines if b'"event":"request"' in x]
        if overhead:
            q = statistics.quantiles(overhead, n=100)
            print(f"gateway's own gateway_ms (from its log, {len(overhead)} requests): "
                  f"p50 {q[49]:.3f} p90 {q[89]:.3f} p99 {q[98]:.3f} ms")
    finally:
        for proc in (gateway, fake):
            proc.send_signal(signal.SIGINT)
        for proc in (gateway, fake):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
