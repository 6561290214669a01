"""`gateway demo`: an offline tour. Two conversations go through the real gateway (embedded store,
in-process folds) to a built-in simulated OpenAI upstream, the way an app using the OpenAI SDK would
send them: the whole history every turn. A long coding conversation (files pasted, code answered),
where the rewrite pays; then a short chat, where the gateway declines to rewrite and says why. Per
turn it prints the tokens and the input the provider is expected to bill (in fresh-token
equivalents, its prompt cache counted, `x-gateway-cost-*`), without and with memory; the totals at
the end; then what the gateway remembers. Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import ClientSession, web

from gateway import logs
from gateway.app import SETTINGS, STORE, create_app, drain_background
from gateway.config import Settings
from gateway.testing import FakeUpstream
from gateway.worker import settle

SYSTEM = "You are a senior engineer helping build a small web service. Be concrete."
MODEL = "gpt-4o-mini"  # the coding conversation's model: cached input at half price, no write premium
CHAT_MODEL = "gpt-5-mini"  # the short chat's: cached input at a tenth

OPENING = [
    "Hi! My name is Dana. The goal is to build a URL shortener service for our team wiki.",
    "We decided to use Python with FastAPI and PostgreSQL 16; Redis will cache hot links.",
    "Constraint: it must run on a single 2-core VM and we cannot use any paid SaaS.",
    "I prefer short, readable code over clever tricks. Please keep functions under 40 lines.",
]
WORK = [
    "How should I structure the {part} module?",
    "The {part} tests fail with a timeout on CI; what could cause that?",
    "Can you review this approach for {part}: a small class with two methods and a cache?",
    "What logging should {part} have in production?",
    "TODO: add rate limiting to {part} before the launch on March 3rd.",
    "We chose to store {part} settings in environment variables, not in a YAML file.",
    "Is there a simpler way to write the {part} migration script at scripts/migrate_{name}.py?",
    "How do I benchmark {part} under 200 requests per second?",
]
PARTS = ["redirect", "analytics", "auth", "admin page", "link expiry", "QR codes", "API keys", "backup"]

CHAT = [
    "Hey, quick one: what's a good name for a team lunch channel?",
    "Ha, I like that. Should it be public or private?",
    "Makes sense. Any idea for a first post there?",
    "Nice. We usually go to the noodle place on Friday.",
    "Some people are vegetarian, is that a problem there?",
    "Great. How many people fit at one table, typically?",
    "We are nine, so two tables then. Should I book?",
    "Booking for 12:30 sounds right. Remind me what to say on the phone?",
]


def _code(part: str, turn: int) -> str:
    """The file a developer pastes with a question about `part` (what makes coding histories long)."""
    name = part.replace(" ", "_")
    cls = "".join(w.capitalize() for w in part.split())
    return (
        f"\n\nHere is app/{name}.py as it stands (revision {turn}):\n\n```python\n"
        f"import logging\nfrom dataclasses import dataclass\n\nlog = logging.getLogger(__name__)\n\n\n"
        f"@dataclass\nclass {cls}Config:\n    enabled: bool = True\n    timeout_s: float = {1 + turn % 5}.5\n"
        f"    max_items: int = {100 * (1 + turn % 7)}\n\n\n"
        f"class {cls}Service:\n    def __init__(self, db, cache, config: {cls}Config) -> None:\n"
        f"        self.db, self.cache, self.config = db, cache, config\n\n"
        f"    async def handle(self, request):\n        key = f\"{name}:{{request.id}}\"\n"
        f"        cached = await self.cache.get(key)\n        if cached is not None:\n            return cached\n"
        f"        row = await self.db.fetchrow(\"SELECT * FROM {name} WHERE id = $1\", request.id)\n"
        f"        if row is None:\n            log.info(\"{name}.missing\", extra={{\"id\": request.id}})\n"
        f"            return None\n        await self.cache.set(key, row, ttl=self.config.timeout_s)\n"
        f"        return row\n```"
    )


def _question(rng: random.Random, turn: int) -> str:
    if turn < len(OPENING):
        return OPENING[turn]
    part = rng.choice(PARTS)
    question = rng.choice(WORK).format(part=part, name=part.replace(" ", "_"))
    return question + _code(part, turn) if turn % 2 == 0 else question


def _answer(body: dict[str, Any]) -> str:
    last = body["messages"][-1]["content"]
    topic = last.split("?")[0].split("\n")[0][-60:]
    if str(body.get("model", "")).startswith(CHAT_MODEL):
        return (f"Sure! About {topic!r}: keep it simple, ask the team in one short message, and give them "
                "a day to answer before you decide. People like being asked.")
    fn = "".join(c if c.isalnum() else "_" for c in topic.lower().split()[-1]) if topic.split() else "step"
    return (f"Good question about {topic!r}. Keep it small: one module, one responsibility, a unit test per "
            "behaviour, and measure before optimising. Start with the simplest version that works, for example:"
            f"\n\n```python\nasync def {fn}_once(service, request, *, retries: int = 2):\n"
            "    for attempt in range(retries + 1):\n        try:\n"
            "            return await asyncio.wait_for(service.handle(request), timeout=2.0)\n"
            "        except asyncio.TimeoutError:\n"
            "            log.warning(\"timeout\", extra={\"attempt\": attempt, \"id\": request.id})\n"
            "    raise RuntimeError(\"gave up after retries\")\n```\n\n"
            "Then add a test that fakes the cache and the database, and check the p99 latency before and after.")


def _showing(body: dict[str, Any]) -> str:
    """The simulated upstream's answer, after printing what it received: the project state included."""
    messages = body.get("messages") or []
    injected = "\n".join(m["content"] for m in messages
                         if m.get("role") == "system" and isinstance(m.get("content"), str))
    state = injected.split("## Project state", 1)[1].split("\n## ", 1)[0] if "## Project state" in injected else ""
    print(f"simulated upstream received {len(messages)} messages; the project state it got:")
    print("  " + "\n  ".join(line for line in state.splitlines()[1:] if line.strip()) if state else "  (none)",
          flush=True)
    return _answer(body)


