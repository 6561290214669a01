"""Unit tests for gateway.retrieval: the lexical index that picks earlier messages to forward."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gateway.retrieval import INDEX_END, Excerpt, RankingParams, RetrievalIndex

_FILLER = (
    "What a great question! Here are some ideas for planning your week and staying organised.",
    "I think I'll try that. Can you give me a few more tips on time management?",
    "Sure. Block out time in your calendar, batch similar tasks, and take regular short breaks.",
    "That makes sense. I also want to get better at cooking simple healthy dinners.",
    "Try sheet-pan meals: roast vegetables with chickpeas or chicken and a little olive oil.",
    "Thanks! What about workouts I can do at home without any equipment?",
)


def _conversation(n: int, *, plant: dict[int, str] | None = None, day: int = 1) -> list[tuple[str, str, str]]:
    """(role, text, time) for n messages in sessions of 10, a day apart, with planted texts."""
    plant = plant or {}
    out = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        text = plant.get(i, _FILLER[i % len(_FILLER)])
        session, turn = divmod(i, 10)
        time = f"2023-03-{day + session:02d}T10:{turn:02d}:00"
        out.append((role, text, time))
    return out


def _index(messages: list[tuple[str, str, str]], tokens: int | list[int] = 20,
           params: RankingParams | None = None) -> RetrievalIndex:
    index = RetrievalIndex(params)
    for i, (role, text, time) in enumerate(messages):
        index.add(i, role, text, time, tokens if isinstance(tokens, int) else tokens[i])
    return index


def test_planted_message_ranks_first() -> None:
    """The one message sharing the query's rare words gets the top score."""
    msgs = _conversation(60, plant={24: "By the way, my cat's name is Luna and she loves the window seat."})
    hits = _index(msgs).search("What is the name of my cat?", budget_tokens=10_000)
    assert max(hits, key=lambda e: e.score).index == 24


@pytest.mark.parametrize(("planted", "query"), [
    ("Мы используем базу данных PostgreSQL для счетов.", "Какую базу данных мы используем?"),
    ("服务器部署在东京区域，每天备份一次。", "服务器在哪个区域？东京吗"),
    ("Τα ελληνικά κείμενα αποθηκεύονται στο S3.", "Πού αποθηκεύονται τα κείμενα;"),
    ("Our office moved to München last spring.", "Munchen?"),
    ("データベースはPostgreSQLです。", "データベースは何ですか"),
])
def test_text_in_any_script_is_found(planted: str, query: str) -> None:
    """Words of every script are indexed (they were dropped: only a-z and 0-9 counted), accents fold,
    and Chinese or Japanese, written without spaces, match by overlapping character pairs."""
    msgs = _conversation(40, plant={17: planted})
    hits = _index(msgs).search(query, budget_tokens=10_000)
    assert hits and max(hits, key=lambda e: e.score).index == 17


def test_budget_never_exceeded_and_only_whole_messages() -> None:
    """Returned token counts sum to at most the budget; an oversized match is skipped for smaller ones."""
    rng = random.Random(7)
    msgs = _conversation(80, plant={10: "cat Luna " * 50, 12: "my cat Luna sleeps all day"})
    tokens = [rng.randint(5, 120) for _ in msgs]
    tokens[10] = 500  # the best match, too big for the budget
    tokens[12] = 10
    index = _index(msgs, tokens)
    for budget in (0, 1, 30, 100, 499, 1000):
        hits = index.search("my cat Luna", budget_tokens=budget)
        assert sum(tokens[e.index] for e in hits) <= budget
        assert all(isinstance(e, Excerpt) and 0 <= e.index < len(msgs) for e in hits)
    hits = index.search("my cat Luna", budget_tokens=100)
    assert 10 not in {e.index for e in hits}
    assert 12 in {e.index for e in hits}


@pytest.mark.parametrize("kind", ["set", "range", "callable"])
def test_excluded_positions_never_returned(kind: str) -> None:
    """Positions in `exclude` (set, range or predicate) are never returned, however well they match."""
    msgs = _conversation(50, plant={5: "my cat Luna", 44: "my cat Luna again", 46: "cat Luna toys"})
    index = _index(msgs)
    exclude: Callable[[int], bool] | set[int] | range
    if kind == "set":
        exclude = {5, 44, 46}
    elif kind == "range":
        exclude = range(40, 50)
    else:
        exclude = lambda p: p % 2 == 0  # noqa: E731
    hits = index.search("my cat Luna", budget_tokens=10_000, exclude=exclude)
    assert hits
    banned = exclude if callable(exclude) else exclude.__contains__
    assert not any(banned(e.index) for e in hits)


