"""`gateway eval`: its metrics on tiny hand-made data with known answers."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import cli
from gateway.config import Settings
from gateway.eval import BASELINES, Biller, dump_name, format_table, normalise, probe_terms, run_eval, salient_terms

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
    # Every request's x-gateway-reason is counted, and the table says how the gateway decided.
    reasons = s["gateway"]["reasons"]
    users = sum(1 for m in conversation()["messages"] if m["role"] == "user")
    assert sum(reasons.values()) == users + len(conversation()["probes"])
    assert reasons.get("rewritten", 0) > 0 and set(reasons) <= {"under-threshold", "rewritten", "cheaper-cached",
                                                                 "no-saving", "summary-pending", "over-window"}
    assert "gateway decisions (x-gateway-reason): " in format_table(result)
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
    abstention = s["full"]["by_category"]["abstention"]
    assert abstention["evidence_probes"] == 0 and abstention["answer_probes"] == 0


def test_table_prints_a_recall_over_no_probe_as_a_dash() -> None:
    """A category without evidence shows '-' for its recalls in the table, not a misleading 0.000."""
    cat = {"probes": 2, "evidence_recall": 0.0, "evidence_probes": 0, "fact_recall": 0.0, "fact_probes": 0,
           "answer_recall": 0.0, "answer_probes": 0, "tokens_ratio": 0.5, "mean_tokens": 100.0}
    table = format_table({"strategies": {"full": {**cat, "by_category": {"abstention": cat}}}})
    row = next(line for line in table.splitlines() if line.startswith("abstention"))
    assert row.split()[2:] == ["2", "-", "-", "-", "0.500", "100"]


def test_salient_terms_skip_a_capital_that_only_starts_a_sentence() -> None:
    """A capitalised word counts only away from a sentence start (text start, line break, after . ! ?)."""
    text = "Yesterday we met Priya at the Harbor Cafe. Later she left.\nMonday was quiet! Then Oslo called"
    assert salient_terms([text]) == ["priya", "harbor", "cafe", "oslo"]


def test_salient_terms_keep_numbers_and_joined_identifiers_normalised() -> None:
    """Digits and `_ . / - :` joins make a term, stripped of surrounding punctuation and normalised."""
    terms = salient_terms(['Deploy to "kestrel-eu-2", then run make_release at 14:30 (see docs/setup).'])
    assert terms == ["kestrel eu 2", "make release", "14 30", "docs setup"]
    assert salient_terms(["plain words - nothing else here: none."]) == []


def _probe(conv_text: str, question: str) -> tuple[dict[str, Any], dict[str, Any]]:
    conv = {"id": "c", "messages": [{"role": "user", "content": conv_text}], "probes": []}
    return conv, {"after": 1, "question": question, "answers": [], "evidence": [0], "category": "x"}


def test_probe_terms_drop_what_the_question_already_says() -> None:
    """A term that occurs (as whole words) in the normalised question is not credited to the context."""
    conv, probe = _probe("My build runs on kestrel-eu-2 with Postgres 16.", "Which region does kestrel use?")
    assert probe_terms(conv, probe) == ["kestrel eu 2", "postgres", "16"]
    conv, probe = _probe("My build runs on kestrel-eu-2 with Postgres 16.", "Is Kestrel-EU-2 on Postgres?")
    assert probe_terms(conv, probe) == ["16"]


def _fact_conversation() -> dict[str, Any]:
    """Message 2 holds facts; probe 0 asks about them, probe 1's evidence has none to look for."""
    conv = conversation()
    conv["messages"][2]["content"] = "I moved the staging cluster to kestrel-eu-2 last week."
    conv["messages"][4]["content"] = "how many sets of squats should i do on day zero?"
    conv["probes"] = [
        {"after": 40, "question": "Where is the staging cluster?", "answers": ["kestrel-eu-2"],
         "evidence": [2], "category": "recall"},
        {"after": 40, "question": "How many sets of squats on day zero?", "answers": [],
         "evidence": [4], "category": "nofacts"},
    ]
    return conv


async def test_fact_recall_matches_whole_words_and_skips_probes_without_terms() -> None:
    """fact_recall is 1 where the normalised term `kestrel eu 2` is forwarded as whole words, 0 where a
    window drops it, and a probe whose evidence has no salient term counts for neither."""
    s = (await run_eval(settings(), [_fact_conversation()], settle=True, progress=False))["strategies"]
    assert s["full"]["fact_recall"] == 1.0 and s["full"]["fact_probes"] == 1
    assert s["window10"]["fact_recall"] == 0.0 and s["window10"]["fact_probes"] == 1
    assert s["gateway"]["fact_recall"] == 1.0
    assert s["full"]["by_category"]["nofacts"]["fact_probes"] == 0
    assert s["full"]["by_category"]["recall"]["fact_recall"] == 1.0


