#!/usr/bin/env python3
"""Gateway CPU per request of two revisions, side by side: what a change to the request path saves.

    python scripts/bench_ab.py --base HEAD~3                 # that revision against the working tree
    python scripts/bench_ab.py --base main --blocks 20 --per-slot 40 --concurrency 10

Starts one fake upstream (20 ms) and two `gateway serve` processes: the working tree (B), and `--base`
(A) checked out in a temporary git worktree, each on its own Redis database (FLUSHED). Both serve
the workload of `bench_overhead.py --conversation-turns N`: full-history clients of N-message
conversations that grow by a reply and a question per request, summarised and indexed first, with
folds firing in-process. Timed blocks alternate between the two (A B, then B A), so drift on a shared
machine falls on both alike, and each block counts only its own gateway process's CPU.

Latency from a small machine's single run is mostly noise (`bench_overhead.py` saw its bare relay's
p50 anywhere from 0.0 to 1.3 ms within an hour); the CPU each process spends on the same requests
is steadier (runs repeat within ~2%). Prints both sides' CPU per request and the change.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overhead as bench

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev],
                   check=True, capture_output=True)
    return into


def serve(tree: Path, fake_port: int, store: str, workdir: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = bench.free_port()
    config = workdir / f"{name}.yaml"
    config.write_text(
        f"upstreams:\n  openai:\n    base_url: http://127.0.0.1:{fake_port}/v1\nstore:\n  url: {store}\n"
        "memory:\n  enabled: true\n  worker:\n    in_process: 1\nserver:\n  log_level: warning\n")
    # PYTHONPATH first: the tree's `gateway` package, not the one this venv has installed.
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port)],
                            cwd=tree, env=env, stdout=(workdir / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def run(args: argparse.Namespace, trees: dict[str, Path], workdir: Path) -> None:
    import redis

    fake_port = bench.free_port()
    fake = bench.start([sys.executable, "-m", "gateway.testing", "--port", str(fake_port), "--latency-ms", "20"],
                       workdir / "fake.log")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    bases: dict[str, str] = {}
    stores: dict[str, str] = {}
    try:
        for i, (name, tree) in enumerate(trees.items()):
            stores[name] = f"{args.redis.rstrip('/')}/{args.db + i}"
            redis.Redis.from_url(stores[name]).flushdb()
            procs[name], bases[name] = serve(tree, fake_port, stores[name], workdir, name)
        await bench.wait_up(f"http://127.0.0.1:{fake_port}/v1/models", fake)
        for name in trees:
            await bench.wait_up(f"{bases[name]}/healthz", procs[name])
        works = {name: bench.Workload(args.turns, False, grow=True, header=True, tag=f"ab-{name}-{time.time_ns()}",
                                      slots=args.concurrency, per_slot=args.blocks * args.per_slot + 10,
                                      per_conversation=args.per_conversation)
                 for name in trees}
        cpu = dict.fromkeys(trees, 0.0)
        sent = dict.fromkeys(trees, 0)
        latencies: dict[str, list[float]] = {name: [] for name in trees}
        per_block = -(-args.per_slot // max(1, args.per_conversation - 2)) + 2  # conversations a block moves through
        for block in range(args.blocks):
            for name in (list(trees) if block % 2 == 0 else list(reversed(trees))):
                work = works[name]
                await bench.seed(bases[name], work, 300, per_block)
                await bench.folds_settled(stores[name])
                before = bench.cpu_seconds(procs[name].pid)
                done = await bench.load(f"{bases[name]}/v1/chat/completions", work, args.per_slot, args.concurrency)
                cpu[name] += bench.cpu_seconds(procs[name].pid) - before
                sent[name] += args.per_slot * args.concurrency
                latencies[name] += done.latencies
                await bench.folds_settled(stores[name])
        per_request = {name: cpu[name] / sent[name] * 1000 for name in trees}
        for name, tree in trees.items():
            print(f"{name} ({args.base if name == 'A' else 'working tree'}, {tree}): gateway CPU/req "
                  f"{per_request[name]:.3f} ms over {sent[name]} requests; latency p50 "
                  f"{bench.pct(latencies[name], 50) * 1000:.2f} ms")
        change = (per_request["B"] - per_request["A"]) / per_request["A"] * 100
        print(f"B against A: {change:+.1f}% CPU per request")
    finally:
        for proc in (*procs.values(), fake):
            proc.send_signal(2)
        for proc in (*procs.values(), fake):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare the working tree with (A)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379", help="server for both stores (databases FLUSHED)")
    p.add_argument("--db", type=int, default=12, help="A's database; B's is the next")
    p.add_argument("--blocks", type=int, default=12, help="timed blocks per side, alternating")
    p.add_argument("--per-slot", type=int, default=40, help="requests per client slot in a block")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--turns", type=int, default=500, help="messages a conversation starts with")
    p.add_argument("--per-conversation", type=int, default=50, help="requests per conversation")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gw-ab-"))
    base = worktree(args.base, workdir / "base")
    try:
        asyncio.run(run(args, {"A": base, "B": ROOT}, workdir))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