def test_truncate_forgets_positions() -> None:
    """After truncate(k) only positions < k can come back, and re-adding matches a fresh index."""
    msgs = _conversation(40, plant={8: "the Eiffel Tower trip", 30: "Eiffel Tower at night"})
    index = _index(msgs)
    index.truncate(20)
    assert len(index) == 20
    assert {e.index for e in index.search("Eiffel Tower", budget_tokens=10_000)} <= set(range(20))
    replacement = [("user", "we never went to the Eiffel Tower", "2023-03-03T11:00:00")]
    for role, text, time in replacement:
        index.add(len(index), role, text, time, 20)
    fresh = _index(msgs[:20] + replacement)
    query = "Eiffel Tower"
    assert index.search(query, budget_tokens=10_000) == fresh.search(query, budget_tokens=10_000)
    index.truncate(0)
    assert len(index) == 0
    assert index.search(query, budget_tokens=10_000) == []


def test_add_must_append() -> None:
    """add() refuses a position other than len(index): the index only appends."""
    index = _index(_conversation(3))
    with pytest.raises(ValueError):
        index.add(5, "user", "hello", None, 3)


def test_results_in_ascending_index_order() -> None:
    """Excerpts come back in conversation order, not score order."""
    msgs = _conversation(70, plant={60: "garden tomatoes basil", 3: "tomatoes", 31: "basil and tomatoes"})
    hits = _index(msgs).search("tomatoes basil garden", budget_tokens=10_000)
    positions = [e.index for e in hits]
    assert len(positions) >= 3
    assert positions == sorted(set(positions))


def test_empty_index_or_query_returns_nothing() -> None:
    """An empty index, an empty query, a query of stop words only, or a zero budget give []."""
    assert RetrievalIndex().search("my cat", budget_tokens=1000) == []
    index = _index(_conversation(20))
    assert index.search("", budget_tokens=1000) == []
    assert index.search("what is it that you were", budget_tokens=1000) == []
    assert index.search("cooking dinners", budget_tokens=0) == []


def test_neighbouring_answer_is_found() -> None:
    """An answer that shares no word with the query is found through the question right before it."""
    plant = {32: "In our chess game, after 27. Kg2 Bd5+ what is your move?", 33: "28. Kg3 would be my move."}
    msgs = _conversation(60, plant=plant)
    hits = _index(msgs).search("what move did you make after 27. Kg2 Bd5+?", budget_tokens=60)
    assert {32, 33} <= {e.index for e in hits}


def test_relative_date_in_query_favours_that_day() -> None:
    """'two days ago' lifts the messages of that day's session above equally matching ones."""
    plant = {5: "I baked bread today", 25: "I baked bread today", 45: "I baked bread today"}
    msgs = _conversation(60, plant=plant)  # sessions on March 1..6; message 25 is on March 3
    query, when = "what did I bake two days ago?", "2023-03-05T09:00:00"
    hits = _index(msgs).search(query, budget_tokens=25, query_time=when)
    assert [e.index for e in hits] == [25]


def test_plain_params_still_search() -> None:
    """The plain-BM25 baseline configuration ranks the planted message first too."""
    index = RetrievalIndex(RankingParams.plain())
    for i, (role, text, time) in enumerate(_conversation(30, plant={7: "my cat Luna"})):
        index.add(i, role, text, time, 10)
    hits = index.search("cat Luna", budget_tokens=10)
    assert [e.index for e in hits] == [7]