DEMO_KEY = "sk-demo-key"
CONVERSATION = "demo-url-shortener"
CHAT_CONVERSATION = "demo-lunch-chat"


@dataclass
class Demo:
    base: str  # the gateway's URL
    app: web.Application
    fake: Any  # the simulated upstream (gateway.testing.FakeUpstream)
    history: list[dict[str, Any]] = field(default_factory=lambda: [{"role": "system", "content": SYSTEM}])


@asynccontextmanager
async def running(port: int = 0) -> AsyncIterator[Demo]:
    """The real gateway (embedded store, in-process folds, shipped defaults) in front of a simulated
    OpenAI upstream."""
    # The simulated provider reports prompt-cache reads as OpenAI does (the gateway calibrates by them).
    async with FakeUpstream(responder=_answer, prompt_cache=True) as fake:
        settings = Settings.model_validate({"upstreams": {"openai": {"base_url": fake.openai_base_url}}})
        app = create_app(settings)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        try:
            await site.start()
            bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            yield Demo(f"http://127.0.0.1:{bound}", app, fake)
        finally:
            await runner.cleanup()


@dataclass
class Totals:
    turns: int = 0
    tokens_original: int = 0
    tokens_forwarded: int = 0
    cost_original: int = 0
    cost_forwarded: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, h: Any) -> None:
        self.turns += 1
        self.tokens_original += int(h.get("x-gateway-tokens-original", 0))
        self.tokens_forwarded += int(h.get("x-gateway-tokens-forwarded", 0))
        self.cost_original += int(h.get("x-gateway-cost-original", 0))
        self.cost_forwarded += int(h.get("x-gateway-cost-forwarded", 0))
        reason = h.get("x-gateway-reason", "?")
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def lines(self, usd_per_mtok: float) -> list[str]:
        def pct(a: int, b: int) -> str:
            return f"{100 * (a - b) / max(a, 1):.0f}%"

        tokens, cost = (self.tokens_original, self.tokens_forwarded), (self.cost_original, self.cost_forwarded)
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        cost_usd = (self.cost_original - self.cost_forwarded) * usd_per_mtok / 1e6
        return [f"{self.turns} turns ({why}):",
                f"  prompt tokens   {self.tokens_original:>9} without memory, {self.tokens_forwarded:>9} with it: "
                f"{tokens[0] - tokens[1]} fewer ({pct(*tokens)})",
                f"  expected bill   {self.cost_original:>9} without memory, {self.cost_forwarded:>9} with it: "
                f"{cost[0] - cost[1]} saved ({pct(*cost)}; "
                f"${cost_usd:.4f} at list price)"]


HEADER = (f"{'turn':>5} {'context':<10} {'reason':<16} {'tokens: full':>12} {'forwarded':>10}"
          f" {'bill: full':>11} {'forwarded':>10}")
BILL_NOTE = ("(bill: the input the provider is expected to charge, in fresh-token equivalents, its prompt cache\n"
             " counted: x-gateway-cost-original / -forwarded. The turns here come seconds apart, so the cache\n"
             " stays warm: the case least favourable to a rewrite.)")


def _row(turn: int, h: Any) -> str:
    return (f"{turn:>5} {h.get('x-gateway-context', '?'):<10} {h.get('x-gateway-reason', '?'):<16} "
            f"{h.get('x-gateway-tokens-original', '0'):>12} {h.get('x-gateway-tokens-forwarded', '0'):>10} "
            f"{h.get('x-gateway-cost-original', '0'):>11} {h.get('x-gateway-cost-forwarded', '0'):>10}")


