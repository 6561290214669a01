"""Latency the gateway adds, and its throughput, against a fake upstream with fixed latency.

Starts the fake upstream (`python -m gateway.testing --latency-ms 20`) and `gateway serve` each in
its own process, then sends chat completions at fixed concurrency, straight to the fake and through
the gateway, streamed and not, and prints per-percentile added latency (gateway minus direct),
requests/s, the gateway's CPU per request and its own time per request (`gateway_ms` from its log);
with a Redis store, also that redis-server's CPU and commands per timed request; and the gateway's
garbage collections during the timed requests (its `gateway_gc_pause_seconds`), each of which holds
every request in flight.
Direct and gateway runs alternate in `--rounds` blocks, so drift on a shared machine hits both.

    python scripts/bench_overhead.py                         # memory off: 2000 requests, concurrency 1, 10, 50
    python scripts/bench_overhead.py --requests 500 --concurrency 10
    python scripts/bench_overhead.py --conversation-turns 500 --store redis://127.0.0.1:6379/15
    python scripts/bench_overhead.py --reference             # also a bare 30-line aiohttp relay, same rounds

`--conversation-turns N[,M...]` turns the memory layer on. Each client slot then holds real conversations
that start at N messages (system prompt aside) and grow as a full-history client's do: every
request resends the history plus the reply it got and a new user message. After `--per-conversation`
requests a slot moves on to its next conversation, so histories stay between N and N + 2 x that.
The default, 50, lets each conversation's timed requests fire folds (one every `fold_batch / 2`
requests) as a long conversation's do; at 6, the 3-4 timed requests of each conversation added fewer
messages than a fold batch, and their slowest requests came right after each block's seeding.
Before each timed block, the conversations it will use are seeded (their first request, untimed),
summarised by the fold workers, and warmed: the timed requests meet the steady state of a long
conversation this gateway has been serving (summary in place, retrieval index built, one fold of
new turns every `fold_batch` messages, in-process by default).
Several sizes (`--conversation-turns 10,500`) run in one gateway process with their rounds
interleaved, so a comparison between sizes is not skewed by the machine's drift either.

`--reference` also runs `scripts/bare_relay.py`, a bare aiohttp relay in its own process, in the
same alternating rounds, and prints its row (`+ref`) under the gateway's: the floor any Python
reverse proxy adds on this machine, measured under the same conditions. It relays the direct
requests' bodies (with memory on, the whole growing histories, unchanged).

`--pin` (Linux) binds the gateway, its fold processes and the relay to the last CPU and this load
generator and the fake upstream to the others. On a small machine, unpinned, the figures include
the gateway and the load generator taking turns on the same cores; pinned, they are closer to a
gateway whose clients and provider are on other machines. (A Redis given by `--store` is not
moved.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from gateway.caches import CONVERSATIONS
from gateway.config import MemorySettings

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    contexts: Counter[str] = field(default_factory=Counter)

    def add(self, other: Run) -> None:
        self.latencies += other.latencies
        self.seconds += other.seconds
        self.contexts += other.contexts

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


def _words(rng: random.Random, n: int) -> str:
    # Zipf-like draws from a 5,000-word vocabulary: the shape of real text, so the retrieval
    # index sees realistic posting lists (identical filler in every message would not be).
    return " ".join(f"w{min(int(rng.paretovariate(1.1)), 5000)}" for _ in range(n))


def history(turns: int) -> list[dict[str, str]]:
    rng = random.Random(turns)
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"Message {i}: " + _words(rng, 40 if i % 2 == 0 else 120)} for i in range(turns)]


def reply_text(payload: bytes, stream: bool) -> str:
    """The assistant's text from a chat completion, JSON or SSE (what a client appends to its history)."""
    if not stream:
        return str(orjson.loads(payload)["choices"][0]["message"]["content"] or "")
    parts = []
    for line in payload.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    sent: int = 0  # requests answered so far