def test_dump_name_is_a_safe_component_and_keeps_ids_apart() -> None:
    """Ids with separators, dots or odd characters become one path component, and distinct ids stay distinct."""
    ids = ["c1", "a/b", "a%2Fb", "..", ".", "", "x~y", "é", "a" * 300, "a" * 299 + "b"]
    names = [dump_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    for n in names:
        assert n and "/" not in n and "\\" not in n and n not in (".", "..") and len(n) <= 255


async def test_dump_writes_each_probes_forwarded_request(tmp_path: Path) -> None:
    """--dump writes DIR/<conversation id>/<probe index>.json with the body the upstream received."""
    conv = _fact_conversation()
    conv["id"] = "team/gym"
    await run_eval(settings(), [conv], settle=True, progress=False, dump=tmp_path)
    folder = tmp_path / dump_name("team/gym")
    assert sorted(p.name for p in folder.iterdir()) == ["0.json", "1.json"]
    record = orjson.loads((folder / "0.json").read_bytes())
    assert {k: record[k] for k in ("conversation", "probe", "category")} == {
        "conversation": "team/gym", "probe": 0, "category": "recall"}
    messages = record["forwarded"]["messages"]
    assert messages[-1] == {"role": "user", "content": "Where is the staging cluster?"}
    assert "kestrel-eu-2" in orjson.dumps(record["forwarded"]).decode()
    assert orjson.loads((folder / "1.json").read_bytes())["probe"] == 1


async def test_settle_lets_each_turns_folds_finish_before_the_next_turn() -> None:
    """A live gateway has seconds between a user's turns to fold; a replay sends the next turn at
    once. With --settle the folds a turn queued are done before the next one, so the later turns of
    the conversation are rewritten on their summary instead of going whole while the folds lag."""
    result = await run_eval(settings(), [conversation()], settle=True, progress=False)
    reasons = result["strategies"]["gateway"]["reasons"]
    # 21 requests: 3 under the thresholds, then no saving until the summary covers enough of the
    # short turns; the last six turns and the probe are rewritten (1 of 21 when the folds lag).
    assert reasons.get("rewritten", 0) >= 7, reasons


async def test_dump_and_new_metrics_leave_the_existing_figures_unchanged(tmp_path: Path) -> None:
    """Dumping and the added metrics change none of the figures the eval reported before (settled,
    the gateway's tokens and bill too: no background fold lands between two turns at a varying time).
    The messages carry their own times: without them the gateway stamps its clock at arrival, the
    timeline and excerpt headers quote it, and two runs a minute boundary apart differ in tokens."""
    recall_keys = ("probes", "evidence_recall", "answer_recall")
    probe_keys = (*recall_keys, "tokens_ratio", "mean_tokens")
    cost_keys = ("cost_ratio_warm", "cost_ratio_timed")

    def timed() -> dict[str, Any]:
        conv = _fact_conversation()
        for i, m in enumerate(conv["messages"]):
            m["time"] = f"2024-03-02T10:{i // 2:02d}:00"
        return conv

    plain = (await run_eval(settings(), [timed()], settle=True, progress=False))["strategies"]
    dumped = (await run_eval(settings(), [timed()], settle=True, progress=False, dump=tmp_path))["strategies"]
    for name in plain:
        keys = probe_keys + cost_keys
        assert {k: plain[name][k] for k in keys} == {k: dumped[name][k] for k in keys}
        assert ({c: {k: v[k] for k in recall_keys if k in v} for c, v in plain[name]["by_category"].items()}
                == {c: {k: v[k] for k in recall_keys if k in v} for c, v in dumped[name]["by_category"].items()})


async def test_cost_counts_every_request_and_conversations_over_full() -> None:
    """The bill covers every replayed request, timed expires across long gaps, and a strategy that
    costs more than the full history is counted per conversation."""
    conv = conversation()
    for i, m in enumerate(conv["messages"]):
        m["time"] = f"2024-01-{1 + i // 20:02d}T10:{i % 20:02d}:00"  # a day's gap half way
    s = (await run_eval(settings(), [conv], settle=True, progress=False))["strategies"]
    assert s["full"]["cost_ratio_warm"] == pytest.approx(1.0) and s["full"]["cost_ratio_timed"] == pytest.approx(1.0)
    assert s["full"]["conversations_over_full_warm"] == 0
    # window10 re-sends a shifting window: nothing cached after the first turns, so it costs more per
    # token than it saves at 40 messages; whatever the ratio, the count agrees with it.
    for name in s:
        assert s[name]["conversations_over_full_warm"] == int(s[name]["cost_ratio_warm"] > 1.0)
        assert s[name]["conversations_over_full_timed"] == int(s[name]["cost_ratio_timed"] > 1.0)


def test_cli_takes_dump_and_model() -> None:
    """`gateway eval` accepts --dump DIR and --model M, and defaults to a Claude model the config prices."""
    args = cli.parser().parse_args(["eval", "data.jsonl", "--dump", "/tmp/d", "--model", "gpt-4o"])
    assert args.dump == "/tmp/d" and args.model == "gpt-4o"
    from gateway.eval import DEFAULT_MODEL

    assert DEFAULT_MODEL.startswith("claude") and Settings().model(DEFAULT_MODEL) is not Settings().models["default"]


def test_eval_refuses_a_model_the_config_does_not_price(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown --model is an error naming the configured models, not a silent default window and price."""
    from gateway import logs
    from gateway.eval import main

    # main() points the process's logging at stderr; here that is capsys's buffer, closed after the test.
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)
    assert main(["missing.jsonl", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "claude-sonnet-4" in err


def two_sessions() -> dict[str, Any]:
    """190 messages 30 s apart, then a second session two days later, and a probe at its end."""
    t0 = datetime(2024, 5, 1, 9, 0, 0)
    msgs = []
    for i in range(200):
        when = t0 + timedelta(seconds=30 * i) + (timedelta(days=2) if i >= 190 else timedelta())
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "time": when.isoformat(),
                     "content": f"Message {i}: about the garden plan, bed {i} gets tomatoes and basil, watered at "
                                f"{i % 12} o'clock, and we keep notes in the blue notebook by the door."})
    return {"id": "two-sessions", "messages": msgs, "probes": [
        {"after": 200, "question": "What goes in bed 2?", "answers": ["tomatoes"], "evidence": [2], "category": "x"}]}


async def test_data_clock_lets_the_cost_model_see_the_pause_between_sessions() -> None:
    """At the replay's pace every cache is warm and the cost policy sends this conversation whole; on the
    data's clock the two-day pause leaves the cache cold and the gateway rewrites it."""
    s = Settings.model_validate({"memory": {"policy": "cost"}})
    paced = await run_eval(s, [two_sessions()], settle=True, progress=False)
    live = await run_eval(s, [two_sessions()], settle=True, progress=False, data_clock=True)
    assert paced["strategies"]["gateway"]["tokens_ratio"] == pytest.approx(1.0)
    assert live["strategies"]["gateway"]["tokens_ratio"] < 0.5


async def test_the_timed_bill_is_that_of_a_gateway_on_the_data_clock() -> None:
    """The timed regime lets caches expire between the data's times, so its bill comes from a second
    replay whose gateway sees those times, as a live one would; recall is scored on the first."""
    s = Settings.model_validate({"memory": {"policy": "cost"}})
    one = await run_eval(s, [two_sessions()], settle=True, progress=False, timed_pass=False)
    both = await run_eval(s, [two_sessions()], settle=True, progress=False)
    live = await run_eval(s, [two_sessions()], settle=True, progress=False, data_clock=True)
    gw, gw_one, gw_live = (r["strategies"]["gateway"] for r in (both, one, live))
    assert both["timed_on_data_clock"] and not one["timed_on_data_clock"]
    assert gw["cost_ratio_timed"] == pytest.approx(gw_live["cost_ratio_timed"], rel=0.02)
    assert gw["cost_ratio_timed"] < gw_one["cost_ratio_timed"]
    assert gw["cost_ratio_timed_replay_clock"] == pytest.approx(gw_one["cost_ratio_timed"], rel=0.02)
    # Everything else is the first replay's, on the replay's pace.
    assert gw["tokens_ratio"] == pytest.approx(gw_one["tokens_ratio"])
    assert gw["cost_ratio_warm"] == pytest.approx(gw_one["cost_ratio_warm"])
    assert set(both["strategies"]) == set(one["strategies"])
