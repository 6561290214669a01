"""`gateway demo`: an offline tour. A long project conversation goes through the real gateway
(embedded store, in-process folds) to a built-in simulated OpenAI upstream, the way an app using
the OpenAI SDK would send it: the whole history every turn. It prints what each request cost with
and without memory, then what the gateway remembers. Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

import orjson
from aiohttp import ClientSession, web

from gateway.config import Settings

SYSTEM = "You are a senior engineer helping build a small web service. Be concrete."

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
    "Is there a simpler way to write the {part} migration script at scripts/migrate_{part}.py?",
    "How do I benchmark {part} under 200 requests per second?",
]
PARTS = ["redirect", "analytics", "auth", "admin page", "link expiry", "QR codes", "API keys", "backup"]


def _question(rng: random.Random, turn: int) -> str:
    if turn < len(OPENING):
        return OPENING[turn]
    return rng.choice(WORK).format(part=rng.choice(PARTS))


def _answer(body: dict[str, Any]) -> str:
    last = body["messages"][-1]["content"]
    topic = last.split("?")[0][-60:]
    return (f"Good question about {topic!r}. Keep it small: one module, one responsibility, a unit "
            "test per behaviour, and measure before optimising. Start with the simplest version that works.")


async def run(turns: int) -> None:
    from gateway.app import create_app, drain_background
    from gateway.testing import FakeUpstream
    from gateway.worker import settle

    async with FakeUpstream(responder=_answer) as fake:
        settings = Settings.model_validate({
            "upstreams": {"openai": {"base_url": fake.openai_base_url}},
        })
        app = create_app(settings)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": "Bearer sk-demo-key", "X-Conversation-Id": "demo-url-shortener"}
        rng = random.Random(7)
        history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        total_original = total_forwarded = 0
        print(f"{'turn':>5} {'context':<10} {'full history':>13} {'forwarded':>10} {'saved':>7}")
        try:
            async with ClientSession() as http:
                for turn in range(turns):
                    history.append({"role": "user", "content": _question(rng, turn)})
                    async with http.post(f"{base}/v1/chat/completions", headers=headers,
                                         json={"model": "gpt-4o-mini", "messages": history}) as resp:
                        body = await resp.json(loads=orjson.loads)
                        h = resp.headers
                    history.append(body["choices"][0]["message"])
                    original = int(h.get("x-gateway-tokens-original", 0))
                    forwarded = int(h.get("x-gateway-tokens-forwarded", 0))
                    total_original += original
                    total_forwarded += forwarded
                    if turn < 3 or (turn + 1) % 10 == 0 or turn == turns - 1:
                        print(f"{turn + 1:>5} {h.get('x-gateway-context', '?'):<10} {original:>13} "
                              f"{forwarded:>10} {int(h.get('x-gateway-tokens-saved', 0)):>7}")
                    await drain_background(app)  # the turn is recorded and its fold queued
                    await settle(app)  # a real app would not wait; the demo shows a settled state
                async with http.get(f"{base}/v1/conversations/demo-url-shortener", headers=headers) as resp:
                    info = await resp.json(loads=orjson.loads)
        finally:
            await runner.cleanup()
    saved = total_original - total_forwarded
    print(f"\n{turns} turns: {total_original} prompt tokens without memory, {total_forwarded} with it: "
          f"{saved} saved ({100 * saved / max(total_original, 1):.0f}%).")
    summary = info.get("summary") or {}
    print(f"\nStored: {info['messages']} messages; the summary covers {summary.get('covers', 0)} of them.")
    print("\nProject state the gateway keeps (sent with every rewritten request):")
    print(info.get("state_rendered") or "(none)")
    text = summary.get("text", "")
    print("\nRolling summary (first lines):")
    print("\n".join(text.splitlines()[:8]) or "(none)")
    print("\nRun `gateway serve` and point your SDK at it to do the same with a real model.")


def main(args: argparse.Namespace) -> int:
    import sys

    from gateway import logs

    logs.configure("console", "warning", sys.stderr)  # the tour's table is the output
    turns = getattr(args, "turns", None) or 100
    asyncio.run(run(turns))
    return 0