@pytest.mark.parametrize("cut", [0, 1, 25, 30, 31, 59])
def test_truncate_then_add_equals_a_fresh_index(cut: int) -> None:
    """Cutting back mid-session and re-adding gives the postings, session frequencies and rankings of a fresh index."""
    msgs = _conversation(60, plant={24: "my cat Luna and the cat flap", 33: "Luna the cat again, cat cat"})
    # The replacement's roles are shifted by one: the index must forget the old ones too.
    after = _conversation(71, plant={41: "a new cat named Miso"}, day=2)[1:]
    replaced = [*msgs[:cut], *after[cut:]]
    index = _index(msgs)
    index.truncate(cut)
    for i in range(cut, len(replaced)):
        role, text, time = replaced[i]
        index.add(i, role, text, time, 20)
    fresh = _index(replaced)
    assert index._postings == fresh._postings and index._roles == fresh._roles
    assert index._novelty == fresh._novelty
    for query in ("my cat Luna", "cat named Miso", "healthy dinners and workouts", "what did I say about workouts?"):
        assert index.search(query, budget_tokens=300) == fresh.search(query, budget_tokens=300)
    assert all(list(index._session_tf(t)) == list(fresh._session_tf(t)) for t in fresh._postings)


def test_session_frequencies_follow_added_messages() -> None:
    """A term's per-session frequencies, cached when it is queried, take in messages added afterwards."""
    msgs = _conversation(45, plant={3: "cat cat", 14: "cat", 27: "cat"})
    index = _index(msgs[:30])
    index.search("cat", budget_tokens=300)  # caches the term's session frequencies
    for i in range(30, 45):
        role, text, time = msgs[i]
        index.add(i, role, "cat " + text if i in (31, 32, 44) else text, time, 20)
    fresh = _index([(r, "cat " + t if i in (31, 32, 44) else t, tm) for i, (r, t, tm) in enumerate(msgs)])
    assert list(index._session_tf("cat")) == list(fresh._session_tf("cat")) == [
        0 << 32 | 2, 1 << 32 | 1, 2 << 32 | 1, 3 << 32 | 2, 4 << 32 | 1]


@pytest.mark.parametrize(("phrase", "spans"), [
    ("3 days ago", [("2023-09-13", "2023-09-13")]),
    ("two months ago", [("2023-07-02", "2023-08-01")]),
    ("a couple of weeks ago", [("2023-08-29", "2023-09-06")]),
    ("yesterday", [("2023-09-15", "2023-09-15")]),
    ("the day before yesterday", [("2023-09-14", "2023-09-14")]),
    ("last weekend", [("2023-09-09", "2023-09-10")]),
    ("last month", [("2023-08-01", "2023-08-31")]),
    ("last year", [("2022-01-01", "2022-12-31")]),
    ("last Tuesday", [("2023-09-12", "2023-09-12")]),
    ("this past Sunday", [("2023-09-10", "2023-09-10")]),
    ("on March 3rd", [("2023-03-03", "2023-03-03")]),
    ("the 5th of May", [("2023-05-05", "2023-05-05")]),
    ("in June", [("2023-06-01", "2023-06-30")]),
    ("2023/05/06", [("2023-05-06", "2023-05-06")]),
    ("may 12: item", []),
    ("early sept", [("2023-09-01", "2023-09-30")]),
    ("nothing here", []),
])
def test_time_expressions_resolve_against_the_day_they_were_said(phrase: str, spans: list[tuple[str, str]]) -> None:
    """Each supported time expression, said on Saturday 2023-09-16, points to the same dates as before."""
    from datetime import date

    from gateway.retrieval import _time_spans

    got = [(date.fromordinal(a).isoformat(), date.fromordinal(b).isoformat())
           for a, b in _time_spans(phrase, date(2023, 9, 16))]
    assert got == spans


def test_a_question_dated_at_the_calendars_ends_searches_without_a_time_prior() -> None:
    """A time at the calendar's ends (stored by an earlier version, or a date in a message) has no
    "day after" or next month: the search goes on without a time prior instead of raising."""
    from datetime import date

    from gateway.retrieval import _time_spans

    for phrase in ("last month", "on dec 31", "yesterday", "last year"):
        assert isinstance(_time_spans(phrase, date(9999, 12, 31)), list)
        assert isinstance(_time_spans(phrase, date(1, 1, 1)), list)
    index = _index([("user", "We met on March 3rd about the redis cluster", "9999-12-31T12:00:00"),
                    ("assistant", "Noted, the redis cluster meeting.", "9999-12-31T12:00:00")])
    hits = index.search("what did we say last month about the redis cluster?", budget_tokens=200,
                        query_time="9999-12-31T12:00:00")
    assert hits


