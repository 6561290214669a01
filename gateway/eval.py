"""`gateway eval`: replay conversations through the real gateway app and measure what memory keeps.

Each conversation of a replay file (format in DESIGN.md) is sent as a full-history client would:
for every user message, the history up to it, with an `X-Conversation-Id`. A recording upstream on
port 0 answers with the next assistant message of the data and keeps the request the gateway
forwarded. At each probe the question goes in as a user message and the forwarded request is
measured. Baselines are computed from the same data in the same run.

Billing model for the cost ratios: each request's cached part is the longest common prefix, item
by item (system blocks, injected blocks, messages), with the previous request of the conversation.
Cached tokens bill at `pricing.cache_read_factor`, the rest is written to the cache and bills at
`pricing.cache_write_factor` (the next request reads it). `warm`: the cache never expires;
`timed`: it expires when more than `--ttl` seconds passed between the two requests' message times.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import ClientSession, ClientTimeout, web

from gateway.config import Settings, load_settings

_PUNCT = re.compile(r"[^\w\s]+|_")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower case, punctuation to spaces, runs of space folded (the metric's definition)."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.lower())).strip()


# -- what a request carries, item by item ------------------------------------------------------


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict):
                if isinstance(block.get("text"), str):
                    parts.append(block["text"])
                elif "content" in block:
                    parts.append(_content_text(block["content"]))
            elif isinstance(block, str):
                parts.append(block)
        return "\n".join(parts)
    return ""


def request_items(body: dict[str, Any]) -> list[str]:
    """The texts of a chat request's items in order: system blocks, then messages."""
    items: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        items.append(system)
    elif isinstance(system, list):
        items.extend(_content_text([b]) for b in system)
    for m in body.get("messages", []):
        items.append(_content_text(m.get("content")))
    return items


# -- strategies ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ProbeResult:
    category: str
    evidence_recall: float | None  # None: probe without evidence
    answer_found: bool | None  # None: answer not in the full history
    tokens: int
    full_tokens: int


@dataclass(slots=True)
class StrategyScore:
    probes: list[ProbeResult] = field(default_factory=list)
    billed: float = 0.0
    billed_timed: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def summary(self, full_billed: float, full_billed_timed: float) -> dict[str, Any]:
        out = _aggregate(self.probes)
        out["cost_ratio_warm"] = self.billed / full_billed if full_billed else 0.0
        out["cost_ratio_timed"] = self.billed_timed / full_billed_timed if full_billed_timed else 0.0
        if self.latencies:
            lat = sorted(self.latencies)
            out["latency_ms_p50"] = 1000 * statistics.median(lat)
            out["latency_ms_p99"] = 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        cats: dict[str, list[ProbeResult]] = {}
        for p in self.probes:
            cats.setdefault(p.category, []).append(p)
        out["by_category"] = {c: _aggregate(ps) for c, ps in sorted(cats.items())}
        return out


def _aggregate(probes: Sequence[ProbeResult]) -> dict[str, Any]:
    ev = [p.evidence_recall for p in probes if p.evidence_recall is not None]
    ans = [p.answer_found for p in probes if p.answer_found is not None]
    ratios = [p.tokens / p.full_tokens for p in probes if p.full_tokens]
    return {
        "probes": len(probes),
        "evidence_recall": statistics.fmean(ev) if ev else 0.0,
        "answer_recall": statistics.fmean(1.0 if a else 0.0 for a in ans) if ans else 0.0,
        "tokens_ratio": statistics.fmean(ratios) if ratios else 0.0,
        "mean_tokens": statistics.fmean(p.tokens for p in probes) if probes else 0.0,
    }


