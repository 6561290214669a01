#!/usr/bin/env python3
"""Request-path cost of hybrid retrieval (memory.retrieval.embeddings), and what background
embedding costs the event loop.

Indexes `--messages` messages of one conversation in a `RecallCache` with an `Embedder` (texts from
the LongMemEval development file when it is there, else synthetic), lets the background worker embed
them while a ticker measures how late the event loop wakes (its stall), then times what a request
does: the question's embedding (in its thread, awaited) plus the fused search, for distinct
questions, against the lexical search alone.

    python scripts/bench_embed.py                  # 1,000 messages, 300 questions
    python scripts/bench_embed.py --messages 2000 --questions 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.embed import Embedder, encoder  # noqa: E402
from gateway.model import Message  # noqa: E402
from gateway.recall import RecallCache  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "longmemeval_s_dev.jsonl"


def _texts(n: int) -> tuple[list[tuple[str, str]], list[str]]:
    """(role, text) of n messages, and questions to ask."""
    rng = random.Random(7)
    if DATA.is_file():
        msgs: list[tuple[str, str]] = []
        questions: list[str] = []
        with DATA.open(encoding="utf-8") as fh:
            for line in fh:
                conv = json.loads(line)
                msgs.extend((m["role"], m["content"] or "") for m in conv["messages"])
                questions.extend(p["question"] for p in conv["probes"])
                questions.extend(m["content"] for m in conv["messages"][-40:] if m["role"] == "user")
                if len(msgs) >= n and len(questions) >= 300:
                    break
        return msgs[:n], questions
    words = [f"w{i}" for i in range(5000)]
    msgs = [("user" if i % 2 == 0 else "assistant",
             " ".join(words[min(int(rng.paretovariate(1.1)), 4999)] for _ in range(40 if i % 2 == 0 else 120)))
            for i in range(n)]
    return msgs, [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=300)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    encoder()
    print(f"model loaded in {time.perf_counter() - t0:.2f} s (int8 copy cached after the first run)")
    msgs, questions = _texts(args.messages)
    turns = [Message(raw={}, role=role, text=text, tokens=max(1, len(text) // 4), hash="", time=None,
                     chain=str(i)) for i, (role, text) in enumerate(msgs)]
    embedder = Embedder()
    cache = RecallCache(embedder=embedder)

    async def nothing(a: int, b: int) -> list[Message]:
        return []

    # Background embedding, with a ticker on the loop: how late does a 1 ms sleep wake?
    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    await cache.sync("bench", turns, 0, nothing)
    await embedder.drain()
    took = time.perf_counter() - t0
    stop.set()
    await tick
    print(f"embedded {cache.embedded('bench')} messages in the background in {took:.1f} s "
          f"({cache.embedded('bench') / took:.0f}/s); event loop lateness while it ran: "
          f"p50 {1000 * _pct(lateness, 0.5):.2f} ms, p99 {1000 * _pct(lateness, 0.99):.2f} ms, "
          f"max {1000 * max(lateness):.2f} ms")

    before = len(turns) - 10
    lexical: list[float] = []
    query: list[float] = []
    fused: list[float] = []
    asked = [questions[i % len(questions)] + ("" if i < len(questions) else f" ({i})")
             for i in range(args.questions)]
    for q in asked[:20]:  # warm-up
        cache.search("bench", query=q + " warm", before=before, budget_tokens=4000,
                     query_vector=await embedder.query(q))
    for i, q in enumerate(asked):
        t0 = time.perf_counter()
        cache.search("bench", query=q, before=before, budget_tokens=4000)
        lexical.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        vector = await embedder.query(q)
        t1 = time.perf_counter()
        cache.search("bench", query=q, before=before, budget_tokens=4000, query_vector=vector)
        t2 = time.perf_counter()
        query.append(t1 - t0)
        fused.append(t2 - t0)
        if i % 50 == 0:
            await asyncio.sleep(0)
    # The same while the worker embeds another conversation's messages (a busy gateway's usual state).
    busy: list[float] = []
    await cache.sync("other", turns, 0, nothing)
    for q in asked:
        if cache.embedded("other") >= len(turns):
            break
        t0 = time.perf_counter()
        vector = await embedder.query(q)
        cache.search("bench", query=q, before=before, budget_tokens=4000, query_vector=vector)
        busy.append(time.perf_counter() - t0)
        await asyncio.sleep(0.005)
    print(f"request path at {len(turns)} messages, {len(asked)} questions (ms):")
    for name, values in (("lexical search alone", lexical), ("query embedding", query),
                         ("query embedding + fused search", fused),
                         (f"the same, background busy ({len(busy)})", busy)):
        print(f"  {name:<32} p50 {1000 * statistics.median(values):6.2f}   p99 {1000 * _pct(values, 0.99):6.2f}")
    await embedder.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
