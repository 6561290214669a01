"""The summary's timeline: a line per session, in order, older lines merged and never dropped."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from gateway import fold, timeline
from gateway.model import Message
from gateway.summarizer import ExtractiveSummarizer


def words(text: str) -> int:
    return len(text.split())


def msg(role: str, text: str, time: str) -> Message:
    return Message(raw={"role": role, "content": text}, role=role, text=text, tokens=words(text) + 4, hash="0",
                   time=time)


def session(day: int, topic: str, decision: str) -> list[Message]:
    """Six messages on 2024-03-<day>, 30 s apart: the user opens on `topic`, someone decides."""
    stamp = [f"2024-03-{day:02d}T10:{m:02d}:{s:02d}" for m in range(2) for s in (0, 30, 45)][:6]
    return [msg("user", f"Let me start on {topic} today, with release-{day}.0 as the target.", stamp[0]),
            msg("assistant", f"Sure. {topic} needs a plan.", stamp[1]),
            msg("user", decision, stamp[2]),
            msg("assistant", "Noted, that works.", stamp[3]),
            msg("user", f"Then the {topic} tests, named test_{day}_suite.py.", stamp[4]),
            msg("assistant", "The tests are in place.", stamp[5])]


TOPICS = [("the PaymentGateway module", "We decided to use Stripe for card payments."),
          ("the InvoiceStore schema", "We decided to use PostgreSQL 16 for invoices."),
          ("the ReportBuilder export", "Let's use WeasyPrint for the PDF reports."),
          ("the NotifyQueue worker", "We decided to use Redis streams for notifications."),
          ("the AuditTrail log", "We'll use append-only tables for the audit log.")]


async def fold_all(turns: list[Message], batch: int, timeline_tokens: int) -> str:
    """Fold `turns` `batch` messages at a time, as the worker does, and return the summary text."""
    summarizer = ExtractiveSummarizer(words)
    text = ""
    for start in range(0, len(turns), batch):
        result = await fold.fold_summary(summarizer, text, turns[start:start + batch], start, max_tokens=600,
                                         timeline_tokens=timeline_tokens)
        text = result.text
    return text


async def test_the_timeline_keeps_one_line_per_session_in_order() -> None:
    """Three sessions on three dates, folded 4 messages at a time (folds cut sessions in two): one
    line per session, in date order, each with its message range, its opening, terms and decision."""
    turns = [t for day, (topic, decision) in zip((2, 9, 16), TOPICS, strict=False)
             for t in session(day, topic, decision)]
    text = await fold_all(turns, 4, 800)
    lines, rest = timeline.parse(text)
    assert text.startswith("Timeline:\n") and rest  # the rest of the summary follows the timeline
    rendered = text.split("\n\n")[0].splitlines()[1:]
    assert len(rendered) == 3
    assert [ln.start[:10] for ln in lines] == ["2024-03-02", "2024-03-09", "2024-03-16"]
    assert [(ln.first, ln.last) for ln in lines] == [(0, 5), (6, 11), (12, 17)]
    assert "PaymentGateway" in rendered[0] and "Stripe" in rendered[0] and "release-2.0" in rendered[0]
    assert "PostgreSQL 16" in rendered[1] and "test_9_suite.py" in rendered[1]
    assert "WeasyPrint" in rendered[2]


async def test_older_lines_are_merged_never_dropped() -> None:
    """Over its budget the timeline merges its older lines: every message stays on exactly one line,
    in order, the first session's date and decision are still there, the newest line is whole."""
    turns = [t for day, (topic, decision) in zip((2, 5, 9, 12, 16), TOPICS, strict=True)
             for t in session(day, topic, decision)]
    whole = timeline.parse(await fold_all(turns, 6, 10_000))[0]
    text = await fold_all(turns, 6, 120)
    lines, _ = timeline.parse(text)
    assert len(whole) == 5 and 1 < len(lines) < 5
    assert words(text.split("\n\n")[0]) <= 120 + len(lines)
    assert lines[0].first == 0 and lines[-1].last == len(turns) - 1
    assert all(a.last + 1 == b.first for a, b in itertools.pairwise(lines))
    assert lines[0].start.startswith("2024-03-02")
    assert lines[-1].render() == whole[-1].render()
    assert re.search(r"2024-03-02 10:00 to 2024-03-\d\d", text)


def long_session(tasks: int) -> list[Message]:
    """One afternoon without a break (a message a minute): `tasks` tasks of 12 messages, each on its own module."""
    turns, pad = [], " It builds and the tests pass." * 40  # a coding turn's length: ~240 words
    for k in range(tasks):
        for j in range(12):
            minute = 12 * k + j
            when = f"2024-03-02T{12 + minute // 60:02d}:{minute % 60:02d}:00"
            text = (f"Now the Module{k} work: wire module_{k}.py to the ServiceBus{k} queue." if j == 0
                    else f"Step {j} of that, still on it." if j % 2 == 0 else "Done, here is the change.") + pad
            turns.append(msg("user" if j % 2 == 0 else "assistant", text, when))
    return turns


