"""Keeping what this process knows of conversations (views.py) true to the store.

Three sources of change reach a known view: this process's own records (`expect` puts the view a
record will leave before the store answers, `settle` keeps it when the answer matches and drops it
otherwise), its own fold workers (`committed`, told by the store at once), and everything else
(another replica's writes, folds and edits), announced on the store's change channel (`follow`,
`changed`). Views are used only while the channel is followed: when it drops, every view is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from gateway.caches import conv_key
from gateway.keys import ConvRef
from gateway.model import ConversationView, Message, Summary
from gateway.reconcile import Decision, chain_hashes
from gateway.store import AppendResult, Store, StoreUnavailable
from gateway.views import KnownViews, advance, rebase, with_summary

log = structlog.get_logger("gateway.memory")


class Follower:
    """Applies every change a conversation's known view can see (see the module's docstring)."""

    def __init__(self, store: Store, views: KnownViews, keep_initial: int,
                 edited: Callable[[ConvRef], None] = lambda ref: None,
                 channel: Callable[[], None] = lambda: None) -> None:
        self.store, self.views, self.keep_initial = store, views, keep_initial
        # What else this process must drop after an edit, and after the channel connects or is lost
        # (edits may have gone unseen): the held layers (caches.py).
        self.edited, self.channel = edited, channel
        self._refreshing: dict[tuple[str, str], asyncio.Task[None]] = {}  # reloads after a fold elsewhere
        store.on_commit(self.committed)

    async def follow(self) -> None:
        """Follow the store's change channel while the process runs. Returns at once for the
        embedded store, which has no other writer."""
        if self.store.embedded:
            return

        def live(up: bool) -> None:
            if up != self.views.live:
                log.info("memory.changes_followed") if up else log.warning("memory.changes_lost")
            self.views.set_live(up)
            self.channel()

        try:
            await self.store.watch(self.changed, live)
        finally:
            for task in list(self._refreshing.values()):
                task.cancel()

    def changed(self, ref: ConvRef, kind: str = "edited") -> None:
        """`ref` was edited or deleted ("edited"), here or on another replica: its next request loads.
        Another process folded it ("folded"): what this process knows of it is reloaded now, in the
        background, rather than after its next request."""
        if kind != "folded":
            self.views.drop_project(ref)  # a state edit concerns every conversation of the project
            self.edited(ref)
            return
        key = conv_key(ref)
        if key in self._refreshing or not self.views.of_project(ref):
            return
        task = asyncio.get_running_loop().create_task(self.refresh(ref))
        self._refreshing[key] = task
        task.add_done_callback(lambda _: self._refreshing.pop(key, None))

    async def refresh(self, ref: ConvRef) -> None:
        """Reload the conversation and merge the summary, state and counters into its known view; the
        state also into its project's other known conversations (the fold updated their shared state)."""
        try:
            loaded = await self.store.load(ref, head=self.keep_initial)
        except StoreUnavailable:
            self.views.drop_project(ref)
            return
        self.views.update(ref, lambda known: rebase(known, loaded))
        if ref.project and loaded.state is not None:
            self.committed(ref, None, (loaded.state, loaded.state_version))

    def committed(self, ref: ConvRef, summary: Summary | None, state: tuple[dict[str, Any], int] | None) -> None:
        """A fold worker of this process committed a summary or a state ledger: known views take it now."""
        if summary is not None:
            self.views.update(ref, lambda known: with_summary(known, summary))
        if state is not None:
            ledger, version = state
            for other, known in self.views.of_project(ref):
                if version > known.state_version:
                    self.views.put(other, replace(known, state=ledger, state_version=version))

    def expect(self, ref: ConvRef, decision: Decision, loaded: ConversationView, turns: list[Message], *,
               dialect: str, stats: dict[str, int], client: str = "") -> tuple[str, ConversationView] | None:
        """Know the view a record of `turns` will leave, before the store confirms it.

        Only a record that appends right after a view this process holds can be known: the chain
        the store must end with is computed here. Returns it, with the view the turns go after
        (`loaded`: the view the request was planned from)."""
        views = self.views
        if not views.live or not turns or decision.action not in ("new", "extend", "delta"):
            views.drop(ref)
            return None
        base = views.get(ref)
        if base is None or base.length != decision.base or (base.last_chain or "") != decision.base_chain:
            base = loaded if loaded.length == decision.base else None
        if base is None:
            views.drop(ref)
            return None
        chained = chain_hashes([t.hash for t in turns], prev=decision.base_chain)
        for t, c in zip(turns, chained, strict=True):
            t.chain = c
        views.put(ref, advance(base, turns, dialect=dialect, last_chain=chained[-1], keep_initial=self.keep_initial,
                               stats=stats, fold_pending=base.fold_pending, client=client))
        return chained[-1], base

    async def settle(self, ref: ConvRef, turns: list[Message], result: AppendResult | None,
                     expected: tuple[str, ConversationView] | None) -> None:
        """Keep the view `expect` put when the store holds exactly that; reload it in the background
        of this record when a fold or an edit changed the summary or state meanwhile."""
        if expected is None:
            return
        chain, base = expected
        if result is None or not result.ok or result.appended != len(turns) or result.chain != chain:
            self.views.drop(ref)  # the store holds something else: the next request loads
            return
        known = self.views.get(ref)
        if known is None:
            return
        # What folds spent (charged against the next request's savings) and whether one is queued
        # come with the answer: neither waits for a reload.
        spent = {k: max(known.stats.get(k, 0), n) for k, n in result.summarizer.items()}
        if known.length == base.length + len(turns) and (
                known.fold_pending != result.fold_queued or any(known.stats.get(k) != n for k, n in spent.items())):
            known = replace(known, fold_pending=result.fold_queued, stats=known.stats | spent)
            self.views.put(ref, known)
        # A fold of this process has been taken already (committed); another process's has not.
        if result.summary_version > known.summary_version or result.state_version not in (-1, known.state_version):
            await self.refresh(ref)