class Biller:
    """Billed input of one conversation's request sequence under prompt caching."""

    def __init__(self, count: Callable[[str], int], read: float, write: float, ttl: float) -> None:
        self.count, self.read, self.write, self.ttl = count, read, write, ttl
        self._prev: list[str] = []
        self._prev_time: float | None = None
        self.warm = 0.0
        self.timed = 0.0

    def add(self, items: list[str], when: float | None) -> None:
        common = 0
        for a, b in zip(items, self._prev, strict=False):
            if a != b:
                break
            common += 1
        sizes = [self.count(i) for i in items]
        cached = sum(sizes[:common])
        fresh = sum(sizes[common:])
        self.warm += self.read * cached + self.write * fresh
        expired = when is None or self._prev_time is None or when - self._prev_time > self.ttl
        if expired and self._prev_time is not None and when is not None:
            self.timed += self.write * (cached + fresh)
        else:
            self.timed += self.read * cached + self.write * fresh
        self._prev, self._prev_time = items, when


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def _probe_result(forwarded: list[str], conv: dict[str, Any], probe: dict[str, Any],
                  count: Callable[[str], int], full_tokens: int, full_norm: str) -> ProbeResult:
    text = normalise("\n".join(forwarded))
    evidence = probe.get("evidence") or []
    ev_recall = None
    if evidence:
        kept = sum(1 for i in evidence if normalise(conv["messages"][i]["content"]) in text)
        ev_recall = kept / len(evidence)
    answers = [normalise(str(a)) for a in probe.get("answers") or [] if normalise(str(a))]
    found = None
    if answers and any(a in full_norm for a in answers):
        found = any(a in text for a in answers)
    tokens = sum(count(i) for i in forwarded)
    return ProbeResult(probe.get("category", "all"), ev_recall, found, tokens, full_tokens)


# -- baselines ----------------------------------------------------------------------------------


def baseline_items(name: str, system: str | None, history: list[dict[str, Any]], question: str,
                   summarize: Callable[[list[dict[str, Any]]], str]) -> list[str]:
    """Items a baseline strategy would send for `history` + the question."""
    sys_items = [system] if system else []
    msgs = [m["content"] for m in history]
    if name == "full":
        kept = msgs
    elif name == "window10":
        kept = msgs[-10:]
    elif name == "first3+last25":
        kept = msgs if len(msgs) <= 28 else msgs[:3] + msgs[-25:]
    elif name == "summary+last6":
        older = history[:-6]
        return [*sys_items, *( [summarize(older)] if older else []), *msgs[-6:], question]
    else:
        raise ValueError(name)
    return [*sys_items, *kept, question]


BASELINES = ("full", "window10", "first3+last25", "summary+last6")


# -- the replay ---------------------------------------------------------------------------------


class Recorder:
    """A fake OpenAI upstream that answers with scripted replies and keeps what it was sent."""

    def __init__(self) -> None:
        self.replies: dict[str, str] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.app = web.Application(client_max_size=256 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self._chat)

    async def _chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        conv = request.headers.get("X-Conversation-Id", "")
        if conv:
            self.last[conv] = body
            reply = self.replies.get(conv, "")
        else:  # the gateway's own summarizer call (llm mode): a plain extract stands in
            text = "\n".join(_content_text(m.get("content")) for m in body.get("messages", []))
            reply = "\n".join(line for line in text.splitlines()[:40] if line.strip())
        payload = {
            "id": "chatcmpl-eval", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }
        return web.Response(body=orjson.dumps(payload), content_type="application/json")


def load_dataset(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                out.append(orjson.loads(line))
                if limit and len(out) >= limit:
                    break
    return out


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / total) if total else width
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
    sys.stderr.flush()


