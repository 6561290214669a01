"""`gateway eval`: replay conversations through the real gateway app and measure what memory keeps.

Each conversation of a replay file (format in DESIGN.md) is sent as a full-history client would:
for every user message, the history up to it, with an `X-Conversation-Id` (and the message's
`time` as `X-Message-Time`, so the gateway dates the turns as they were, not as replayed). A recording upstream on
port 0 answers with the next assistant message of the data and keeps the request the gateway
forwarded. At each probe the question goes in as a user message and the forwarded request is
measured. Baselines are computed from the same data in the same run. With `--settle` the folds
(and embeddings) a turn queued finish before the next turn or probe is sent, as they do on a live
gateway whose user takes seconds to minutes between turns; without it the replay outruns them.

Billing model for the cost ratios: each request's cached part is the longest common prefix, item
by item (system blocks, injected blocks, messages), with the previous request of the conversation.
Cached tokens bill at the model's `pricing.<model>.cache_read`, the rest is written to the cache and
bills at its `cache_write` (the next request reads it). `warm`: the cache never expires; `timed`: it
expires when more than `--ttl` seconds (default: the model's `cache_ttl_seconds`) passed between the
two requests' message times. The prices are the config's `pricing` entry for the replayed `--model`,
which the gateway's own cost decisions use too (a Claude model by default: Anthropic's cache write
premium is the case hardest for a rewrite).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import re
import statistics
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import ClientSession, ClientTimeout, web

from gateway import logs
from gateway.app import HOOK, STORE, create_app, drain_background
from gateway.config import Settings, load_settings
from gateway.memory import Memory
from gateway.summarizer import extractive_summary
from gateway.tokens import TokenCounter
from gateway.worker import settle as settle_folds

_PUNCT = re.compile(r"[^\w\s]+|_")
_SPACE = re.compile(r"\s+")
DEFAULT_MODEL = "claude-sonnet-4"


def normalise(text: str) -> str:
    """Lower case, punctuation to spaces, runs of space folded (the metric's definition)."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.lower())).strip()


# -- fact_recall: the evidence's salient terms --------------------------------------------------

_SURROUNDING = ".,;:!?()[]{}\"'`"
_JOINED = re.compile(r"[A-Za-z0-9][_./:-][A-Za-z0-9]")
_DIGIT = re.compile(r"\d")
_SENTENCE_END = (".", "!", "?")


def salient_terms(texts: Iterable[str]) -> list[str]:
    """Distinct normalised tokens that look like facts: numbers, joined identifiers, and capitalised
    words that do not merely start a sentence."""
    terms: dict[str, None] = {}
    for text in texts:
        for line in text.splitlines():
            starts_sentence = True
            for raw in line.split():
                token = raw.strip(_SURROUNDING)
                if token and (_DIGIT.search(token) or _JOINED.search(token)
                              or (not starts_sentence and any(c.isupper() for c in token))):
                    term = normalise(token)
                    if term:
                        terms.setdefault(term)
                starts_sentence = raw.endswith(_SENTENCE_END)
    return list(terms)


def occurs(term: str, padded: str) -> bool:
    """`term` appears as whole words in a normalised text given as `" " + text + " "`."""
    return f" {term} " in padded


def probe_terms(conv: dict[str, Any], probe: dict[str, Any]) -> list[str]:
    """The probe's salient evidence terms less those its question already says."""
    evidence = probe.get("evidence") or []
    question = f" {normalise(str(probe.get('question', '')))} "
    texts = [_content_text(conv["messages"][i]["content"]) for i in evidence]
    return [t for t in salient_terms(texts) if not occurs(t, question)]


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
    fact_recall: float | None  # None: no salient evidence term left to look for
    answer_found: bool | None  # None: answer not in the full history
    tokens: int
    full_tokens: int


@dataclass(slots=True)
class StrategyScore:
    probes: list[ProbeResult] = field(default_factory=list)
    billed: float = 0.0
    billed_timed: float = 0.0
    over_full_warm: int = 0  # conversations billed more than their full history
    over_full_timed: int = 0
    latencies: list[float] = field(default_factory=list)

    def summary(self, full_billed: float, full_billed_timed: float) -> dict[str, Any]:
        out = _aggregate(self.probes)
        out["cost_ratio_warm"] = self.billed / full_billed if full_billed else 0.0
        out["cost_ratio_timed"] = self.billed_timed / full_billed_timed if full_billed_timed else 0.0
        out["conversations_over_full_warm"] = self.over_full_warm
        out["conversations_over_full_timed"] = self.over_full_timed
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
    facts = [p.fact_recall for p in probes if p.fact_recall is not None]
    ans = [p.answer_found for p in probes if p.answer_found is not None]
    ratios = [p.tokens / p.full_tokens for p in probes if p.full_tokens]
    return {
        "probes": len(probes),
        "evidence_recall": statistics.fmean(ev) if ev else 0.0,
        "evidence_probes": len(ev),
        "fact_recall": statistics.fmean(facts) if facts else 0.0,
        "fact_probes": len(facts),
        "answer_recall": statistics.fmean(1.0 if a else 0.0 for a in ans) if ans else 0.0,
        "answer_probes": len(ans),
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


def _probe_result(forwarded: list[str], conv: dict[str, Any], probe: dict[str, Any], terms: list[str],
                  count: Callable[[str], int], full_tokens: int, full_norm: str) -> ProbeResult:
    text = normalise("\n".join(forwarded))
    padded = f" {text} "
    facts = sum(1 for t in terms if occurs(t, padded)) / len(terms) if terms else None
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
    return ProbeResult(probe.get("category", "all"), ev_recall, facts, found, tokens, full_tokens)


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
                   ttl: float | None = None, model: str = DEFAULT_MODEL, dump: Path | None = None,
                   progress: bool = True, data_clock: bool = False, timed_pass: bool = True) -> dict[str, Any]:
    if ttl is None:
        ttl = settings.price(model).cache_ttl_seconds
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
    # The timed regime's bill comes from a gateway living on the data's clock, as a live one does: it
    # sees a pause leave the cache cold and decides for that. Replayed at its own pace the gateway
    # believes every cache warm, which is the warm regime's world, not this one's.
    timed_apart = (timed_pass and not data_clock
                   and any(m.get("time") for c in conversations for m in c["messages"]))

    total = sum(1 for c in conversations for m in c["messages"] if m["role"] == "user")
    total += sum(len(c.get("probes") or []) for c in conversations)

    async def replay_once(on_data_clock: bool, prefix: str, bill_only: bool) -> Replay:
        app = create_app(settings)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        replay = Replay(app, recorder, f"http://127.0.0.1:{port}/v1/chat/completions", settings, count,
                        settle=settle, ttl=ttl, model=model, dump=None if bill_only else dump, progress=progress,
                        data_clock=on_data_clock, prefix=prefix, bill_only=bill_only)
        replay.total = total
        try:
            async with ClientSession(timeout=ClientTimeout(total=600)) as http:
                replay.http = http
                for conv in conversations:
                    await replay.conversation(conv)
        finally:
            if progress:
                sys.stderr.write("\n")
            await runner.cleanup()
        return replay

    try:
        replay = await replay_once(data_clock, "eval-", False)
        timed = await replay_once(True, "eval-timed-", True) if timed_apart else None
    finally:
        await rec_runner.cleanup()

    full = replay.scores["full"]
    strategies = {name: s.summary(full.billed, full.billed_timed) for name, s in replay.scores.items()}
    gateway = strategies["gateway"]
    gateway["reasons"] = dict(replay.reasons.most_common())
    if timed is not None:
        t_full, t_gw = timed.scores["full"], timed.scores["gateway"]
        gateway["cost_ratio_timed_replay_clock"] = gateway["cost_ratio_timed"]
        gateway["cost_ratio_timed"] = t_gw.billed_timed / t_full.billed_timed if t_full.billed_timed else 0.0
        gateway["conversations_over_full_timed"] = t_gw.over_full_timed
        gateway["reasons_data_clock"] = dict(timed.reasons.most_common())
    return {"strategies": strategies,
            "conversations": len(conversations), "settled": settle, "model": model, "ttl": ttl,
            "data_clock": data_clock, "timed_on_data_clock": data_clock or timed is not None}


class Replay:
    """One run: sends each conversation through the gateway and scores every strategy."""

    def __init__(self, app: web.Application, recorder: Recorder, url: str, settings: Settings,
                 count: Callable[[str], int], *, settle: bool, ttl: float, model: str, dump: Path | None,
                 progress: bool, data_clock: bool = False, prefix: str = "eval-", bill_only: bool = False) -> None:
        self.app, self.recorder, self.url, self.count = app, recorder, url, count
        # bill_only: a replay kept for the gateway's bill alone (the timed regime's), scored on nothing else.
        self.prefix, self.bill_only = prefix, bill_only
        self.settle, self.ttl, self.model, self.dump, self.progress = settle, ttl, model, dump, progress
        self.cap = settings.memory.max_summary_tokens
        self.price = settings.price(model)
        self.scores = {name: StrategyScore() for name in ("gateway", *(("full",) if bill_only else BASELINES))}
        self.http: ClientSession | None = None
        # data_clock: the gateway's cost model sees the data's own message times, as it would have
        # live (a cache goes cold across a pause between sessions), which is the `timed` regime's
        # world; by default it sees the replay's pace (every cache warm), the `warm` regime's.
        self.now = 0.0
        hook = app.get(HOOK)
        if data_clock and isinstance(hook, Memory):
            hook.clock = lambda: self.now
        self.total = 0
        self.done = 0
        self.reasons: Counter[str] = Counter()  # x-gateway-reason of every gateway request

    async def _send(self, cid: str, system: str | None, history: list[dict[str, Any]],
                    reply: str, when: str | None = None) -> tuple[dict[str, Any], float]:
        assert self.http is not None
        self.recorder.replies[cid] = reply
        messages = ([{"role": "system", "content": system}] if system else []) + history
        body = orjson.dumps({"model": self.model, "messages": messages})
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-eval", "X-Conversation-Id": cid}
        if when:
            headers["X-Message-Time"] = when  # the data's own times, as a client replaying them would
        t0 = time.perf_counter()
        async with self.http.post(self.url, data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"gateway answered {resp.status} for {cid}")
            self.reasons[resp.headers.get("x-gateway-reason", "-")] += 1
        return self.recorder.last[cid], time.perf_counter() - t0

    async def _settle(self) -> None:
        await drain_background(self.app)  # the last turn is recorded (and its fold queued) first
        try:
            await settle_folds(self.app[STORE])
        except TimeoutError:
            sys.stderr.write("\nwarning: folds still pending after the settle timeout\n")
        embedder = getattr(getattr(getattr(self.app.get(HOOK), "caches", None), "recall", None), "embedder", None)
        if embedder is not None:
            await embedder.drain()  # messages already stored have their vectors, as between a user's turns

    async def conversation(self, conv: dict[str, Any]) -> None:
        cid, msgs, system = f"{self.prefix}{conv['id']}", conv["messages"], conv.get("system")
        billers = {name: Biller(self.count, self.price.cache_read, self.price.cache_write, self.ttl)
                   for name in self.scores}
        probes_at: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        for index, p in enumerate(conv.get("probes") or []):
            probes_at.setdefault(int(p["after"]), []).append((index, p))
        summaries: dict[int, str] = {}

        def summarize(older: list[dict[str, Any]]) -> str:
            # Rolling like a real summary+window client: re-summarised every 10 messages.
            bucket = len(older) - len(older) % 10
            if bucket not in summaries:
                summaries[bucket] = extractive_summary(
                    [(m["role"], m["content"]) for m in older[:bucket]], self.cap, self.count)
            return summaries[bucket]

        async def request(history: list[dict[str, Any]], question: str, reply: str, stamp: str | None,
                          probe: tuple[int, dict[str, Any]] | None) -> None:
            when = _epoch(stamp)
            if when is not None:
                self.now = when
            forwarded, latency = await self._send(cid, system, [*history, {"role": "user", "content": question}],
                                                  reply, stamp)
            items = request_items(forwarded)
            billers["gateway"].add(items, when)
            self.scores["gateway"].latencies.append(latency)
            per_strategy = {name: baseline_items(name, system, history, question, summarize)
                            for name in self.scores if name != "gateway"}
            for name, b_items in per_strategy.items():
                billers[name].add(b_items, when)
            self.done += 1
            if probe is None or self.bill_only:
                if self.progress and self.done % 10 == 0:
                    _progress(self.done, self.total, conv["id"])
                return
            index, spec = probe
            if self.dump is not None:
                write_dump(self.dump, conv["id"], index, spec.get("category", "all"), forwarded)
            full_items = per_strategy["full"]
            full_tokens = sum(self.count(i) for i in full_items)
            full_norm = normalise("\n".join(full_items))
            terms = probe_terms(conv, spec)
            for name, b_items in (("gateway", items), *per_strategy.items()):
                self.scores[name].probes.append(
                    _probe_result(b_items, conv, spec, terms, self.count, full_tokens, full_norm))
            if self.progress:
                _progress(self.done, self.total, conv["id"])

        for i in range(len(msgs) + 1):
            for index, probe in probes_at.get(i, []):
                if self.settle:
                    await self._settle()
                await request(msgs[:i], probe["question"], "", msgs[i - 1].get("time") if i else None,
                              (index, probe))
            if i == len(msgs) or msgs[i]["role"] != "user":
                continue
            if self.settle:
                # A live gateway has seconds to minutes between a user's turns to finish its folds;
                # the replay sends the next turn at once.
                await self._settle()
            nxt = msgs[i + 1] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
            await request(msgs[:i], msgs[i]["content"], nxt["content"] if nxt else "", msgs[i].get("time"), None)
        full = billers["full"]
        for name, biller in billers.items():
            score = self.scores[name]
            score.billed += biller.warm
            score.billed_timed += biller.timed
            score.over_full_warm += biller.warm > full.warm
            score.over_full_timed += biller.timed > full.timed


def dump_name(conversation_id: str) -> str:
    """A conversation id as one safe path component; distinct ids stay distinct.

    Percent-encoding (of `~` and `.` too) is injective and leaves no separator or dot name; an
    over-long name is cut and given a hash of the id after a `~`, which no encoded name contains.
    """
    name = urllib.parse.quote(conversation_id, safe="").replace("~", "%7E").replace(".", "%2E")
    if not name:
        return "%"  # the empty id: '%' alone is never the output of quote
    if len(name) > 200:
        name = name[:160] + "~" + hashlib.sha256(conversation_id.encode()).hexdigest()[:32]
    return name


def write_dump(root: Path, conversation_id: str, index: int, category: str, forwarded: dict[str, Any]) -> None:
    """`root/<conversation id>/<probe index>.json`: the request body the upstream received at a probe."""
    folder = root / dump_name(conversation_id)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"conversation": conversation_id, "probe": index, "category": category, "forwarded": forwarded}
    (folder / f"{index}.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))


# -- output -------------------------------------------------------------------------------------

_COLUMNS = ("evidence_recall", "fact_recall", "answer_recall", "tokens_ratio", "mean_tokens", "cost_ratio_warm",
            "cost_ratio_timed", "conversations_over_full_warm", "conversations_over_full_timed")
_HEADERS = ("evidence", "fact", "answer", "tokens_ratio", "mean_tokens", "cost_warm", "cost_timed",
            "over_full_warm", "over_full_timed")
_CATEGORY_HEADERS = ("probes", "evidence", "fact", "answer", "tokens_ratio", "mean_tokens")
_CATEGORY_COLUMNS = ("probes", "evidence_recall", "fact_recall", "answer_recall", "tokens_ratio", "mean_tokens")


# A recall over no probe (an abstention category has no evidence) prints as '-', not as a zero.
_COUNTED = {"evidence_recall": "evidence_probes", "fact_recall": "fact_probes", "answer_recall": "answer_probes"}


def _cell(column: str, scores: dict[str, Any]) -> str:
    value = scores.get(column, 0.0)
    if scores.get(_COUNTED.get(column, ""), 1) == 0:
        return f"{'-':>16}"
    if column in ("mean_tokens", "probes") or column.startswith("conversations_"):
        return f"{value:>16.0f}"
    return f"{value:>16.3f}"


def format_table(result: dict[str, Any]) -> str:
    strategies: dict[str, Any] = result["strategies"]
    lines = [f"{'strategy':<16}" + "".join(f"{h:>16}" for h in _HEADERS)]
    for name, s in strategies.items():
        lines.append(f"{name:<16}" + "".join(_cell(c, s) for c in _COLUMNS))
    lines.append("(evidence/fact/answer: evidence_recall, fact_recall, answer_recall; over_full_*: "
                 "conversations billed more than their full history)")
    gw = strategies.get("gateway", {})
    if "latency_ms_p50" in gw:
        lines.append(f"\ngateway request latency: p50 {gw['latency_ms_p50']:.2f} ms, "
                     f"p99 {gw['latency_ms_p99']:.2f} ms (through the gateway, fake upstream)")
    if gw.get("reasons"):
        lines.append("gateway decisions (x-gateway-reason): "
                     + ", ".join(f"{reason} {n}" for reason, n in gw["reasons"].items()))
    cats = sorted({c for s in strategies.values() for c in s.get("by_category", {})})
    if cats:
        lines.append(f"\n{'category':<28}{'strategy':<16}" + "".join(f"{h:>16}" for h in _CATEGORY_HEADERS))
        for c in cats:
            for i, (name, s) in enumerate(strategies.items()):
                cat = s.get("by_category", {}).get(c)
                if cat:
                    lines.append(f"{c if i == 0 else '':<28}{name:<16}"
                                 + "".join(_cell(col, cat) for col in _CATEGORY_COLUMNS))
    return "\n".join(lines)


def main(args: argparse.Namespace | Iterable[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="gateway eval")
        add_arguments(parser)
        args = parser.parse_args(list(args) if args is not None else None)
    logs.configure("console", "warning", sys.stderr)  # stdout carries the table
    settings = load_settings(args.config)
    if args.summarizer:
        data = settings.model_dump()
        data["memory"]["summarizer"]["mode"] = args.summarizer
        settings = Settings.model_validate(data)
    model = getattr(args, "model", None) or DEFAULT_MODEL
    if not settings.priced(model):
        # Without an entry the gateway would decide, and the bill be priced, as `pricing.default`, unnoticed.
        known = ", ".join(sorted(k for k in settings.pricing if k != "default"))
        sys.stderr.write(f"gateway eval: --model {model} matches no entry of the config's pricing ({known})\n")
        return 2
    conversations = load_dataset(args.dataset, getattr(args, "limit", None))
    dump = Path(args.dump) if getattr(args, "dump", None) else None
    started = time.perf_counter()
    ttl = getattr(args, "ttl", None)
    ttl = settings.price(model).cache_ttl_seconds if ttl is None else ttl
    result = asyncio.run(run_eval(settings, conversations, settle=args.settle, ttl=ttl, model=model, dump=dump,
                                  data_clock=bool(getattr(args, "data_clock", False)),
                                  timed_pass=not getattr(args, "one_replay", False)))
    result["seconds"] = round(time.perf_counter() - started, 1)
    second_replay = result["timed_on_data_clock"] and not result["data_clock"]
    print(format_table(result))
    print(f"\n{len(conversations)} conversations in {result['seconds']} s, model {model}"
          f"{' (folds settled before each turn and probe)' if args.settle else ''}"
          f"{'; the gateway saw the data clock' if result['data_clock'] else ''}"
          f"{'; timed: a second replay, the gateway on the data clock' if second_replay else ''}")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", metavar="DATASET", help="replay file (JSONL)")
    parser.add_argument("--config", default=None,
                        help="YAML config file (default: $GATEWAY_CONFIG, else built-in defaults)")
    parser.add_argument("--summarizer", choices=("extractive", "llm"), default=None)
    parser.add_argument("--settle", action="store_true",
                        help="wait for pending folds (and embeddings) before each turn and probe, as a live "
                        "gateway has them done between a user's turns")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--dump", default=None, metavar="DIR",
                        help="write each probe's forwarded request to DIR/<conversation id>/<probe index>.json")
    parser.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model the replay asks for; the gateway decides and the bill prices with its config "
                        f"(default {DEFAULT_MODEL})")
    parser.add_argument("--data-clock", action="store_true",
                        help="the gateway's cost model sees the data's message times (caches go cold across "
                        "pauses, as live) instead of the replay's pace (always warm)")
    parser.add_argument("--one-replay", action="store_true",
                        help="bill the timed regime on the same replay (faster; the gateway then believes every "
                        "cache warm) instead of a second one on the data's clock")
    parser.add_argument("--ttl", type=float, default=None,
                        help="prompt-cache lifetime for cost_ratio_timed (default: the model's cache_ttl_seconds)")