def test_an_index_gives_the_cyclic_gc_next_to_nothing_to_walk() -> None:
    """Indexing hundreds of messages adds a handful of GC-tracked objects, not one per term: a full
    collection walks every tracked object on the event loop, so cached indexes must stay out of it."""
    import gc

    texts = [f"message {i} about topic{i % 150} and item{i * 7} with word{i % 40}" for i in range(400)]
    messages = [("user", text, "") for text in texts]
    gc.collect()
    before = len(gc.get_objects())
    index = _index(messages)
    index.search("topic5 item35", budget_tokens=200)
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert not gc.is_tracked(index._postings)


def test_dense_candidates_fuse_with_the_lexical_ranking() -> None:
    idx = RetrievalIndex()
    texts = ["I cooked pasta with basil from my balcony.", "Noted.", "The deploy uses Kubernetes rolling updates.",
             "Noted.", "We chose Postgres for the ledger service."]
    for i, t in enumerate(texts):
        idx.add(i, "user" if i % 2 == 0 else "assistant", t, None, 10)
    question = "what dinner did I make with homegrown ingredients?"  # no word in common with message 0
    assert idx.search(question, budget_tokens=10) == []
    # The nearest by embedding: message 0 far ahead, the short "Noted." turns barely above the last.
    dense = [(0, 0.62), (1, 0.11), (3, 0.11), (2, 0.05), (4, 0.02)]
    assert [e.index for e in idx.search(question, budget_tokens=10, dense=dense)] == [0]
    # A lexical match still counts: the fused ranking keeps it when the budget has room for two.
    hits = idx.search("Postgres ledger dinner", budget_tokens=20, dense=dense)
    assert [e.index for e in hits] == [0, 4]
    # Positions excluded (the window) are never returned, dense or not.
    assert idx.search(question, budget_tokens=10, dense=dense, exclude={0}) != [] and all(
        e.index != 0 for e in idx.search(question, budget_tokens=10, dense=dense, exclude={0}))


def test_nothing_is_recalled_for_a_question_the_recent_window_answers_better() -> None:
    """Reach back: a question about what the window holds recalls nothing; one whose best match is
    earlier recalls it; a question that names a time, or asks what was said, always reaches back;
    reach_back 0 always recalls."""
    msgs = _conversation(60, plant={
        4: "My sister Alice is getting married in Lisbon next spring.",
        12: "Some day we should ship the service in a Docker image.",
        56: "The Dockerfile now uses a multi-stage build with python:3.12-slim as the base image.",
        57: "Good: the multi-stage Dockerfile keeps the final image small.",
    })
    index = _index(msgs)
    window = 50
    exclude = range(window, 60)

    def search(query: str, reach_back: float = 1.0) -> list[int]:
        return [e.index for e in index.search(query, budget_tokens=200, exclude=exclude, window_start=window,
                                              reach_back=reach_back, query_time="2023-03-06T12:00:00")]

    assert search("Which base image does the Dockerfile build use?") == []
    # A question about what was said reaches back on the same words.
    for asked_back in ("Which base image did I say the Dockerfile build should use?",
                       "Which base image did you suggest for the Dockerfile build?",
                       "In order, which base images did the Dockerfile build use?"):
        assert 12 in search(asked_back)
    # The same words said, not asked, ask nothing of the past.
    assert search("The base image you suggested for the Dockerfile build works.") == []
    assert 4 in search("Where is my sister's wedding going to be?")
    assert 12 in search("Which base image does the Dockerfile build use?", reach_back=0.0)
    # Not on the window's topic alone: a time named sends the question back.
    assert 12 in search("What did I say about the Docker image four days ago?")
    # A short question is judged on its own words, not on those its expansion takes from the window.
    recent = [msgs[56][1], msgs[57][1]]
    assert 4 in [e.index for e in index.search("And Alice?", budget_tokens=200, exclude=exclude, recent=recent,
                                               window_start=window, reach_back=1.0)]
    # No earlier message shares a word with it: the embeddings' nearest earlier message decides.
    asked = "Which slim python does the multi-stage build start from?"
    assert search(asked) == []
    assert [e.index for e in index.search(asked, budget_tokens=200, exclude=exclude, window_start=window,
                                          reach_back=1.0, dense=[(12, 0.9), (30, 0.2)])][:1] == [12]


