"""Fold benchmark: latency, fact survival and the forwarded-token share.

    python scripts/bench_fold.py [--store memory://|redis://…] [--turns 120] [--upstream-delay 0.0]

Prints, for the extractive and llm summarizers (llm against a fake OpenAI upstream on port 0, so
its latency is the gateway's own part plus `--upstream-delay`):
- the latency of one fold of 10 messages (load + summarize + CAS commit + ledger update), wall
  and CPU (process time: the fold's own cost, whatever else runs on the machine);
- the 120-turn sequence folded 10 messages at a time: total and per-fold latency, and CPU;
- fact survival after 120 turns (8 planted durable facts; in the summary, in the state, either);
- at turn 100, forwarded tokens (summary + state + window) as a share of the full history.
The generated session and the fake upstream are the test suite's (tests/test_summarizer.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_summarizer import PLANTED, FakeUpstream, count, llm_settings, planted_session, survival

from gateway import fold, state, worker
from gateway.config import Settings, parse_settings
from gateway.dialects import content_hash, dialect_named
from gateway.keys import ConvRef
from gateway.model import Message
from gateway.store import Store, open_store
from gateway.summarizer import build_summarizer

SHAPE = dialect_named("openai_chat")


def make_turn(role: str, text: str) -> Message:
    raw = {"role": role, "content": text}
    return Message(raw=raw, role=role, text=text, tokens=count(text), hash=content_hash(SHAPE, raw))


async def append(store: Store, ref: ConvRef, messages: list[tuple[str, str]]) -> int:
    view = await store.load(ref)
    res = await store.append(ref, [make_turn(r, t) for r, t in messages], base_length=view.length,
                             base_chain=view.last_chain or "", dialect="openai_chat")
    assert res.ok
    return res.length


def with_store(settings: Settings, url: str) -> Settings:
    return settings.model_copy(update={"store": parse_settings({"store": {"url": url}}).store})


async def one_fold(store: Store, settings: Settings, summarizer: Any, ref: ConvRef) -> tuple[float, float]:
    """(wall, CPU) seconds for one fold of 10 messages (20 stored, keep_recent 10)."""
    await store.delete(ref)  # a rerun against the same Redis starts from scratch
    await append(store, ref, planted_session(10, seed=3))
    w = worker.FoldWorker(store, settings, summarizer, name="bench")
    started, cpu = time.perf_counter(), time.process_time()
    result = await w.fold_conversation(ref)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert result == "ok", result
    return elapsed, cpu


async def sequence(store: Store, settings: Settings, summarizer: Any, ref: ConvRef, turns: int) -> dict[str, Any]:
    """Replay `turns` turns, folding whenever due; fold timings, survival, and the share at turn 100."""
    mem = settings.memory
    w = worker.FoldWorker(store, settings, summarizer, name="bench")
    messages = planted_session(turns)
    await store.delete(ref)
    timings: list[float] = []
    cpu: list[float] = []
    share_at_100: float | None = None
    for i in range(0, len(messages), 2):
        length = await append(store, ref, messages[i:i + 2])
        view = await store.load(ref)
        covers = view.summary.covers if view.summary else 0
        if fold.should_fold(length=length, covers=covers, keep_recent=mem.keep_recent, fold_batch=mem.fold_batch):
            started, cpu_started = time.perf_counter(), time.process_time()
            await w.fold_conversation(ref)
            timings.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        if length == 200:  # turn 100
            view = await store.load(ref)
            full = sum(t.tokens for t in await store.messages(ref))
            summary_tokens = count(view.summary.text) if view.summary else 0
            rendered = state.render(state.load(view.state), mem.state_budget_tokens, count)
            window = sum(t.tokens for t in view.tail)
            share_at_100 = (summary_tokens + count(rendered) + window) / full
    view = await store.load(ref)
    summary = view.summary.text if view.summary else ""
    rendered = state.render(state.load(view.state), mem.state_budget_tokens, count)
    in_summary, in_state = survival(summary), survival(rendered)
    folded = view.summary.covers if view.summary else 0
    return {
        "folds": len(timings), "total": sum(timings), "mean": statistics.mean(timings),
        "cpu_mean": statistics.mean(cpu), "cpu_per_message": sum(cpu) / folded if folded else 0.0,
        "p95": sorted(timings)[int(len(timings) * 0.95) - 1] if timings else 0.0,
        "summary_tokens": count(summary), "in_summary": sum(in_summary.values()),
        "in_state": sum(in_state.values()),
        "either": sum(a or b for a, b in zip(in_summary.values(), in_state.values(), strict=True)),
        "share_at_100": share_at_100,
    }


async def bench(mode: str, settings: Settings, url: str, turns: int, repeat: int) -> None:
    store = await open_store(settings.store if url == "memory://" else with_store(settings, url).store)
    summarizer = build_summarizer(settings, count, mode=mode)
    try:
        singles = [await one_fold(store, settings, summarizer, ConvRef("bench", f"{mode}-one-{i}"))
                   for i in range(repeat)]
        seq = await sequence(store, settings, summarizer, ConvRef("bench", f"{mode}-seq"), turns)
    finally:
        await summarizer.close()
        await store.close()
    n = len(PLANTED)
    walls, cpus = [w for w, _ in singles], [c for _, c in singles]
    print(f"[{mode}] fold of 10 messages: median {statistics.median(walls) * 1000:.1f} ms "
          f"(min {min(walls) * 1000:.1f}, max {max(walls) * 1000:.1f}, n={repeat}); "
          f"CPU median {statistics.median(cpus) * 1000:.2f} ms")
    print(f"[{mode}] {turns}-turn sequence: {seq['folds']} folds, total {seq['total'] * 1000:.0f} ms, "
          f"mean {seq['mean'] * 1000:.1f} ms, p95 {seq['p95'] * 1000:.1f} ms; CPU mean {seq['cpu_mean'] * 1000:.2f} ms "
          f"per fold, {seq['cpu_per_message'] * 1000:.3f} ms per folded message; final summary "
          f"{seq['summary_tokens']} tokens (cap {settings.memory.max_summary_tokens})")
    print(f"[{mode}] fact survival after {turns} turns: summary {seq['in_summary']}/{n}, "
          f"state {seq['in_state']}/{n}, either {seq['either']}/{n}")
    if seq["share_at_100"] is not None:
        print(f"[{mode}] forwarded-token share at turn 100 (summary + state + window / full history): "
              f"{seq['share_at_100']:.1%}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="memory://", help="store URL (memory:// or redis://…)")
    ap.add_argument("--turns", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=20, help="single 10-message folds to time")
    ap.add_argument("--upstream-delay", type=float, default=0.0, help="seconds the fake llm takes per call")
    args = ap.parse_args()
    await bench("extractive", Settings(), args.store, args.turns, args.repeat)
    fake = await FakeUpstream().start()
    if args.upstream_delay:
        real = fake._answer

        def slow(body: dict[str, Any]) -> str:
            time.sleep(args.upstream_delay)  # the fake is in-process: a blocking delay is fine here
            return real(body)

        fake._answer = slow  # type: ignore[method-assign]
    try:
        await bench("llm", llm_settings(fake.url), args.store, args.turns, args.repeat)
        print(f"[llm] fake upstream calls: {len(fake.requests)} "
              "(its summaries keep 8 words per message: llm survival figures measure the plumbing, not a model)")
    finally:
        await fake.close()


if __name__ == "__main__":
    asyncio.run(main())