async def run_eval(settings: Settings, conversations: list[dict[str, Any]], *, settle: bool,
                   ttl: float = 300.0, model: str = "gpt-4o", progress: bool = True) -> dict[str, Any]:
    # Imported here: the app pulls in every module, the pure helpers above do not need it.
    from gateway.app import create_app
    from gateway.tokens import TokenCounter

    counter = TokenCounter(settings.models)

    @functools.lru_cache(maxsize=200_000)
    def count(text: str) -> int:
        # Every strategy's requests repeat the same messages: each text is tokenised once per run.
        return counter.count(text, "gpt-4")

    recorder = Recorder()
    rec_runner = web.AppRunner(recorder.app)
    await rec_runner.setup()
    rec_site = web.TCPSite(rec_runner, "127.0.0.1", 0)
    await rec_site.start()
    rec_port = rec_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    data = settings.model_dump()
    data["upstreams"]["openai"] |= {"base_url": f"http://127.0.0.1:{rec_port}/v1", "api_key": None}
    data["auth"] = {"keys": [], "admin_token": None}
    settings = Settings.model_validate(data)
    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    replay = Replay(app, recorder, f"http://127.0.0.1:{port}/v1/chat/completions", settings, count,
                    settle=settle, ttl=ttl, model=model, progress=progress)
    replay.total = sum(1 for c in conversations for m in c["messages"] if m["role"] == "user")
    replay.total += sum(len(c.get("probes") or []) for c in conversations)
    try:
        async with ClientSession(timeout=ClientTimeout(total=600)) as http:
            replay.http = http
            for conv in conversations:
                await replay.conversation(conv)
    finally:
        if progress:
            sys.stderr.write("\n")
        await runner.cleanup()
        await rec_runner.cleanup()

    full = replay.scores["full"]
    return {"strategies": {name: s.summary(full.billed, full.billed_timed) for name, s in replay.scores.items()},
            "conversations": len(conversations), "settled": settle}


class Replay:
    """One run: sends each conversation through the gateway and scores every strategy."""

    def __init__(self, app: web.Application, recorder: Recorder, url: str, settings: Settings,
                 count: Callable[[str], int], *, settle: bool, ttl: float, model: str, progress: bool) -> None:
        self.app, self.recorder, self.url, self.count = app, recorder, url, count
        self.settle, self.ttl, self.model, self.progress = settle, ttl, model, progress
        self.cap = settings.memory.max_summary_tokens
        self.pricing = settings.pricing
        self.scores = {name: StrategyScore() for name in ("gateway", *BASELINES)}
        self.http: ClientSession | None = None
        self.total = 0
        self.done = 0

    async def _send(self, cid: str, system: str | None, history: list[dict[str, Any]],
                    reply: str) -> tuple[dict[str, Any], float]:
        assert self.http is not None
        self.recorder.replies[cid] = reply
        messages = ([{"role": "system", "content": system}] if system else []) + history
        body = orjson.dumps({"model": self.model, "messages": messages})
        t0 = time.perf_counter()
        async with self.http.post(self.url, data=body, headers={
                "Content-Type": "application/json", "Authorization": "Bearer sk-eval",
                "X-Conversation-Id": cid}) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"gateway answered {resp.status} for {cid}")
        return self.recorder.last[cid], time.perf_counter() - t0

    async def _settle(self) -> None:
        from gateway.app import drain_background
        from gateway.worker import settle as settle_folds

        await drain_background(self.app)  # the last turn is recorded (and its fold queued) first
        try:
            await settle_folds(self.app)
        except TimeoutError:
            sys.stderr.write("\nwarning: folds still pending after the settle timeout\n")

    async def conversation(self, conv: dict[str, Any]) -> None:
        from gateway.summarizer import extractive_summary

        cid, msgs, system = f"eval-{conv['id']}", conv["messages"], conv.get("system")
        billers = {name: Biller(self.count, self.pricing.cache_read_factor, self.pricing.cache_write_factor,
                                self.ttl) for name in self.scores}
        probes_at: dict[int, list[dict[str, Any]]] = {}
        for p in conv.get("probes") or []:
            probes_at.setdefault(int(p["after"]), []).append(p)
        summaries: dict[int, str] = {}

        def summarize(older: list[dict[str, Any]]) -> str:
            # Rolling like a real summary+window client: re-summarised every 10 messages.
            bucket = len(older) - len(older) % 10
            if bucket not in summaries:
                summaries[bucket] = extractive_summary(
                    [(m["role"], m["content"]) for m in older[:bucket]], self.cap, self.count)
            return summaries[bucket]

        async def request(history: list[dict[str, Any]], question: str, reply: str, when: float | None,
                          probe: dict[str, Any] | None) -> None:
            forwarded, latency = await self._send(cid, system, [*history, {"role": "user", "content": question}],
                                                  reply)
            items = request_items(forwarded)
            billers["gateway"].add(items, when)
            self.scores["gateway"].latencies.append(latency)
            per_strategy = {name: baseline_items(name, system, history, question, summarize) for name in BASELINES}
            for name, b_items in per_strategy.items():
                billers[name].add(b_items, when)
            self.done += 1
            if probe is None:
                if self.progress and self.done % 10 == 0:
                    _progress(self.done, self.total, conv["id"])
                return
            full_items = per_strategy["full"]
            full_tokens = sum(self.count(i) for i in full_items)
            full_norm = normalise("\n".join(full_items))
            for name, b_items in (("gateway", items), *per_strategy.items()):
                self.scores[name].probes.append(
                    _probe_result(b_items, conv, probe, self.count, full_tokens, full_norm))
            if self.progress:
                _progress(self.done, self.total, conv["id"])

        for i in range(len(msgs) + 1):
            for probe in probes_at.get(i, []):
                if self.settle:
                    await self._settle()
                await request(msgs[:i], probe["question"], "", _epoch(msgs[i - 1].get("time")) if i else None, probe)
            if i == len(msgs) or msgs[i]["role"] != "user":
                continue
            nxt = msgs[i + 1] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
            await request(msgs[:i], msgs[i]["content"], nxt["content"] if nxt else "", _epoch(msgs[i].get("time")),
                          None)
        for name, biller in billers.items():
            self.scores[name].billed += biller.warm
            self.scores[name].billed_timed += biller.timed


