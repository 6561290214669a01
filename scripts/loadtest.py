"""Load test on loopback: N conversations x M turns through a real gateway with folds on, then every
stored history compared with what was sent.

    python scripts/loadtest.py --redis redis://127.0.0.1:PORT/0 --conversations 50 --turns 20
    python scripts/loadtest.py --redis ... --conversations 1 --turns 10 --writers 10 --instant
    python scripts/loadtest.py --redis ... --soak 10

The gateway runs as `gateway serve` (its own process) in front of a fake upstream (port 0, this
process); `--instant` makes the upstream answer with no delay. `--writers W`: W clients write to
each conversation at once, each resending the shared history plus its own turn. `--soak MINUTES`
keeps new conversations arriving for that long and samples the gateway's RSS: its drift after
warm-up (the first fifth), its value by tenth of the run, and its growth rate in each half after
warm-up (caches that fill and hold flatten in the second half; a leak does not).

Prints throughput, latency percentiles (and, apart, how much of them was spent waiting for one of
this generator's own `--concurrency` connections: with more conversations than that, it is the
client's queue, not the gateway), errors, and lost / duplicated / reordered user turns: lost
means stored on no branch (the history or one it abandoned, /gateway/conversations/ID/branches),
duplicated means twice on one branch; turns kept only on an abandoned branch are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gateway.testing import FakeUpstream

KEY = "sk-loadtest-0001"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def spawn(argv: list[str], err: Path) -> subprocess.Popen[bytes]:
    with err.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)  # the log lines go to stdout


async def start_gateway(redis: str, upstream: str, connections: int,
                        store: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str, Path]:
    # The gateway's connection cap above the client's, so that every client connection is served.
    cfg = {"store": {"url": redis, **store}, "upstreams": {"openai": {"base_url": upstream + "/v1"}},
           "memory": {"message_threshold": 10, "keep_recent": 4, "fold_batch": 4},
           "server": {"log_level": "warning", "max_connections": connections + 64}}
    tmp = Path(tempfile.mkdtemp(prefix="gw-load-"))
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn([sys.executable, "-m", "gateway", "serve", "--config", str(tmp / "gw.yaml"), "--port", str(port)],
                 tmp / "err.log")
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(url + "/healthz") as r:
                    if r.status == 200:
                        return proc, url, tmp
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    proc.kill()
    raise SystemExit(f"gateway did not start: {(tmp / 'err.log').read_text()[-2000:]}")


def queue_tracer() -> aiohttp.TraceConfig:
    """Adds to each request's `trace_request_ctx["queued"]` the time it waited for a pooled connection."""
    tracer = aiohttp.TraceConfig()

    async def start(session: Any, ctx: Any, params: Any) -> None:
        ctx.queued_at = time.perf_counter()

    async def end(session: Any, ctx: Any, params: Any) -> None:
        if ctx.trace_request_ctx is not None:  # a request that asked to be timed
            ctx.trace_request_ctx["queued"] += time.perf_counter() - ctx.queued_at

    tracer.on_connection_queued_start.append(start)
    tracer.on_connection_queued_end.append(end)
    return tracer


