"""The project-state ledger: extraction, supersession, edits, rendering (pure, no Redis)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import state
from gateway.model import Message


def words(text: str) -> int:
    return len(text.split())


def turn(role: str, text: str, time: str | None = None) -> Message:
    return Message(raw={"role": role, "content": text}, role=role, text=text, tokens=words(text), hash="00",
                time=time)


def test_extract_kinds_from_opening_messages() -> None:
    """Goal, constraints, decisions, preferences, stack, tasks and facts are recognised by pattern."""
    turns = [
        turn("user", "Hi! My name is Priya Raman. The goal is a billing service for the Orion shop."),
        turn("assistant", "Happy to help. What stack do you have in mind?"),
        turn("user", "Stack: Python 3.12 with FastAPI and PostgreSQL. We must keep p99 latency under 200 ms. "
                     "I prefer small pull requests. TODO write the migration script."),
        turn("assistant", "We decided to use Alembic for migrations. The config lives at /etc/orion/app.yaml."),
        turn("user", "The launch date is 2024-11-18."),
    ]
    ledger = state.extract(state.Ledger(), turns, 0, now="2024-01-01T00:00:00+00:00")
    texts = {kind: [i.text for i in ledger.active(kind)] for kind in state.KINDS}
    assert any("billing service" in t for t in texts["goal"])
    assert any("p99 latency" in t for t in texts["constraints"])
    assert any("Alembic" in t for t in texts["decisions"])
    assert any("small pull requests" in t for t in texts["preferences"])
    assert any("FastAPI" in t for t in texts["tech_stack"])
    assert any("migration script" in t for t in texts["open_tasks"])
    assert any("Priya Raman" in t for t in texts["facts"])
    assert any("2024-11-18" in t for t in texts["facts"])
    assert all(i.source is not None for _, i in ledger.all_items())
    assert "Happy to help" not in " ".join(i.text for _, i in ledger.all_items())


def test_items_record_source_index_and_time() -> None:
    """Each item remembers the index and time of the message it came from."""
    turns = [turn("user", "hello"), turn("user", "We must never log card numbers.", time="2024-05-01T10:00:00")]
    ledger = state.extract(state.Ledger(), turns, 40)
    (item,) = ledger.active("constraints")
    assert item.source == 41 and item.time == "2024-05-01T10:00:00"


def test_changed_value_supersedes_not_deletes() -> None:
    """A restated fact with a new value marks the old item superseded and keeps it."""
    ledger = state.extract(state.Ledger(), [turn("user", "The API server must listen on port 8443.")], 0)
    ledger = state.extract(ledger, [turn("user", "The API server must listen on port 9443.")], 5)
    items = ledger.constraints
    assert len(items) == 2
    old, new = items
    assert old.superseded_by == new.id and new.superseded_by is None
    assert [i.text for i in ledger.active("constraints")] == ["The API server must listen on port 9443."]


def test_switch_from_supersedes_mentions() -> None:
    """"switch from X to Y" supersedes earlier items that mention X."""
    ledger = state.extract(state.Ledger(), [turn("user", "We decided to use Flask for the web layer.")], 0)
    ledger = state.extract(ledger, [turn("user", "We decided to switch from Flask to FastAPI.")], 9)
    active = [i.text for i in ledger.active("decisions")]
    assert active == ["We decided to switch from Flask to FastAPI."]
    assert ledger.decisions[0].superseded_by == ledger.decisions[1].id


def test_a_move_to_another_product_is_a_decision_and_replaces_what_it_leaves() -> None:
    """"let's switch to", "we're moving from X to Y" decide, said as people say them, without "decided";
    "instead of PostgreSQL." (the sentence's stop after the name) replaces the PostgreSQL decision. A
    move to something that is not a product decides nothing for the project."""
    ledger = state.Ledger()
    said = [("We're moving from SQLite to PostgreSQL 16.", "2024-02-01T09:00:00"),
            ("I'm moving to Seattle.", "2024-02-10T09:00:00"), ("Let's switch to dark mode.", "2024-02-11T09:00:00"),
            ("We'll move the meeting to Friday.", "2024-02-12T09:00:00"),
            ("Actually, let's switch to MySQL 8 instead of PostgreSQL.", "2024-03-02T09:00:00")]
    for i, (text, time) in enumerate(said):
        ledger = state.extract(ledger, [turn("user", text, time=time)], i)
    (latest,) = ledger.active("decisions")
    assert latest.text == "Actually, let's switch to MySQL 8 instead of PostgreSQL."
    assert latest.was == ["We're moving from SQLite to PostgreSQL 16."]
    assert len(ledger.decisions) == 2


@pytest.mark.parametrize(("said", "decides"), [
    ("We're migrating to Aurora next week.", True),
    ("Let's switch to Go for the workers.", True),
    ("We're migrating the queue to SQS.", True),
    ("Let's switch the ORM to Prisma.", True),
    ("Let's switch to `pnpm` for installs.", True),
    ("We've moved the CI to GitHub Actions.", True),
    ("I'm moving to Seattle next month.", False),
    ("I'm moving to NYC in May.", False),
    ("We're moving our team from Boston to Austin.", False),
    ("We'll move the launch to Q3.", False),
    ("We moved the standup to Monday.", False),
    ("Let's switch the sync to Fri.", False),
    ("Let's switch to English.", False),
    ("Let's switch to Plan B.", False),
    ("We're migrating to the new office in March.", False),
    ("Let's switch to dark mode.", False),
    ("We'll switch the review to Alice.", False),
    ("Let's migrate the on-call rotation to Priya.", False),
    ("Let's switch the optimizer to Adam.", True),
    ("We'll migrate the lambdas to SAM.", True),
    ("We're moving to Vercel.", True),
    ("Let's migrate the auth to Supabase.", True),
])
def test_a_move_to_a_product_named_in_capitals_is_a_decision(said: str, decides: bool) -> None:
    """A switch or migration to a product spelled like any proper name or acronym ("Aurora", "Go",
    "SQS"), or written as code (`pnpm`), decides as much as one to "PostgreSQL 16" does; a day, a
    quarter, a language or a plan does not, nor a "move" to a name that is not spelled as a product
    (people move to cities and move teams and launches)."""
    ledger = state.extract(state.Ledger(), [turn("user", said)], 0)
    assert [i.text for i in ledger.active("decisions")] == ([said] if decides else [])


@pytest.mark.parametrize(("said", "decides"), [
    ("We finally decided to use Postgres.", True),
    ("We've now switched to PostgreSQL 16.", True),
    ("I've finally decided on FastAPI.", True),
    ("We ultimately went with Redis.", True),
    ("Let's just use Vite.", True),
    ("We eventually chose MongoDB over Postgres.", True),
    ("We'll probably use Redis.", False),
    ("Let's not use Redis.", False),
])
def test_a_decision_said_with_an_adverb_before_its_verb_is_a_decision(said: str, decides: bool) -> None:
    """"We finally decided", "we've now switched": the adverb people put before the verb hid the
    decision. A hedge ("we'll probably use") still decides nothing."""
    ledger = state.extract(state.Ledger(), [turn("user", said)], 0)
    assert [i.text for i in ledger.active("decisions")] == ([said] if decides else [])


def test_a_move_replaces_what_names_the_old_thing_not_what_a_pronoun_stands_for() -> None:
    """"instead of MySQL" replaces the rule that requires MySQL (a stale rule would be read first),
    and "Postgres" the items that say "PostgreSQL"; "instead of them", "instead of using Celery" name
    nothing a statement can be matched on, so they hide nothing."""
    ledger = state.Ledger()
    for i, text in enumerate(["All new services must use MySQL.", "We run PostgreSQL 16.2.",
                              "We will use them for logging.", "We decided to use Celery for jobs.",
                              "We decided to use PostgreSQL instead of MySQL.",
                              "We switched from Postgres to MySQL 8.0.1.",
                              "Let's use a queue instead of them.", "Let's use a queue instead of using Celery."]):
        ledger = state.extract(ledger, [turn("user", text)], i)
    assert ledger.active("constraints") == []
    assert [i.text for i in ledger.active("tech_stack")] == ["MySQL 8.0.1"]
    assert [i.text for i in ledger.active("decisions")] == [
        "We will use them for logging.", "We decided to use Celery for jobs.",
        "We switched from Postgres to MySQL 8.0.1.", "Let's use a queue instead of them.",
        "Let's use a queue instead of using Celery."]


def test_a_platform_at_a_major_version_is_in_the_stack() -> None:
    """"PostgreSQL 16", "Django 5", "Node.js 20" are the stack. Said in passing, a bare major version
    never replaces a version the stack holds ("my Python 2 scripts", "the legacy code used React 16",
    "tutorials target Java 8"), nor counts when it is a course, a cluster's node or a comparison; a
    move to it does replace ("we upgraded to PostgreSQL 17"), and "PostgreSQL 17.1" then refines it
    without a new date. "Postgres" and "PostgreSQL" are one platform."""
    ledger = state.Ledger()
    said = ["We run Python 3.12, Postgres 16, Django 5, React 18.2.0 and Node.js 20.",
            "My Python 2 scripts are broken.", "The old code base used React 16 class components.",
            "Most tutorials still target Java 8.", "I'm teaching Python 101 on Fridays.",
            "Node 3 keeps running out of memory.", "We're deciding between Vue 3 and Angular 17.",
            "We upgraded the main database to PostgreSQL 17.", "PostgreSQL 17.1 is what prod reports."]
    for i, text in enumerate(said):
        ledger = state.extract(ledger, [turn("user", text, time=f"2024-03-{i + 1:02d}T09:00:00")], i)
    stack = sorted(i.text for i in ledger.active("tech_stack") if state.is_component(i))
    assert stack == ["Django 5", "Node.js 20", "PostgreSQL 17.1", "Python 3.12", "React 18.2.0"]
    (pg,) = [i for i in ledger.active("tech_stack") if i.text == "PostgreSQL 17.1"]
    assert pg.was == ["Postgres 16"] and pg.time == "2024-03-08T09:00:00"


def test_a_move_to_a_major_version_is_made_or_planned() -> None:
    """A move made replaces the version ("..., which was painless" is about the move); a planned one
    ("we plan to upgrade ... next quarter") changes nothing; a move to less precision ("React 18" after
    "React 18.2.0") keeps the precise one; a comparison word far from the name does not hide it."""
    ledger = state.Ledger()
    for i, text in enumerate(["We run PostgreSQL 15.4 and React 18.2.0.",
                              "We plan to upgrade to PostgreSQL 17 next quarter.",
                              "We upgraded to PostgreSQL 16, which was painless.", "We upgraded to React 18.",
                              "I'm setting up my Django 5 project with relationships between the tables."]):
        ledger = state.extract(ledger, [turn("user", text)], i)
    assert sorted(i.text for i in ledger.active("tech_stack") if state.is_component(i)) == [
        "Django 5", "PostgreSQL 16", "React 18.2.0"]


def test_a_short_preference_that_says_it_changes_replaces_the_old_one() -> None:
    """"I changed my mind, I prefer spaces." replaces "I prefer tabs." and keeps it as history. Weaker
    words of change in a short statement ("From now on, ...", "Actually, ...") add a rule or a taste
    beside the old one: "From now on, always add tests." leaves "Always add docstrings." standing."""
    ledger = state.Ledger()
    said = ["I prefer tabs.", "Always add docstrings.", "I hate cilantro.", "From now on, always add tests.",
            "Actually, I hate olives.", "I changed my mind, I prefer spaces."]
    for i, text in enumerate(said):
        ledger = state.extract(ledger, [turn("user", text, time=f"2024-03-0{i + 1}T09:00:00")], i)
    assert [i.text for i in ledger.active("preferences")] == [
        "I hate cilantro.", "Actually, I hate olives.", "I changed my mind, I prefer spaces."]
    assert ledger.active("preferences")[2].was == ["I prefer tabs."]
    rules = [i.text for i in ledger.active("constraints")]
    assert rules == ["Always add docstrings.", "From now on, always add tests."]


def test_dates_money_and_people_said_in_words_are_facts() -> None:
    """A deadline said as "March 15", a budget in dollars, a manager by name are facts; the same words
    without a value ("the deadline is tight", "my manager said so"), someone else's launch, or a thing
    that starts with a capital ("my PM Jira board") are not."""
    said = ["The deadline is March 15.", "The budget is $5,000 per month.", "My manager Priya wants weekly reports.",
            "The deadline is tight.", "My manager said so.", "I watched the SpaceX launch on Friday.",
            "My PM Jira board is a mess."]
    ledger = state.extract(state.Ledger(), [turn("user", text) for text in said], 0)
    assert [i.text for i in ledger.active("facts")] == said[:3]


def test_the_projects_goal_stays_beside_the_current_tasks() -> None:
    """The first goal says what the project is for; later goals are tasks: the newest replaces the one
    before it, never the project's, unless it changes that one in so many words."""
    ledger = state.Ledger()
    for i, text in enumerate(["My goal is a recommendation service for local restaurants.",
                              "My goal is to make the scoring code more modular.",
                              "My goal is to keep the final image size under 120MB."]):
        ledger = state.extract(ledger, [turn("user", text)], i)
    assert [i.text for i in ledger.active("goal")] == [
        "My goal is a recommendation service for local restaurants.",
        "My goal is to keep the final image size under 120MB."]
    rendered = state.render(ledger, 500, words)
    assert rendered.startswith("Goal:\n- My goal is to keep the final image size under 120MB.\n"
                               "- My goal is a recommendation service for local restaurants.")
    # A goal that says it changes replaces the project's too.
    ledger = state.extract(ledger, [turn("user", "Actually, my goal is now a recipe app instead.")], 3)
    assert [i.text for i in ledger.active("goal")] == ["Actually, my goal is now a recipe app instead."]


def test_duplicates_are_not_added_twice() -> None:
    """Restating the same fact adds nothing."""
    t = turn("user", "We must keep p99 latency under 200 ms.")
    ledger = state.extract(state.Ledger(), [t], 0)
    again = state.extract(ledger, [turn("user", "We must keep the p99 latency under 200 ms.")], 3)
    assert again == ledger


def test_extract_leaves_its_input_alone() -> None:
    """extract returns the very ledger when nothing is added, and a copy (input untouched) when something is."""
    ledger = state.extract(state.Ledger(), [turn("user", "The API server must listen on port 8443.")], 0)
    before = ledger.dump()
    assert state.extract(ledger, [turn("assistant", "Sure, the suite passes.")], 1) is ledger
    assert state.extract(ledger, [turn("user", "The API server must listen on port 8443.")], 2) is ledger
    changed = state.extract(ledger, [turn("user", "The API server must listen on port 9443.")], 3)
    assert changed is not ledger and len(changed.constraints) == 2
    assert ledger.dump() == before


def test_copy_ledger_is_independent() -> None:
    """A copied ledger's items can change without changing the original's."""
    ledger = state.extract(state.Ledger(), [turn("user", "We must keep p99 latency under 200 ms.")], 0)
    copy = state.copy_ledger(ledger)
    assert copy == ledger
    copy.constraints[0].superseded_by = "s9"
    copy.seq = 9
    assert ledger.constraints[0].superseded_by is None and ledger.seq == 1


def test_edits_win_over_extraction() -> None:
    """Items set via the API are never superseded nor duplicated by later extraction."""
    ledger = state.apply_edits(state.Ledger(), {"constraints": ["The API server must listen on port 8443."]},
                               time="t")
    ledger = state.extract(ledger, [turn("user", "The API server must listen on port 9443."),
                                    turn("user", "The API server must listen on port 8443.")], 2)
    edited = [i for i in ledger.constraints if i.edited]
    assert len(edited) == 1 and edited[0].superseded_by is None
    assert sum("8443" in i.text for i in ledger.constraints) == 1


def test_apply_edits_replaces_a_kind() -> None:
    """A PUT of a kind supersedes that kind's previous active items."""
    ledger = state.extract(state.Ledger(), [turn("user", "The goal is a CLI for backups.")], 0)
    ledger = state.apply_edits(ledger, {"goal": "The goal is a backup service with a web UI."}, time="t")
    assert [i.text for i in ledger.active("goal")] == ["The goal is a backup service with a web UI."]
    assert len(ledger.goal) == 2


def test_llm_update_applies_with_replaces() -> None:
    """A validated llm update adds items and supersedes the one it names."""
    ledger = state.extract(state.Ledger(), [turn("user", "We decided to use MySQL.")], 0)
    old = ledger.decisions[0]
    update = state.StateUpdate.model_validate({"items": [
        {"kind": "decisions", "text": "Use PostgreSQL 16 instead of MySQL", "source": 7, "replaces": old.id}]})
    out = state.apply_update(ledger, update)
    assert [i.text for i in out.active("decisions")] == ["Use PostgreSQL 16 instead of MySQL"]
    assert ledger.decisions[0].superseded_by is None  # the input is not mutated


def test_a_branch_forgets_what_its_abandoned_turns_said() -> None:
    """forget_from(at) drops the items extracted from messages at or after `at`, makes the items they
    had replaced current again, moves the read mark back, and keeps what was set through the API."""
    ledger = state.extract(state.Ledger(), [turn("user", "We decided to use MySQL.")], 0)
    ledger = state.extract(ledger, [turn("user", "We decided to use PostgreSQL 16 instead of MySQL.")], 6)
    ledger = state.apply_edits(ledger, {"constraints": ["Never log API keys"]}, time="2024-01-01T00:00:00")
    ledger = state.marked(ledger, "c1", 9)
    assert [i.text for i in ledger.active("decisions")] == ["We decided to use PostgreSQL 16 instead of MySQL."]
    out = state.forget_from(ledger, "c1", 4)
    assert out is not None and out is not ledger
    assert [i.text for i in out.active("decisions")] == ["We decided to use MySQL."]
    assert all("PostgreSQL" not in i.text for _, i in out.all_items())
    assert [i.text for i in out.active("constraints")] == ["Never log API keys"]
    assert out.marks["c1"] == 4 and ledger.marks["c1"] == 9  # the input is not mutated
    assert state.forget_from(out, "c1", 4) is None  # nothing left to forget
    # An edit that cleared or replaced the dropped item still wins over the item it had replaced.
    for edit in ([], ["Billing uses Oracle 19c"]):
        edited = state.apply_edits(ledger, {"decisions": edit}, time="2024-01-02T00:00:00")
        after = state.forget_from(edited, "c1", 4)
        assert after is not None and [i.text for i in after.active("decisions")] == edit


def test_render_order_budget_and_determinism() -> None:
    """Render puts goal and constraints first, newest first, leaves superseded out, fits its budget, same bytes."""
    ledger = state.Ledger()
    state.add_item(ledger, "facts", "The office is in Lyon.", source=1, time=None)
    state.add_item(ledger, "constraints", "Never deploy on Fridays.", source=2, time=None)
    state.add_item(ledger, "goal", "The goal is a billing service.", source=3, time=None)
    state.add_item(ledger, "constraints", "Responses must stay under 200 ms.", source=8, time=None)
    state.add_item(ledger, "goal", "The goal is a billing and invoicing service.", source=9, time=None)
    text = state.render(ledger, 500, words)
    assert text.splitlines()[:5] == [
        "Goal:", "- The goal is a billing and invoicing service.",
        "Constraints:", "- Responses must stay under 200 ms.", "- Never deploy on Fridays."]
    assert "billing service." not in text  # superseded goal left out
    assert text == state.render(state.Ledger.model_validate(ledger.dump()), 500, words)
    small = state.render(ledger, 12, words)
    assert words(small) + len(small.splitlines()) <= 12 + len(small.splitlines())
    assert small.startswith("Goal:") and "Lyon" not in small
    assert state.render(ledger, 0, words) == ""


def test_ledger_is_bounded() -> None:
    """A very long conversation does not grow the ledger without bound; edited items stay."""
    ledger = state.apply_edits(state.Ledger(), {"goal": "The goal is X."}, time=None)
    for i in range(400):
        state.add_item(ledger, "facts", f"Build {i} finished at step {i * 7} on host h{i}.", source=i, time=None)
    assert sum(1 for _ in ledger.all_items()) <= state.MAX_ITEMS
    assert ledger.active("goal")[0].edited


def test_changed_identifier_is_a_second_item() -> None:
    """Two statements differing only in a name are both kept; only numbers and paths update a statement."""
    ledger = state.extract(state.Ledger(), [turn("user", "We decided to add a helper called parse_safe.")], 0)
    ledger = state.extract(ledger, [turn("user", "We decided to add a helper called render_safe.")], 4)
    assert len(ledger.active("decisions")) == 2


_CASELESS_WORDS = ["We", "we'll", "MUST", "never", "TODO", "I'm", "port", "8443", "Kafka", "\u212aafka", "\u017ftack",
                   "\u0130", "stack:", "using", "redis", "for", "ORION-12", "caf\u00e9", ".", ",", "decided"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_CASELESS_WORDS), max_size=10), st.sampled_from(["", " ", "-", "'"]))
