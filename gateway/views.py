"""What this process knows of each conversation as stored, so a warm conversation is planned
without a store round trip.

Planning needs the stored conversation (length, last chain, summary, state, the tail after the
summary). Loading it is one round trip, and on a busy host the wait for it was most of the
gateway's own time per request (docs/architecture.md, "Known views"). But this process records
every turn it forwards, and the store's answer to that record says whether what it stored is
exactly what this process expected: its last chain is the chain computed here from the same base
and turns. Then the view after the record is known without reading it back, and the
conversation's next request is planned from it.

What can make a known view stale, and what happens then (the store is never written from a stale
view without a check):
- another replica (or a concurrent request) appended: the record's base is checked by the store;
  a base behind it skips what is stored, a moved base is refused; either way the result's chain
  differs from the local one and the view is dropped (a refusal is recorded again from a fresh load);
- a fold (in any process) committed a summary or updated the state: the record's answer carries
  the summary and state versions; a change reloads the view in the background. Until then the
  older summary is used: it still stands for exactly the prefix it covers, the window is longer;
- an edit or a delete through the conversation API: this replica drops the view at once, and the
  store's change channel tells every other replica to drop it;
- the store goes away: the change channel's connection drops with it, every view is dropped and
  requests load (and degrade) until the channel is back.
Only `extend` and `delta` requests are planned from a known view; anything else (a retry, an edit,
a regenerate, a client that switched dialect) loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from gateway.keys import ConvRef
from gateway.model import ConversationView, Message, Summary


class KnownViews:
    """Conversation views as stored after this process's last load or record of them (LRU)."""

    # A view holds the messages after its summary: normally a window and a fold batch, more while
    # folds fall behind (no worker running, a summarizer failing). It is kept then too: a request
    # that loads instead reads and parses that whole backlog, the cost growing with it (a per-view
    # cap made every request of a conversation past it several times slower). The messages
    # share their `raw` and text with the resend cache (caches.hashes), so a view costs ~400 bytes a
    # message (the object, its hash, chain and time strings: ~40 MB at the bound); past this many
    # messages in all views, the least recently used views are dropped.
    MAX_MESSAGES = 100_000

    def __init__(self, limit: int = 256, *, live: bool = False, max_messages: int = MAX_MESSAGES) -> None:
        self._views: OrderedDict[tuple[str, str], tuple[ConversationView, str | None]] = OrderedDict()
        self.limit = limit
        self.max_messages = max_messages
        self.messages = 0  # tail messages held by all views
        # Known views are used only while the store's change channel is connected (always, for the
        # embedded store, which has no other writer): otherwise every request loads.
        self.live = live

    def __len__(self) -> int:
        return len(self._views)

    def get(self, ref: ConvRef) -> ConversationView | None:
        if not self.live:
            return None
        hit = self._views.get((ref.tenant, ref.conversation))
        return hit[0] if hit is not None else None

    def put(self, ref: ConvRef, view: ConversationView) -> None:
        """Remember `view` unless a longer one is known (a newer record of this process's own)."""
        key = (ref.tenant, ref.conversation)
        if len(view.tail) > self.max_messages:
            self._pop(key)
            return
        known = self._views.get(key)
        if known is not None and known[0].length > view.length:
            return
        self.messages += len(view.tail) - (len(known[0].tail) if known is not None else 0)
        self._views[key] = (view, ref.project)
        self._views.move_to_end(key)
        while len(self._views) > self.limit or self.messages > self.max_messages:
            self._pop(next(iter(self._views)))

    def _pop(self, key: tuple[str, str]) -> None:
        gone = self._views.pop(key, None)
        if gone is not None:
            self.messages -= len(gone[0].tail)

    def update(self, ref: ConvRef, change: Callable[[ConversationView], ConversationView | None]) -> None:
        """Replace the known view of `ref` by `change(view)`; forget it when that is None."""
        known = self.get(ref)
        if known is not None:
            changed = change(known)
            if changed is None:
                self.drop(ref)
            else:
                self.put(ref, changed)

    def drop(self, ref: ConvRef) -> None:
        """Forget the conversation."""
        self._pop((ref.tenant, ref.conversation))

    def drop_project(self, ref: ConvRef) -> None:
        """Forget the conversation and, with a project, every conversation sharing its state."""
        self.drop(ref)
        if ref.project:
            for key in [k for k, (_, p) in self._views.items() if p == ref.project and k[0] == ref.tenant]:
                self._pop(key)

    def of_project(self, ref: ConvRef) -> list[tuple[ConvRef, ConversationView]]:
        """Every known conversation sharing `ref`'s state: itself, or its project's."""
        if not self.live:
            return []
        if not ref.project:
            hit = self._views.get((ref.tenant, ref.conversation))
            return [(ref, hit[0])] if hit is not None else []
        return [(ConvRef(t, c, p), v) for (t, c), (v, p) in self._views.items() if p == ref.project and t == ref.tenant]

    def clear(self) -> None:
        self._views.clear()
        self.messages = 0

    def set_live(self, live: bool) -> None:
        """The change channel connected (True) or lost (False): either way, views known so far may
        have missed a change."""
        self.live = live
        self.clear()


