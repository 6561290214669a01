"""The cost policy as a user sees it: per-model prices decide between the cached full history and the
rewrite, the decision and its expected bill are on every memory response and in the request log, and
a model the pricing table does not know is named in the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from memory_helpers import (
    Chat,
    Gateway,
    Lines,
    memory_gateway,
    reply_text,
    store_url,  # noqa: F401 (fixture)
    user_text,
)

from gateway import app as app_module
from gateway import cli, cost
from gateway import memory as memory_module
from gateway.app import HOOK
from gateway.config import ConfigError, Settings, parse_settings

# The shipped defaults (the helpers' gateway has smaller ones): over the thresholds after 15 turns.
MEMORY = {"message_threshold": 30, "keep_recent": 10, "fold_batch": 10, "policy": "cost"}


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Lines:
    """The request log and the memory layer's log, recorded."""
    rec = Lines()
    monkeypatch.setattr(app_module, "get_logger", lambda name="gateway": rec)
    monkeypatch.setattr(memory_module, "log", rec)
    return rec




def said(i: int) -> str:
    """A short user message (about 60 tokens)."""
    return user_text(i) + f" Keep it brief; we revisit point {i} after lunch with the rest of the team."


class Clock:
    """The memory layer's cost-model clock, moved by the test."""

    def __init__(self, g: Gateway) -> None:
        self.now = 1000.0
        g.app[HOOK].clock = lambda: self.now


