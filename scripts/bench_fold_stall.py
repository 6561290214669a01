"""How long the serving process's event loop waits while folds run in the fold process.

`gateway serve` hands each local fold to a child process (foldcpu.ProcessCPU). The hand-off is
cheap. But when the child and the serving process share a CPU, every millisecond the child holds
that CPU is a millisecond the event loop cannot answer requests, unless the scheduler puts the
loop first. This script runs the real ProcessCPU in this process, beside a ticker that sleeps 1 ms
on the event loop and records how late it wakes, and hands it `--folds` folds of `--aged`
messages each (text prepared before timing starts), waiting `--gap-ms` between them. It prints the
ticker's lateness percentiles and how many ticks were late by more than 1 and 2 ms.

    python scripts/bench_fold_stall.py                  # this process and the fold process on one CPU
    python scripts/bench_fold_stall.py --cpus all       # wherever the scheduler puts them
    python scripts/bench_fold_stall.py --aged 10 --folds 100

`--cpus` takes `one` (the last CPU this process may use, as a busy single core would be) or `all`.
The fold process inherits the affinity.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from gateway.config import parse_settings
from gateway.foldcpu import ProcessCPU
from gateway.model import Message

WORDS = ("we", "decided", "to", "use", "PostgreSQL", "16", "for", "the", "orders", "service", "because",
         "the", "cache", "in", "Redis", "7.2", "kept", "latency", "under", "20ms", "deploy", "on", "Friday")


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


async def run(aged: int, folds: int, gap: float) -> list[float]:
    cpu = ProcessCPU(parse_settings({}), 1)
    cpu.start()
    await cpu.call(os.getpid)  # the child is up before timing starts
    rng = random.Random(7)
    summary = " ".join(text(rng, 20) for _ in range(60))
    batches = [[Message(raw={}, role="user" if i % 2 == 0 else "assistant", text=text(rng, 200), tokens=260,
                        hash="", time="2024-03-02T10:00:00Z") for i in range(aged)] for _ in range(folds)]
    late: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.2)
    late.clear()
    state = None
    try:
        for k, batch in enumerate(batches):
            out = await cpu.fold(summary, batch, 100 + k * aged, "bench", state, k, "2024-03-02T10:00:00Z", "bench")
            state = out.state.dumped or state
            await asyncio.sleep(gap)
    finally:
        done = True
        await tick
        await cpu.close()
    return late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aged", type=int, default=50, help="messages per fold")
    p.add_argument("--folds", type=int, default=60)
    p.add_argument("--gap-ms", type=float, default=20.0, help="pause between folds")
    p.add_argument("--cpus", choices=("one", "all"), default="one")
    args = p.parse_args()
    where = "all CPUs"
    if args.cpus == "one":
        if not hasattr(os, "sched_setaffinity"):
            raise SystemExit("--cpus one needs Linux")
        last = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {last})
        where = f"CPU {last} only"
    late = sorted(asyncio.run(run(args.aged, args.folds, args.gap_ms / 1000)))
    if not late:
        raise SystemExit("the ticker never ran")

    def pct(q: float) -> float:
        return late[min(len(late) - 1, int(q / 100 * len(late)))] * 1000

    print(f"{args.folds} folds of {args.aged} messages, {where}: {len(late)} ticks of 1 ms; lateness "
          f"p50 {pct(50):.3f} ms, p99 {pct(99):.3f} ms, p99.9 {pct(99.9):.3f} ms, max {late[-1] * 1000:.3f} ms; "
          f"late by > 1 ms: {sum(x > 0.001 for x in late)}, > 2 ms: {sum(x > 0.002 for x in late)}")


if __name__ == "__main__":
    main()