def test_weak_matches_are_left_out_when_min_relevance_is_set() -> None:
    # One message matches the question on all its words, the filler on one common word only.
    msgs = _conversation(60, plant={24: "We picked the kestrel-eu-2 cluster for the billing database."})
    index = _index(msgs)
    question = "Which cluster did we pick for the billing database, and what about time?"
    filled = index.search(question, budget_tokens=5000)
    assert 24 in {e.index for e in filled} and len(filled) > 1  # the budget has room for weak matches
    strict = {e.index for e in index.search(question, budget_tokens=5000, min_relevance=0.5)}
    # The match and what its session lends its neighbours; nothing from the filler sessions.
    assert 24 in strict and strict <= set(range(20, 30))


def test_the_budget_goes_to_short_matching_turns_before_one_long_answer() -> None:
    # A long answer that names every word of the question, and three short turns that each state one
    # fact on it: the budget holds the answer or the turns, and the turns are what a question needs.
    plant = {
        21: "Kestrel backups, replication, failover and nodes: a long walkthrough of each in turn.",
        30: "Kestrel is the name of our database cluster.",
        40: "Backups run nightly at two.",
        50: "We run three nodes in eu-west.",
    }
    msgs = _conversation(60, plant=plant)
    tokens = [200] * len(msgs)
    tokens[21] = 300
    tokens[30] = tokens[40] = tokens[50] = 20
    hits = _index(msgs, tokens).search("kestrel backups replication failover nodes", budget_tokens=300)
    assert {30, 40, 50} <= {e.index for e in hits}


def test_a_question_about_the_start_favours_the_first_session() -> None:
    """"When I first described my setup" is about the conversation's opening, where the setup was
    said, even when a later message matches the question's words better; a question about no time
    is not pulled there."""
    plant = {
        0: "Setup versions: Python 3.11, Django 4.2.",
        60: "The intern asked about my setup versions today.",
    }
    messages = _conversation(80, plant=plant)
    index = _index(messages)
    (first,) = index.search("Which versions did I say I was using when I first described my setup?",
                            budget_tokens=20)
    assert first.index == 0
    (plain,) = index.search("Which versions did I say I was using when I described my setup?", budget_tokens=20)
    assert plain.index == 60
    off = _index(messages, params=RankingParams(opening_weight=0.0))
    (unfavoured,) = off.search("Which versions did I say I was using when I first described my setup?",
                               budget_tokens=20)
    assert unfavoured.index == 60


def _with_and_without(plant: dict[int, str], **off: float) -> tuple[RetrievalIndex, RetrievalIndex]:
    """A 70-message conversation with `plant`, indexed with the default ranking and with `off`."""
    messages = _conversation(70, plant=plant)
    return _index(messages), _index(messages, params=RankingParams(**off))  # type: ignore[arg-type]


def test_a_question_about_what_one_side_said_favours_that_sides_messages() -> None:
    """"When did I bring up ..." asks for the user's own message, "what did you recommend ..." for
    the assistant's, even when the other side's message repeats the question's words more; "can you
    list ..." asks for an answer, not about what the assistant said, and favours neither."""
    plant = {
        30: "Should the nightly export go to the archive bucket, or somewhere cheaper such as cold storage tiers?",
        31: "Nightly export to the archive bucket: yes, the archive bucket takes the nightly export.",
        50: "The kestrel dashboard is slow; the kestrel dashboard queries the kestrel replica.",
        51: "Cache the kestrel dashboard queries for a minute.",
    }
    index, off = _with_and_without(plant, speaker_weight=0.0)

    def first(idx: RetrievalIndex, query: str) -> int:
        (hit,) = idx.search(query, budget_tokens=20)
        return hit.index

    asked_user = "When did I bring up the nightly export to the archive bucket?"
    asked_assistant = "What did you recommend for the kestrel dashboard queries?"
    assert (first(off, asked_user), first(off, asked_assistant)) == (31, 50)  # by the words alone
    assert (first(index, asked_user), first(index, asked_assistant)) == (30, 51)
    assert first(index, "Can you list the kestrel dashboard queries?") == first(
        off, "Can you list the kestrel dashboard queries?")


