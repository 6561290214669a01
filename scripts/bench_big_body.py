"""How long one very large request holds the gateway's event loop (issue: no step may stall it).

Starts `gateway serve` (its own process) in front of a fake upstream (this process, port 0), then
for each body shape sends `--repeat` first requests of about `--mb` megabytes, each on a new
conversation, while a poller (a process of its own) asks `GET /healthz` every 2 ms. The loop's stall is what the poller
sees: the slowest /healthz answer while the big request is in flight (after it too, until its
fold is done: `--settle` seconds), against the idle median. Prints one line per shape: status,
request time, the worst and second-worst /healthz times while requests were in flight over all
repeats, and the worst in the seconds after them. Each conversation is deleted once measured.

    python scripts/bench_big_body.py --redis redis://127.0.0.1:6379/12
    python scripts/bench_big_body.py --store memory:// --mb 30 --repeat 5 --shapes messages,one-text

Shapes: `messages` (2,000 messages), `small` (60,000 messages of ~500 bytes: over memory.max_messages
is not the point; the parse is), `one-text` (one message holding the whole body, ASCII), `code`
(one message of code: escaped quotes, backslashes, non-ASCII), `anthropic` (2,000 messages on
/v1/messages), `resend` (the `messages` body again with one more message, on the same conversation),
`images` (four user messages with a picture each, as a data URL: few tokens, stored whole).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import socket
import statistics
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

WORDS = ("we", "decided", "to", "use", "PostgreSQL", "16", "for", "the", "orders", "service", "because", "the",
         "cache", "in", "Redis", "kept", "latency", "low", "and", "the", "deploy", "goes", "out", "on", "Friday")
CODE = 'def f{}(x):\n    return "a\\\\b" + x  # {{é}} [1, 2]\n'
SHAPES = ("messages", "small", "one-text", "code", "anthropic", "resend", "images")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n // 6 + 1))[:n]


def body(shape: str, mb: float, rng: random.Random) -> tuple[str, dict[str, Any]]:
    size = int(mb * 1_000_000)
    if shape in ("messages", "anthropic", "resend"):
        n = 2000
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng, size // n)} for i in range(n)]
    elif shape == "images":  # four pictures as data URLs: stored whole, though they count few tokens
        msgs = []
        for i in range(4):
            picture = base64.b64encode(rng.randbytes(size // 4 * 3 // 4)).decode()
            msgs += [{"role": "user", "content": [{"type": "text", "text": f"what is in picture {i}?"},
                                                  {"type": "image_url",
                                                   "image_url": {"url": "data:image/png;base64," + picture}}]},
                     {"role": "assistant", "content": _text(rng, 400)}]
    elif shape == "small":
        n = size // 500
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng, 450)} for i in range(n)]
        msgs[-1]["role"] = "user"
    elif shape == "one-text":
        msgs = [{"role": "user", "content": _text(rng, size)}]
    else:  # (its escapes make the JSON about 1.2x the text)
        text = "".join(CODE.format(rng.randrange(10**6)) for _ in range(size * 5 // 6 // len(CODE)))
        msgs = [{"role": "user", "content": text}]
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "and now?"})
    if shape == "anthropic":
        return "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 256, "messages": msgs}
    return "/v1/chat/completions", {"model": "gpt-4o", "messages": msgs}


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            try:
                async with http.get(url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the gateway did not start")


POLLER = """
import http.client, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]))
out = open(sys.argv[3], "w", buffering=1)
while True:
    t = time.monotonic()
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
    except OSError:
        conn.close()
        conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]))
        continue
    out.write(f"{t} {(time.monotonic() - t) * 1000}\\n")
    time.sleep(0.002)