def test_caseless_agrees_with_ignorecase(words: list[str], sep: str) -> None:
    """A caseless Pattern answers as the same pattern under re.IGNORECASE, on ASCII and non-ASCII text alike."""
    text = sep.join(words) if sep else " ".join(words)
    for source in (r"\bwe(?:'ll| will)\s+use\b|\bmust\b|\btodo\b|\bi'm\b", r"\bstack\s*[:=]|\b[a-z][a-z0-9]+-\d+\b",
                   r"\bkafka\b|\bstack\b|\bi\b"):
        caseless = state.Pattern(source, caseless=True)
        folded = re.compile(source, re.IGNORECASE)
        lower = state.ascii_lower(text)
        assert caseless.search(text, lower) == (folded.search(text) is not None)
        assert caseless.match(text, lower) == (folded.match(text) is not None)


def test_caseless_source_must_be_lower_case() -> None:
    """A caseless source with a capital letter outside an escape is refused (its fast path could not match it)."""
    state.Pattern(r"\bhttps?://\S+\b", caseless=True)  # \S and \b are escapes, not capitals
    state.Pattern(r"\bTODO\b")  # case-sensitive: capitals are fine
    with pytest.raises(ValueError):
        state.Pattern(r"\bTODO\b", caseless=True)


def test_pattern_needs_guards_the_search() -> None:
    """A Pattern with `needs` finds what its regex finds on text that passes the test, and nothing on other text."""
    p = state.Pattern(r"\bport\s+\d+", needs=lambda text: "port" in text)
    assert p.search("listen on port 8443") and not p.search("no value here")
    never = state.Pattern(r"\bport\s+\d+", needs=lambda text: False)
    assert not never.search("listen on port 8443")


