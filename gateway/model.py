"""Plain data shared by the pure core (context, reconcile, fold) and the edges (store, proxy).

A `Message` is one item of a conversation's history (a user, assistant, tool or developer message,
or a Responses input item) in its provider-native shape (`raw`), with what the gateway derived from
it once: flattened text, token count, content hash and chain hash. A *turn* is a user message and
everything after it up to the next user message (docs/architecture.md, "Words").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

DialectName = Literal["openai_chat", "openai_responses", "anthropic"]
ContextKind = Literal["passthrough", "full", "rewritten", "degraded"]


@dataclass(slots=True)
class Message:
    """One message of a conversation as the gateway keeps it."""

    raw: dict[str, Any]  # provider-native message / input item, forwarded verbatim
    role: str  # "user" | "assistant" | "tool" | "system" | "developer"
    text: str  # flattened text: for tokens, search and summaries
    tokens: int
    hash: str  # content hash of the canonical form (see shape.canonical)
    chain: str = ""  # hash of (previous chain, hash): identifies the whole prefix up to here
    time: str | None = None  # ISO 8601 when known


@dataclass(slots=True)
class Summary:
    text: str
    covers: int  # the summary stands for messages [0, covers)
    version: int  # bumped at every committed fold; folds commit by compare-and-set on it
    tokens: int
    chain: str = ""  # chain hash of message covers-1: the exact history prefix it summarises


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


@dataclass(slots=True)
class ConversationView:
    """What the request path loads in one round trip."""

    length: int  # messages stored
    dialect: str | None  # dialect the conversation was stored in (None: new)
    first_hash: str | None  # hash of message 0: tells a full-history client from a delta client
    last_chain: str | None  # chain hash of message length-1
    summary: Summary | None
    state: dict[str, Any] | None  # project-state ledger JSON (rendered by state.py)
    state_version: int
    head: list[Message]  # the first `head` messages asked for (keep_initial)
    tail: list[Message]  # messages [tail_start, length): everything after the summary's coverage
    tail_start: int
    tokens_total: int  # sum of the stored messages' tokens
    stats: dict[str, int] = field(default_factory=dict)
    fold_pending: bool = False
    summary_version: int = 0  # bumped by every fold commit, edit or drop, also while there is no summary
    client: str | None = None  # "full" / "delta": how its client was seen to send its history (reconcile.py)


@dataclass(slots=True)
class Plan:
    """The rewritten request, dialect-neutral: the dialect's shape renders it into a body."""

    kind: ContextKind
    state_block: str  # "" when no state
    summary_block: str  # "" when no summary
    head: list[dict[str, Any]]  # first keep_initial messages (raw)
    omitted_marker: str  # "" or "[N earlier messages omitted]"
    window: list[dict[str, Any]]  # recent messages (raw), ending with the newest turn
    excerpts_block: str  # "" or the rendered excerpts, placed before the newest user turn
    tokens_original: int
    tokens_forwarded: int
    urgent_fold: bool = False
    reason: str = ""  # why the request goes as it does: one of rewrite.REASONS
    # Excerpt blocks of earlier requests kept where they were first placed: (window index of the
    # message each sits before, the block as first forwarded), in window order.
    pinned: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Pin:
    """An excerpt block an earlier request placed, kept byte for byte before the same message."""

    at: int  # position of the message the block sits before (that request's newest turn)
    hash: str  # that message's hash: another message there and the pins lapse
    text: str
    tokens: int
    quoted: tuple[tuple[int, int], ...]  # (position, tokens) of the earlier messages it quotes
    # The text's digest, the cache-prefix item it stands for: taken once, where every later request
    # (and each of its cost comparisons) would hash blocks of thousands of tokens again.
    digest: str


@dataclass(frozen=True, slots=True)
class Pins:
    """The excerpt blocks a rewrite carries, valid while its layers and window start stay as they were."""

    layers: str  # digest of the state, summary, head and marker they were placed under
    start: int  # the window's first position
    blocks: tuple[Pin, ...]
    # position -> tokens of every message the blocks quote (their `quoted`, merged once here rather
    # than by every request that keeps them); shared by the Pins that extend these.
    quoted: Mapping[int, int]

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.blocks)
