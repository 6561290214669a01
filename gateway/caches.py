"""What this process keeps about each conversation between its requests, in one object.

Every entry is bounded (LRU, `size` conversations) and none is ever needed for correctness: the
store stays the truth, and each cache is either checked before use or only advisory.

- `views` (views.py): the stored conversation as this process last wrote it. Checked against the
  store's answer to every record and dropped on a change announced on the change channel.
- `recall` (recall.py): the retrieval index. Fed from the store by position, cut back on a branch.
- the last request's messages with their hashes: compared message by message before reuse.
- `forwarded`: what the last request carried upstream, for the cost model. Advisory: an estimate
  that expires with the provider's cache. `originals`: the last request's full history as the client
  sent it, priced for `x-gateway-cost-original` (what it would bill without the gateway).
- `writes`: which turns this process stored, and when their replies went out. Advisory: tells a
  sibling request from an edit.
- `held`: the layers (summary, state) the last rewrite forwarded and its messages from their
  coverage on, so that a fold finished since can wait while the provider's cache is warm
  (rewrite.keep_layers). Each message is checked by chain hash before reuse; an edit drops it.

`forget(ref)` drops a conversation from all of them (delete); an edit drops the view and the held
layers, a fold elsewhere reloads the view (Memory.changed); the rest checks itself.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from hashlib import blake2b
from typing import Any

import orjson

from gateway import state
from gateway.config import MemorySettings
from gateway.cost import Forwarded
from gateway.dialects import Dialect, content_hash
from gateway.keys import ConvRef
from gateway.model import Message, Summary
from gateway.recall import RecallCache
from gateway.reconcile import chain_hashes
from gateway.tokens import TokenCounter
from gateway.validate import string_bytes
from gateway.views import KnownViews

Conv = tuple[str, str]  # (tenant, conversation): the caches' key
CONVERSATIONS = 256  # conversations each per-conversation cache holds (LRU)
# New message bytes past which they are hashed in a thread: canonical form and blake2b cost about
# 5 ms a megabyte on the loop (a 30 MB first request held it 154 ms).
HASH_OFF_LOOP = 256 << 10
HOLD_OFF_LOOP = 1000  # new messages a held rewrite copies in a thread past this many


@dataclass(frozen=True, slots=True)
class Held:
    """The layers a rewrite forwarded, and its messages from their coverage on (tail_start)."""

    project: str | None
    summary: Summary | None
    state_block: str
    state_tokens: int
    tail_start: int
    tail: tuple[Message, ...]


def conv_key(ref: ConvRef) -> Conv:
    return (ref.tenant, ref.conversation)


def bounded_put(cache: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Insert or refresh `key` as most recent, evicting the least recent past `limit`."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


class RecentWrites:
    """The turns this process stored lately, per conversation, with when their reply was relayed.

    A request whose history diverges from the store is an edit (branch), unless every stored turn
    after the divergence was stored by requests answered after it arrived: then they were siblings
    in flight together, and its turns go beside theirs (`siblings`).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._runs: OrderedDict[Conv, list[tuple[int, int, float]]] = OrderedDict()  # (start, stop, replied)
        self._storing: dict[Conv, list[tuple[int, float]]] = {}  # (turns, replied at) whose store call is out

    def siblings(self, key: Conv, at: int, length: int, arrived: float) -> bool:
        """Were stored messages [at, length) all stored by requests answered after `arrived`?

        Runs whose store call has not returned yet may account for the positions no known run covers.
        """
        runs, storing = self._runs.get(key, []), self._storing.get(key, [])
        if at >= length or not (runs or storing):
            return False
        covered, gaps = at, 0
        for start, stop, replied in sorted(runs):
            if start >= length:
                break
            if stop <= covered:
                continue
            if replied <= arrived:
                return False
            gaps += max(0, start - covered)
            covered = stop
        gaps += max(0, length - covered)
        return gaps <= sum(n for n, replied in storing if replied > arrived)

    def storing(self, key: Conv, turns: int, replied: float) -> tuple[int, float]:
        """Note a store call going out; pass what it returns to `stored` when it is back."""
        entry = (turns, replied)
        self._storing.setdefault(key, []).append(entry)
        return entry

    def stored(self, key: Conv, entry: tuple[int, float]) -> None:
        pending = self._storing.get(key, [])
        if entry in pending:
            pending.remove(entry)
        if not pending:
            self._storing.pop(key, None)

    def note(self, key: Conv, start: int, stop: int, replied: float, *, branched: bool) -> None:
        """Messages [start, stop) were stored for a reply relayed at `replied`."""
        runs = self._runs.get(key, [])
        if branched:  # the branch replaced everything from `start` on
            runs = [r for r in runs if r[1] <= start]
        runs.append((start, stop, replied))
        bounded_put(self._runs, key, runs[-64:], self.size)

    def forget(self, key: Conv) -> None:
        self._runs.pop(key, None)
        self._storing.pop(key, None)


