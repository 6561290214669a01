"""How long folds hold up the event loop: a fold's CPU in a thread versus in a child process.

Stores `--conversations` conversations of `--messages` messages (bench_overhead's synthetic text) in
the embedded store, then folds them one after the other with one `FoldWorker` whose CPU runs in a
thread of this process (`fold_processes: 0`) or in a child process (`ProcessCPU`, what `gateway
serve` does by default), while a probe on the same event loop sleeps 1 ms at a time and records
how late it wakes. The lateness is what every request on that loop would wait on top of its work.

    python scripts/bench_fold_lag.py                      # both modes, 6 conversations of 500 messages
    python scripts/bench_fold_lag.py --messages 40 --conversations 40
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from gateway import worker
from gateway.config import parse_settings
from gateway.dialects import content_hash, dialect_named
from gateway.foldcpu import FoldCPU, ProcessCPU, ThreadCPU
from gateway.keys import ConvRef
from gateway.logs import configure
from gateway.model import Message
from gateway.store import open_store
from gateway.summarizer import build_summarizer
from gateway.tokens import TokenCounter

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead import history, pct


async def run(mode: str, messages: int, conversations: int) -> str:
    settings = parse_settings({"store": {"url": "memory://"}})
    configure("console", "warning")
    store = await open_store(settings.store)
    counter = TokenCounter(settings.models)
    summarizer = build_summarizer(settings, lambda text: counter.count(text, "gpt-4o-mini"), mode="extractive")
    cpu: FoldCPU = (ProcessCPU(settings, 1) if mode == "process"
                    else ThreadCPU(summarizer, settings.memory.max_summary_tokens))
    w = worker.FoldWorker(store, settings, summarizer, name=f"lag-{mode}", cpu=cpu)
    shape = dialect_named("openai_chat")
    refs = []
    for c in range(conversations + 1):
        ref = ConvRef("bench", f"lag-{mode}-{c}")
        turns = [Message(raw=m, role=m["role"], text=m["content"], tokens=counter.count_message(m["content"]),
                         hash=content_hash(shape, m)) for m in history(messages + c)]
        assert (await store.append(ref, turns, base_length=0, base_chain="", dialect="openai_chat")).ok
        refs.append(ref)
    await w.fold_conversation(refs[0])  # warm-up: the child starts, the caches fill
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t - 0.001) * 1000)

    task = asyncio.create_task(probe())
    started = time.perf_counter()
    for ref in refs[1:]:
        assert await w.fold_conversation(ref) == "ok"
    seconds = time.perf_counter() - started
    done.set()
    await task
    await cpu.close()
    await store.close()
    return (f"{mode:<8} {conversations} folds of {messages} messages in {seconds:.2f} s | loop lateness "
            f"p50 {pct(lags, 50):.2f} p99 {pct(lags, 99):.2f} max {max(lags):.2f} ms ({len(lags)} probes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=500)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--modes", default="thread,process")
    args = p.parse_args()
    for mode in args.modes.split(","):
        print(asyncio.run(run(mode, args.messages, args.conversations)), flush=True)


if __name__ == "__main__":  # the fold processes import the main module: it must not run again there
    main()