def test_a_question_about_the_order_things_were_raised_in_favours_where_each_was_raised() -> None:
    """"The order in which I brought up ..." is answered by the user's messages that raised each
    subject, not by the follow-ups that repeat its words more often; other questions rank as before."""
    plant = {
        40: "Next subject: rate limiting for the billing webhook.",
        41: "Put a token bucket in front of the billing webhook endpoint.",
        42: "Billing webhook rate limiting again: billing webhook rate limiting at 50 billing webhook calls a second.",
        # New subjects sharing only the question's "list" or "order": nothing to lift.
        52: "My lunch order is late again today.",
        54: "Sort the customer list by signup date.",
    }
    index, off = _with_and_without(plant, survey_weight=0.0)
    ordered = "Can you list in order what I brought up about the billing webhook rate limiting?"
    (raised,) = index.search(ordered, budget_tokens=20)
    (repeated,) = off.search(ordered, budget_tokens=20)
    assert (raised.index, repeated.index) == (40, 42)
    # Lifted by their own match: a message sharing only "order" or "list" stays far below.
    scores = {e.index: e.score for e in index.search(ordered, budget_tokens=1000)}
    assert max(scores[52], scores[54]) < 0.5 * min(scores[40], scores[42])
    plain = "What did I bring up about the billing webhook rate limiting?"
    assert index.search(plain, budget_tokens=20) == off.search(plain, budget_tokens=20)


def test_a_branch_judges_its_next_message_new_against_the_messages_before_it() -> None:
    """After a cut, the next user message's novelty is measured against the two messages before the
    cut, as in an index that never branched."""
    said = [("user", "alpha beta gamma delta"), ("assistant", "epsilon zeta"), ("user", "alpha beta epsilon theta")]
    fresh, branched = RetrievalIndex(), RetrievalIndex()
    for i, (role, text) in enumerate(said):
        fresh.add(i, role, text, f"2024-01-01T10:0{i}:00", 5)
    for i, (role, text) in enumerate([*said[:2], ("user", "something else entirely"), ("assistant", "ok")]):
        branched.add(i, role, text, f"2024-01-01T10:0{i}:00", 5)
    branched.truncate(2)
    branched.add(2, "user", said[2][1], "2024-01-01T10:02:00", 5)
    assert list(branched._novelty) == list(fresh._novelty) == [255, 0, 64]  # theta alone is new


def test_a_question_of_any_size_is_searched_by_a_bounded_set_of_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """Search runs on the event loop: a pasted page as the newest message is searched by its two
    ends (where its question is) and at most 64 of its words, the rarest in the conversation, so
    scoring it costs no more than a question's. A rare word at its end finds its message; one
    buried in the middle is not read."""
    plant = {i: f"Entry {i}: tag{i} recorded." for i in range(0, 300, 3)}
    plant[200] = "The osprey cluster runs in us-east."
    plant[250] = "The kestrel cluster runs in eu-west."
    index = _index(_conversation(300, plant=plant))
    scored: list[dict[str, float]] = []
    real = RetrievalIndex._bm25

    def counting(self: RetrievalIndex, weights: dict[str, float], n: int) -> dict[int, float]:
        scored.append(dict(weights))
        return real(self, weights, n)

    monkeypatch.setattr(RetrievalIndex, "_bm25", counting)
    # 101 words it knows: a common one first, then 100 that each occur once. The common one goes.
    index.search("calendar " + " ".join(f"tag{i}" for i in range(0, 300, 3)), budget_tokens=20)
    assert [len(w) for w in scored] == [64] and "calendar" not in scored[0]
    assert all(w.startswith("tag") for w in scored[0])
    filler = "lorem ipsum dolor " * 5_000  # words it does not know
    (hit,) = index.search(f"{filler} osprey {filler} kestrel?", budget_tokens=20)
    assert hit.index == 250
    (hit,) = index.search(f"osprey? {filler}", budget_tokens=20)
    assert hit.index == 200
    # A long message is not a short follow-up ("and the other one?") because few of its words are
    # known: the recent turns' words are not added to it.
    unknown = " ".join(f"{a}{b}{c}qz" for a in "abcdefghij" for b in "abcdefghij" for c in "abcdefghij")
    scored.clear()
    index.search(f"{unknown} osprey?", budget_tokens=20, recent=["kestrel cluster", "kestrel eu-west"])
    assert scored and all(set(w) == {"osprey"} for w in scored)


