"""Fold throughput of one worker process (`gateway worker`: a pool of `memory.worker.concurrency`).

    python scripts/bench_fold_throughput.py [--conversations 200] [--concurrency 4] [--llm-latency 1.0]

On a real redis-server of its own (free port, no persistence): `--conversations` conversations of
20 LongMemEval messages each (~1 KB, ~220 tokens a message), each with one fold job queued: the
steady state of a long conversation, where every fold takes the 10 messages that aged out of the
window (`memory.fold_batch`). One worker pool in this process drains the queue; printed: folds per
second (wall) and CPU per fold (process time: its own cost, whatever else the machine runs).

Two summarizers: `extractive` (local; CPU-bound) and `llm` against a fake OpenAI upstream on port 0
that answers after `--llm-latency` seconds (a fold makes two calls: summary and ledger update), so
that one is bound by the upstream's latency and the pool's concurrency, not by CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.shape import content_hash, shape_for
from measure_redis_bytes import DEFAULT_DATA, pairs, start_redis

from gateway import logs, worker
from gateway.config import Settings, parse_settings
from gateway.keys import ConvRef
from gateway.model import Message
from gateway.store import Store, open_store
from gateway.summarizer import build_summarizer
from gateway.testing import FakeUpstream
from gateway.tokens import TokenCounter

SHAPE = shape_for("openai_chat")
MESSAGES = 20


def _answer(body: dict[str, Any]) -> str:
    system = str(body["messages"][0]["content"])
    if "ledger" in system:
        return '{"items": [{"kind": "facts", "text": "The user works on the billing service.", "source": 0,' \
               ' "replaces": null}]}'
    return "The user and the assistant discussed the topics above; the user prefers short answers. " * 4


async def load(store: Store, counter: TokenCounter, n: int, data: Path) -> list[ConvRef]:
    texts = [t for pair in pairs(data) for t in pair]
    refs = []
    for i in range(n):
        ref = ConvRef("bench", f"fold-{i}")
        await store.delete(ref)
        turns = []
        for j in range(MESSAGES):
            role, text = ("user", "assistant")[j % 2], texts[(i * MESSAGES + j) % len(texts)]
            raw = {"role": role, "content": text}
            turns.append(Message(raw=raw, role=role, text=text, tokens=counter.count(text, "gpt-4o-mini"),
                              hash=content_hash(SHAPE, raw)))
        result = await store.append(ref, turns, base_length=0, base_chain="", dialect="openai_chat")
        assert result.ok
        refs.append(ref)
    return refs


async def run(settings: Settings, store: Store, counter: TokenCounter, refs: list[ConvRef],
              concurrency: int) -> tuple[float, float]:
    """(folds per second, CPU ms per fold) for one pool draining one job per conversation."""
    summarizer = build_summarizer(settings, lambda text: counter.count(text, "gpt-4o-mini"))
    for ref in refs:
        await store.enqueue_fold(ref)
    cpu0, t0 = time.process_time(), time.perf_counter()
    pool = worker.WorkerPool(store, settings, summarizer, concurrency, name="bench").start()
    await worker.settle(store, timeout=3600)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await pool.stop()
    await summarizer.close()
    folded = 0
    for ref in refs:
        view = await store.load(ref)
        folded += view.summary is not None and view.summary.covers == MESSAGES // 2
    assert folded == len(refs), f"only {folded} of {len(refs)} conversations folded"
    return len(refs) / wall, 1000 * cpu / len(refs)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=4, help="memory.worker.concurrency")
    p.add_argument("--llm-latency", type=float, default=1.0, help="seconds the fake upstream takes per call")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA[0])
    args = p.parse_args()
    logs.configure("console", "warning")
    workdir = tempfile.mkdtemp(prefix="gw-bench-fold-")
    proc, port = start_redis(workdir)
    try:
        async with FakeUpstream(responder=_answer, latency=args.llm_latency) as fake:
            for mode in ("extractive", "llm"):
                key = {"api_key": "sk-bench"} if mode == "llm" else {}
                settings = fake.settings(store={"url": f"redis://127.0.0.1:{port}/0"},
                                         upstreams={"openai": key},
                                         memory={"summarizer": {"mode": mode}, "worker": {"retry_base_seconds": 0}})
                settings = parse_settings(settings.model_dump(mode="json"))
                store = await open_store(settings.store)
                counter = TokenCounter(settings.models)
                refs = await load(store, counter, args.conversations, args.data)
                rate, cpu_ms = await run(settings, store, counter, refs, args.concurrency)
                extra = f", upstream {args.llm_latency:.1f} s a call" if mode == "llm" else ""
                print(f"{mode:>10}: {rate:7.1f} folds/s per worker (concurrency {args.concurrency}{extra}), "
                      f"CPU {cpu_ms:.1f} ms a fold, {args.conversations} folds of {MESSAGES // 2} messages")
                await store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