def advance(view: ConversationView, turns: Sequence[Message], *, dialect: str, last_chain: str,
            keep_initial: int, stats: Mapping[str, int], fold_pending: bool,
            client: str | None = None) -> ConversationView:
    """The view once `turns` (their chains set) are stored right after `view`'s last message, with
    `stats` added, its client's history style `client` when given. Pure. `view.head` holds messages
    [0, min(keep_initial, view.length)), as loaded."""
    length = view.length + len(turns)
    head = view.head
    if len(head) < min(keep_initial, length):
        head = [*head, *turns][:keep_initial]
    merged = dict(view.stats)
    for name, n in stats.items():
        merged[name] = merged.get(name, 0) + int(n)
    return replace(
        view, length=length, dialect=dialect, last_chain=last_chain, head=head,
        first_hash=view.first_hash if view.length else (turns[0].hash if turns else None),
        tail=[*view.tail, *turns], tokens_total=view.tokens_total + sum(t.tokens for t in turns),
        stats=merged, fold_pending=fold_pending, client=client or view.client)


def rebase(known: ConversationView, loaded: ConversationView) -> ConversationView | None:
    """`known` with the summary, state and fold flag of `loaded`, a fresher read of a prefix of it.

    `known` may be ahead of the store by records of this process still in flight, so a reload
    cannot simply replace it. None when `loaded` is not a prefix of `known` (another writer
    branched or appended), or its summary covers less than `known` holds (dropped by a branch).
    Counters are merged by maximum: each only grows, and each side may lack the other's latest.
    """
    if loaded.length > known.length or loaded.tail_start < known.tail_start:
        return None
    if loaded.length:
        at = loaded.length - 1 - known.tail_start
        if at < 0 or known.tail[at].chain != loaded.last_chain:
            return None
    stats = dict(known.stats)
    for name, n in loaded.stats.items():
        stats[name] = max(stats.get(name, 0), n)
    return replace(
        known, summary=loaded.summary, summary_version=loaded.summary_version, state=loaded.state,
        state_version=loaded.state_version, tail=known.tail[loaded.tail_start - known.tail_start:],
        tail_start=loaded.tail_start, stats=stats, fold_pending=loaded.fold_pending)


def with_summary(known: ConversationView, summary: Summary) -> ConversationView | None:
    """`known` once `summary` (just committed, its version set) stands for its first messages.
    None when `known` does not hold the prefix the summary covers (it is no longer current)."""
    if summary.version <= known.summary_version:
        return known
    covers = summary.covers
    if covers < known.tail_start or covers > known.length:
        return None
    at = covers - 1 - known.tail_start
    chain = known.tail[at].chain if at >= 0 else (known.summary.chain if known.summary else "")
    if covers and chain != summary.chain:
        return None
    return replace(known, summary=summary, summary_version=summary.version, tail=known.tail[at + 1:], tail_start=covers)
