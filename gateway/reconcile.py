"""Match a request's messages against the stored conversation (pure: no I/O).

Each message has a content hash; `chain_i = sha1_hex(chain_{i-1} + hash_i)` (chain_{-1} = "")
identifies the whole prefix up to message i, so one comparison tells whether two histories agree up
to a position, and agreement is monotone: if the prefixes of length p agree, all shorter ones do.
The store's Lua append script computes the same chains with `redis.sha1hex`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.model import ConversationView

Action = Literal["new", "extend", "prefix", "branch", "delta", "need_chains"]
HistoryMode = Literal["auto", "full", "delta"]

# In mode "auto", a request of at most this many messages that does not start like the stored
# conversation is taken for a delta client's new turns (a user message, or tool results).
AUTO_DELTA_MAX = 4


def chain_hashes(hashes: Sequence[str], prev: str = "") -> list[str]:
    """The chain hash of each message, continuing from `prev` (the chain before the first)."""
    out: list[str] = []
    for h in hashes:
        prev = hashlib.sha1((prev + h).encode()).hexdigest()
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with a request; see `reconcile` for each action.

    base: the stored length the request builds on (`append(base_length=base, base_chain=base_chain)`,
    or `branch(at=base, base_chain=base_chain)`). new_from: index in the incoming messages of the
    first message not stored yet. branch_at: the first differing position for "branch", else -1.
    """

    action: Action
    base: int
    new_from: int
    branch_at: int = -1
    base_chain: str = ""


def shown_style(decision: Decision, configured: HistoryMode) -> str:
    """How a request in history mode auto shows its client sends its history, to keep with the
    conversation: "full" when it resent two or more stored messages and added to them (a delta client
    never resends a stored reply), "delta" when it was taken for new turns only; "" otherwise."""
    if configured != "auto":
        return ""
    if decision.action == "extend" and decision.base >= 2:
        return "full"
    return "delta" if decision.action == "delta" else ""


def _known_chains(view: ConversationView, stored_chains: Sequence[str] | None) -> dict[int, str]:
    """Stored chain hashes by position, from whatever the load brought back."""
    if stored_chains is not None:
        return dict(enumerate(stored_chains))
    known: dict[int, str] = {}
    if view.first_hash is not None:
        known[0] = chain_hashes([view.first_hash])[0]
    for i, turn in enumerate(view.head):
        known[i] = turn.chain
    if view.summary is not None and view.summary.covers > 0 and view.summary.chain:
        known[view.summary.covers - 1] = view.summary.chain
    for i, turn in enumerate(view.tail, start=view.tail_start):
        known[i] = turn.chain
    if view.last_chain is not None and view.length > 0:
        known[view.length - 1] = view.last_chain
    return known


def reconcile(
    incoming: Sequence[str],
    incoming_chains: Sequence[str],
    view: ConversationView,
    mode: HistoryMode = "auto",
    stored_chains: Sequence[str] | None = None,
    *,
    replies: bool = False,
) -> Decision:
    """Decide how the request's messages (content hashes + their chains) relate to the stored ones.

    - "new": nothing stored yet. Every incoming message is new (base 0, new_from 0).
    - "delta": the client sends only its new turns (mode "delta"; or mode "auto" when the request is
      short, at most AUTO_DELTA_MAX messages and fewer than stored, carries no assistant message
      (`replies` False: a short request with one is a whole history starting elsewhere than the
      stored one, a client's fork; a delta client sends its user message or tool results, the
      replies being stored already, and appending a fork would store its resent turns twice), and
      either incoming[0] differs from the stored message 0 or the client's last request that
      showed its style was a delta (`view.client`, see `shown_style`). They go after the stored
      history: base = view.length, new_from = 0. So a delta client can repeat its first message
      ("hi") without that being taken for a regenerate of the conversation's first reply, and a
      client that sent its whole history once (importing a conversation) can go on with deltas.
      In mode "auto" a request from a client last seen sending deltas that carries no assistant
      message and is neither an extend nor a prefix is a delta too: several new turns at once
      (queued user messages, tool results), not a whole history that diverged, which carries the
      replies the gateway stored.
      A longer request that does not start like the stored conversation is a full history that
      replaces it (a branch at 0): appending it would duplicate a whole history on every request
      of a client that reused a conversation id or edited its first message.
    - Otherwise the client sends its whole history:
      - "extend": the incoming chain at view.length-1 equals the stored last chain and there are
        more incoming messages: store incoming[view.length:] (base = new_from = view.length).
      - "prefix": no more messages than stored and the incoming history is a prefix of the stored
        one: a retry or a regenerate from an earlier point. Nothing is new before the reply
        (base = new_from = len(incoming)); the caller records the reply with
        `branch(at=base, ...)`, which is a no-op-plus-append when base == view.length, and needs
        nothing when the stored message at `base` already has the reply's hash (a retry that got
        the same answer).
      - "branch": the histories diverge (an edited or regenerated message): base = new_from =
        branch_at = the length of the common prefix; the caller stores
        `branch(at=branch_at, turns=incoming[branch_at:] + reply)`. A summary covering more than
        branch_at messages belongs to the abandoned branch.
      - "need_chains": the divergence lies where the load brought no chain hashes (inside the part
        the summary covers, past the head): fetch `store.chains()` and call again with
        `stored_chains`; the answer is then exact.
    base_chain is always the chain of message base-1 ("" for base 0), for the store's CAS.
    An empty `incoming` is treated as a delta with nothing new.
    """
    length = view.length
    m = len(incoming)
    if length == 0:
        return Decision("new", base=0, new_from=0)
    last = view.last_chain or ""
    if m == 0 or mode == "delta" or (mode == "auto" and m < length and m <= AUTO_DELTA_MAX and not replies and (
            incoming[0] != view.first_hash or view.client == "delta")):
        return Decision("delta", base=length, new_from=0, base_chain=last)

    if m > length and incoming_chains[length - 1] == last:
        return Decision("extend", base=length, new_from=length, base_chain=last)

    known = _known_chains(view, stored_chains)
    n = min(m, length)
    if m <= length and known.get(m - 1) == incoming_chains[m - 1]:
        return Decision("prefix", base=m, new_from=m, base_chain=incoming_chains[m - 1])
    if mode == "auto" and not replies and view.client == "delta":
        return Decision("delta", base=length, new_from=0, base_chain=last)

    # Divergence at some position < n. Matches form a prefix, so the common prefix length is one past
    # the last known matching position, provided the next position is known (and so mismatches).
    matched = -1
    for pos in sorted(p for p in known if p < n):
        if known[pos] != incoming_chains[pos]:
            break
        matched = pos
    at = matched + 1
    if at not in known:
        return Decision("need_chains", base=length, new_from=0, base_chain=last)
    base_chain = incoming_chains[at - 1] if at > 0 else ""
    return Decision("branch", base=at, new_from=at, branch_at=at, base_chain=base_chain)