async def _send(demo: Demo, http: ClientSession, conversation: str, model: str,
                history: list[dict[str, Any]]) -> Any:
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "X-Conversation-Id": conversation}
    async with http.post(f"{demo.base}/v1/chat/completions", headers=headers,
                         json={"model": model, "messages": history}) as resp:
        body = await resp.json(loads=orjson.loads)
        h = resp.headers
    history.append(body["choices"][0]["message"])
    await drain_background(demo.app)  # the turn is recorded and its fold queued
    await settle(demo.app[STORE])  # a real app would not wait; the demo shows a settled state
    return h


async def tour(demo: Demo, turns: int, http: ClientSession, *, quiet: bool = False) -> dict[str, Any]:
    """Send `turns` turns of the coding conversation, printing tokens and expected bill per turn; what
    the gateway keeps of it."""
    history = demo.history
    rng = random.Random(7)
    totals = Totals()
    say = (lambda *a: None) if quiet else print
    say(f"A coding conversation ({MODEL}, files pasted and answered with code):")
    say(HEADER)
    previous = None
    for turn in range(turns):
        history.append({"role": "user", "content": _question(rng, turn)})
        h = await _send(demo, http, CONVERSATION, MODEL, history)
        totals.add(h)
        reason = h.get("x-gateway-reason")
        if turn < 3 or (turn + 1) % 5 == 0 or turn == turns - 1 or reason != previous:
            say(_row(turn + 1, h))
        previous = reason
    async with http.get(f"{demo.base}/gateway/conversations/{CONVERSATION}",
                        headers={"Authorization": f"Bearer {DEMO_KEY}"}) as resp:
        info: dict[str, Any] = await resp.json(loads=orjson.loads)
    for line in totals.lines(demo.app[SETTINGS].price(MODEL).input_usd_per_mtok):
        say(line)
    info["totals"] = totals
    return info


async def chat_tour(demo: Demo, turns: int, http: ClientSession, *, quiet: bool = False) -> Totals:
    """A short chat of one-line messages: the gateway keeps forwarding it whole, and says why."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a friendly assistant."}]
    totals = Totals()
    say = (lambda *a: None) if quiet else print
    say(f"\nA short chat ({CHAT_MODEL}, one-line messages):")
    say(HEADER)
    for turn in range(turns):
        history.append({"role": "user", "content": f"{CHAT[turn % len(CHAT)]} (message {turn + 1})"})
        h = await _send(demo, http, CHAT_CONVERSATION, CHAT_MODEL, history)
        totals.add(h)
        if turn < 2 or (turn + 1) % 4 == 0 or turn == turns - 1:
            say(_row(turn + 1, h))
    for line in totals.lines(demo.app[SETTINGS].price(CHAT_MODEL).input_usd_per_mtok):
        say(line)
    say("  (cheaper-cached: this model bills a cached prefix at a tenth of fresh input, so resending the\n"
        "   whole short history costs less than a rewrite, which would be new to the cache; with\n"
        "   `memory.policy: threshold` it is rewritten anyway.)")
    return totals


async def run(turns: int, serve: bool = False, port: int = 0) -> None:
    async with running(port if serve else 0) as demo, ClientSession() as http:
        info = await tour(demo, turns, http)
        await chat_tour(demo, 24, http)
        print(BILL_NOTE)
        summary = info.get("summary") or {}
        print(f"\nStored: {info['messages']} messages; the summary covers {summary.get('covers', 0)} of them.")
        print("\nProject state the gateway keeps (sent with every rewritten request):")
        print(info.get("state_rendered") or "(none)")
        text = summary.get("text", "")
        print("\nRolling summary (first lines):")
        print("\n".join(text.splitlines()[:8]) or "(none)")
        if not serve:
            print("\nRun `gateway demo --serve` to explore it in the dashboard; `gateway serve` and point your SDK "
                  "at it to do the same with a real model.")
            return
        print(f"\nDashboard: {demo.base}/dashboard  (log in with the key {DEMO_KEY})")
        print("Edit the project state there, then send the next turn; the simulated upstream receives it:")
        print(f"  curl -s {demo.base}/v1/chat/completions -H 'Authorization: Bearer {DEMO_KEY}' "
              f"-H 'X-Conversation-Id: {CONVERSATION}' -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"gpt-4o-mini\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What did we decide?\"}}]}}'")
        print("Ctrl-C stops the demo (its store is in memory: nothing is kept).\n")
        demo.fake.responder = _showing
        await asyncio.Event().wait()


def main(args: argparse.Namespace) -> int:
    logs.configure("console", "warning", sys.stderr)  # the tour's table is the output
    turns = getattr(args, "turns", None) or 100
    port = getattr(args, "port", None) or 8080
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends `--serve`
            asyncio.run(run(turns, bool(getattr(args, "serve", False)), port))
    except BrokenPipeError:
        # `gateway demo | head`: the reader left. Nothing to report, and nothing more to print to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        print(f"gateway demo: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc}): "
              "is a gateway already running there? Choose another port with --port.", file=sys.stderr)
        return 1
    return 0
