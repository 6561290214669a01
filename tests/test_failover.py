"""Failover on Redis Cluster: two real `gateway serve` processes, one SIGKILLed in the middle of a fold."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path
from typing import Any

import openai
from redis.asyncio.cluster import RedisCluster
from test_cli import start_gateway
from test_summarizer import FakeUpstream as SummarizerUpstream

from gateway import timeline, worker
from gateway.config import StoreSettings
from gateway.keys import ConvRef
from gateway.store import open_store
from gateway.testing import FakeUpstream

CLIENT_KEY = "sk-gw-failover-0001"
REF = ConvRef("team", "failover-1")


def _config(tmp_path: Path, name: str, cluster: str, chat_url: str, summarizer_url: str) -> str:
    # Each gateway has its own summarizer key: the fake upstream tells from it which one is folding.
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
store: {{url: "{cluster}"}}
upstreams:
  openai: {{base_url: "{chat_url}", api_key: sk-upstream-chat}}
  anthropic: {{base_url: "{summarizer_url}", api_key: sk-summarizer-{name}}}
auth: {{keys: [{{key: {CLIENT_KEY}, tenant: team}}]}}
memory:
  message_threshold: 6
  keep_recent: 4
  fold_batch: 4
  cost_model: false
  summarizer: {{mode: llm, upstream: anthropic, model: claude-haiku-4}}
  worker: {{in_process: 1, claim_idle_ms: 1000, retry_base_seconds: 0}}
""")
    return str(path)


def _text(message: dict[str, Any]) -> str:
    return str(message["content"])


async def _until(check: Any, what: str, seconds: float = 30.0) -> Any:
    for _ in range(int(seconds / 0.1)):
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_other_gateway_reclaims_a_fold_its_peer_died_in(tmp_path: Path, redis_cluster: str) -> None:
    """A gateway SIGKILLed mid-fold: the other reclaims the job, and the summary covers exactly a prefix of
    the stored history, which holds every message sent through either gateway."""
    store = await open_store(StoreSettings(url=redis_cluster))
    await store.redis.flushall(target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    summarizer = await SummarizerUpstream().start()
    summarizer.gate = asyncio.Event()  # folds stall until the folding gateway is dead
    procs: dict[str, Any] = {}
    clients: dict[str, openai.AsyncOpenAI] = {}
    async with FakeUpstream(reply="Noted, I will keep that in mind.") as chat:
        try:
            for name in ("a", "b"):
                cfg = _config(tmp_path, name, redis_cluster, chat.openai_base_url, summarizer.url)
                port, procs[name] = await start_gateway("--config", cfg)
                clients[name] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=CLIENT_KEY,
                                                   max_retries=0)

            history: list[dict[str, Any]] = []

            async def turn(i: int, via: str) -> None:
                history.append({"role": "user", "content": f"fact {i}: the service {i} listens on port {7000 + i}"})
                reply = await clients[via].chat.completions.create(
                    model="gpt-4o-mini", messages=history, extra_headers={"X-Conversation-Id": REF.conversation})
                history.append({"role": "assistant", "content": reply.choices[0].message.content})

            for i in range(6):  # alternating replicas; 12 messages: a fold is due from the 8th
                await turn(i, "ab"[i % 2])

            async def all_recorded() -> bool:
                return (await store.load(REF)).length == len(history)

            await _until(all_recorded, "every turn recorded")
            await asyncio.wait_for(summarizer.entered.wait(), timeout=30)
            folding = summarizer.requests[0][0]["x-api-key"].removeprefix("sk-summarizer-")
            survivor = "b" if folding == "a" else "a"
            procs[folding].kill()  # SIGKILL: no shutdown, the job stays pending on its consumer
            await procs[folding].wait()
            assert (await store.load(REF)).summary is None
            summarizer.gate.set()

            async def folded() -> Any:
                view = await store.load(REF)
                return view if view.summary is not None and await worker.queued(store) == 0 else None

            view = await _until(folded, "the survivor's fold")
            # Summary lines are "- [i] role: first words" (the fake summarizer): exactly messages 0..covers-1.
            covers = view.summary.covers
            assert 0 < covers <= len(history) - 4
            sessions, rest = timeline.parse(view.summary.text)  # the timeline first, then the summarizer's lines
            assert sessions and sessions[0].first == 0 and sessions[-1].last == covers - 1
            lines = rest.splitlines()
            assert [int(re.match(r"- \[(\d+)\]", line).group(1)) for line in lines] == list(range(covers))  # type: ignore[union-attr]
            for line, message in zip(lines, history, strict=False):
                assert line.split(": ", 1)[1] == " ".join(_text(message).split()[:8])
            assert view.summary.version == 1
            keys_used = [headers["x-api-key"] for headers, _ in summarizer.requests]
            assert f"sk-summarizer-{survivor}" in keys_used

            stored = await store.messages(REF, 0, view.length)
            assert [t.raw for t in stored] == history

            await turn(6, survivor)  # the conversation goes on through the survivor alone
            await _until(all_recorded, "the last turn recorded")
            stored = await store.messages(REF, 0, len(history))
            assert [(t.role, t.text) for t in stored] == [(m["role"], _text(m)) for m in history]
        finally:
            summarizer.gate.set()
            for client in clients.values():
                await client.close()
            outputs = {}
            for name, proc in procs.items():
                if proc.returncode is None:
                    proc.send_signal(signal.SIGINT)
                outputs[name] = (await asyncio.wait_for(proc.communicate(), timeout=30))[0].decode()
            await store.close()
            await summarizer.close()
    assert '"event":"fold.reclaimed"' in outputs[survivor]