def test_a_decision_changed_twice_shows_the_latest_with_its_history() -> None:
    """SQLite, then PostgreSQL 15, then PostgreSQL 16: state shows the last one, since when, and
    what it replaced (the earlier two stay in the ledger, superseded)."""
    ledger = state.extract(state.Ledger(), [
        turn("user", "We decided to use SQLite for the orders database.", time="2024-01-10T09:00:00")], 0)
    ledger = state.extract(ledger, [
        turn("user", "We decided to switch from SQLite to PostgreSQL 15 for the orders database.",
             time="2024-02-01T09:00:00")], 12)
    ledger = state.extract(ledger, [
        turn("user", "We decided to upgrade the orders database from PostgreSQL 15 to PostgreSQL 16.",
             time="2024-03-02T09:00:00")], 40)
    (latest,) = ledger.active("decisions")
    assert "PostgreSQL 16" in latest.text and len(ledger.decisions) == 3
    rendered = state.render(ledger, 500, words)
    decisions = rendered.partition("Decisions:\n")[2].partition("\n\n")[0].splitlines()
    (line,) = [ln for ln in decisions if ln.startswith("- ")]  # the superseded ones are not items of their own
    assert "PostgreSQL 16" in line and "since 2024-03-02" in line
    assert line.index("PostgreSQL 15") < line.index("SQLite")  # newest replaced first
    # The stack says it too, at its version: "PostgreSQL 16" names a major version alone.
    assert "- PostgreSQL 16 (since 2024-03-02; was: PostgreSQL 15)" in rendered


