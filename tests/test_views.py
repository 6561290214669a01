"""The pure parts of gateway/views.py: how a known view moves with records, reloads and folds."""

from __future__ import annotations

import hashlib

from gateway.keys import ConvRef
from gateway.model import ConversationView, Message, Summary
from gateway.reconcile import chain_hashes
from gateway.views import KnownViews, advance, rebase, with_summary


def _turns(labels: list[str], prev: str = "") -> list[Message]:
    hashes = [hashlib.sha1(x.encode()).hexdigest() for x in labels]
    return [Message(raw={"role": "user", "content": x}, role="user", text=x, tokens=2, hash=h, chain=c)
            for x, h, c in zip(labels, hashes, chain_hashes(hashes, prev), strict=True)]


def _view(turns: list[Message], *, covers: int = 0, summary_version: int = 0, stats: dict[str, int] | None = None,
          head: int = 0) -> ConversationView:
    summary = Summary("s", covers, summary_version, 1, turns[covers - 1].chain) if covers else None
    return ConversationView(length=len(turns), dialect="openai_chat", first_hash=turns[0].hash if turns else None,
                            last_chain=turns[-1].chain if turns else None, summary=summary, state=None,
                            state_version=0, head=turns[:head], tail=turns[covers:], tail_start=covers,
                            tokens_total=2 * len(turns), stats=dict(stats or {}), summary_version=summary_version)


def test_advance_appends_turns_tokens_and_stats() -> None:
    """A view advanced by a record holds the new turns after its tail, their tokens and the stat increments."""
    turns = _turns(["a", "b", "c", "d"])
    view = _view(turns[:2], stats={"requests": 1}, head=2)  # loaded with keep_initial 3: all it had
    after = advance(view, turns[2:], dialect="openai_chat", last_chain=turns[-1].chain, keep_initial=3,
                    stats={"requests": 1, "tokens_saved": 5}, fold_pending=True)
    assert (after.length, after.last_chain, after.tokens_total) == (4, turns[-1].chain, 8)
    assert [t.text for t in after.tail] == ["a", "b", "c", "d"] and [t.text for t in after.head] == ["a", "b", "c"]
    assert after.stats == {"requests": 2, "tokens_saved": 5} and after.fold_pending
    assert view.length == 2 and view.stats == {"requests": 1}  # the original is untouched


def test_advance_from_nothing_sets_the_first_hash() -> None:
    """The first record of a conversation gives the view its first message's hash."""
    turns = _turns(["a", "b"])
    after = advance(_view([]), turns, dialect="anthropic", last_chain=turns[-1].chain, keep_initial=0,
                    stats={}, fold_pending=False)
    assert (after.first_hash, after.dialect, after.length) == (turns[0].hash, "anthropic", 2)


def test_rebase_takes_the_reloaded_summary_and_keeps_own_newer_turns() -> None:
    """A reload that saw a prefix of what this process knows brings its summary and state; the turns
    recorded since stay, the summarised ones leave the tail; counters keep the larger value."""
    turns = _turns([f"m{i}" for i in range(8)])
    known = _view(turns, stats={"requests": 4, "summarizer_tokens_charged": 10})
    loaded = _view(turns[:6], covers=4, summary_version=1, stats={"requests": 3, "summarizer_tokens_in": 50})
    merged = rebase(known, loaded)
    assert merged is not None
    assert (merged.length, merged.tail_start, merged.summary_version) == (8, 4, 1)
    assert [t.text for t in merged.tail] == ["m4", "m5", "m6", "m7"]
    assert merged.stats == {"requests": 4, "summarizer_tokens_charged": 10, "summarizer_tokens_in": 50}


def test_rebase_refuses_what_is_not_a_prefix() -> None:
    """A reload of another branch, of more than is known, or with less summarised, cannot be merged."""
    turns = _turns([f"m{i}" for i in range(6)])
    other = _turns([f"x{i}" for i in range(4)])
    known = _view(turns, covers=2, summary_version=1)
    assert rebase(known, _view(other)) is None
    assert rebase(known, _view(_turns([f"m{i}" for i in range(7)]))) is None
    assert rebase(known, _view(turns[:4])) is None  # no summary there: it was dropped by a branch


def test_with_summary_moves_the_tail_to_the_new_coverage() -> None:
    """A committed summary that covers a prefix of the known view becomes its summary."""
    turns = _turns([f"m{i}" for i in range(10)])
    known = _view(turns, covers=2, summary_version=1)
    folded = with_summary(known, Summary("new", 6, 2, 3, turns[5].chain))
    assert folded is not None and folded.summary is not None
    assert (folded.tail_start, folded.summary.text, folded.summary_version) == (6, "new", 2)
    assert [t.text for t in folded.tail] == ["m6", "m7", "m8", "m9"]
    assert with_summary(known, Summary("old", 6, 1, 3, turns[5].chain)) is known  # not newer
    assert with_summary(known, Summary("other", 6, 2, 3, "f" * 40)) is None  # another history


def test_known_views_are_used_only_while_live() -> None:
    """Known views count only while the change channel is followed; losing or regaining it forgets them;
    a shorter view never replaces a longer one; past max_messages in all, the least recently used go."""
    ref = ConvRef("t", "c", "p")
    turns = _turns(["a", "b", "c"])
    views = KnownViews(live=True)
    views.put(ref, _view(turns))
    views.put(ref, _view(turns[:2]))
    view = views.get(ref)
    assert view is not None and view.length == 3
    views.put(ConvRef("t", "d", "p"), _view(turns))
    views.drop(ConvRef("t", "d", "p"))
    assert len(views) == 1
    views.put(ConvRef("t", "d", "p"), _view(turns))
    views.drop_project(ConvRef("t", "x", "p"))  # the project's state changed: both of its conversations
    assert len(views) == 0
    views.put(ref, _view(turns))
    assert views.messages == 3
    small = KnownViews(live=True, max_messages=10)
    backlog = _view(_turns([f"m{i}" for i in range(8)]))  # folds behind: kept, its requests need not load
    small.put(ConvRef("t", "a"), _view(turns))
    small.put(ConvRef("t", "b"), backlog)
    assert small.get(ConvRef("t", "b")) is backlog and small.get(ConvRef("t", "a")) is None and small.messages == 8
    small.put(ConvRef("t", "c"), _view(_turns([f"m{i}" for i in range(11)])))  # past the bound alone
    assert small.get(ConvRef("t", "c")) is None and small.messages == 8
    small.drop(ConvRef("t", "b"))
    assert small.messages == 0
    views.set_live(False)
    assert views.get(ref) is None
    views.set_live(True)
    assert views.get(ref) is None and len(views) == 0