class Workload:
    """What each client slot sends: one fixed body (memory off), or conversations that grow.

    Growing conversations sit in a queue per slot; a slot moves on to its next one after
    `per_conversation` answers (the seed's included), so histories stay in a band.
    """

    def __init__(self, turns: int, stream: bool, *, grow: bool, header: bool, tag: str, slots: int,
                 per_slot: int, per_conversation: int) -> None:
        self.stream, self.grow, self.header, self.per_conversation = stream, grow, header, per_conversation
        self.rng = random.Random(tag)
        self.extra = {"stream_options": {"include_usage": True}} if stream else {}
        base = [SYSTEM, *history(turns)]
        # The seed and warm-up requests (see `seed`) count against per_conversation too.
        count = -(-per_slot // max(1, per_conversation - 2)) + 1 if grow else 1
        self.queues = {s: deque(Conversation(f"{tag}-{s}-{j}", [*base, self._question(0)]) for j in range(count))
                       for s in range(slots)}
        self._fixed = None if grow else self._body(self.queues[0][0])

    def _question(self, k: int) -> dict[str, str]:
        return {"role": "user", "content": f"Question {k}: and now, about {_words(self.rng, 12)}?"}

    def _body(self, conv: Conversation) -> bytes:
        return orjson.dumps({"model": "gpt-4o-mini", "messages": conv.messages, "stream": self.stream, **self.extra})

    def headers(self, conv: Conversation) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        if self.header:
            headers["X-Conversation-Id"] = conv.id
        return headers

    def request(self, slot: int) -> tuple[Conversation, bytes]:
        conv = self.queues[slot][0]
        return conv, self._fixed if self._fixed is not None else self._body(conv)

    def answered(self, slot: int, conv: Conversation, payload: bytes) -> None:
        """Extend the conversation with the reply and a new question, as a full-history client does."""
        if not self.grow:
            return
        conv.sent += 1
        conv.messages.append({"role": "assistant", "content": reply_text(payload, self.stream)})
        conv.messages.append(self._question(conv.sent))
        if conv.sent >= self.per_conversation and len(self.queues[slot]) > 1:
            self.queues[slot].popleft()


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> tuple[bytes, str]:
    async with session.post(url, data=body, headers=headers) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {payload[:300]!r}")
        return payload, resp.headers.get("x-gateway-context", "-")


async def load(url: str, work: Workload, per_slot: int, concurrency: int) -> Run:
    run = Run()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def slot(s: int) -> None:
            for _ in range(per_slot):
                conv, body = work.request(s)
                t = time.perf_counter()
                payload, context = await _post(session, url, body, work.headers(conv))
                run.latencies.append(time.perf_counter() - t)
                run.contexts[context] += 1
                work.answered(s, conv, payload)

        t0 = time.perf_counter()
        await asyncio.gather(*(slot(i) for i in range(concurrency)))
        run.seconds = time.perf_counter() - t0
    return run


async def seed(base: str, work: Workload, settle_s: float, per_slot: int) -> None:
    """Bring the next `per_slot` conversations of each slot to the steady state of one this gateway
    has been serving (only those: more than the in-process caches hold would measure evictions).

    Its first request (the whole history at once), then a wait until the fold workers summarised
    it, then more requests until one comes back rewritten (at most 3; the cost model may send the
    first ones whole): the first rewritten request builds the process's retrieval index of the
    conversation, which one grown turn by turn through this gateway has had since its first rewrite.
    """
    url = f"{base}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(work.queues))) as session:

        fresh = {s: [c for c in list(q)[:per_slot] if c.sent == 0] for s, q in work.queues.items()}

        async def send_all(s: int, tries: int = 1) -> None:
            for conv in fresh[s]:
                for _ in range(tries):
                    payload, context = await _post(session, url, work._body(conv), work.headers(conv))
                    conv.sent += 1
                    conv.messages.append({"role": "assistant", "content": reply_text(payload, work.stream)})
                    conv.messages.append(work._question(conv.sent))
                    if context == "rewritten":
                        break

        await asyncio.gather(*(send_all(s) for s in work.queues))
        pending = {conv.id for convs in fresh.values() for conv in convs}
        deadline = time.monotonic() + settle_s
        while pending and time.monotonic() < deadline:
            for conv_id in list(pending):
                async with session.get(f"{base}/gateway/conversations/{conv_id}",
                                       headers={"Authorization": "Bearer sk-bench"}) as r:
                    info = await r.json()
                w = info.get("window")  # absent while the seed's turns are still being recorded
                if w is not None and not info["fold_pending"] and w["end"] - w["start"] <= 2 * w["keep_recent"] + 2:
                    pending.discard(conv_id)
            if pending:
                await asyncio.sleep(0.5)
        if pending:
            print(f"  ({len(pending)} seeded conversations still unsummarised after {settle_s:.0f} s)")
        # Over the rewrite threshold a conversation is warmed until rewritten; under it, once.
        tries = 3 if len(work.queues[0][0].messages) > MemorySettings().message_threshold else 1
        await asyncio.gather(*(send_all(s, tries) for s in work.queues))


@dataclass
class Cell:
    """One history size of one (concurrency, mode): its workloads and what its rounds measured."""

    turns: int
    d_work: Workload
    g_work: Workload
    cpu: list[float]  # seconds per process: gateway (, worker)
    direct: Run = field(default_factory=Run)
    gateway: Run = field(default_factory=Run)
    reference: Run = field(default_factory=Run)  # the bare relay (--reference)
    ref_cpu: float = 0.0
    own: list[float] = field(default_factory=list)
    redis: Counter[str] = field(default_factory=Counter)  # per command during the timed blocks; "cpu": its seconds
    gc: Counter[str] = field(default_factory=Counter)  # the gateway's GC pauses in the timed blocks (gc_pauses)

    def row(self, mode: str, conc: int, memory: bool, *, reference: bool = False) -> str:
        d, g = self.direct, self.reference if reference else self.gateway
        n = len(g.latencies)
        dq = [pct(d.latencies, q) * 1000 for q in (50, 90, 99)]
        gq = [pct(g.latencies, q) * 1000 for q in (50, 90, 99)]
        own = f"{pct(self.own, 50):.3f}/{pct(self.own, 99):.3f}" if self.own and not reference else "-"
        cpu = self.ref_cpu if reference else self.cpu[0]
        if reference:
            mode += "+ref"
        ctx = " | " + ", ".join(f"{k} {v}" for k, v in sorted(g.contexts.items())) if memory and not reference else ""
        worker = f" | worker CPU/req {self.cpu[1] / n * 1000:.2f}ms" if len(self.cpu) > 1 and not reference else ""
        if self.redis and not reference:
            calls = sorted(((v, k) for k, v in self.redis.items() if k != "cpu"), reverse=True)[:4]
            worker += (f" | redis CPU/req {self.redis['cpu'] / n * 1000:.2f}ms, commands/req (Lua's own counted) "
                       f"{sum(v for k, v in self.redis.items() if k != 'cpu') / n:.1f} ("
                       + ", ".join(f"{k} {v / n:.1f}" for v, k in calls) + ")")
        if self.gc["blocks"] and not reference:  # printed with zeros too: none is not unmeasured
            per = 1000 / n
            worker += (f" | GC pauses/1000 req: {self.gc['count'] * per:.0f}, over 5 ms {self.gc['over5'] * per:.1f}"
                       f" (gen0/1/2 {'/'.join(f'{self.gc[str(g)] * per:.1f}' for g in range(3))}),"
                       f" {self.gc['seconds'] / n * 1000:.3f} ms/req")
        return (f"{mode:<10}{conc:>5}{self.turns:>5} | {'/'.join(f'{x:.2f}' for x in dq):>22} | "
                f"{'/'.join(f'{x:.2f}' for x in gq):>22} | "
                f"{'/'.join(f'{b - a:.2f}' for a, b in zip(dq, gq, strict=True)):>21} | "
                f"{d.rps:>6.0f}/{g.rps:<6.0f} | {cpu / n * 1000:>5.2f}ms | {own:>18}{ctx}{worker}")


async def gc_pauses(base: str) -> Counter[str]:
    """The gateway's GC pauses so far, from its /metrics: collections, those over 5 ms (by generation),
    seconds paused."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("gateway_gc_pause_seconds"):
            continue
        name, value = line.rsplit(" ", 1)
        generation = name.split('generation="')[1].split('"')[0]
        if name.startswith("gateway_gc_pause_seconds_count"):
            out["count"] += float(value)
            out[generation] += float(value)  # pauses over 5 ms, until the bucket below is taken off
            out["over5"] += float(value)
        elif name.startswith("gateway_gc_pause_seconds_sum"):
            out["seconds"] += float(value)
        elif 'le="0.005"' in name:
            out[generation] -= float(value)
            out["over5"] -= float(value)
    return out


async def folds_settled(store_url: str, within: float = 60.0) -> None:
    """Wait until no fold job is queued or running, so one block's folds do not run in the next's time."""
    if store_url.startswith("memory://"):
        await asyncio.sleep(1.0)  # no view into the embedded store from here
        return
    import redis.asyncio as aioredis

    from gateway.keys import Keys

    client = aioredis.Redis.from_url(store_url)
    try:
        stream, deadline = Keys().fold_stream(), time.monotonic() + within
        while time.monotonic() < deadline:
            groups = await client.xinfo_groups(stream) if await client.exists(stream) else []
            if all(g["pending"] == 0 and not g.get("lag") for g in groups):
                return
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def redis_counts(store_url: str) -> Counter[str]:
    """Commands served and CPU seconds of the store's redis-server so far (shared with whatever else uses it)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(store_url)
    try:
        cmds = await client.info("commandstats")
        cpu = await client.info("cpu")
    finally:
        await client.aclose()
    out: Counter[str] = Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in cmds.items()})
    out["cpu"] = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    return out


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