@pytest.mark.parametrize("text", [
    "hmm, so how do I ensure the query always returns a list?",
    "I've been staring at this code for hours and it must be something obvious.",
    "Can we always use the same connection pool for every worker?",
    "Should I never commit the .env file?",
    "Hi! Thanks, we decided nothing yet.",
    "This is so frustrating, the build must have broken again.",
    "What is the goal is the question I keep asking myself",
    "I'm getting a 'Cannot set headers after they are sent' error that must come from authController.js.",
    "I'm not sure we decided to always use UTC.",
    "I'd like to know if there are any issues with using Redis as a session store.",
    "I'm wondering whether we must keep the old endpoint.",
    "However, this throws an error saying that the value must be an integer.",
    "The call gives me an error that says the token must be refreshed.",
    "For example, if the PDF cannot be opened, I want to display a user-friendly error message.",
    "For this example, let's use AWS Secrets Manager to store the key.",
    "I also want to filter out the inactive users.",
])
def test_questions_greetings_and_complaints_are_never_state(text: str) -> None:
    """Sentences that ask, greet, complain, report an error, give an example or ask for one thing now
    ("I also want to filter out ...") hold the words of a constraint, a decision or a preference, but
    state nothing: no state item comes of them."""
    ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
    assert list(ledger.all_items()) == []


def test_statements_next_to_questions_are_still_state() -> None:
    """The filter is per sentence: a question does not hide the rule stated beside it."""
    ledger = state.extract(state.Ledger(), [turn(
        "user", "Why does it time out? We must keep every request under 2 seconds. Don't log tokens, never.")], 0)
    texts = [i.text for i in ledger.active("constraints")]
    assert "We must keep every request under 2 seconds." in texts
    assert not any("?" in t for t in texts)


def test_near_duplicates_merge_into_one_item() -> None:
    """A restatement adds nothing; an extended restatement takes the shorter one's place."""
    ledger = state.extract(state.Ledger(), [turn("user", "We must keep all the API responses under 200 ms.")], 0)
    ledger = state.extract(ledger, [turn("user", "We must keep API responses under 200 ms.")], 3)
    assert len(ledger.active("constraints")) == 1
    ledger = state.extract(ledger, [turn("user", "We must keep all the API responses under 200 ms, even "
                                                 "during nightly batch imports.")], 7)
    (item,) = ledger.active("constraints")
    assert "nightly batch imports" in item.text and not item.was


