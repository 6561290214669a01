"""Reconciliation of incoming messages with the stored hash chain (pure)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gateway.model import ConversationView, Message, Summary
from gateway.reconcile import Decision, chain_hashes, reconcile, shown_style


def h(label: str) -> str:
    return hashlib.blake2b(label.encode(), digest_size=16).hexdigest()


def view_of(hashes: list[str], *, covers: int = 0, head: int = 0) -> ConversationView:
    """What store.load returns for `hashes` stored, a summary covering `covers`, `head` first messages."""
    chains = chain_hashes(hashes)
    turns = [Message(raw={}, role="user", text="", tokens=1, hash=x, chain=c)
             for x, c in zip(hashes, chains, strict=True)]
    summary = Summary("s", covers, 1, 5, chains[covers - 1]) if covers else None
    return ConversationView(
        length=len(hashes), dialect="openai_chat", first_hash=hashes[0] if hashes else None,
        last_chain=chains[-1] if chains else None, summary=summary, state=None, state_version=0,
        head=turns[:head], tail=turns[covers:], tail_start=covers, tokens_total=len(hashes),
    )


STORED = [h(f"m{i}") for i in range(10)]


def test_chain_hashes_match_the_lua_definition() -> None:
    """chain_i = sha1_hex(chain_{i-1} + hash_i), starting from "" (what redis.sha1hex computes)."""
    a, b = h("a"), h("b")
    c = chain_hashes([a, b])
    assert c[0] == hashlib.sha1(a.encode()).hexdigest()
    assert c[1] == hashlib.sha1((c[0] + b).encode()).hexdigest()
    assert chain_hashes([b], prev=c[0]) == [c[1]]


def test_nothing_stored_is_new() -> None:
    """With nothing stored every incoming message is new."""
    inc = STORED[:3]
    d = reconcile(inc, chain_hashes(inc), view_of([]), "auto")
    assert (d.action, d.base, d.new_from, d.base_chain) == ("new", 0, 0, "")


def test_full_history_client_extends() -> None:
    """Stored history plus new messages is an extend from the stored length."""
    inc = [*STORED, h("u10")]
    view = view_of(STORED)
    d = reconcile(inc, chain_hashes(inc), view, "auto")
    assert (d.action, d.base, d.new_from, d.base_chain) == ("extend", 10, 10, view.last_chain)


def test_retry_of_the_last_request_is_prefix() -> None:
    """Re-sending the history without the stored reply is a prefix at the last user message."""
    inc = STORED[:9]
    chains = chain_hashes(inc)
    d = reconcile(inc, chains, view_of(STORED), "auto")
    assert (d.action, d.base, d.new_from, d.base_chain) == ("prefix", 9, 9, chains[8])


def test_identical_history_is_prefix_at_length() -> None:
    """Re-sending exactly the stored history builds on the whole of it."""
    d = reconcile(STORED, chain_hashes(STORED), view_of(STORED), "full")
    assert (d.action, d.base) == ("prefix", 10)


def test_regenerate_from_an_earlier_point_is_prefix() -> None:
    """Re-asking from an earlier user message (fewer messages, same prefix) is a prefix there."""
    inc = STORED[:5]
    d = reconcile(inc, chain_hashes(inc), view_of(STORED), "auto")
    assert (d.action, d.base, d.new_from) == ("prefix", 5, 5)


def test_edit_in_the_window_branches_at_the_edit() -> None:
    """A changed message inside the loaded tail branches exactly at its position."""
    inc = [*STORED[:6], h("edited"), h("u")]
    chains = chain_hashes(inc)
    d = reconcile(inc, chains, view_of(STORED, covers=4), "auto")
    assert (d.action, d.branch_at, d.base, d.new_from, d.base_chain) == ("branch", 6, 6, 6, chains[5])


def test_replaced_last_reply_branches_at_it() -> None:
    """A client that regenerated the last reply and continues branches at that reply."""
    inc = [*STORED[:9], h("other reply"), h("u10")]
    d = reconcile(inc, chain_hashes(inc), view_of(STORED), "auto")
    assert (d.action, d.branch_at) == ("branch", 9)


def test_edit_before_the_window_needs_chains_then_branches() -> None:
    """An edit inside the summarised part cannot be located from the load: need_chains, then exact."""
    stored = [h(f"m{i}") for i in range(30)]
    view = view_of(stored, covers=20)
    inc = [*stored[:5], h("edited"), *stored[6:], h("u30")]
    chains = chain_hashes(inc)
    d = reconcile(inc, chains, view, "auto")
    assert d.action == "need_chains"
    d = reconcile(inc, chains, view, "auto", stored_chains=chain_hashes(stored))
    assert (d.action, d.branch_at, d.base_chain) == ("branch", 5, chains[4])


def test_edit_of_the_first_message_branches_at_zero() -> None:
    """A changed first message (full-history mode) is a branch at 0 without fetching chains."""
    stored = [h(f"m{i}") for i in range(30)]
    inc = [h("new first"), *stored[1:]]
    d = reconcile(inc, chain_hashes(inc), view_of(stored, covers=20), "full")
    assert (d.action, d.branch_at, d.base_chain) == ("branch", 0, "")


def test_edit_inside_the_head_is_located() -> None:
    """A changed message inside the loaded head is located without fetching chains."""
    stored = [h(f"m{i}") for i in range(30)]
    inc = [*stored[:2], h("edited"), *stored[3:]]
    d = reconcile(inc, chain_hashes(inc), view_of(stored, covers=20, head=4), "auto")
    assert (d.action, d.branch_at) == ("branch", 2)


def test_prefix_ending_inside_the_summary_needs_chains() -> None:
    """A short re-ask whose last message lies in the summarised part cannot be confirmed without chains."""
    stored = [h(f"m{i}") for i in range(30)]
    inc = stored[:8]
    view = view_of(stored, covers=20)
    assert reconcile(inc, chain_hashes(inc), view, "full").action == "need_chains"
    d = reconcile(inc, chain_hashes(inc), view, "full", stored_chains=chain_hashes(stored))
    assert (d.action, d.base) == ("prefix", 8)


def test_delta_client_auto_detected() -> None:
    """In auto mode, fewer messages than stored that do not start with message 0 are new turns."""
    inc = [h("new user turn")]
    view = view_of(STORED)
    d = reconcile(inc, chain_hashes(inc), view, "auto")
    assert (d.action, d.base, d.new_from, d.base_chain) == ("delta", 10, 0, view.last_chain)


def test_auto_mode_never_appends_a_whole_foreign_history() -> None:
    """In auto mode a long history that does not start like the stored one replaces it (branch at 0):
    a client that reused a conversation id must not get its history appended on every request."""
    stored = [h(f"m{i}") for i in range(40)]
    inc = [h(f"other{i}") for i in range(20)]
    d = reconcile(inc, chain_hashes(inc), view_of(stored), "auto")
    assert (d.action, d.branch_at) == ("branch", 0)


def test_auto_mode_reads_a_repeated_first_message_by_how_the_client_was_seen_sending() -> None:
    """The first message sent again alone: a regenerate of its reply from a client seen resending
    its history (or not seen yet), a new turn from a client seen sending deltas."""
    inc = STORED[:1]
    for client, action in ((None, "prefix"), ("full", "prefix"), ("delta", "delta")):
        d = reconcile(inc, chain_hashes(inc), replace(view_of(STORED), client=client), "auto")
        assert d.action == action, client
    # A client seen sending deltas that sends a long whole history again is still read by its chain.
    inc = [*STORED, h("u10")]
    d = reconcile(inc, chain_hashes(inc), replace(view_of(STORED), client="delta"), "auto")
    assert (d.action, d.base) == ("extend", 10)


def test_a_delta_client_sending_several_turns_at_once_is_a_delta() -> None:
    """Auto mode, more messages than a short request holds and none of them a reply: new turns from a
    client last seen sending deltas; from any other, a whole history that diverged (a branch)."""
    inc = [h(f"new{i}") for i in range(6)]
    for client, action in ((None, "branch"), ("full", "branch"), ("delta", "delta")):
        d = reconcile(inc, chain_hashes(inc), replace(view_of(STORED), client=client), "auto", replies=False)
        assert d.action == action, client
    d = reconcile(inc, chain_hashes(inc), replace(view_of(STORED), client="delta"), "auto", replies=True)
    assert d.action == "branch"  # with a reply among them it is a whole history
    inc = [*STORED, h("u10")]
    d = reconcile(inc, chain_hashes(inc), replace(view_of(STORED), client="delta"), "auto", replies=False)
    assert d.action == "extend"


def test_what_a_request_shows_of_its_client() -> None:
    """Resending two or more stored messages shows a full-history client; a delta, a delta client;
    nothing else shows either, and only history mode auto keeps it."""
    extend = Decision("extend", base=10, new_from=10)
    assert shown_style(extend, "auto") == "full"
    assert shown_style(Decision("extend", base=1, new_from=1), "auto") == ""
    assert shown_style(Decision("delta", base=10, new_from=0), "auto") == "delta"
    assert shown_style(Decision("new", base=0, new_from=0), "auto") == ""
    assert shown_style(Decision("prefix", base=5, new_from=5), "auto") == ""
    assert shown_style(extend, "full") == shown_style(Decision("delta", base=10, new_from=0), "delta") == ""


def test_a_short_request_carrying_a_reply_is_a_whole_history() -> None:
    """Auto mode: a short request that does not start like the stored history is new turns, unless
    it carries an assistant message: then it is a client's fork, a branch at 0."""
    inc = [h("x"), h("its reply"), h("y")]
    assert reconcile(inc, chain_hashes(inc), view_of(STORED), "auto").action == "delta"
    d = reconcile(inc, chain_hashes(inc), view_of(STORED), "auto", replies=True)
    assert (d.action, d.branch_at) == ("branch", 0)