async def test_a_long_session_gets_a_line_per_task() -> None:
    """A coding session of hours with no break: a line ends at the first user turn past 20 messages,
    so each stretch keeps its own names, where one line of ten terms for the afternoon lost most."""
    turns = long_session(10)
    lines, _ = timeline.parse(await fold_all(turns, 10, 100_000))
    assert len(lines) == 6  # 120 messages, a line per 20 (each cut at a user turn)
    assert all(20 <= ln.last - ln.first + 1 <= 21 for ln in lines[:-1])
    assert lines[0].first == 0 and lines[-1].last == len(turns) - 1
    assert all(a.last + 1 == b.first for a, b in itertools.pairwise(lines))
    terms = {t for ln in lines for t in ln.terms}
    assert {f"module_{k}.py" for k in range(10)} <= terms


async def test_a_chat_of_one_line_messages_keeps_a_line_per_session() -> None:
    """A line ends for a task only once it covers about TASK_TOKENS tokens: sixty one-line messages
    of one afternoon stay one line, which a line per 20 of them would make as long as what it covers."""
    turns = [msg("user" if i % 2 == 0 else "assistant", f"Chat line {i} about the Lunch{i % 3} plan.",
                 f"2024-03-02T12:{i:02d}:00") for i in range(60)]
    lines, _ = timeline.parse(await fold_all(turns, 10, 800))
    assert [(ln.first, ln.last) for ln in lines] == [(0, 59)]


async def test_a_long_conversations_timeline_grows_with_it() -> None:
    """`timeline_tokens` is the floor: a conversation whose 1% of tokens is more keeps more of its
    lines apart, and a short one keeps to the floor."""
    turns = long_session(30)
    grown = timeline.budget(40, len(turns), turns)
    assert grown == int(0.01 * sum(t.tokens for t in turns)) > 800  # ~90,000 words
    assert timeline.budget(40, 12, turns[:12]) == 40
    text = await fold_all(turns, 10, 40)
    lines = timeline.parse(text)[0]
    assert words(text.split("\n\n")[0]) <= grown + len(lines)
    floor_only = timeline.cap(timeline.extend([], turns, 0), 40, words)
    assert 2 == len(floor_only) < len(lines) <= 18  # 18 tasks: the grown budget keeps them apart, not the floor
    assert lines[0].first == 0 and lines[-1].last == len(turns) - 1


def test_a_line_opens_on_what_was_asked_not_a_bare_request_for_help() -> None:
    """The opening is the first statement or question that names something: "Can you help me fix
    this?" before the file and the error says nothing of the task; with no name at all, the first one."""
    turns = [msg("user", "Can you help me fix this? I upgraded to Flask 2.3.3 and the /predict endpoint "
                 "returns 500. Here's my code:", "2024-03-02T10:00:00")]
    (line,) = timeline.extend([], turns, 0)
    assert line.opening == "I upgraded to Flask 2.3.3 and the /predict endpoint returns 500"
    (plain,) = timeline.extend([], [msg("user", "Can you help me? It is slow.", "2024-03-02T10:00:00")], 0)
    assert plain.opening == "Can you help me"
    # A complaint that names the task says what was asked; a greeting with a name does not.
    stuck = msg("user", "Hi Claude! I'm trying to add JWT v9.0.0 to my chat app, but I'm having trouble with "
                "the expiry. Can you help me with that?", "2024-03-02T10:00:00")
    (line,) = timeline.extend([], [stuck], 0)
    assert line.opening.startswith("I'm trying to add JWT v9.0.0 to my chat app")
    # Words that only fill the start ("hmm, so") are not what was asked.
    hmm = msg("user", "hmm, so how do I handle time zone conversions in Postgres?", "2024-03-02T10:00:00")
    (line,) = timeline.extend([], [hmm], 0)
    assert line.opening == "how do I handle time zone conversions in Postgres"
    (line,) = timeline.extend([], [msg("user", "Ok so, Redis 7 keeps crashing under load.", "2024-03-02T10:00:00")], 0)
    assert line.opening == "Redis 7 keeps crashing under load"


async def fold_batches(batches: list[list[Message]], timeline_tokens: int) -> list[timeline.Line]:
    summarizer = ExtractiveSummarizer(words)
    text, start = "", 0
    for batch in batches:
        text = (await fold.fold_summary(summarizer, text, batch, start, max_tokens=600,
                                        timeline_tokens=timeline_tokens)).text
        start += len(batch)
    return timeline.parse(text)[0]


async def test_a_fold_of_short_messages_does_not_merge_a_grown_timeline_down() -> None:
    """The budget is estimated from each fold's messages, and merges are not undone: a fold of
    "ok" and "go on" between long ones leaves the timeline as long as it had grown, not at the floor."""
    big = [replace(m, tokens=800) for m in long_session(32)]  # ~300K tokens: 1% holds all its task lines
    head = [big[i:i + 10] for i in range(0, 360, 10)]
    short = [msg("user" if j % 2 == 0 else "assistant", "ok", "2024-03-02T18:00:00") for j in range(10)]
    plain = await fold_batches([*head, big[360:]], 200)
    dipped = await fold_batches([*head, short, big[360:]], 200)
    assert len(plain) >= 18 and len(dipped) >= len(plain)