def test_framing_words_do_not_make_a_second_rule() -> None:
    """"I've been told to always X" restates the rule "Always X when ..." it came with: one item."""
    ledger = state.extract(state.Ledger(), [turn(
        "user", "Always use camelCase for variable names when I ask about JavaScript code style.")], 0)
    ledger = state.extract(ledger, [turn("user", "I've been told to always use camelCase for variable names.")], 4)
    assert [i.text for i in ledger.active("constraints")] == [
        "Always use camelCase for variable names when I ask about JavaScript code style."]
    # Said the other way round, the fuller rule takes the framed one's place.
    framed = "I've been told to always use camelCase for variable names."
    ledger = state.extract(state.Ledger(), [turn("user", framed)], 0)
    ledger = state.extract(ledger, [turn(
        "user", "Always use camelCase for variable names when I ask about JavaScript code style.")], 4)
    assert [i.text for i in ledger.active("constraints")] == [
        "Always use camelCase for variable names when I ask about JavaScript code style."]


def test_a_reversed_rule_replaces_the_one_it_reverses() -> None:
    """"We must not use X" after "We must use X" is the rule now, with the old one as its history;
    a reversal is never taken for a duplicate of what it reverses."""
    ledger = state.extract(state.Ledger(), [turn("user", "We must use camelCase for variable names.")], 0)
    ledger = state.extract(ledger, [turn("user", "We must not use camelCase for variable names.")], 6)
    (item,) = ledger.active("constraints")
    assert item.text == "We must not use camelCase for variable names."
    assert item.was == ["We must use camelCase for variable names."]


@pytest.mark.parametrize(("first", "second", "active"), [
    # A negation about another subject reverses nothing: both stand.
    ("We decided to use Redis for caching.", "We decided not to use Memcached for caching.", 2),
    ("We must use Redis for the session cache.", "We must not use Postgres for the session cache.", 2),
    # The same rule in other words of negation is one rule, replacing nothing.
    ("We must not use tabs in Python files.", "We must never use tabs in Python files.", 1),
    # Whose it is makes it another rule.
    ("You must review my pull requests before merging to main.",
     "I must review your pull requests before merging to main.", 2),
])
def test_only_a_statement_turned_by_its_negation_alone_replaces_it(first: str, second: str, active: int) -> None:
    ledger = state.extract(state.Ledger(), [turn("user", first)], 0)
    ledger = state.extract(ledger, [turn("user", second)], 4)
    items = [i for _, i in ledger.all_items() if i.superseded_by is None]
    assert len(items) == active and items[0].text == first and not any(i.was for i in items)


@pytest.mark.parametrize(("first", "second", "replaced"), [
    ("I prefer dark mode in every editor.", "Actually, I prefer light mode in every editor now.", True),
    ("Always use two spaces for indentation.", "Always use four spaces for indentation instead.", True),
    ("We must deploy on Fridays.", "Actually, we must deploy on Mondays.", True),
    ("I prefer tabs over spaces.", "I actually prefer spaces over tabs.", True),
    # "now" alone also means "at this point": a second browser, not a change of browser.
    ("We must support Chrome.", "We must now support Firefox.", False),
    # Saying no change, a changed choice and a second one look alike: both stand, the newer first.
    ("I prefer dark mode in every editor.", "I prefer light mode in every editor.", False),
    ("We chose to store API keys settings in environment variables.",
     "We chose to store backup settings in environment variables.", False),
    # Two changes apart, or the same order for another case: two statements.
    ("Always use camelCase for variable names.", "Always use snake_case for function names now.", False),
    ("Always include exact version numbers when I ask about upgrades.",
     "Always include exact version numbers when I ask about integrations.", False),
])
def test_a_changed_choice_is_never_dropped_and_replaces_when_it_says_so(first: str, second: str,
                                                                         replaced: bool) -> None:
    """"I prefer light mode" after "I prefer dark mode" was taken for a duplicate and dropped: the
    state kept the stale choice. It now stands beside it, and replaces it (kept as history) when it
    says it changes it ("actually", "instead", "anymore", "no longer", "switched to")."""
    ledger = state.Ledger()
    kind = state.classify(first, "user")
    assert kind is not None
    for source, text in enumerate((first, second)):
        state.add_item(ledger, kind, text, source=source, time=None)
    active = [(i.text, i.was) for i in ledger.active(kind)]
    assert active == ([(second, [first])] if replaced else [(first, []), (second, [])])


def test_a_change_that_could_replace_several_replaces_none_and_rewordings_stay_one() -> None:
    """"Actually, we must support Safari instead" after Chrome and Firefox: which one goes is unsaid,
    so all three stand. "Fridays" for "Friday", "each" for "every" are the same statement."""
    ledger = state.Ledger()
    for source, text in enumerate(("We must support Chrome.", "We must support Firefox.",
                                   "Actually, we must support Safari instead.")):
        state.add_item(ledger, "constraints", text, source=source, time=None)
    assert len(ledger.active("constraints")) == 3
    for first, second in (("We must deploy on Friday.", "We must deploy on Fridays."),
                          ("I prefer dark mode in every editor.", "I prefer dark mode in each editor.")):
        ledger = state.Ledger()
        for source, text in enumerate((first, second)):
            state.add_item(ledger, "constraints", text, source=source, time=None)
        assert [i.text for i in ledger.active("constraints")] == [first]


def test_a_correction_of_one_inflection_is_kept_and_history_reads_newest_first() -> None:
    """"Actually, the table is named user instead" corrects "... users" (the same stem, but it says it
    corrects); an item replacing several lists them newest first."""
    ledger = state.Ledger()
    state.add_item(ledger, "facts", "The table is named users.", source=0, time=None)
    state.add_item(ledger, "facts", "Actually, the table is named user instead.", source=1, time=None)
    assert [(i.text, i.was) for i in ledger.active("facts")] == [
        ("Actually, the table is named user instead.", ["The table is named users."])]
    ledger = state.Ledger()
    for source, text in enumerate(("The API is built with Flask 1.1.", "We use Flask blueprints for the admin.")):
        state.add_item(ledger, "architecture", text, source=source, time=None)
    item = state.add_item(ledger, "architecture", "We moved the API to FastAPI.", source=2, time=None)
    assert item is not None
    state.supersede_mentions(ledger, "Flask", item.id)
    assert item.was == ["We use Flask blueprints for the admin.", "The API is built with Flask 1.1."]


def test_a_change_is_read_from_the_users_words_through_extraction() -> None:
    """"I actually prefer ..." is a preference (an adverb after "I" hid it), and replaces the old one."""
    ledger = state.extract(state.Ledger(), [turn("user", "I prefer dark mode in every editor.")], 0)
    ledger = state.extract(ledger, [turn("user", "I actually prefer light mode in every editor.")], 1)
    assert [(i.text, i.was) for i in ledger.active("preferences")] == [
        ("I actually prefer light mode in every editor.", ["I prefer dark mode in every editor."])]


@pytest.mark.parametrize(("first", "second"), [
    ("We use Redis for caching.", "We don't use Redis for caching."),
    ("Don't use tabs for indentation.", "Use tabs for indentation."),
    ("Use Redis without TLS.", "Don't use Redis without TLS."),
])
def test_a_contraction_reverses_as_not_does(first: str, second: str) -> None:
    """"Don't", "won't" reverse a statement as "not" does; "without" beside them is no negation of it."""
    ledger = state.Ledger()
    for source, text in enumerate((first, second)):
        state.add_item(ledger, "constraints", text, source=source, time=None)
    assert [(i.text, i.was) for _, i in ledger.all_items() if i.superseded_by is None] == [(second, [first])]