def test_a_message_of_any_size_is_indexed_by_its_two_ends() -> None:
    """Indexing runs on the request path: a pasted megabyte is read at its ends (64,000 characters
    each, about 32K tokens in all), so it costs no more than a long message; past that, it is found
    by the words there. An index built off the event loop (the conversation API's search) reads it all."""
    filler = "lorem ipsum dolor " * 60_000  # ~1 MB of one repeated phrase
    end = INDEX_END - len("osprey ")
    text = f"osprey {filler[: end - 20]} sandpiper {filler} kestrel {filler} plover {filler[: end - 20]} heron"
    messages = _conversation(20, plant={10: text})
    tokens = [20] * 20
    tokens[10] = len(text) // 4  # what it costs to quote: a budget that holds it
    index = _index(messages, tokens)
    budget = len(text)
    for word in ("osprey", "sandpiper", "plover", "heron"):  # the ends, to their last word
        assert 10 in [h.index for h in index.search(word, budget_tokens=budget)], word
    assert index.search("kestrel", budget_tokens=budget) == []
    whole = RetrievalIndex(index_end=None)
    for i, (role, msg, time) in enumerate(messages):
        whole.add(i, role, msg, time, tokens[i])
    assert 10 in [h.index for h in whole.search("kestrel", budget_tokens=budget)]


def test_a_message_too_long_to_quote_sets_no_scale_for_those_that_can_be() -> None:
    """A pasted file that matches the question best but is past the budget is never quoted, so it
    neither hides the quotable matches under min_relevance nor sends the question back past a window
    that matches better than anything quotable."""
    question = "Which kestrel cluster holds the billing ledger replicas?"
    msgs = _conversation(60, plant={
        24: "kestrel cluster billing ledger replicas: kestrel-eu-2 holds the billing ledger replicas.",
        30: "The billing ledger runs on kestrel.",
        55: "The kestrel cluster billing ledger replicas sit in eu-west.",
    })
    tokens = [20] * 60
    tokens[24] = 50_000  # a pasted dump: no budget below holds it
    index = _index(msgs, tokens)
    found = [e.index for e in index.search(question, budget_tokens=5000, min_relevance=0.5, exclude=range(50, 60))]
    assert 30 in found and 24 not in found  # (23 and 25 sit beside the file: its neighbours' share)
    # The window (from 50) matches better than message 30, the best quotable earlier one: nothing recalled.
    assert index.search(question, budget_tokens=5000, exclude=range(50, 60), window_start=50, reach_back=1.0) == []
    tokens[24] = 20  # the same message, quotable: it is recalled
    quotable = _index(msgs, tokens)
    assert 24 in [e.index for e in quotable.search(question, budget_tokens=5000, exclude=range(50, 60),
                                                   window_start=50, reach_back=1.0)]


def test_the_priors_and_the_fusion_are_scaled_by_what_can_be_quoted() -> None:
    """A pasted file past the budget (with its neighbours) matches every word of the question: the
    session prior it would scale lifts filler of its session over the neighbour of the one quotable
    match; the embeddings' nearest message is scaled against that match, not against the file; and
    with min_relevance, no quotable word match means nothing, not the file's session."""
    question = "Which kestrel cluster holds the billing ledger replicas?"
    dump = "kestrel cluster billing ledger replicas: kestrel-eu-2 holds the billing ledger replicas."
    tokens = [20] * 60
    for d in (23, 24, 25):
        tokens[d] = 50_000
    index = _index(_conversation(60, plant={24: dump, 45: "The billing ledger runs on kestrel."}), tokens)
    assert [e.index for e in index.search(question, budget_tokens=40)] == [44, 45]
    dense = [(10, 0.9), (45, 0.3), (33, 0.1)]  # 10 shares no word with the question
    fused = {e.index: e.score for e in index.search(question, budget_tokens=40, dense=dense)}
    assert set(fused) == {10, 45} and fused[10] < 0.5 * fused[45]
    alone = _index(_conversation(60, plant={24: dump}), tokens)
    assert alone.search(question, budget_tokens=200, min_relevance=0.5) == []