"""


class Poller:
    """`GET /healthz` every 2 ms from a process of its own: this one's event loop (the fake upstream
    parses what the gateway forwards, tens of MB) must not delay what is measured."""

    def __init__(self, port: int, folder: Path) -> None:
        self.path = folder / "healthz.txt"
        self.proc = subprocess.Popen([sys.executable, "-c", POLLER, "127.0.0.1", str(port), str(self.path)])

    def between(self, start: float, end: float) -> list[float]:
        """Latencies (ms) of the polls sent from `start` to `end` (time.monotonic)."""
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and start <= float(parts[0]) < end:
                out.append(float(parts[1]))
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def one(url: str, path: str, raw: bytes, conv: str, settle: float,
              poller: Poller) -> tuple[int, float, list[float], list[float], float]:
    """(status, request seconds, /healthz ms while in flight, then while settling, idle median ms)."""
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench-big-body",
               "x-api-key": "sk-bench-big-body", "anthropic-version": "2023-06-01", "x-conversation-id": conv}
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(0.5)
        t = time.monotonic()
        async with http.post(url + path, data=raw, headers=headers) as r:
            status = r.status
            await r.read()
        done = time.monotonic()
        await asyncio.sleep(settle)
        # What the request stored (tens of MB) does not stay in the store.
        async with http.delete(url + "/gateway/conversations/" + conv, headers=headers) as r:
            await r.read()
    # (A poll in flight when the answer came is counted with the request.)
    idle = statistics.median(poller.between(t - 0.5, t) or [0.0])
    return status, done - t, poller.between(t, done), poller.between(done, done + settle), idle


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", default=None, help="store URL (default: memory://, the embedded store)")
    p.add_argument("--mb", type=float, default=30.0, help="body size in MB (the default limit is 33.5)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--settle", type=float, default=3.0, help="seconds polled after each answer (its fold)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-offload", action="store_true",
                   help="server.offload: false (the gateway's own process serves every body)")
    args = p.parse_args()
    async with FakeUpstream(record=False) as fake:
        tmp = Path(tempfile.mkdtemp(prefix="gw-bigbody-"))
        server: dict[str, Any] = {"log_level": "warning"}
        if args.no_offload:
            server["offload"] = False
        cfg = {"store": {"url": args.redis or "memory://"}, "server": server,
               "upstreams": {"openai": {"base_url": fake.url + "/v1"}, "anthropic": {"base_url": fake.url}}}
        (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = (tmp / "gateway.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",  # noqa: ASYNC220 (before timing)
                                 str(tmp / "gw.yaml"), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        poller = None
        try:
            await wait_ready(url)
            poller = Poller(port, tmp)
            print(f"{'shape':10} {'MB':>5} {'status':>6} {'request s':>9} {'healthz idle ms':>15} "
                  f"{'max ms':>7} {'2nd ms':>7} {'after: max ms':>13}  (over {args.repeat} requests; "
                  f"after: the {args.settle:g} s after each answer, its fold)")
            for shape in args.shapes.split(","):
                rng = random.Random(7)
                worst: list[float] = []
                after: list[float] = []
                statuses, times, idles = set(), [], []
                for i in range(args.repeat):
                    # New text each time: a repeat would find its token counts cached.
                    path, doc = body(shape, args.mb, rng)
                    conv = f"big-{shape}-{i}-{random.random()}"
                    raw = json.dumps(doc, ensure_ascii=False).encode()
                    if shape == "resend":  # the first body learned, then the same history and one more message
                        await one(url, path, raw, conv, args.settle, poller)
                        more = {**doc, "messages": [*doc["messages"], {"role": "assistant", "content": "ok"},
                                                    {"role": "user", "content": "one more"}]}
                        raw = json.dumps(more, ensure_ascii=False).encode()
                    status, took, lat, settling, idle = await one(url, path, raw, conv, args.settle, poller)
                    statuses.add(status)
                    times.append(took)
                    idles.append(idle)
                    worst += sorted(lat)[-2:]
                    after += settling
                worst.sort()
                print(f"{shape:10} {len(raw) / 1e6:5.1f} {','.join(map(str, sorted(statuses))):>6} "
                      f"{statistics.median(times):9.3f} {statistics.median(idles):15.2f} "
                      f"{worst[-1]:7.1f} {worst[-2]:7.1f} {max(after, default=0):13.1f}", flush=True)
        finally:
            if poller is not None:
                poller.close()
            proc.terminate()
            proc.wait(30)
            log.close()


if __name__ == "__main__":
    asyncio.run(main())