async def test_the_timeline_stops_growing_at_its_ceiling() -> None:
    """However long the conversation, the timeline stays within MAX_TOKENS (it goes into every
    rewritten request): past it, older lines merge, none is dropped."""
    turns = [replace(m, tokens=1000) for m in long_session(120)]  # 1,440 messages of a coding agent's size
    lines = await fold_batches([turns[i:i + 40] for i in range(0, len(turns), 40)], 200)
    assert sum(words(ln.render()) + 1 for ln in lines) <= timeline.MAX_TOKENS
    assert lines[0].first == 0 and lines[-1].last == len(turns) - 1
    assert all(a.last + 1 == b.first for a, b in itertools.pairwise(lines))


def test_a_task_line_ends_at_a_user_turn() -> None:
    """An agent loop (a request, then many assistant and tool messages) is cut only where the user
    speaks again: every line opens on a user message."""
    turns = []
    for k in range(4):
        for j in range(27):  # a user turn, then 26 of the agent's
            minute = 27 * k + j
            role = "user" if j == 0 else "assistant"
            when = f"2024-03-02T{12 + minute // 60:02d}:{minute % 60:02d}:00"
            turns.append(replace(msg(role, f"Task {k}: step {j} of module_{k}.py.", when), tokens=300))
    lines = timeline.extend([], turns, 0)
    assert [(ln.first, ln.last) for ln in lines] == [(0, 26), (27, 53), (54, 80), (81, 107)]
    assert all(turns[ln.first].role == "user" for ln in lines)


def test_a_list_of_numbers_is_not_a_topic_but_a_number_is() -> None:
    """"3,31" (a reference, a list) says nothing of what a session was about; "1,000" and "7.2" do."""
    terms = timeline._terms("We moved 1,000 users to Redis 7.2 in batch 3,31 and 4,3 on port 3000.")
    assert terms == ["1,000", "Redis", "7.2", "3000"]


def test_a_leading_date_stamp_is_the_lines_date_not_its_topic() -> None:
    """Clients that date each message in its text ("[2023/05/20 (Sat) 07:47] ...") get the session's
    subjects as topics and opening, not the stamp's date, weekday and time."""
    turns = [msg("user", "[2023/05/20 (Sat) 07:47] I'm looking for advice on the Fujifilm X-T5 and a 23mm lens.",
                 "2023-05-20T07:47:00"),
             msg("assistant", "[2023/05/20 (Sat) 07:48] The XF 23mm f/2 pairs well with it.", "2023-05-20T07:48:00"),
             msg("user", "[2023/05/20 (Sat) 07:52] What about a bag for the X-T5?", "2023-05-20T07:52:00")]
    (line,) = timeline.extend([], turns, 0)
    assert line.opening.startswith("I'm looking for advice on the Fujifilm X-T5")
    assert "X-T5" in line.terms and "23mm" in line.terms
    assert not {"2023/05/20", "Sat", "07:47", "07:52"} & set(line.terms)


def test_the_timeline_decides_as_the_state_does() -> None:
    """The same sentences count: a pasted ruling's "Decision: ..." is neither the state's nor the
    timeline's; the assistant's "we'll use" after the user's assent is both."""
    from gateway import state

    ruling = ("Summarise this ruling for me. Decision: the petition is denied. "
              + "The committee reviews each application in the order it arrives. " * 40)
    agreed = [msg("assistant", "I'd suggest PostgreSQL 16 for the orders service.", "2024-03-02T10:00:00"),
              msg("user", "Sounds good, let's do that.", "2024-03-02T10:01:00"),
              msg("assistant", "We'll use PostgreSQL 16 for the orders service. We'll use a dict to show it.",
                  "2024-03-02T10:02:00")]
    for turns, decided in (([msg("user", ruling, "2024-03-02T10:00:00")], []),
                           (agreed, ["We'll use PostgreSQL 16 for the orders service"])):
        (line,) = timeline.extend([], turns, 0)
        assert line.decisions == decided
        ledger = state.extract(state.Ledger(), turns, 0)
        assert [i.text.rstrip(".") for i in ledger.active("decisions")] == decided


def test_a_time_at_the_calendars_end_east_of_utc_does_not_break_a_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored 9999-12-31T12:00:00 (before X-Message-Time was bounded) read as local time on a host
    east of UTC overflowed, and every fold of the conversation failed: it is undated instead."""
    import time

    from gateway import timeline

    monkeypatch.setenv("TZ", "Pacific/Kiritimati")
    time.tzset()
    try:
        assert timeline._stamp("9999-12-31T12:00:00") == ("", None)
        assert timeline._stamp("2024-03-02T09:30:00")[0] == "2024-03-02 09:30"
    finally:
        monkeypatch.undo()
        time.tzset()