def test_bold_marks_go_but_stars_that_are_words_stay() -> None:
    """An answer's bold labels are layout; a glob, **kwargs and a power are the statement's words."""
    said = ["Never commit files matching **/*.env to the repo.", "Every handler must accept **kwargs in the API.",
            "The cache key must be 2**16 entries at most.", "We must compute x**2 + y**2 for every point.",
            "Always exclude node_modules/** from the lint run.", "**Always** use **strict mode** in every file."]
    ledger = state.extract(state.Ledger(), [turn("user", "\n".join(said))], 0)
    assert [i.text for i in ledger.active("constraints")] == [*said[:5], "Always use strict mode in every file."]


@pytest.mark.parametrize(("text", "decided"), [
    ("Here's a summary of their pros and cons to help you make an informed decision:", None),
    ("Decision: we keep Redis 7 for sessions.", "Decision: we keep Redis 7 for sessions."),
    ("**Final decision:** PostgreSQL 16 for the orders service.",
     "Final decision: PostgreSQL 16 for the orders service."),  # an answer's bold marks are layout
    ("1. **Decision:** we keep Redis 7 for sessions.", "1. Decision: we keep Redis 7 for sessions."),
    ("The final decision: PostgreSQL 16 for the orders service.",
     "The final decision: PostgreSQL 16 for the orders service."),
])
def test_a_decision_label_opens_its_sentence(text: str, decided: str | None) -> None:
    """"Decision:" labels a decision where it opens the sentence; "make an informed decision:" at the
    end of an answer's lead-in decides nothing."""
    for role in ("user", "assistant"):
        ledger = state.extract(state.Ledger(), [turn(role, text)], 0)
        assert [i.text for i in ledger.active("decisions")] == ([decided] if decided else [])


def test_what_the_user_never_did_is_not_a_rule() -> None:
    """"I've never configured X" is the user's history (a fact), not a constraint they set."""
    ledger = state.extract(state.Ledger(), [turn("user", "I've never configured environment variables in Render.")], 0)
    assert ledger.active("constraints") == []


@pytest.mark.parametrize("text", [
    "I'll have to watch that show next!",
    "But I have to say, I love being able to stream music from anywhere.",
    "I never realized that account sharing was such a big deal.",
    "It's always tough to make ends meet as a student.",
    "They don't always win, but at least they try.",
    "I can't wait to try them all when I visit China.",
    "It must have taken a massive workforce to pull that off!",
    "If you're in the mood for something relaxing, you could always take a nap.",
    "I always end up wasting them after a few days.",
    "npm ERR! stack TypeError: Cannot assign to read only property 'cflags' of object",
    "I'm thinking about donating the leftover cat litter I have to the local animal shelter.",
])
def test_habits_feelings_and_figures_of_speech_are_not_rules(text: str) -> None:
    """"always", "never", "have to" and "can't" describe or exclaim as often as they order: only an
    order becomes a constraint."""
    ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
    assert ledger.active("constraints") == []


@pytest.mark.parametrize("text", [
    "Never deploy on Fridays.",
    "Please make sure to always include the address of each place.",
    "Don't log tokens, never.",
    "I can't wait to ship it, but it must run on Python 3.8.",
    "I need at least 80% test coverage on the billing module.",
    "I always want the examples in TypeScript.",
    "The upload has to stay under 50 MB.",
])
def test_orders_are_rules(text: str) -> None:
    """The same words in an order are a constraint, kept in the user's words."""
    ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
    assert [i.text for i in ledger.active("constraints")] == [text]


@pytest.mark.parametrize(("text", "kind"), [
    ("I'd like to know more about the fishing regulations in Unit 54.", None),
    ("I want to try making kimchi at home.", None),
    ("I want to make sure I have enough space in my closet.", None),
    ("I prefer small pull requests.", "preferences"),
    ("I'd like the answers in bullet points.", "preferences"),
    ("I want to keep every function under 40 lines.", "preferences"),
    ("I like those ideas, thanks!", None),
    ("I like that idea.", None),
    ("I like it a lot, and I prefer dark themes.", "preferences"),
    ("I've set a preference for CPU-only deployment due to hardware constraints.", "preferences"),
    ("My preference is tabs over spaces in the Makefile.", "preferences"),
    ("Some people have a preference for darker roasts.", None),
    ("Please ignore my preference for tabs from earlier.", None),
    ("The pills don't seem to be working as well as I'd like.", None),
    ("It takes longer than I would like, and I prefer short builds.", "preferences"),
])
def test_a_request_of_the_moment_is_not_a_preference(text: str, kind: str | None) -> None:
    """"I'd like to know more about X" asks for something now; a preference is a taste that lasts."""
    ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
    assert [(k, i.text) for k, i in ledger.all_items()] == ([(kind, text)] if kind else [])


def test_the_stack_keeps_each_component_at_its_latest_version_with_its_history() -> None:
    """Components the user names with a version become stack items, whatever the sentence; a new
    version replaces the old one, which the item keeps; the assistant's suggestions are not the stack."""
    ledger = state.extract(state.Ledger(), [
        turn("user", "Can you review my server? I've initialized my Node.js v18.15.0 backend with Express "
                     "version 4.18.2, and the tests run on pytest 7.4.0 in about 2.5 seconds.",
             time="2024-01-05T10:00:00"),
        turn("assistant", "Consider moving to Express 5.0.0 and Fastify 4.21.0 later."),
    ], 0)
    assert sorted(i.text for i in ledger.active("tech_stack")) == ["Express v4.18.2", "Node.js v18.15.0",
                                                                   "pytest 7.4.0"]
    ledger = state.extract(ledger, [turn("user", "Node.js 18.15.0 is what we run.")], 5)  # same version
    assert len(ledger.tech_stack) == 3
    ledger = state.extract(ledger, [turn("user", "We upgraded the backend to Node.js v20.11.1 this morning.",
                                         time="2024-03-02T09:00:00")], 9)
    (node,) = [i for i in ledger.active("tech_stack") if i.text.startswith("Node.js")]
    assert node.text == "Node.js v20.11.1"
    rendered = state.render(ledger, 500, words)
    assert "- Node.js v20.11.1 (since 2024-03-02; was: Node.js v18.15.0), pytest 7.4.0, Express v4.18.2" \
        in rendered.splitlines()  # one line, the newest first
    assert "Express 5.0.0" not in rendered and "Fastify" not in rendered