class ConversationCaches:
    """The per-conversation caches of one process (see the module's table)."""

    def __init__(self, size: int = CONVERSATIONS, *, live: bool, recall: RecallCache) -> None:
        self.size = size
        self.views = KnownViews(size, live=live)
        self.recall = recall  # sized by memory.retrieval.index_cache_mb (Memory builds it)
        self.forwarded: OrderedDict[Conv, Forwarded] = OrderedDict()
        self.originals: OrderedDict[Conv, Forwarded] = OrderedDict()
        self.held: OrderedDict[Conv, Held] = OrderedDict()
        self._holding: dict[Conv, int] = {}  # holds copying in a thread: the latest one's ticket
        self.edits = 0  # edits seen (edited), and change-channel gaps, which may have hidden some
        self.writes = RecentWrites(size)
        # (tenant, conversation, dialect) → the last request's messages and their hashes.
        self._last: OrderedDict[tuple[str, str, str],
                                tuple[list[dict[str, Any]], tuple[str, ...], tuple[str, ...]]] = OrderedDict()

    def forget(self, ref: ConvRef) -> None:
        """Drop everything kept about a deleted conversation."""
        conv = conv_key(ref)
        self.views.drop(ref)
        self.recall.forget(conv)
        for key in [k for k in self._last if k[:2] == conv]:
            del self._last[key]
        self.forwarded.pop(conv, None)
        self.originals.pop(conv, None)
        self.held.pop(conv, None)
        self.writes.forget(conv)

    def edited(self, ref: ConvRef) -> None:
        """A summary or state edit: the next request forwards it, whatever the cache holds (a state
        edit concerns every conversation of the project)."""
        self.edits += 1  # a request planned across this edit does not hold what it planned from
        conv = conv_key(ref)
        for key in [k for k, h in self.held.items()
                    if k == conv or (ref.project and k[0] == conv[0] and h.project == ref.project)]:
            del self.held[key]

    async def hold(self, ref: ConvRef, held: Held, edits: int) -> None:
        """Keep `held` unless an edit (or a gap in the change channel) came since `edits` was read.
        Its messages are kept without their raw bodies (a held message is forwarded with the
        client's own bytes); the copies already held for the same positions are reused. Thousands
        of new ones (an import: ~1.5 us each) are copied in a thread."""
        if edits != self.edits:
            return
        key = conv_key(ref)
        before = self.held.get(key)
        reuse: tuple[Message, ...] = ()
        if before is not None and before.tail_start == held.tail_start and before.tail:
            n = len(before.tail)
            # A chain hash stands for its whole prefix: one comparison tells the copies still apply.
            if n <= len(held.tail) and before.tail[-1].chain and before.tail[-1].chain == held.tail[n - 1].chain:
                reuse = before.tail
        new = held.tail[len(reuse):]
        if len(new) > HOLD_OFF_LOOP:
            ticket = self._holding[key] = self._holding.get(key, 0) + 1
            try:
                copies = await asyncio.to_thread(lambda: tuple(replace(t, raw={}) for t in new))
            finally:
                latest = self._holding.get(key) == ticket
                if latest:
                    del self._holding[key]
            # An edit meanwhile wins, and so does a later request's hold that began meanwhile.
            if edits != self.edits or not latest or self.held.get(key) is not before:
                return
        else:
            copies = tuple(replace(t, raw={}) for t in new)
        bounded_put(self.held, key, replace(held, tail=reuse + copies), self.size)

    def channel_changed(self) -> None:
        """The change channel connected or was lost: edits may have gone unseen meanwhile."""
        self.edits += 1
        self.held.clear()

    def remember_forwarded(self, ref: ConvRef, record: Forwarded, original: Forwarded | None = None) -> None:
        bounded_put(self.forwarded, conv_key(ref), record, self.size)
        if original is not None:
            bounded_put(self.originals, conv_key(ref), original, self.size)

    async def hashes(self, ref: ConvRef, dialect: Dialect, history: list[dict[str, Any]],
                     check: Callable[[int], None], body_bytes: int = 0) -> tuple[list[str], list[str]]:
        """Content and chain hashes of every incoming message, reusing the previous request's.

        Full-history clients resend the same messages every turn. A message that compares equal
        (a C-level dict comparison, ~0.1 µs) to the one at the same position last time has the
        same hash, so only the messages that are new or changed are canonicalised and hashed:
        a 500-message history costs about as much as a 10-message one. `check(same)` runs before
        the rest are read (it raises for a malformed message): the first `same` messages passed it
        when they were cached, so only the new ones are checked.
        """
        key = (ref.tenant, ref.conversation, dialect.name)
        cached = self._last.get(key)
        same = 0
        if cached is not None:
            raws, old_hashes, old_chains = cached
            limit = min(len(raws), len(history))
            if history[:limit] == raws[:limit]:
                same = limit  # the usual resend, compared in one C loop
            else:
                while same < limit and history[same] == raws[same]:
                    same += 1
            hashes, chains = list(old_hashes[:same]), list(old_chains[:same])
        else:
            hashes, chains = [], []
        new = history[same:]
        if new and _new_bytes(new, body_bytes, len(history)) > HASH_OFF_LOOP:
            # Many new bytes (an import, pasted files): checked, canonicalised and hashed in a thread,
            # so that every other conversation is served meanwhile (the check of 2,000 Anthropic
            # messages alone held the loop 20-45 ms).
            def check_and_hash() -> list[str]:
                check(same)
                return [content_hash(dialect, m) for m in new]

            fresh = await asyncio.to_thread(check_and_hash)
        else:
            check(same)
            fresh = [content_hash(dialect, m) for m in new]
        hashes += fresh
        chains += chain_hashes(fresh, prev=chains[-1] if chains else "")
        # The hashes as tuples, not lists: the cyclic GC stops tracking a tuple of strings once it has
        # seen it, so its full collections do not walk every cached hash. (A tuple of message dicts
        # stays tracked like a list would, so the messages are kept as they came.)
        bounded_put(self._last, key, (history, tuple(hashes), tuple(chains)), self.size)
        return hashes, chains