async def talk(g: Gateway, chat: Chat, msgs: list[dict[str, Any]], turns: int, clock: Clock,
               step: float = 20.0) -> list[Any]:
    """`turns` more turns of short messages, `step` seconds apart; each response's headers."""
    seen = []
    for _ in range(turns):
        clock.now += step
        msgs.append({"role": "user", "content": said(len(msgs) // 2)})
        headers, text = await chat.send(msgs, model="gpt-5")
        msgs.append({"role": "assistant", "content": text})
        await g.settle()
        seen.append(headers)
    return seen


def costs(h: Any) -> tuple[int, int, float]:
    return int(h["x-gateway-cost-original"]), int(h["x-gateway-cost-forwarded"]), float(h["x-gateway-window-used"])


async def test_warm_openai_conversation_of_short_messages_goes_whole_then_cold_is_rewritten(
        lines: Lines, store_url: str) -> None:  # noqa: F811
    """gpt-5 bills a cached prefix at a tenth: while the cache is warm, a 24-turn conversation of short
    messages (about 60 tokens each) is forwarded whole (`cheaper-cached`, expected at the cached read
    the full history really bills); once the cache lifetime has passed since the last request it is
    rewritten, expected below the full history's bill. Headers and the request log line agree."""
    async with memory_gateway(store_url, memory=MEMORY) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True
        clock = Clock(g)
        chat, msgs = Chat(g, "openai", "short-warm"), []
        seen = await talk(g, chat, msgs, 24, clock)
        over = [h for h in seen if int(h["x-gateway-tokens-original"]) and h["x-gateway-reason"] != "under-threshold"]
        assert over, "the conversation never went over the thresholds"
        assert {h["x-gateway-reason"] for h in over} == {"cheaper-cached"}
        assert {h["x-gateway-context"] for h in over} == {"full"}
        last = seen[-1]
        original, forwarded, used = costs(last)
        tokens = int(last["x-gateway-tokens-original"])
        # Warm: the previous request's prefix reads at 0.1, only the newest turn is fresh.
        assert original == forwarded and 0 < forwarded < 0.5 * tokens
        assert used == pytest.approx(int(last["x-gateway-tokens-forwarded"]) / 400_000, abs=0.0005)
        assert g.last(chat.path).body["messages"][1:] == msgs[:-1]  # sent whole, as the client sent it

        clock.now += cost.DEFAULT_PRICES.ttl + 1  # gpt-5's cache lifetime (300 s) has passed
        cold = (await talk(g, chat, msgs, 1, clock, step=0))[0]
        assert (cold["x-gateway-context"], cold["x-gateway-reason"]) == ("rewritten", "rewritten")
        original, forwarded, used = costs(cold)
        assert original == int(cold["x-gateway-tokens-original"])  # cold: every token fresh
        assert forwarded < original
        assert used == pytest.approx(int(cold["x-gateway-tokens-forwarded"]) / 400_000, abs=0.0005)

    requests = lines.events("request")
    assert len(requests) == 25
    for line, h in zip(requests, [*seen, cold], strict=True):
        assert line["reason"] == h["x-gateway-reason"]
        assert (line["cost_original"], line["cost_forwarded"]) == costs(h)[:2]
        assert line["window_used"] == float(h["x-gateway-window-used"])


async def test_policy_threshold_rewrites_the_warm_conversation(store_url: str) -> None:  # noqa: F811
    """`memory.policy: threshold` rewrites over the thresholds whatever the cache would bill."""
    async with memory_gateway(store_url, memory={**MEMORY, "policy": "threshold"}) as g:
        g.fake.responder = reply_text
        clock = Clock(g)
        seen = await talk(g, Chat(g, "openai", "short-threshold"), [], 30, clock)
        assert seen[-1]["x-gateway-reason"] == "rewritten"
        original, forwarded, _ = costs(seen[-1])
        assert forwarded > 0 and original > 0


async def test_unknown_model_is_named_in_the_log_once(lines: Lines) -> None:
    """A requested model no pricing entry matches is logged (once) as priced by `pricing.default`,
    which assumes no prompt caching: over the thresholds it is rewritten."""
    async with memory_gateway("memory://", memory=MEMORY) as g:
        clock = Clock(g)
        chat, msgs = Chat(g, "openai", "unknown-model"), []
        g.fake.responder = reply_text
        for i in range(16):
            clock.now += 10
            msgs.append({"role": "user", "content": user_text(i)})
            headers, text = await chat.send(msgs, model="acme-llm-7")
            msgs.append({"role": "assistant", "content": text})
            await g.settle()
    warned = [f for f in lines.events("pricing.unknown_model") if f["model"] == "acme-llm-7"]
    assert len(warned) == 1 and warned[0]["seen"] == "request"
    assert "pricing" in warned[0]["message"]
    assert headers["x-gateway-reason"] == "rewritten"


async def test_a_huge_unknown_model_name_is_clipped_in_the_log(lines: Lines) -> None:
    """A client's model name can be any size: its warning line is not."""
    async with memory_gateway("memory://", memory=MEMORY) as g:
        g.fake.responder = reply_text
        await Chat(g, "openai", "huge-model").send([{"role": "user", "content": "hi"}], model="m" * 100_000)
    warned = lines.events("pricing.unknown_model")
    assert len(warned) == 1 and len(warned[0]["model"]) <= 101 and len(warned[0]["message"]) < 400


async def test_configured_model_without_price_is_named_at_start_up(lines: Lines) -> None:
    """A `models:` entry with no pricing entry is named when the gateway starts."""
    async with memory_gateway("memory://", memory=MEMORY, models={"acme-llm": {"context_window": 32_000}}):
        pass
    warned = lines.events("pricing.unknown_model")
    assert [(f["model"], f["seen"]) for f in warned] == [("acme-llm", "configured")]


def test_check_config_warns_of_an_unpriced_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "gw.yaml"
    p.write_text("models:\n  acme-llm: {context_window: 32000}\n")
    assert cli.main(["check-config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "acme-llm" in out and "no pricing entry" in out


def test_pricing_is_per_provider_and_model() -> None:
    """The built-in prices follow each provider's published cache pricing; dated ids match their family."""
    s = Settings()
    assert cost.prices(s.price("gpt-4o-2024-08-06")) == cost.Prices(read=0.5, write=1.0, ttl=300, min_tokens=1024)
    assert cost.prices(s.price("gpt-4.1-mini")).read == 0.25
    assert cost.prices(s.price("gpt-5-mini")).read == 0.1
    assert cost.prices(s.price("claude-sonnet-4-5-20250929")) == cost.Prices(read=0.1, write=1.25, ttl=300,
                                                                              min_tokens=1024)
    assert cost.prices(s.price("claude-sonnet-4-5"), one_hour=True) == cost.Prices(read=0.1, write=2.0, ttl=3600,
                                                                                            min_tokens=1024)
    assert cost.prices(s.price("gpt-4o"), one_hour=True).write == 1.0  # Anthropic's 1-hour cache only
    assert s.price("claude-3-5-haiku-20241022").cache_min_tokens == 2048
    assert not s.priced("acme-llm") and s.price("acme-llm").cache_ttl_seconds == 0


def test_pricing_entries_merge_and_old_keys() -> None:
    """An entry named like a built-in one changes only what it gives; prices still given in `models:`
    move to `pricing:`; `cost_model` reads as `policy`; the old flat cache factors are refused by name."""
    s = parse_settings({"pricing": {"gpt-4o": {"cache_ttl_seconds": 3600}},
                        "models": {"acme": {"context_window": 8192, "input_usd_per_mtok": 1.5}},
                        "memory": {"cost_model": False}})
    assert s.price("gpt-4o").cache_read == 0.5 and s.price("gpt-4o").cache_ttl_seconds == 3600
    assert s.price("acme").input_usd_per_mtok == 1.5 and s.model("acme").context_window == 8192
    assert s.memory.policy == "threshold"
    with pytest.raises(ConfigError) as info:
        parse_settings({"pricing": {"cache_read_factor": 0.1}})
    assert any("pricing.cache_read_factor" in p for p in info.value.problems)


def test_a_prefix_under_the_providers_minimum_is_never_cached() -> None:
    """Providers cache only prefixes of 1,024 tokens or more: a short full history resent to a warm
    cache is billed whole, a longer one reads its prefix at the cache price."""
    p = cost.prices(Settings().price("gpt-5"))
    last = cost.full_record(("sys", 100), ["c0", "c1"], 800, 100, now=0.0)
    assert cost.billed_full(("sys", 100), 900, ["c0", "c1", "c2"], last, 10.0, p, cacheable=True) == 1000
    last = cost.full_record(("sys", 100), ["c0", "c1"], 2000, 100, now=0.0)
    assert cost.billed_full(("sys", 100), 2100, ["c0", "c1", "c2"], last, 10.0, p,
                            cacheable=True) == pytest.approx(0.1 * 2100 + 100)


async def test_a_server_that_reports_no_cache_reads_gets_the_rewrite(store_url: str) -> None:  # noqa: F811
    """Usage corrects the belief: the same warm conversation that goes whole to a provider reporting
    cached reads is rewritten when the server reports none (an OpenAI-compatible server without
    prompt caching under an OpenAI model name), and its expected bills count no cache."""
    async with memory_gateway(store_url, memory=MEMORY) as g:
        g.fake.responder = reply_text  # prompt_cache off: `cached_tokens: 0` on every answer
        clock = Clock(g)
        seen = await talk(g, Chat(g, "openai", "no-cache-server"), [], 24, clock)
    over = [h for h in seen if h["x-gateway-reason"] != "under-threshold"]
    assert over and {h["x-gateway-reason"] for h in over} == {"rewritten"}
    original, _, _ = costs(over[-1])
    assert original > 0.8 * int(over[-1]["x-gateway-tokens-original"])  # nearly every token billed fresh


async def test_a_cache_read_after_a_long_pause_extends_the_believed_lifetime() -> None:
    """A provider that still reports a cached read after a pause longer than the configured cache
    lifetime teaches the gateway: the next such pause is priced as warm."""
    async with memory_gateway("memory://", memory=MEMORY) as g:
        g.fake.responder, g.fake.prompt_cache = reply_text, True
        clock = Clock(g)
        chat, msgs = Chat(g, "openai", "long-pause"), []
        await talk(g, chat, msgs, 12, clock)  # under the thresholds, over 1,024 tokens: sent whole
        before = (await talk(g, chat, msgs, 1, clock, step=400.0))[0]
        after = (await talk(g, chat, msgs, 1, clock, step=400.0))[0]
    assert before["x-gateway-reason"] == after["x-gateway-reason"] == "under-threshold"
    assert int(before["x-gateway-cost-forwarded"]) == int(before["x-gateway-tokens-forwarded"])  # believed cold
    assert int(after["x-gateway-cost-forwarded"]) < 0.5 * int(after["x-gateway-tokens-forwarded"])  # now warm


async def test_the_cache_marks_of_a_long_body_are_found_wherever_they_are() -> None:
    """The cost model reads two marks in an Anthropic body (a `cache_control` breakpoint, the 1-hour
    cache): a long body is read once, a megabyte at a time, and a mark is found anywhere in it, across
    the edge of two slices too, as a whole-body search finds it."""
    from memory_helpers import loop_turns

    from gateway.dialects import dialect_named
    from gateway.memory import _ONE_HOUR, _marks

    anthropic, openai_chat = dialect_named("anthropic"), dialect_named("openai_chat")
    mark = b'"cache_control": {"type": "ephemeral", "ttl":  "1h"}'
    size = 3 << 20
    for at in (0, (1 << 20) - 20, (1 << 20) - 3, 1 << 20, (2 << 20) + 4090, size - len(mark)):
        raw = b"x" * at + mark + b"x" * (size - at - len(mark))
        got = await _marks(anthropic, raw)
        assert (got.cacheable, got.one_hour) == (True, _ONE_HOUR.search(raw) is not None) == (True, True), at
    assert await _marks(anthropic, b"x" * size) == await _marks(anthropic, b"{}") == type(got)(False, False)
    assert (await _marks(openai_chat, mark)).one_hour is False  # Anthropic's 1-hour cache only

    async with loop_turns() as turns:
        await _marks(anthropic, b"x" * size)
    assert turns[0] >= 2  # served between the slices
