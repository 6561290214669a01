"""Every Redis key name the gateway uses, in one place.

All keys of one conversation share a Redis Cluster hash tag, `gw:{<tenant>:<conversation>}:<part>`,
so one Lua script can touch all of them on a cluster. Tenant and conversation ids come from
clients: they are percent-encoded (`{`, `}`, `%`, `:` and non-printable characters) so that no id
can close the tag early, open a second one, or make two different conversations share a key.

Layout of one conversation (`<T>` = `gw:{tenant:conv}`):

| key | type | holds |
|---|---|---|
| `<T>:meta` | hash | `d` dialect, `f` hash of msg 0, `l` last chain, `k` tokens total, `q` fold queued at (ms) |
| `<T>:msgs` | list | one JSON record per message (see store.py) |
| `<T>:chains` | list | chain hash of each message, parallel to `msgs` |
| `<T>:summary` | hash | `v` version, `x` text, `n` covers, `k` tokens, `c` chain, `e` edited |
| `<T>:stats` | hash | integer counters |
| `<T>:state` | hash | `j` ledger JSON, `v` version (when the conversation has no project) |
| `<T>:lock` | string | the fold worker's per-conversation lock |

A project's state is shared by its conversations: `gw:{tenant:p:project}:state` (its own slot: the
conversation tag holds exactly one `:`, a project tag two, so they can never collide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
    CONVERSATION_PARTS: ClassVar[tuple[str, ...]] = ("meta", "msgs", "chains", "summary", "stats", "state")

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

    def changes(self) -> str:
        """The pub/sub channel on which edits and deletes are announced to every replica."""
        return f"{self.prefix}:changes"