def test_reference_tags_after_a_statement_are_not_state() -> None:
    """Numbers after a run of arrows ("->-> 9,30") point elsewhere: the rule is kept without them."""
    ledger = state.extract(state.Ledger(), [turn(
        "user", "Always include a latency graph when I ask about profiling results. ->-> 9,30")], 0)
    assert [i.text for i in ledger.active("constraints")] == [
        "Always include a latency graph when I ask about profiling results."]
    assert state.sentences("map a -> 5") == ("map a -> 5",)  # one arrow is prose


@pytest.mark.parametrize(("text", "named"), [
    ("I've initialized my Node.js v18.15.0 backend with Express version 4.18.2 and Socket.io v4.6.1.",
     [("Node.js", "v18.15.0"), ("Express", "v4.18.2"), ("Socket.io", "v4.6.1")]),
    ("Using Redis 7.0.11 for caching, React Hook Form v7.43.9 for forms, Python 3.11 for the jobs.",
     [("Redis", "7.0.11"), ("React Hook Form", "v7.43.9"), ("Python", "3.11")]),
    ("We run pandas 2.0.3 and scikit-learn 1.2.2 on 10.0.0.1.", [("pandas", "2.0.3"), ("scikit-learn", "1.2.2")]),
    ("React 18.2.0 and React DOM 18.2.0 are in.", [("React", "18.2.0"), ("React DOM", "18.2.0")]),
    ("I upgraded Node.js from v18.15.0 to v20.1.0.", [("Node.js", "v18.15.0"), ("Node.js", "v20.1.0")]),
    ("We migrated to Vue 3.3.4 from Vue 2.7.14.", [("Vue", "3.3.4")]),
    # Numbers, measures, dates, references: no component.
    ("See Figure 1.2 and follow Step 2.1.3 of Section 4.2.1.", []),
    ("It took 2.5 seconds, about 2.5 s, on Monday 3.30 pm.", []),
    ("The UK has 2.5 million users; RAM 16.0 GB, CPU 3.2 GHz, costs USD 1.50.", []),
    ("Release date 2024.03.02 is set, and we bumped 1.2.3 to its 3.12.0 successor.", []),
    ("Scores ranging from 0.1 to 0.9 pass, as in the planned v1.1.0 release.", []),
    ("We use tracing 0.1.40 and keyring 24.3.1.", [("tracing", "0.1.40"), ("keyring", "24.3.1")]),
    ("I'm using the tracing 0.1.40 crate.", [("tracing", "0.1.40")]),
    ("We upgraded keyring from 23.13.1 to 24.3.1.", [("keyring", "23.13.1"), ("keyring", "24.3.1")]),
    # Questions, negations, hypotheses and quoted errors: not what the project runs.
    ("Should I upgrade to Node.js v20.1.0?", []),
    ("I can't upgrade to Node.js v20.1.0 yet.", []),
    ("We will never use Django 5.0.1.", []),
    ("Error: Node.js v20.1.0 is required by this package.", []),
    ("The log says `Node.js v16.0.0` somewhere.", []),
])
def test_components_are_what_the_user_says_the_project_runs(text: str, named: list[tuple[str, str]]) -> None:
    assert [(name, version) for name, version, _ in state.components(text)] == named


def test_the_stack_keeps_each_component_apart_from_sentences_and_edits() -> None:
    """A stack sentence does not swallow the component it names (the next version still replaces
    the component); an edit of the stack wins over a component extracted later."""
    ledger = state.extract(state.Ledger(), [turn("user", "Our backend runs on Node.js v18.15.0.")], 0)
    assert sorted(i.text for i in ledger.active("tech_stack")) == ["Node.js v18.15.0",
                                                                   "Our backend runs on Node.js v18.15.0."]
    ledger = state.extract(ledger, [turn("user", "We moved the backend to Node.js v20.1.0 today.")], 4)
    (node,) = [i for i in ledger.active("tech_stack") if state.is_component(i)]
    assert node.text == "Node.js v20.1.0" and node.was == ["Node.js v18.15.0"]
    edited = state.apply_edits(ledger, {"tech_stack": ["Django 4.2.7"]}, time=None)
    edited = state.extract(edited, [turn("user", "We set up Django 5.0.1 for the admin site.")], 9)
    assert [i.text for i in edited.active("tech_stack")] == ["Django 4.2.7"]


def test_a_later_message_of_one_fold_wins() -> None:
    """Messages folded together apply in order: going back to Flask after switching away keeps Flask."""
    ledger = state.extract(state.Ledger(), [
        turn("user", "We decided to switch from Flask to FastAPI."),
        turn("user", "Fine, we are back on Flask 2.3.2 for good."),
    ], 0)
    assert "Flask 2.3.2" in [i.text for i in ledger.active("tech_stack")]


def test_an_assistants_stack_sentence_is_not_the_projects_stack() -> None:
    ledger = state.extract(state.Ledger(), [turn(
        "assistant", "Here's an example of a React component using Axios for HTTP requests.")], 0)
    assert ledger.active("tech_stack") == []
    ledger = state.extract(ledger, [turn("user", "We're using Redis for caching and Express for the API.")], 1)
    assert [i.text for i in ledger.active("tech_stack")] == ["We're using Redis for caching and Express for the API."]


