"""Every Redis key name the gateway uses, in one place.

All keys of one conversation share a Redis Cluster hash tag, `gw:{<tenant>:<conversation>}:<part>`,
so one Lua script can touch all of them on a cluster. Tenant and conversation ids come from
clients: they are percent-encoded (`{`, `}`, `%`, `:` and non-printable characters) so that no id
can close the tag early, open a second one, or make two different conversations share a key.

Layout of one conversation (`<T>` = `gw:{tenant:conv}`):

| key | type | holds |
|---|---|---|
| `<T>:meta` | hash | `META_*` fields below |
| `<T>:msgs` | list | one JSON record per message (`RECORD_*` members below) |
| `<T>:chains` | list | chain hash of each message, parallel to `msgs` |
| `<T>:summary` | hash | `SUMMARY_*` fields below |
| `<T>:stats` | hash | integer counters by name |
| `<T>:state` | hash | `STATE_*` fields below (when the conversation has no project) |
| `<T>:lock` | string | the fold worker's per-conversation lock |

A project's state is shared by its conversations: `gw:{tenant:p:project}:state` (its own slot: the
conversation tag holds exactly one `:`, a project tag two, so they can never collide). Fold jobs go
on the stream `<prefix>:folds` (entries: `JOB_*` fields), read by the consumer group `fold-workers`;
edits and folds are announced on the channel `<prefix>:changes`.

Field names are one letter: they are stored with every conversation and every message. The store's
Lua scripts use these constants too (lua.py fills them in).

What the dashboard and `/gateway/stats` read is kept per tenant, under the tag `gw:{t:<tenant>}`
(a leading `t:` and no second `:`, so it collides with neither a conversation nor a project):
`:convs` (sorted set: conversation id by last use), `:last` (hash: conversation id to the last
request's decision, JSON), `:totals` (hash of counters), `:series:<yyyymmdd>` (hash:
`<minute>:<counter>` to an integer, expiring after a week), `:recent` (list: the newest requests'
`[time, tokens original, forwarded, cost original, cost forwarded]`, capped). `gw:tenants` (sorted set) lists the
tenants by last use, for the admin token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# <T>:meta
META_DIALECT = "d"  # the dialect the conversation is stored in
META_FIRST_HASH = "f"  # content hash of message 0
META_LAST_CHAIN = "l"  # chain hash of the last message
META_TOKENS = "k"  # tokens of all stored messages
META_FOLD_QUEUED = "q"  # when a fold job was queued (ms since the epoch); absent: none queued
META_CLIENT = "h"  # "full" or "delta": how its client was seen to send its history (history mode auto)
# <T>:summary
SUMMARY_VERSION = "v"  # bumped by every commit, edit or drop; folds commit by CAS on it
SUMMARY_TEXT = "x"
SUMMARY_COVERS = "n"  # the summary stands for messages [0, covers)
SUMMARY_TOKENS = "k"
SUMMARY_CHAIN = "c"  # chain hash of message covers-1
SUMMARY_EDITED = "e"  # "1": written by hand through the API (and kept through the folds since)
# The text of the last edit through the API, and its tokens: later folds keep it verbatim at the
# summary's head and summarise only after it (an edit wins over extraction).
SUMMARY_PINNED = "p"
SUMMARY_PINNED_TOKENS = "pk"
SUMMARY_FOLDED_AT = "t"  # unix seconds of the last fold commit (the dashboard's "last fold")
# <T>:state and a project's state
STATE_LEDGER = "j"  # the ledger as JSON
STATE_VERSION = "v"
# a message record in <T>:msgs (JSON; "k" first so Lua reads the tokens with one anchored match,
# "c" last because the append script computes it and splices it in)
RECORD_TOKENS = "k"
RECORD_HASH = "h"
RECORD_ROLE = "o"
RECORD_TIME = "t"
RECORD_TEXT = "x"
RECORD_RAW = "r"
RECORD_CHAIN = "c"
# a fold job's stream entry
JOB_TENANT = "t"
JOB_CONVERSATION = "c"
JOB_PROJECT = "p"
JOB_URGENT = "u"

# Characters that would break or alias the hash tag / the `:`-separated key structure.
_RESERVED = frozenset("{}%:")


@dataclass(frozen=True, slots=True)
class ConvRef:
    """One conversation: (tenant, conversation id), optionally part of a project."""

    tenant: str
    conversation: str
    project: str | None = None


def enc(value: str) -> str:
    """Percent-encode the characters of an id that could break a key (UTF-8 bytes, `%XX`)."""
    if value.isprintable() and not any(ch in _RESERVED for ch in value):
        return value  # the common case: nothing to do, no copy
    out: list[str] = []
    for ch in value:
        if ch in _RESERVED or not ch.isprintable():
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        else:
            out.append(ch)
    return "".join(out)


class Keys:
    """Builds key names under one prefix (`store.key_prefix`)."""

    FOLD_GROUP: ClassVar[str] = "fold-workers"
    # `branches` and `abandoned`: what a branch took off the history (store.branch), kept, never deleted.
    CONVERSATION_PARTS: ClassVar[tuple[str, ...]] = ("meta", "msgs", "chains", "summary", "stats", "state",
                                                     "branches", "abandoned")

    def __init__(self, prefix: str = "gw") -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and put every key in one slot.
            raise ValueError(f"key prefix must be non-empty and free of braces: {prefix!r}")
        self.prefix = prefix
        # (tenant, conversation) -> tag: each request names its conversation's keys several times,
        # and encoding an id checks it character by character.
        self._tags: dict[tuple[str, str], str] = {}

    def tag(self, ref: ConvRef) -> str:
        tag = self._tags.get((ref.tenant, ref.conversation))
        if tag is None:
            tag = f"{self.prefix}:{{{enc(ref.tenant)}:{enc(ref.conversation)}}}"
            if len(self._tags) >= 4096:  # ids come from clients: bounded
                self._tags.clear()
            self._tags[ref.tenant, ref.conversation] = tag
        return tag

    def conv(self, ref: ConvRef, part: str) -> str:
        return f"{self.tag(ref)}:{part}"

    def meta(self, ref: ConvRef) -> str:
        return self.conv(ref, "meta")

    def msgs(self, ref: ConvRef) -> str:
        return self.conv(ref, "msgs")

    def chains(self, ref: ConvRef) -> str:
        return self.conv(ref, "chains")

    def summary(self, ref: ConvRef) -> str:
        return self.conv(ref, "summary")

    def stats(self, ref: ConvRef) -> str:
        return self.conv(ref, "stats")

    def branches(self, ref: ConvRef) -> str:
        return self.conv(ref, "branches")

    def abandoned(self, ref: ConvRef) -> str:
        return self.conv(ref, "abandoned")

    def project_state(self, ref: ConvRef) -> str:
        """The state ledger: the project's when `ref.project` is set, else the conversation's own."""
        if ref.project:
            return f"{self.prefix}:{{{enc(ref.tenant)}:p:{enc(ref.project)}}}:state"
        return self.conv(ref, "state")

    def state_is_shared(self, ref: ConvRef) -> bool:
        """True when the state key lies outside the conversation's hash slot (a project's)."""
        return bool(ref.project)

    def fold_lock(self, ref: ConvRef) -> str:
        return self.conv(ref, "lock")

    def conversation_keys(self, ref: ConvRef) -> list[str]:
        """Every key owned by the conversation alone (not the project state, not the lock); a new list."""
        tag = self.tag(ref)
        return [f"{tag}:{part}" for part in self.CONVERSATION_PARTS]

    def fold_stream(self) -> str:
        return f"{self.prefix}:folds"

    def tenant(self, tenant: str, part: str) -> str:
        """A tenant's own key (`convs`, `last`, `totals`, `series:<day>`): one hash slot per tenant."""
        return f"{self.prefix}:{{t:{enc(tenant)}}}:{part}"

    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    def changes(self) -> str:
        """The pub/sub channel on which edits and deletes are announced to every replica."""
        return f"{self.prefix}:changes"
