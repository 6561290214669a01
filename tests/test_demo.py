"""`gateway demo` tells the truth: savings where the rewrite pays, the reason where it declines."""

from __future__ import annotations

import shlex
import subprocess
import sys

import aiohttp
import pytest

from gateway import demo


async def test_demo_saves_on_the_coding_conversation_and_says_why_not_on_the_short_chat(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With the shipped defaults and a warm cache, the long coding conversation is rewritten and its
    expected bill is lower; the short chat is forwarded whole with reason `cheaper-cached`, billed the
    same as without the gateway; every turn's tokens and bills are printed, then the totals."""
    async with demo.running() as d, aiohttp.ClientSession() as http:
        info = await demo.tour(d, 40, http)
        chat = await demo.chat_tour(d, 20, http)
    coding = info["totals"]
    assert coding.reasons.get("rewritten", 0) > 0
    assert coding.cost_forwarded < 0.8 * coding.cost_original
    assert coding.tokens_forwarded < coding.tokens_original
    assert set(chat.reasons) == {"under-threshold", "cheaper-cached"}
    assert (chat.cost_forwarded, chat.tokens_forwarded) == (chat.cost_original, chat.tokens_original)
    out = capsys.readouterr().out
    assert "bill: full" in out and "cheaper-cached" in out
    assert f"{coding.cost_original - coding.cost_forwarded} saved" in out


def test_demo_piped_into_head_ends_quietly() -> None:
    """`gateway demo | head -2`: the reader leaving is no error (it once blamed a busy port)."""
    proc = subprocess.run(f"{shlex.quote(sys.executable)} -m gateway demo --turns 30 | head -2",
                          shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.count("\n") == 2
    assert proc.stderr == ""


@pytest.mark.parametrize("turns", ["0", "-3", "x"])
def test_demo_refuses_a_length_that_is_not_a_positive_number(turns: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--turns 0` ran the default 100 turns and `--turns -3` printed an empty table: both are usage errors."""
    from gateway import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--turns", turns])
    assert stop.value.code == 2 and "--turns" in capsys.readouterr().err
