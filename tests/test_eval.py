"""`gateway eval`: its metrics on tiny hand-made data with known answers."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Settings
from gateway.eval import BASELINES, Biller, normalise, run_eval

FACT = "My locker combination is 31-17-42 and the locker is number 808 in the east hall."


def conversation() -> dict[str, Any]:
    """40 messages; the only evidence is message 2, far outside any recent window."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi, I am setting up my gym routine."},
        {"role": "assistant", "content": "Great, tell me about your schedule."},
        {"role": "user", "content": FACT},
        {"role": "assistant", "content": "Noted, I will remember your locker details."},
    ]
    topics = ["squats", "rowing", "stretching", "swimming", "cycling", "yoga", "sprints", "planks"]
    for i in range(36):
        if i % 2 == 0:
            question = f"How many sets of {topics[i // 2 % 8]} should I do on day {i}?"
            messages.append({"role": "user", "content": question})
        else:
            messages.append({"role": "assistant", "content": f"Three sets of {topics[i // 2 % 8]} are enough."})
    return {
        "id": "gym", "source": "hand-made", "system": None, "messages": messages,
        "probes": [
            {"after": 40, "question": "What is my locker combination?", "answers": ["31-17-42"],
             "evidence": [2], "category": "recall"},
        ],
    }


def settings() -> Settings:
    return Settings.model_validate({"memory": {"message_threshold": 6, "keep_recent": 4, "fold_batch": 4,
                                               "cost_model": False}})


def test_normalise_folds_case_punctuation_and_space() -> None:
    """Normalisation lower-cases, turns punctuation into spaces and folds runs of space."""
    assert normalise("  The Locker:\n31-17-42!  ") == "the locker 31 17 42"


def test_biller_reads_the_common_prefix_while_warm_and_writes_all_when_cold() -> None:
    """A warm cache bills the common prefix at the read factor; past the TTL everything is written again."""
    b = Biller(lambda t: len(t), read=0.1, write=1.25, ttl=300)
    b.add(["aaaa", "bb"], when=0.0)  # cold start: 6 written
    b.add(["aaaa", "bb", "c"], when=10.0)  # 6 read, 1 written
    b.add(["aaaa", "bb", "c", "d"], when=1000.0)  # expired for `timed`
    assert b.warm == pytest.approx(1.25 * 6 + (0.1 * 6 + 1.25 * 1) + (0.1 * 7 + 1.25 * 1))
    assert b.timed == pytest.approx(1.25 * 6 + (0.1 * 6 + 1.25 * 1) + 1.25 * 8)


async def test_eval_scores_known_evidence_and_answers() -> None:
    """The replay recovers the far-back evidence through the gateway while a last-10 window cannot,
    and the full history scores 1 on everything it carries."""
    result = await run_eval(settings(), [conversation()], settle=True, progress=False)
    s = result["strategies"]
    assert set(s) == {"gateway", *BASELINES}
    assert s["full"]["evidence_recall"] == 1.0 and s["full"]["answer_recall"] == 1.0
    assert s["full"]["tokens_ratio"] == pytest.approx(1.0)
    assert s["full"]["cost_ratio_warm"] == pytest.approx(1.0)
    assert s["window10"]["evidence_recall"] == 0.0 and s["window10"]["answer_recall"] == 0.0
    assert s["gateway"]["evidence_recall"] == 1.0 and s["gateway"]["answer_recall"] == 1.0
    assert 0 < s["gateway"]["tokens_ratio"] < 1.0
    assert s["gateway"]["by_category"]["recall"]["evidence_recall"] == 1.0
    for name in s:
        assert {"evidence_recall", "answer_recall", "tokens_ratio", "mean_tokens", "cost_ratio_warm",
                "cost_ratio_timed", "by_category"} <= set(s[name])


async def test_probes_without_evidence_do_not_count_towards_evidence_recall() -> None:
    """An abstention probe (no evidence, answer absent from the history) leaves both recalls to the other probes."""
    conv = conversation()
    conv["probes"].append({"after": 40, "question": "What is my cat's name?", "answers": ["Mittens"],
                           "evidence": [], "category": "abstention"})
    s = (await run_eval(settings(), [conv], settle=True, progress=False))["strategies"]
    assert s["full"]["probes"] == 2
    assert s["full"]["evidence_recall"] == 1.0  # only the probe with evidence counts
    assert s["full"]["answer_recall"] == 1.0  # "Mittens" is nowhere in the history: not counted
    assert s["window10"]["evidence_recall"] == 0.0