def start(argv: list[str], log: Path, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """Start a process; with `cpus`, bound to them from before it runs (its children inherit it)."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=pin)


class GatewayLog:
    """The gateway's own time per request (`gateway_ms`), read from its JSON log since the last mark."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size

    def since_mark(self) -> list[float]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            lines = f.read().splitlines()
        return [orjson.loads(x)["gateway_ms"] for x in lines
                if b'"event":"request"' in x and b'"/v1/chat/completions"' in x]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=0, help="timed requests per cell (default 2000, memory 1000)")
    p.add_argument("--concurrency", default="1,10,50", help="comma-separated levels")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="upstream latency varies uniformly by up to this much (0: fixed, and the clients "
                        "tend to fall into lock-step waves)")
    p.add_argument("--modes", default="json,stream")
    p.add_argument("--conversation-turns", default="0",
                   help="memory on, histories of this many messages (comma-separated sizes run interleaved)")
    p.add_argument("--per-conversation", type=int, default=50, help="requests per conversation (memory mode)")
    p.add_argument("--store", default="memory://", help="the gateway's store; a Redis database given here is FLUSHED")
    p.add_argument("--rounds", type=int, default=4, help="alternating direct/gateway blocks per cell")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--settle-seconds", type=float, default=300)
    p.add_argument("--separate-worker", action="store_true",
                   help="folds in a `gateway worker` process instead of inside `gateway serve`")
    p.add_argument("--in-process", type=int, default=1,
                   help="memory.worker.in_process of `gateway serve` (0 without --separate-worker: nothing "
                        "folds, every request meets a growing backlog of unfolded messages)")
    p.add_argument("--reference", action="store_true",
                   help="also time a bare aiohttp relay (scripts/bare_relay.py) of the direct bodies, same rounds")
    p.add_argument("--pin", action="store_true",
                   help="Linux: the gateway (its fold processes too) and the relay on the last CPU, this load "
                        "generator and the fake upstream on the others, as when clients and provider are elsewhere")
    args = p.parse_args()

    sizes = [int(t) for t in args.conversation_turns.split(",")]
    memory = sizes != [0]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cpus) < 2:
        raise SystemExit("--pin needs Linux and at least two CPUs")
    served, loading = ({cpus[-1]}, set(cpus[:-1])) if args.pin else (None, None)
    if loading:
        os.sched_setaffinity(0, loading)
    requests = args.requests or (1000 if memory else 2000)
    folding = args.separate_worker or args.in_process > 0
    if not folding:
        args.settle_seconds = 0  # nothing will summarise the seeded conversations
    workdir = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    fake_port, gw_port, ref_port = free_port(), free_port(), free_port()
    config = workdir / "gateway.yaml"
    config.write_text(
        f"upstreams:\n  openai:\n    base_url: http://127.0.0.1:{fake_port}/v1\n"
        f"store:\n  url: {args.store}\nmemory:\n  enabled: {str(memory).lower()}\n"
        f"  worker:\n    in_process: {0 if args.separate_worker else args.in_process}\n"
        "server:\n  log_level: info\n")
    if memory and not args.store.startswith("memory://"):
        import redis

        redis.Redis.from_url(args.store).flushdb()
    fake = start([sys.executable, "-m", "gateway.testing", "--port", str(fake_port),
                  "--latency-ms", str(args.latency_ms), "--jitter-ms", str(args.jitter_ms)], workdir / "fake.log",
                 loading)
    procs = [start([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(gw_port)],
                   workdir / "gateway.log", served)]
    if args.separate_worker:
        procs.append(start([sys.executable, "-m", "gateway", "worker", "--config", str(config)],
                           workdir / "worker.log", served))
    ref = (start([sys.executable, str(Path(__file__).with_name("bare_relay.py")), f"http://127.0.0.1:{fake_port}",
                  str(ref_port)], workdir / "reference.log", served) if args.reference else None)
    gw_log = GatewayLog(workdir / "gateway.log")
    try:
        await wait_up(f"http://127.0.0.1:{fake_port}/v1/models", fake)
        await wait_up(f"http://127.0.0.1:{gw_port}/healthz", procs[0])
        if ref is not None:
            await wait_up(f"http://127.0.0.1:{ref_port}/healthz", ref)
        base = f"http://127.0.0.1:{gw_port}"
        direct, proxied = f"http://127.0.0.1:{fake_port}/v1/chat/completions", f"{base}/v1/chat/completions"
        relayed = f"http://127.0.0.1:{ref_port}/v1/chat/completions"
        print(f"{requests} timed requests per cell in {args.rounds} alternating rounds, upstream latency "
              f"{args.latency_ms:g} ms" + (f" ± {args.jitter_ms:g}" if args.jitter_ms else "")
              + f", {os.cpu_count()} CPUs"
              + (f" (gateway on CPU {cpus[-1]}, load and fake upstream on {','.join(map(str, cpus[:-1]))})"
                 if args.pin else "") + ", memory "
              + (f"on ({args.store}), histories of N to N+{2 * args.per_conversation} messages, folds "
                 f"{'in a separate worker' if args.separate_worker else 'in-process' if folding else 'off'}"
                 if memory else "off"))
        print(f"{'mode':<10}{'conc':>5}{' N':>5} | {'direct p50/p90/p99 ms':>22} | {'gateway p50/p90/p99 ms':>22} | "
              f"{'added p50/p90/p99 ms':>21} | {'rps direct/gw':>13} | {'CPU/req':>7} | "
              f"{'gateway_ms p50/p99':>18}" + (" | contexts" if memory else ""))
        for conc in (int(c) for c in args.concurrency.split(",")):
            for mode in args.modes.split(","):
                stream = mode == "stream"
                per_round = max(1, requests // args.rounds // conc)
                cells = []
                for turns in sizes:
                    d_work, g_work = (
                        Workload(turns, stream, grow=memory, header=header, tag=tag, slots=conc,
                                 per_slot=per_round * args.rounds + args.warmup // conc,
                                 per_conversation=args.per_conversation)
                        for tag, header in ((f"d{conc}{mode}{turns}", False),
                                            (f"g{conc}{mode}{turns}-{time.time_ns()}", memory)))
                    await load(direct, d_work, max(1, args.warmup // conc), conc)
                    if not memory:
                        await load(proxied, g_work, max(1, args.warmup // conc), conc)
                    if ref is not None:
                        await load(relayed, d_work, max(1, args.warmup // conc), conc)
                    cells.append(Cell(turns, d_work, g_work, cpu=[0.0] * len(procs)))
                # Conversations one block moves through, per slot (seed and warm-up requests included).
                per_block = -(-per_round // max(1, args.per_conversation - 2)) + 2
                if memory and per_block * conc * len(sizes) > CONVERSATIONS:
                    print(f"  (warning: a block moves through {per_block * conc * len(sizes)} conversations, more than "
                          f"the {CONVERSATIONS} the gateway's per-conversation caches hold: this measures their "
                          "evictions; raise --per-conversation or --rounds)")
                for _ in range(args.rounds):
                    for c in cells:
                        c.direct.add(await load(direct, c.d_work, per_round, conc))
                        if ref is not None:
                            ref_cpu0 = cpu_seconds(ref.pid)
                            c.reference.add(await load(relayed, c.d_work, per_round, conc))
                            c.ref_cpu += cpu_seconds(ref.pid) - ref_cpu0
                        if memory:
                            await seed(base, c.g_work, args.settle_seconds, per_block)
                            if folding:
                                await folds_settled(args.store)  # those the warm-up requests queued
                            await asyncio.sleep(0.2)  # their log lines are written in batches too
                        gw_log.mark()
                        redis0 = await redis_counts(args.store) if args.store.startswith("redis") else None
                        gc0 = await gc_pauses(base)  # both scrapes outside the CPU measured
                        cpu0 = [cpu_seconds(pr.pid) for pr in procs]
                        c.gateway.add(await load(proxied, c.g_work, per_round, conc))
                        c.cpu = [x + cpu_seconds(pr.pid) - x0 for x, x0, pr in zip(c.cpu, cpu0, procs, strict=True)]
                        c.gc.update(await gc_pauses(base) - gc0)
                        c.gc["blocks"] += 1
                        if redis0 is not None:
                            c.redis.update((await redis_counts(args.store)) - redis0)
                        await asyncio.sleep(0.2)  # the log is written in batches
                        c.own += gw_log.since_mark()
                        if memory and folding:
                            await folds_settled(args.store)
                for c in cells:
                    print(c.row(mode, conc, memory), flush=True)
                    if ref is not None:
                        print(c.row(mode, conc, memory, reference=True), flush=True)
    finally:
        others = (*procs, fake, *((ref,) if ref is not None else ()))
        for proc in others:
            proc.send_signal(signal.SIGINT)
        for proc in others:
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