def test_the_voice_rule_reads_prose_not_code_and_only_the_users() -> None:
    """Past PASTED_CHARS of prose (fenced code aside), a user's sentence needs their voice or an
    order's opening; rules around a pasted file stay rules; an assistant's long answer is not judged."""
    code = "```python\n" + "def handler(request):\n    return process(request.body)\n" * 60 + "```\n"
    rules = "Never add new dependencies. Always use type hints. The API must respond within 200 ms."
    ledger = state.extract(state.Ledger(), [turn("user", f"Here is my handler. {code}{rules}")], 0)
    assert len(ledger.active("constraints")) == 3
    filler = "The committee reviews each application in the order it arrives. "
    rule = "Applicants must file the form in person."
    for prose, kept in ((filler * ((state.PASTED_CHARS - len(rule)) // len(filler)), 1),
                        (filler * (state.PASTED_CHARS // len(filler) + 1), 0)):
        text = prose + rule
        ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
        assert len(ledger.active("constraints")) == kept, len(text)
        voiced = text.replace(rule, "I’ve learned applicants must file the form in person.")
        ledger = state.extract(state.Ledger(), [turn("user", voiced)], 0)
        assert len(ledger.active("constraints")) == 1  # a curly apostrophe is a voice too
        coded = text.replace(rule, "For i in the list, each item must be checked.")  # code's i is no voice
        assert len(state.extract(state.Ledger(), [turn("user", coded)], 0).active("constraints")) == kept
    ledger = state.extract(state.Ledger(), [turn("assistant", filler * 40 + "We decided to use Redis 7.")], 0)
    assert [i.text for i in ledger.active("decisions")] == ["We decided to use Redis 7."]


def test_an_assistant_states_what_the_user_just_agreed_to() -> None:
    """"OK, let's do that" then the assistant's "we'll use PostgreSQL 16": the two decided it, in the
    state and the timeline alike. "A decision tree" decides nothing; a leading date stamp hides no label."""
    said = [turn("assistant", "I'd suggest PostgreSQL 16 or MongoDB 7 for the orders service."),
            turn("user", "Ok, let's do that. Postgres it is."),
            turn("assistant", "Great, we'll use PostgreSQL 16 for the orders service.")]
    ledger = state.extract(state.Ledger(), said, 0)
    assert [i.text for i in ledger.active("decisions")] == ["Great, we'll use PostgreSQL 16 for the orders service."]
    assert state.classify("Let's use a decision tree classifier for this example.", "assistant") is None
    # Only the reply's first decision, and only after a reply that agrees and says nothing else.
    walkthrough = turn("assistant", "We'll use a list for the queue. We'll use the points (2, 3) to test it.")
    for reply in ("ok thanks", "OK, that didn't work.", "Sure, but what about performance?", "Great, another error.",
                  "I don't think it is.", "yes, i think it is", "Broken it is"):
        assert not state.extract(state.Ledger(), [turn("user", reply), walkthrough], 0).active("decisions"), reply
    agreed = state.extract(state.Ledger(), [turn("user", "Sounds good, let's do that."), walkthrough], 0)
    assert [i.text for i in agreed.active("decisions")] == ["We'll use a list for the queue."]
    stamped = "[2023/05/20 (Sat) 07:47] Decision: Redis 7.2 for sessions."
    ledger = state.extract(state.Ledger(), [turn("user", stamped)], 0)
    assert [i.text for i in ledger.active("decisions")] == ["Decision: Redis 7.2 for sessions."]


@pytest.mark.parametrize(("text", "kind"), [
    ("URL: https://www.budgetbytes.com/category/recipes/vegetarian/", None),
    ("Certificate: PG-13", None),
    ("2023-01-14 18:59:13", None),
    ("Deadline is 2024-03-01.", "facts"),
    ("Release date: 2024-06-01.", "facts"),
    ("Here's the link to my pitch deck: https://drive.example.com/file/d/1Qw.", "facts"),
])
def test_a_fact_says_something_of_its_value(text: str, kind: str | None) -> None:
    """A reference or stamp pasted alone names a value and says nothing of it."""
    assert state.classify(text, "user") == kind


def test_a_pasted_page_states_nothing_but_what_the_user_says_about_it() -> None:
    """A long message is mostly what the user pasted (a chapter, a form's instructions): its rules
    are not the user's. What the user says around it in their own voice still counts, and a short
    message needs no voice ("The service must handle 1,000 users")."""
    pasted = " ".join(["You have to crawl before you walk, and you have to take it in steps.",
                       "Petitioners must file this supplement with the Form I-129.",
                       *["The committee reviews each application in the order it arrives."] * 40])
    text = f"Summarise this chapter for me. {pasted} I must send the summary by Friday."
    assert len(text) > state.PASTED_CHARS
    ledger = state.extract(state.Ledger(), [turn("user", text)], 0)
    assert [i.text for i in ledger.active("constraints")] == ["I must send the summary by Friday."]
    ledger = state.extract(ledger, [turn("user", "The service must handle 1,000 users.")], 1)
    assert "The service must handle 1,000 users." in [i.text for i in ledger.active("constraints")]


@pytest.mark.parametrize(("text", "decided"), [
    ("We'll use NumPy arrays to represent these bounding boxes.", False),
    ("Let's use the points (2, 3) and (5, 11) as an example.", False),
    ("For simplicity, we'll use a list as the queue for demonstration purposes.", False),
    ("We decided to use Redis 7 for the session store.", True),
    ("We've agreed on PostgreSQL 16 for the orders service.", True),
    ("We went with Celery for the background jobs.", True),
])
def test_an_assistant_decides_only_by_reporting_a_decision(text: str, decided: bool) -> None:
    """An answer walking through its own code ("we'll use", "let's use") decides nothing for the
    project; an assistant reporting what was decided does. The user's "we'll use" is a decision."""
    ledger = state.extract(state.Ledger(), [turn("assistant", text)], 0)
    assert [i.text for i in ledger.active("decisions")] == ([text] if decided else [])
    ledger = state.extract(state.Ledger(), [turn("user", "We'll use NumPy arrays for the bounding boxes.")], 0)
    assert [i.text for i in ledger.active("decisions")] == ["We'll use NumPy arrays for the bounding boxes."]


def test_many_standing_orders_do_not_crowd_every_decision_out_of_the_state() -> None:
    """Nine "Always ..." orders used to fill a small budget before any decision was shown: each kind's
    newest items come first, the rest after, and the sections stay in their order."""
    ledger = state.Ledger()
    orders = ["Always answer billing questions with a table.", "Never log raw tokens.",
              "Always mask secrets in shown configs.", "Use 24-hour times in schedules.",
              "Always write tests with pytest.", "Never deploy on Fridays.", "Always cite the RFC section.",
              "Keep answers under 300 words.", "Always name the migration file."]
    for n, order in enumerate(orders):
        state.add_item(ledger, "constraints", order, source=n, time=None)
    state.add_item(ledger, "decisions", "We decided to use PostgreSQL 16 for storage.", source=20, time=None)
    state.add_item(ledger, "decisions", "We decided to shard messages by room id.", source=21, time=None)
    text = state.render(ledger, 50, words)
    lines = text.splitlines()
    assert lines.index("Constraints:") < lines.index("Decisions:")
    assert "- We decided to shard messages by room id." in lines
    assert "- We decided to use PostgreSQL 16 for storage." in lines
    assert len(ledger.active("constraints")) == 9
    assert "- Always name the migration file." in lines  # the newest order
    assert "- Always answer billing questions with a table." not in lines  # no room left
    assert words(text) <= 50


def test_the_stack_renders_before_decisions_and_outlives_older_items() -> None:
    """Components render on one line ahead of decisions, and a full ledger drops older extracted
    statements before the stack the project started on."""
    ledger = state.extract(state.Ledger(), [turn("user", "I've set up Express version 4.18.2 and Mongoose v7.3.1.")], 0)
    letters = ["".join(chr(ord("a") + int(d)) for d in f"{n:03d}") for n in range(state.MAX_ITEMS + 10)]
    ledger = state.extract(ledger, [turn("user", f"We decided to put {w} {w}q {w}z behind the jobs.")
                                    for w in letters], 1)
    assert len(ledger.decisions) == state.MAX_ITEMS - 2  # the oldest decisions went, not the stack
    assert sorted(i.text for i in ledger.active("tech_stack")) == ["Express v4.18.2", "Mongoose v7.3.1"]
    lines = state.render(ledger, 500, words).splitlines()
    assert lines[:2] == ["Tech stack:", "- Mongoose v7.3.1, Express v4.18.2"] and lines[2] == "Decisions:"