def test_delta_mode_always_appends() -> None:
    """In delta mode incoming messages are always new, even when they repeat message 0."""
    inc = STORED[:2]
    d = reconcile(inc, chain_hashes(inc), view_of(STORED), "delta")
    assert (d.action, d.base, d.new_from) == ("delta", 10, 0)


def test_full_mode_never_guesses_delta() -> None:
    """In full mode a short list with a different first message is a branch at 0, not a delta."""
    inc = [h("x")]
    d = reconcile(inc, chain_hashes(inc), view_of(STORED), "full")
    assert (d.action, d.branch_at) == ("branch", 0)


@given(st.integers(1, 40), st.integers(0, 39), st.integers(0, 30), st.integers(0, 5), st.integers(0, 10))
def test_branch_point_is_the_common_prefix(n: int, edit: int, covers: int, head: int, extra: int) -> None:
    """Whatever is loaded, the answer (after at most one chain fetch) is the exact common prefix."""
    stored = [h(f"m{i}") for i in range(n)]
    covers = min(covers, n)
    edit = min(edit, n - 1)
    inc = [*stored[:edit], h("edited"), *[h(f"new{i}") for i in range(extra)]]
    chains = chain_hashes(inc)
    view = view_of(stored, covers=covers, head=head)
    d = reconcile(inc, chains, view, "full")
    if d.action == "need_chains":
        d = reconcile(inc, chains, view, "full", stored_chains=chain_hashes(stored))
    assert (d.action, d.branch_at, d.base, d.new_from) == ("branch", edit, edit, edit)
    assert d.base_chain == (chains[edit - 1] if edit else "")
