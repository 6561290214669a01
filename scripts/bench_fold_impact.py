"""User-request latency through the gateway with background folds firing vs folding disabled.

Same workload three times, each time against a fresh fake upstream (`python -m gateway.testing`), a fresh
`gateway serve` process and a flushed store:

  (a) folds on:  memory.worker.in_process: 1, memory.fold_batch: 10
  (b) folds in a separate worker: memory.worker.in_process: 0 plus a separate
      `gateway worker --config <same yaml>` process (memory.worker.concurrency workers, default 4)
      consuming the fold jobs; its `fold.ok` lines are counted from its own log
  (c) folds off: memory.worker.in_process: 0 (fold jobs are queued, but nothing consumes them)

All runs set memory.policy: threshold, so no rewrite is swapped back for the full history on cost
grounds. Note: even without a summary the gateway rewrites once a conversation passes
memory.message_threshold / token_threshold (recent window + omitted-turns marker + retrieval excerpts,
no summary block), so (c) also mixes `full` and `rewritten`; in (a) and (b) later rewrites carry a
summary instead. Each block prints the split with gateway_ms per kind.

Workload: C concurrent conversations, each a full-history client (it resends the whole history plus
one new user message, then appends the reply it got back) for T turns, with its own
X-Conversation-Id. User messages are Zipf-like text of 60-150 words, seeded, so all runs send
exactly the same user messages; the fake upstream answers every turn with the same ~100-word text.

Prints per run: client-side request latency p50/p90/p99, the gateway's own `gateway_ms` p50/p99 (from
its JSON `"event":"request"` log lines), how requests were forwarded (their `context`: full or
rewritten, with gateway_ms per kind),
folds committed (`"event":"fold.ok"` lines) during the workload and after a short drain, and the
ratios of the p50s of each folds mode vs folds off.

    python scripts/bench_fold_impact.py                          # 10 conversations x 60 turns
    python scripts/bench_fold_impact.py --conversations 20 --turns 100 --store redis://127.0.0.1:6379/15
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

# The process and text helpers are the overhead benchmark's (same folder).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import _words, free_port, start, wait_up

CONV_PREFIX = "fold-impact-"


def user_messages(seed: int, conversation: int, turns: int, lo: int, hi: int) -> list[str]:
    rng = random.Random(f"{seed}/{conversation}")
    return [f"Turn {t}: " + _words(rng, rng.randint(lo, hi)) for t in range(turns)]


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] if s else float("nan")


@dataclass
class Result:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    gateway_ms: list[float] = field(default_factory=list)
    gateway_ms_by_context: dict[str, list[float]] = field(default_factory=dict)
    folds_during: int = 0
    folds_total: int = 0
    seconds: float = 0.0
    summarizer: str = "none (in_process 0)"


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def flush_store(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return  # memory:// starts empty with every process
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    try:
        await r.flushdb()
    finally:
        await r.aclose()


def log_events(path: Path) -> list[dict]:
    out = []
    for line in path.read_bytes().splitlines():
        if line.startswith(b"{"):
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
    return out


def count_folds(path: Path) -> int:
    return sum(1 for line in path.read_bytes().splitlines() if b'"event":"fold.ok"' in line)


async def conversation(session: aiohttp.ClientSession, url: str, conv_id: str, users: list[str],
                       out: Result) -> None:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench",
               "X-Conversation-Id": conv_id}
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    for text in users:
        messages.append({"role": "user", "content": text})
        body = orjson.dumps({"model": "gpt-4o-mini", "messages": messages})
        t = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as resp:
            raw = await resp.read()
        out.latencies_ms.append((time.perf_counter() - t) * 1000)
        if resp.status != 200:
            raise RuntimeError(f"{conv_id}: gateway answered {resp.status}: {raw[:300]!r}")
        msg = orjson.loads(raw)["choices"][0]["message"]
        messages.append({"role": "assistant", "content": msg.get("content") or ""})


async def run_once(name: str, in_process: int, args: argparse.Namespace, reply: str,
                   workload: list[list[str]], workdir: Path, *, separate_worker: bool = False) -> Result:
    res = Result(name)
    slug = name.replace(" ", "-")
    fake_port, gw_port = free_port(), free_port()
    config = workdir / f"gateway-{slug}.yaml"
    config.write_text(
        f"upstreams:\n  openai:\n    base_url: http://127.0.0.1:{fake_port}/v1\n"
        f"store:\n  url: {args.store}\n"
        "server:\n  log_level: info\n  log_format: json\n"
        "memory:\n  enabled: true\n  policy: threshold\n"
        f"  fold_batch: {args.fold_batch}\n  keep_recent: {args.keep_recent}\n"
        f"  worker:\n    in_process: {in_process}\n")
    await flush_store(args.store)
    gw_log = workdir / f"gateway-{slug}.log"
    worker_log = workdir / f"worker-{slug}.log"
    fold_log = worker_log if separate_worker else gw_log  # where this run's fold.ok lines are logged
    fake = start([sys.executable, "-m", "gateway.testing", "--port", str(fake_port),
                  "--latency-ms", str(args.latency_ms), "--reply", reply], workdir / f"fake-{slug}.log")
    gateway = start([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(gw_port)],
                    gw_log)
    worker = (start([sys.executable, "-m", "gateway", "worker", "--config", str(config)], worker_log)
              if separate_worker else None)
    try:
        await wait_up(f"http://127.0.0.1:{fake_port}/v1/models", fake)
        await wait_up(f"http://127.0.0.1:{gw_port}/healthz", gateway)
        if worker is not None:
            await wait_worker(worker_log, worker)
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        connector = aiohttp.TCPConnector(limit=args.conversations + 2)
        async with aiohttp.ClientSession(connector=connector) as session:
            # Warm-up (tokenizer load, connection pools); its log lines are filtered out below.
            warm = Result("warmup")
            await conversation(session, url, "warmup", [_words(random.Random(0), 20)] * 3, warm)
            t0 = time.perf_counter()
            await asyncio.gather(*(conversation(session, url, f"{CONV_PREFIX}{i}", users, res)
                                   for i, users in enumerate(workload)))
            res.seconds = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # the gateway's log is flushed at most 50 ms late
        res.folds_during = count_folds(fold_log)
        # Drain: let queued folds finish (folds on) so the committed total is complete.
        deadline, last, stable_since = time.monotonic() + args.drain_seconds, -1, time.monotonic()
        while time.monotonic() < deadline and (in_process > 0 or separate_worker):
            n = count_folds(fold_log)
            if n != last:
                last, stable_since = n, time.monotonic()
            elif time.monotonic() - stable_since > 1.0:
                break
            await asyncio.sleep(0.1)
    finally:
        stop(*([worker] if worker is not None else []), gateway, fake)
    events = log_events(gw_log)
    res.folds_total = count_folds(fold_log)
    for e in events:
        if e.get("event") == "request" and str(e.get("conversation", "")).startswith(CONV_PREFIX):
            res.gateway_ms.append(float(e["gateway_ms"]))
            res.gateway_ms_by_context.setdefault(str(e.get("context")), []).append(float(e["gateway_ms"]))
        elif e.get("event") == "fold.workers_started":
            res.summarizer = f"{e.get('workers')} worker(s), {e.get('summarizer')}"
    if separate_worker:
        # `gateway worker` logs `fold.summarizer` (not `fold.workers_started`) and runs
        # memory.worker.concurrency workers.
        from gateway.config import load_settings

        n = load_settings(str(config)).memory.worker.concurrency
        for e in log_events(worker_log):
            if e.get("event") == "fold.summarizer":
                res.summarizer = f"separate process, {n} worker(s) (memory.worker.concurrency), {e.get('mode')}"
    return res


def log_has(path: Path, needle: bytes) -> bool:
    return needle in path.read_bytes()


async def wait_worker(log: Path, proc: subprocess.Popen[bytes]) -> None:
    """Wait until the separate worker has logged `fold.summarizer` (its store is open, its pool starting)."""
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"process exited early: {proc.args!r} (see {log})")
        if log_has(log, b'"event":"fold.summarizer"'):
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"worker did not start (see {log})")


def report(r: Result) -> None:
    lat, gw = r.latencies_ms, r.gateway_ms
    print(f"[{r.name}]  {len(lat)} requests in {r.seconds:.1f} s ({len(lat) / r.seconds:.0f} req/s), "
          f"fold workers: {r.summarizer}")
    print(f"  request latency (client)  p50 {pct(lat, 50):7.2f}  p90 {pct(lat, 90):7.2f}  p99 {pct(lat, 99):7.2f} ms")
    print(f"  gateway_ms (gateway log)  p50 {pct(gw, 50):7.3f}  p99 {pct(gw, 99):7.3f} ms   ({len(gw)} log lines)")
    print("  forwarded as (gateway_ms p50/p99): " + ", ".join(
        f"{k} {len(v)} ({pct(v, 50):.3f}/{pct(v, 99):.3f} ms)" for k, v in sorted(r.gateway_ms_by_context.items())))
    print(f"  folds committed: {r.folds_during} during the workload, {r.folds_total} after drain")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=10, help="concurrent conversations (C)")
    p.add_argument("--turns", type=int, default=60, help="user turns per conversation (T)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="fake upstream latency")
    p.add_argument("--store", default="redis://127.0.0.1:6379/15", help="flushed (FLUSHDB) before each run")
    p.add_argument("--fold-batch", type=int, default=10)
    p.add_argument("--keep-recent", type=int, default=10)
    p.add_argument("--min-words", type=int, default=60)
    p.add_argument("--max-words", type=int, default=150)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--drain-seconds", type=float, default=5.0, help="max wait for queued folds after the load")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gw-fold-impact-"))
    workload = [user_messages(args.seed, i, args.turns, args.min_words, args.max_words)
                for i in range(args.conversations)]
    rng = random.Random(f"{args.seed}/reply")
    reply = _words(rng, 100)
    print(f"{args.conversations} conversations x {args.turns} turns (full history resent, "
          f"{args.min_words}-{args.max_words}-word user messages, 100-word replies), "
          f"upstream latency {args.latency_ms:g} ms, store {args.store}, "
          f"fold_batch {args.fold_batch}, keep_recent {args.keep_recent}, policy threshold; logs in {workdir}",
          flush=True)
    # Folds off first: a worker process of an earlier run that is slow to exit must not fold
    # into this run's conversations (same store, same conversation ids).
    off = await run_once("folds off", 0, args, reply, workload, workdir)
    report(off)
    on = await run_once("folds on", 1, args, reply, workload, workdir)
    report(on)
    sep = await run_once("folds in a separate worker", 0, args, reply, workload, workdir, separate_worker=True)
    report(sep)
    for r in (on, sep):
        print(f"p50 ratio {r.name} / folds off: "
              f"request latency {pct(r.latencies_ms, 50) / pct(off.latencies_ms, 50):.3f}, "
              f"gateway_ms {pct(r.gateway_ms, 50) / pct(off.gateway_ms, 50):.3f}")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