def _new_bytes(new: list[dict[str, Any]], body_bytes: int, messages: int) -> int:
    """About how many bytes the new messages hold: their share of the body by count, or for a few of
    them (a resend's turn after a long history: one may be a pasted file or a picture) their strings'."""
    share = body_bytes * len(new) // max(messages, 1)
    if len(new) > 8:
        return share
    return max(share, sum(string_bytes(m) for m in new))


class Blocks:
    """Token counts of system prompts and rendered state blocks, by content (not per conversation)."""

    def __init__(self, settings: MemorySettings, tokens: TokenCounter, size: int = 256) -> None:
        self.settings, self.tokens, self.size = settings, tokens, size
        self._system: OrderedDict[int, int] = OrderedDict()
        # (ledger digest, encoding, state budget) -> (state block, its tokens)
        self._state: OrderedDict[tuple[bytes, str, int], tuple[str, int]] = OrderedDict()

    def system_tokens(self, text: str, model: str | None) -> int:
        if not text:
            return 0
        key = hash((text, model))
        n = self._system.get(key)
        if n is None:
            n = self.tokens.count(text, model)
            bounded_put(self._system, key, n, 4096)
        return n

    def state_block(self, ledger: dict[str, Any] | None, model: str | None) -> tuple[str, int]:
        """The project state wrapped in its template, and its tokens; remembered by content.

        The ledger changes only when a fold or an edit updates it, but validating and rendering it
        (a count per line) on every request cost ~0.4 ms for 40 items."""
        if not ledger:
            return "", 0
        mem = self.settings
        key = (blake2b(orjson.dumps(ledger), digest_size=16).digest(), self.tokens.encoding(model).name,
               mem.state_budget_tokens)
        hit = self._state.get(key)
        if hit is None:
            rendered = state.render(state.Ledger.model_validate(ledger), mem.state_budget_tokens,
                                    lambda s: self.tokens.count(s, model))
            block = mem.templates.state.format(state=rendered) if rendered else ""
            hit = (block, self.tokens.count(block, model) if block else 0)
        bounded_put(self._state, key, hit, self.size)
        return hit