# -- output -------------------------------------------------------------------------------------

_COLUMNS = ("evidence_recall", "answer_recall", "tokens_ratio", "mean_tokens", "cost_ratio_warm",
            "cost_ratio_timed")


def format_table(result: dict[str, Any]) -> str:
    strategies: dict[str, Any] = result["strategies"]
    lines = [f"{'strategy':<16}" + "".join(f"{c:>18}" for c in _COLUMNS)]
    for name, s in strategies.items():
        lines.append(f"{name:<16}" + "".join(
            f"{s.get(c, 0.0):>18.0f}" if c == "mean_tokens" else f"{s.get(c, 0.0):>18.3f}" for c in _COLUMNS))
    gw = strategies.get("gateway", {})
    if "latency_ms_p50" in gw:
        lines.append(f"\ngateway request latency: p50 {gw['latency_ms_p50']:.2f} ms, "
                     f"p99 {gw['latency_ms_p99']:.2f} ms (through the gateway, fake upstream)")
    cats = sorted({c for s in strategies.values() for c in s.get("by_category", {})})
    if cats:
        lines.append("\nevidence_recall / answer_recall by category")
        lines.append(f"{'category':<28}" + "".join(f"{n:>22}" for n in strategies))
        for c in cats:
            row = f"{c:<28}"
            for s in strategies.values():
                cat = s.get("by_category", {}).get(c)
                row += f"{cat['evidence_recall']:>11.3f}/{cat['answer_recall']:<10.3f}" if cat else f"{'-':>22}"
            lines.append(row)
    return "\n".join(lines)


def main(args: argparse.Namespace | Iterable[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="gateway eval")
        add_arguments(parser)
        args = parser.parse_args(list(args) if args is not None else None)
    from gateway import logs

    logs.configure("console", "warning", sys.stderr)  # stdout carries the table
    settings = load_settings(args.config)
    if args.summarizer:
        data = settings.model_dump()
        data["memory"]["summarizer"]["mode"] = args.summarizer
        settings = Settings.model_validate(data)
    conversations = load_dataset(args.dataset, getattr(args, "limit", None))
    started = time.perf_counter()
    result = asyncio.run(run_eval(settings, conversations, settle=args.settle, ttl=getattr(args, "ttl", 300.0)))
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(format_table(result))
    print(f"\n{len(conversations)} conversations in {result['seconds']} s"
          f"{' (folds settled before each probe)' if args.settle else ''}")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", help="replay file (JSONL)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--summarizer", choices=("extractive", "llm"), default=None)
    parser.add_argument("--settle", action="store_true", help="wait for pending folds before each probe")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    parser.add_argument("--ttl", type=float, default=300.0, help="prompt-cache lifetime for cost_ratio_timed")