class Run:
    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url, self.http = url, http
        self.latencies: list[float] = []
        # Of each latency, the time spent waiting for one of this generator's own connections
        # (`--concurrency`): with more conversations than connections that queue is the client's.
        self.queued: list[float] = []
        self.errors: dict[str, int] = {}
        self.sent: dict[str, list[str]] = {}  # conversation → user turns sent (2xx answers only)

    async def turn(self, conv: str, history: list[dict[str, Any]], text: str) -> str | None:
        body = {"model": "gpt-test", "messages": [*history, {"role": "user", "content": text}]}
        t = time.perf_counter()
        waited = {"queued": 0.0}
        try:
            async with self.http.post(self.url + "/v1/chat/completions", json=body, trace_request_ctx=waited, headers={
                    "Authorization": f"Bearer {KEY}", "X-Conversation-Id": conv}) as r:
                data = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            return None
        self.latencies.append(time.perf_counter() - t)
        self.queued.append(waited["queued"])
        if status != 200:
            self.errors[str(status)] = self.errors.get(str(status), 0) + 1
            return None
        self.sent.setdefault(conv, []).append(text)
        return str(data["choices"][0]["message"]["content"])

    async def conversation(self, conv: str, turns: int) -> None:
        history: list[dict[str, Any]] = []
        for i in range(turns):
            text = f"{conv} turn {i}: the value of item {i} is {i * 7}."
            reply = await self.turn(conv, history, text)
            if reply is not None:
                history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]

    async def writers(self, conv: str, turns: int, writers: int) -> None:
        """`writers` clients on one conversation, each resending the shared history plus its turn."""
        shared: list[dict[str, Any]] = []

        async def one(w: int) -> None:
            for i in range(turns):
                text = f"{conv} writer {w} turn {i}"
                reply = await self.turn(conv, list(shared), text)
                if reply is not None:
                    shared.extend([{"role": "user", "content": text}, {"role": "assistant", "content": reply}])

        await asyncio.gather(*(one(w) for w in range(writers)))

    async def _pages(self, path: str) -> list[str] | None:
        """The user turns of a paged message list (None: 404)."""
        out: list[str] = []
        offset = 0
        while True:
            async with self.http.get(f"{self.url}{path}?offset={offset}&limit=1000",
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                if r.status == 404:
                    return None
                page = await r.json()
                if r.status != 200:
                    raise SystemExit(f"reading {path}: {r.status} {page}")
            out += [d["message"]["content"] for d in page["data"] if d["role"] == "user"]
            offset += len(page["data"])
            if not page["data"] or offset >= page["total"]:
                return out

    async def stored(self, conv: str) -> tuple[list[str], list[list[str]]]:
        """The user turns of the conversation's history, and of each branch it abandoned."""
        base = f"/gateway/conversations/{conv}"
        main = await self._pages(base + "/messages")
        if main is None:
            return [], []  # nothing stored at all: every turn of it was lost
        async with self.http.get(self.url + base + "/branches", headers={"Authorization": f"Bearer {KEY}"}) as r:
            found = (await r.json())["data"] if r.status == 200 else []
        branches = [await self._pages(f"{base}/branches/{b['id']}/messages") or [] for b in found]
        return main, branches


def _samples(text: str, name: str) -> dict[str, float]:
    """Prometheus samples of one metric: {labels text: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


async def settled(http: aiohttp.ClientSession, url: str, wait: float = 120.0) -> dict[str, float]:
    """Wait until the gateway has recorded every answered turn (its retry queue empty too); the
    gateway_unrecorded_total counts by result."""
    deadline = time.monotonic() + wait
    while True:
        await asyncio.sleep(0.5)  # recordings run after each answer, in the background
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        pending = sum(_samples(text, "gateway_unrecorded_pending").values())
        if not pending or time.monotonic() > deadline:
            return _samples(text, "gateway_unrecorded_total")


def events(err: Path) -> dict[str, int]:
    """How many times each warning or error event appears in the gateway's log."""
    counts: dict[str, int] = {}
    for line in err.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") in ("warning", "error", "critical"):
            name = f"{record['level']} {record.get('event')} {record.get('error', '')}".strip()
            counts[name] = counts.get(name, 0) + 1
    return counts


def compare(sent: list[str], stored: list[str], branches: list[list[str]],
            ordered: bool) -> tuple[int, int, int, int]:
    """(lost, duplicated, reordered, only on an abandoned branch) user turns: lost means on no branch,
    duplicated twice on one."""
    kept_anywhere = set(stored).union(*branches)
    lost = len(set(sent) - kept_anywhere)
    dup = sum(len(b) - len(set(b)) for b in [stored, *branches])
    aside = len(set(sent) & kept_anywhere - set(stored))
    kept = [s for s in stored if s in set(sent)]
    reordered = 0
    if ordered:
        expect = [s for s in sent if s in set(kept)]
        reordered = sum(1 for a, b in zip(expect, dict.fromkeys(kept), strict=False) if a != b)
    return lost, dup, reordered, aside


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000


async def main(args: argparse.Namespace) -> None:
    async with FakeUpstream(reply="Noted.", latency=0.0 if args.instant else args.latency, record=False) as fake:
        store = {k: v for k, v in (("pool_size", args.pool_size), ("pool_wait_seconds", args.pool_wait)) if v}
        proc, url, tmp = await start_gateway(args.redis, fake.url, args.concurrency, store)
        samples: list[tuple[float, int]] = []
        try:
            timeout = aiohttp.ClientTimeout(total=60)
            conn = aiohttp.TCPConnector(limit=args.concurrency)
            async with aiohttp.ClientSession(timeout=timeout, connector=conn, trace_configs=[queue_tracer()]) as http:
                run = Run(url, http)
                t0 = time.perf_counter()
                convs: list[str] = []
                if args.soak:
                    end = time.monotonic() + args.soak * 60
                    n = 0
                    while time.monotonic() < end:
                        batch = [f"soak-{os.getpid()}-{n + i}" for i in range(args.conversations)]
                        n += len(batch)
                        convs += batch
                        await asyncio.gather(*(run.conversation(c, args.turns) for c in batch))
                        samples.append((time.perf_counter() - t0, rss_kib(proc.pid)))
                elif args.writers > 1:
                    convs = [f"w-{os.getpid()}-{i}" for i in range(args.conversations)]
                    await asyncio.gather(*(run.writers(c, args.turns, args.writers) for c in convs))
                else:
                    convs = [f"c-{os.getpid()}-{i}" for i in range(args.conversations)]
                    await asyncio.gather(*(run.conversation(c, args.turns) for c in convs))
                elapsed = time.perf_counter() - t0
                unrecorded = await settled(http, url)
                lost = dup = reordered = aside = 0
                for c in convs:
                    main, branches = await run.stored(c)
                    a, b, d, e = compare(run.sent.get(c, []), main, branches, ordered=args.writers <= 1)
                    lost, dup, reordered, aside = lost + a, dup + b, reordered + d, aside + e
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            logged = events(tmp / "err.log")
            shutil.rmtree(tmp, ignore_errors=True)
        n = len(run.latencies)
        print(f"requests {n} in {elapsed:.1f} s: {n / elapsed:.0f} req/s; "
              f"latency p50 {pct(run.latencies, 50):.1f} ms, p95 {pct(run.latencies, 95):.1f} ms, "
              f"p99 {pct(run.latencies, 99):.1f} ms, max {pct(run.latencies, 100):.1f} ms")
        served = [total - queued for total, queued in zip(run.latencies, run.queued, strict=True)]
        print(f"  of which waiting for one of the {args.concurrency} client connections: "
              f"p50 {pct(run.queued, 50):.1f} ms, p99 {pct(run.queued, 99):.1f} ms; "
              f"after it: p50 {pct(served, 50):.1f} ms, p95 {pct(served, 95):.1f} ms, p99 {pct(served, 99):.1f} ms")
        print(f"errors {sum(run.errors.values())} {run.errors or ''}")
        print(f"gateway: unrecorded {unrecorded or 0}; logged {logged or 'no warning'}")
        print(f"user turns sent {sum(len(v) for v in run.sent.values())}: "
              f"lost {lost}, duplicated {dup}, reordered {reordered}; "
              f"kept only on an abandoned branch {aside}")
        if samples:
            base = samples[min(len(samples) - 1, len(samples) // 5)][1]  # after warm-up (first fifth)
            last = samples[-1][1]
            print(f"RSS after warm-up {base / 1024:.0f} MiB, at the end {last / 1024:.0f} MiB: "
                  f"drift {100 * (last - base) / max(base, 1):+.1f}% over {len(samples)} samples")
            # Bounded caches fill early and then hold; a leak keeps the same slope to the end. The
            # run's tenths and the two halves after warm-up tell one from the other.
            tenths = [samples[min(len(samples) - 1, len(samples) * k // 10)] for k in range(1, 11)]
            print("  RSS by tenth of the run (MiB): " + ", ".join(f"{kib / 1024:.0f}" for _, kib in tenths))
            mid = samples[(len(samples) // 5 + len(samples)) // 2]
            for label, (t_a, a), (t_b, b) in (("first", samples[len(samples) // 5], mid), ("second", mid, samples[-1])):
                rate = (b - a) / 1024 / max((t_b - t_a) / 60, 1e-9)
                print(f"  {label} half after warm-up: {rate:+.2f} MiB/min")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", required=True, help="redis:// URL of a server for this run (not a shared one)")
    p.add_argument("--conversations", type=int, default=50)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--writers", type=int, default=1, help="concurrent writers per conversation")
    p.add_argument("--instant", action="store_true", help="the upstream answers with no delay")
    p.add_argument("--latency", type=float, default=0.02, help="upstream latency in seconds (without --instant)")
    p.add_argument("--concurrency", type=int, default=100, help="client connections at most")
    p.add_argument("--pool-size", type=int, default=0, help="store.pool_size (default: the gateway's)")
    p.add_argument("--pool-wait", type=float, default=0.0, help="store.pool_wait_seconds (default: the gateway's)")
    p.add_argument("--soak", type=float, default=0.0, help="minutes of new conversations, sampling RSS")
    asyncio.run(main(p.parse_args()))
