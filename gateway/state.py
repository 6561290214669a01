"""The project-state ledger: durable facts kept apart from the prose summary.

A summary is rewritten at every fold, and what one fold drops never comes back. The ledger is the
second line of defence: typed items (goal, constraints, decisions, ...) extracted from the
conversation, each remembering where it came from. An item replaced by a newer one is marked
`superseded_by`, not deleted; items set through the API are `edited` and win over extraction.

Pure: no I/O. `extract` is the local (pattern) extractor; the llm summarizer proposes updates
as `StateUpdate` JSON and `apply_update` merges them under the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import islice
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.model import Message
from gateway.retrieval import STAMP_RE, stem

Kind = Literal["goal", "architecture", "tech_stack", "decisions", "constraints", "preferences",
               "open_tasks", "facts"]
KINDS: tuple[Kind, ...] = ("goal", "architecture", "tech_stack", "decisions", "constraints", "preferences",
                           "open_tasks", "facts")
# Rendering order: what a model most needs to stay on track comes first, so a tight budget cuts
# the least important kinds.
# The stack comes before decisions: its components are one short line, and code that fits the
# project needs them.
RENDER_ORDER: tuple[Kind, ...] = ("goal", "constraints", "tech_stack", "decisions", "architecture",
                                  "preferences", "open_tasks", "facts")
TITLES: dict[Kind, str] = {
    "goal": "Goal", "architecture": "Architecture", "tech_stack": "Tech stack", "decisions": "Decisions",
    "constraints": "Constraints", "preferences": "Preferences", "open_tasks": "Open tasks", "facts": "Facts",
}
# The ledger lives in one Redis value read on every request: bound it. Superseded items go first.
MAX_ITEMS = 200
# One state edit (PUT …/state): each item is compared with the kind's active ones (in a thread, which
# still holds the interpreter while it runs: the bound is what keeps other requests moving).
MAX_EDIT_ITEMS = 100
MAX_EDITED = MAX_ITEMS // 2  # active edited items in a ledger (the rest of MAX_ITEMS is extraction's)
MAX_EDIT_CHARS = 2_000
MAX_WAS = 2
WAS_WORDS = 24
MAX_MARKS = 256  # conversations of one project remembered by their read marks (oldest dropped)


class Item(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    text: str
    source: int | None = None  # index of the message it came from (None: set via the API)
    time: str | None = None  # ISO 8601 of the source message, or of the edit
    superseded_by: str | None = None
    edited: bool = False
    # What this item replaced, newest first (a decision changed twice keeps both earlier ones):
    # rendered as "(since DATE; was Y)". Bounded by MAX_WAS, each clipped to WAS_WORDS words.
    was: list[str] = Field(default_factory=list)
    # A component of the stack named at a version ("Node.js v18.15.0"): its name, lower-cased. Such
    # items are added, replaced and merged by name alone, never as sentences are.
    component: str | None = None


class Ledger(BaseModel):
    model_config = ConfigDict(extra="ignore")

    goal: list[Item] = Field(default_factory=list)
    architecture: list[Item] = Field(default_factory=list)
    tech_stack: list[Item] = Field(default_factory=list)
    decisions: list[Item] = Field(default_factory=list)
    constraints: list[Item] = Field(default_factory=list)
    preferences: list[Item] = Field(default_factory=list)
    open_tasks: list[Item] = Field(default_factory=list)
    facts: list[Item] = Field(default_factory=list)
    seq: int = 0  # last item id issued: ids stay unique across supersessions and pruning
    # Messages of each conversation the ledger has read ([0, mark)): a project's conversations share
    # one ledger, and state is read from every conversation's first messages, not only from folds.
    marks: dict[str, int] = Field(default_factory=dict)

    def items(self, kind: Kind) -> list[Item]:
        return getattr(self, kind)  # type: ignore[no-any-return]

    def active(self, kind: Kind) -> list[Item]:
        return [i for i in self.items(kind) if i.superseded_by is None]

    def all_items(self) -> Iterable[tuple[Kind, Item]]:
        for kind in KINDS:
            for item in self.items(kind):
                yield kind, item

    def dump(self) -> dict:
        return self.model_dump(mode="json")


# -- the update format the llm summarizer answers in (validated; invalid → extractive fallback) --

class ProposedItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    kind: Kind
    text: str = Field(min_length=1, max_length=1000)
    source: int | None = None
    replaces: str | None = None  # id of the item this one supersedes


class StateUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    items: list[ProposedItem] = Field(default_factory=list)


# -- merging --------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")
# Tokens that carry a value: a changed number or identifier means an update, not a duplicate.
# The lookbehinds start a run-scanning alternative only where its run starts: tried from every
# character of a long run it was quadratic (a 96 KB word froze a fold for 20 s). Same matches:
# an alternative that fails from a run's start fails from inside it too (tests/test_patterns.py).
_VALUE = re.compile(r"\d[\w.:/-]*|(?<![\w.-])[\w.-]*/[\w./-]+|(?<![A-Z])[A-Z]{2,}-\d+|\b[a-z]+_[a-z0-9_]+\b"
                    r"|\b[A-Z][a-z]+[A-Z]\w*")


# Cached: every new statement is compared with each active item of its kind, whose texts come
# back at every fold (regexes over the same texts, up to MAX_ITEMS of them, otherwise).
@lru_cache(maxsize=4096)
def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


@lru_cache(maxsize=4096)
def _values(text: str) -> frozenset[str]:
    return frozenset(v.lower().rstrip(".") for v in _VALUE.findall(text))


def _similar(a: str, b: str, threshold: float = 0.6) -> bool:
    wa, wb = _words(a), _words(b)
    if not wa or not wb:
        return False
    return len(wa & wb) / len(wa | wb) >= threshold


def _contained(a: str, b: str) -> float:
    """Share of a's words that b also has."""
    wa, wb = _words(a), _words(b)
    return len(wa & wb) / len(wa) if wa else 0.0


# Words that frame a statement without adding to it: "I've been told to always use camelCase for
# variable names" says no more than "Always use camelCase for variable names when I ask about code
# style". Not among them: negations and modal words ("never", "must not" change what is said), nor
# whose it is ("I must review your pull requests" is not "You must review my pull requests").
_FRAME = frozenset((
    "ve", "m", "ll", "re", "d", "s", "been", "was", "were", "told", "asked", "instructed", "reminded", "to", "for",
    "the", "a", "an", "of", "in", "on", "at", "by", "with", "as", "that", "this", "it", "is", "are", "be", "and",
    "so", "also", "please", "remember", "make", "sure",
))


@lru_cache(maxsize=4096)
def _content(text: str) -> frozenset[str]:
    return _words(text) - _FRAME


_NEGATION = frozenset(("not", "never", "no", "t", "cannot", "without", "nor", "neither", "avoid", "stop"))
_NOT = frozenset(("not", "never", "t", "cannot", "nor", "neither"))  # one negation in other words


def _negations(text: str) -> tuple[bool, frozenset[str]]:
    """Whether a statement is negated ("not", "never", "don't" alike), and its other negating words."""
    found = _words(text) & _NEGATION
    return bool(found & _NOT), found - _NOT


_CONDITION = frozenset(("when", "whenever", "if", "unless"))
# Words that may sit in a changed statement ("I prefer light mode now") and are left out when two
# statements are aligned; only the strong ones say it changes the other (_CHANGES): "now" alone
# also means "at this point" ("We must now support Firefox" adds a browser).
_CHANGED = frozenset(("now", "actually", "instead", "anymore"))
_CHANGES = re.compile(r"\b(?:actually|instead|anymore|no\s+longer|switch(?:ed|ing)?\s+to"
                      r"|(?:i(?:'ve|\s+have)?\s+)?changed\s+(?:my\s+mind|to)|on\s+second\s+thought"
                      r"|from\s+now\s+on)\b", re.IGNORECASE)
_CHANGED_MIND = re.compile(r"\bchanged\s+my\s+mind\b|\bon\s+second\s+thought\b", re.IGNORECASE)
# One word for another that says the same ("every editor" / "each editor").
_SAME_WORD = {"each": "every", "all": "every"}
_ORDERING = frozenset(("over", "than", "instead", "rather", "before", "after", "from", "to", "into", "vs", "versus"))


@lru_cache(maxsize=4096)
def _sequence(text: str) -> tuple[str, ...]:
    return tuple(w for w in _WORD.findall(_CHANGES.sub(" ", text).lower()) if w not in _CHANGED)


@lru_cache(maxsize=4096)
def _markers(text: str) -> frozenset[str]:
    return frozenset(" ".join(m.lower().split()) for m in _CHANGES.findall(text))


@lru_cache(maxsize=4096)
def _aligned(text: str) -> tuple[str, ...]:
    """Its words as two statements are compared: stemmed ("Fridays" is "Friday"), "each" is "every"."""
    return tuple(stem(_SAME_WORD.get(w, w)) for w in _sequence(text))


@lru_cache(maxsize=4096)
def _slot(new: str, old: str, least: int = 3) -> int | None:
    """Where `new` changes one choice of `old` (see is_change): the words before the change, or None.
    `least`: words around the change the two must share. Cached: add_item asks it of each active item
    of the kind, twice (is_duplicate, changes)."""
    a, b = _sequence(new), _sequence(old)
    if a == b or _values(new) != _values(old):
        return None  # a changed number or path is an update, a changed identifier another statement
    pre = 0
    while pre < min(len(a), len(b)) and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < min(len(a), len(b)) - pre and a[-1 - suf] == b[-1 - suf]:
        suf += 1
    if len(a) == len(b) >= 3 and set(a) == set(b) and sorted(a) == sorted(b):
        # "spaces over tabs": an order that says which comes first; "Express and Socket.io" is a list.
        return pre if not _ORDERING.isdisjoint(a[pre:len(a) - suf]) else None
    kept = pre + suf
    if not (1 <= len(a) - kept <= 2 and 1 <= len(b) - kept <= 2
            and kept >= least and kept >= 0.6 * max(len(a), len(b))):
        return None
    # "must never" for "must not" says the same; a turned negation is a reversal (is_reversal).
    return None if {*a[pre:len(a) - suf], *b[pre:len(b) - suf]} <= _NEGATION | _REVERSAL_SLACK else pre


def is_change(new: str, old: str) -> bool:
    """The same statement with one choice changed, or a second choice beside it: "I prefer light mode
    in every editor" after "I prefer dark mode in every editor", "We must deploy on Mondays" after "...
    on Fridays", "I prefer spaces over tabs" after "tabs over spaces", but also "We chose to store
    backup settings in environment variables" after "... API keys settings ...". Never a duplicate;
    it replaces the old one only when it says it changes it (`changes`). One or two words in one
    place differ, and what is around them (at least three words, most of the statement) is the same;
    or the same words come in another order. Two changes apart ("camelCase for variable names" /
    "snake_case for function names") are two statements."""
    return _slot(new, old) is not None


def changes(new: str, old: str) -> bool:
    """`new` is a changed choice (is_change) that says so: "Actually, I prefer light mode in every
    editor" replaces "I prefer dark mode in every editor". Without such words the two stand, the
    newer first: which is the change and which a second choice is not in the words. Nor when the
    change is in a condition: "... when I ask about upgrades" / "... about integrations" are two orders."""
    if _markers(new) <= _markers(old):
        return False
    pre = _slot(new, old)
    if pre is None and _CHANGED_MIND.search(new) and len(_sequence(new)) <= 4 and len(_sequence(old)) <= 4:
        # "I changed my mind, I prefer spaces" after "I prefer tabs": a short statement that says in so
        # many words that it changes the user's mind shares two words with the one it changes. ("From
        # now on, always add tests" after "Always add docstrings" adds a rule: only these words count.)
        pre = _slot(new, old, 2)
    return pre is not None and _CONDITION.isdisjoint(_sequence(new)[:pre])


def is_duplicate(new: str, old: str) -> bool:
    """Same statement: similar words (or all of new's words in old, its framing words aside), no value
    the old one lacks, not its reversal ("must use" after "must not use") nor a changed choice."""
    if not _values(new) <= _values(old) or _negations(new) != _negations(old):
        return False
    if _aligned(new) == _aligned(old) and _markers(new) <= _markers(old):
        return True  # "on Fridays" for "on Friday", "each editor" for "every editor", unless it corrects
    if is_change(new, old):
        return False
    if _similar(new, old, 0.75) or (len(_words(new)) >= 4 and _contained(new, old) >= 0.9):
        return True
    content = _content(new)
    return len(content) >= 4 and content <= _content(old)


def is_restatement(new: str, old: str) -> bool:
    """`new` says all that `old` said and more (a near-duplicate that extends it): it takes old's place.
    Framing words aside too: "Always use camelCase for variable names when I ask about JavaScript"
    after "I've been told to always use camelCase for variable names"."""
    if len(_words(old)) < 4 or len(_words(new) - _words(old)) < 2 or not _values(old) <= _values(new):
        return False
    if _contained(old, new) >= 0.9 and _similar(new, old, 0.5):
        return True
    content = _content(old)
    return len(content) >= 4 and content <= _content(new) and _negations(new) == _negations(old)


# What may differ, besides a negation, between a statement and its reversal: "We must never use X"
# reverses "We must use X" and "We decided not to use X" reverses "We decided to use X".
_REVERSAL_SLACK = frozenset((
    "always", "ever", "any", "anymore", "longer", "more", "do", "does", "did", "can", "must", "should", "will",
    "shall", "would", "could", "may", "might", "have", "has", "had", "we", "i", "to",
    # what "don't", "won't", "shouldn't" leave beside their "t"
    "don", "doesn", "didn", "won", "shouldn", "couldn", "wouldn", "isn", "aren", "wasn", "weren", "haven", "hasn",
    "hadn", "mustn", "shan",
))


def is_reversal(new: str, old: str) -> bool:
    """The same statement with its negation turned ("We must not use camelCase" after "We must use
    camelCase"): the newer one replaces it. Only when nothing else differs: "We decided not to use
    Memcached" does not reverse "We decided to use Redis"."""
    if _negations(new) == _negations(old) or _values(new) != _values(old):
        return False
    a, b = _words(new) - _NEGATION, _words(old) - _NEGATION
    return len(a & b) >= 3 and (a ^ b) <= _REVERSAL_SLACK


def is_update(new: str, old: str) -> bool:
    """The same statement with a changed number or path (port 8443 → 9443): the newer one replaces it.

    A changed name or identifier ("a helper called a_safe" vs "b_safe") is a second statement.
    """
    vn, vo = _values(new), _values(old)
    if not vn or not vo or vn == vo or not _similar(new, old, 0.6):
        return False
    return all(v[0].isdigit() or "/" in v for v in vn ^ vo)


def _next_id(ledger: Ledger) -> str:
    ledger.seq += 1
    return f"s{ledger.seq}"


def add_item(ledger: Ledger, kind: Kind, text: str, *, source: int | None, time: str | None,
             replaces: str | None = None, edited: bool = False) -> Item | None:
    """Add one item under the ledger's rules; returns it, or None when it adds nothing new.

    Extraction (edited=False) never duplicates nor supersedes an edited item. A near-identical
    statement with a changed value supersedes the older one; `replaces` names one explicitly.
    `goal` holds at most two active items: the first stated (the project's) and the newest; a new goal
    supersedes the previous newest.
    """
    text = " ".join(text.split())
    if not text:
        return None
    existing = [i for i in ledger.active(kind) if not is_component(i)]  # components change by name (_add_component)
    for old in existing:
        if is_duplicate(text, old.text) and not is_restatement(text, old.text) and (old.edited or not edited):
            return None
    item = Item(id=_next_id(ledger), text=text, source=source, time=time, edited=edited)
    targets: list[Item] = []
    if replaces:
        targets += [i for _, i in ledger.all_items() if i.id == replaces and i.superseded_by is None]
    targets += [old for old in existing if is_update(text, old.text) or is_reversal(text, old.text)]
    changed = [old for old in existing if old not in targets and changes(text, old.text)]
    if len(changed) == 1:  # "Actually, Safari instead" after Chrome and Firefox: which one it replaces is unsaid
        targets += changed
    if kind == "goal":
        # The first goal stated is what the project is for ("a robust data model for restaurant
        # recommendations"); a later one is the task at hand ("keep the final image size under
        # 120MB"). Both stay: the newest replaces the previous task's, not the project's, unless it
        # says it changes ("Actually, my goal is now ...") or restates it (`merged` below).
        targets += [old for old in (existing if _markers(text) else existing[1:]) if old not in targets]
    merged = [old for old in existing if old not in targets and is_restatement(text, old.text)]
    for old in targets:
        if old.edited and not edited:
            continue  # an edit wins over anything extracted later
        old.superseded_by = item.id
        if old in existing and kind != "goal":  # a goal is restated whole, not changed piecemeal
            record_replaced(item, old)
    for old in merged:
        if not old.edited or edited:
            old.superseded_by = item.id  # the same statement, extended: no history to keep
    ledger.items(kind).append(item)
    _prune(ledger)
    return item


def record_replaced(item: Item, old: Item) -> None:
    """`item` replaces `old` (of the same kind): it keeps old's text, and what old had replaced, newest
    first (it may replace several: "switched from Flask" over three Flask items)."""
    if old.text in item.was:
        return
    # Callers go through what it replaces oldest first: each goes ahead of those before it.
    item.was = list(dict.fromkeys([clip_words(old.text, WAS_WORDS), *old.was, *item.was]))[:MAX_WAS]


def supersede_mentions(ledger: Ledger, term: str, by: str) -> None:
    """Mark active extracted items mentioning `term` (or another spelling of it: "Postgres" for
    "PostgreSQL") as replaced ("switch from Flask to FastAPI"); the replacing item keeps what it
    replaced of its own kind."""
    key = _ALIASES.get(term.lower(), term.lower())
    spellings = {term.lower(), key, *(k for k, v in _ALIASES.items() if v == key)}
    pat = re.compile(r"(?<!\w)(?:" + "|".join(sorted(map(re.escape, spellings))) + r")(?!\w)", re.IGNORECASE)
    new = next(((k, i) for k, i in ledger.all_items() if i.id == by), None)
    for kind, item in ledger.all_items():
        if item.id != by and item.superseded_by is None and not item.edited and pat.search(item.text):
            item.superseded_by = by
            if new is not None and new[0] == kind:
                record_replaced(new[1], item)


def _prune(ledger: Ledger) -> None:
    total = sum(len(ledger.items(k)) for k in KINDS)
    if total <= MAX_ITEMS:
        return
    # Oldest superseded first (edited or not: an edit replaced is history), then oldest extracted;
    # what an edit set and nothing replaced since is kept. A component ("Express v4.18.2") goes after
    # the other extracted items: the stack a project started on is still its stack.
    order = sorted(((item.superseded_by is None, item.edited, item.superseded_by is None and is_component(item),
                     int(item.id[1:]), item)
                    for kind, item in ledger.all_items()), key=lambda t: t[:4])
    drop = {id(t[4]) for t in order[: total - MAX_ITEMS] if not (t[0] and t[1])}
    for kind in KINDS:
        setattr(ledger, kind, [i for i in ledger.items(kind) if id(i) not in drop])


def copy_ledger(ledger: Ledger) -> Ledger:
    """A copy that can be changed without touching `ledger`.

    An item holds only immutable values, so a shallow copy of each item is a deep copy of the
    ledger, at a third of what pydantic's deepcopy costs (32 vs 94 us for 16 items).
    """
    return ledger.model_copy(update={**{kind: [item.model_copy() for item in ledger.items(kind)] for kind in KINDS},
                                     "marks": dict(ledger.marks)})


def apply_update(ledger: Ledger, update: StateUpdate, *, time: str | None = None) -> Ledger:
    """Merge an llm-proposed update into a copy of `ledger`."""
    out = copy_ledger(ledger)
    for p in update.items:
        if is_statement(p.text):  # the same rule as extraction: no question or complaint is state
            add_item(out, p.kind, p.text, source=p.source, time=time, replaces=p.replaces)
    return out


def apply_edits(ledger: Ledger, edits: dict[str, list[str] | str], *, time: str | None) -> Ledger:
    """Set kinds through the API: the given texts replace that kind's active items and are `edited`."""
    out = copy_ledger(ledger)
    for kind, texts in edits.items():
        if kind not in KINDS:
            raise ValueError(f"unknown state kind {kind!r}; one of {', '.join(KINDS)}")
        k: Kind = kind  # type: ignore[assignment]
        previous = out.active(k)
        values = [texts] if isinstance(texts, str) else list(texts)
        new_ids = []
        for text in values:
            item = add_item(out, k, text, source=None, time=time, edited=True)
            if item is not None:
                new_ids.append(item.id)
        for old in previous:
            if old.superseded_by is None and old.id not in new_ids:
                old.superseded_by = new_ids[0] if new_ids else "edit"
    _prune(out)  # what the edit replaced is history now, first to go
    return out


def edited_items(ledger: Ledger) -> int:
    """Items an edit set that nothing replaced since: never pruned, so an edit may not add past MAX_EDITED."""
    return sum(1 for _, item in ledger.all_items() if item.edited and item.superseded_by is None)


# -- extractive (pattern) extraction ---------------------------------------------------------

class Pattern:
    """A regex the extractors try on every sentence of every aged message, made cheaper two ways.

    `caseless`: Python's re compares each character against an IGNORECASE pattern through its
    case folds, 4x slower than matching the same alternation case-sensitively against
    lower-cased text. The source, written in lower case (checked: a lower-case letter folds like
    its capital), is also compiled case-sensitive and tried on ASCII text lower-cased once per
    sentence (`ascii_lower`): the same answer, since ASCII lower-casing keeps every position and
    character class. Other text takes the IGNORECASE pattern, whose folds also cover the Kelvin
    sign, the long s and the dotted capital I.

    `needs`: a cheap test (a substring, or a search that re scans for) of something every match
    holds; the pattern is only tried on text that passes it. The patterns that try a word-long
    run from every word boundary cost most and match least.
    """

    __slots__ = ("exact", "lowered", "needs")

    def __init__(self, source: str, *, caseless: bool = False, needs: Callable[[str], bool] | None = None) -> None:
        if caseless and any(c.isascii() and c.isupper() for c in re.sub(r"\\.", "", source)):
            raise ValueError(f"a caseless pattern is written in lower case: {source!r}")
        self.exact = re.compile(source, re.IGNORECASE if caseless else 0)
        self.lowered = re.compile(source) if caseless else None
        self.needs = needs

    def search(self, text: str, lower: str | None = None) -> bool:
        """Whether the pattern occurs in `text`, given `lower = ascii_lower(text)` for a caseless one."""
        if self.needs is not None and not self.needs(text):
            return False
        if self.lowered is not None and lower is not None:
            return self.lowered.search(lower) is not None
        return self.exact.search(text) is not None

    def match(self, text: str, lower: str | None = None) -> bool:
        """Whether the pattern occurs at the start of `text` (see `search`)."""
        if self.needs is not None and not self.needs(text):
            return False
        if self.lowered is not None and lower is not None:
            return self.lowered.match(lower) is not None
        return self.exact.match(text) is not None


def ascii_lower(text: str) -> str | None:
    """`text` lower-cased when it is ASCII (the fast path of a caseless Pattern), else None."""
    return text.lower() if text.isascii() else None


_I = re.IGNORECASE
_GOAL = Pattern(r"\b(?:the|our|my)\s+(?:main\s+|overall\s+|end\s+|primary\s+)?(?:goal|aim|objective)\s+is\b"
                r"|\bwe(?:'re| are)\s+(?:trying|aiming)\s+to\b|\bi(?:'m| am)\s+(?:trying|aiming)\s+to\s+build\b",
                caseless=True)
# An adverb people put before the verb ("we finally decided", "we've now switched", "let's just use");
# not a hedge ("we'll probably use" decides nothing yet).
_ADVERB = (r"(?:\s+(?:just|now|already|also|then|finally|eventually|ultimately|officially|definitely|actually"
           r"|really|recently|formally|both|all|at\s+last))?")
_DECISION = Pattern(rf"\bwe(?:'ve| have)?{_ADVERB}\s+(?:decided|chose|chosen|agreed|settled\s+on|went\s+with)\b"
                    rf"|\bwe(?:'ll| will){_ADVERB}\s+(?:use|go\s+with|stick\s+with)\b|\bwe\s+are\s+going\s+with\b"
                    rf"|\blet's{_ADVERB}\s+(?:go\s+with|use|stick\s+with)\b|\bi(?:'ve| have)?{_ADVERB}\s+decided\b"
                    # A label opening the sentence ("Decision: Redis"), not "make an informed decision:".
                    r"|^[\W_]{0,3}(?:\d{1,3}[.)]\s*[\W_]{0,3})?(?:(?:final|our|my|the|team)\s+){0,2}decision(?:\*\*)?\s*:",
                    caseless=True)
# A move from one thing to another, said by the user: "let's switch to MySQL 8", "we're migrating from
# SQLite to PostgreSQL 16", "I moved the queue over to Redis". A decision only when what follows its
# first "to"/"from" (a few words on), or the "to" after that, is a product (`_switches`): "I'm moving
# to Seattle", "let's switch to dark mode", "we'll move the meeting to Friday", "moving on to Phase 2"
# decide nothing for the project. ("We should switch" is a suggestion, not a decision.)
_SWITCH = Pattern(rf"\b(?:let's|we(?:'ll| will)|i(?:'ll| will)){_ADVERB}\s+(?:switch|move|migrate)\b(?!\s+on\b)"
                  rf"|\b(?:we(?:'re| are)|i(?:'m| am)){_ADVERB}\s+(?:switching|moving|migrating)\b(?!\s+on\b)"
                  rf"|\b(?:we|i)(?:'ve| have)?{_ADVERB}\s+(?:switched|moved|migrated)\b(?!\s+on\b)", caseless=True)
_SWITCH_TARGET = re.compile(r"(?:\s+[\w'-]+){0,4}?\s+(?:over\s+)?(?:to|from)\s+(?:the\s+|a\s+|an\s+)?"
                            r"(?P<code>`)?(?P<name>[\w.+#-]{1,40})(?(code)`)(?P<version>\s+v?\d+\.\d)?")
# A product's spelling: "PostgreSQL", "Node.js", "C++", "C#" (not the sentence's own full stop, nor "St.").
_PRODUCT_SPELLING = re.compile(r"[A-Za-z]+(?:[a-z][A-Z]|\.[a-z]|\+\+|#)")


def _product(word: str) -> bool:
    """Whether one word names a product: a known technology or a product's spelling."""
    return _PRODUCT_SPELLING.match(word) is not None or _TECH.exact.fullmatch(word) is not None


# A name past "to"/"from" that is not a sentence's first word: an acronym ("SQS", "GCP") or a
# capitalised word ("Aurora", "Prisma", "Go"), other than what people also switch to that is no
# product: a day or a month ("to Fri"), a quarter, a language, a plan or phase ("to Plan B").
_ACRONYM = re.compile(r"[A-Z][A-Z0-9]{1,5}s?")
_PROPER = re.compile(r"[A-Z][a-z0-9]+")
_NOT_PRODUCT = frozenset((
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "mon", "tue", "tues", "wed",
    "thu", "thur", "thurs", "fri", "sat", "sun", "january", "february", "march", "april", "may", "june", "july",
    "august", "september", "october", "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug",
    "sep", "sept", "oct", "nov", "dec", "today", "tomorrow", "tonight", "q1", "q2", "q3", "q4", "h1", "h2",
    "eod", "eow", "eom", "asap", "tbd", "english", "spanish", "french", "german", "italian", "portuguese",
    "dutch", "russian", "chinese", "mandarin", "japanese", "korean", "arabic", "hindi", "hebrew", "turkish",
    "polish", "swedish", "plan", "phase", "option", "step", "stage", "tier", "level", "part", "chapter", "version",
))
# People get work switched to them ("let's switch the review to Alice"): common first names, less those
# that are also a product's (Ruby, Julia, Ada, Jenkins, Adam, Charles, Eve, Oscar, Sam). Capitalised words
# only: in capitals (SAM, EVE) a name is an acronym.
_FIRST_NAMES = frozenset((
    "alice", "bob", "carol", "dave", "david", "frank", "grace", "heidi", "ivan", "judy", "mallory",
    "peggy", "trent", "victor", "walter", "james", "john", "robert", "michael", "william", "richard", "joseph",
    "thomas", "chris", "christopher", "daniel", "matthew", "anthony", "mark", "paul", "steven", "andrew",
    "kevin", "brian", "george", "tim", "timothy", "ed", "edward", "jason", "jeff", "ryan", "jacob", "gary", "eric",
    "jonathan", "stephen", "larry", "justin", "scott", "brandon", "ben", "benjamin", "samuel", "greg",
    "alex", "patrick", "jack", "dennis", "jerry", "tyler", "aaron", "jose", "nathan", "henry", "pete",
    "peter", "zach", "kyle", "noah", "ethan", "mary", "patricia", "jennifer", "linda", "elizabeth", "barbara",
    "susan", "jessica", "sarah", "karen", "lisa", "nancy", "betty", "sandra", "margaret", "ashley", "kim",
    "kimberly", "emily", "donna", "michelle", "amanda", "melissa", "deborah", "stephanie", "rebecca",
    "sharon", "laura", "cynthia", "amy", "angela", "anna", "emma", "olivia", "sophia", "mia", "maria", "priya",
    "raj", "wei", "li", "chen", "yuki", "omar", "fatima", "ahmed", "sofia", "lucas", "leo", "liam", "nina", "tom",
))
_MOVE_VERB = re.compile(r"mov", re.IGNORECASE)


def _named(name: str) -> bool:
    """Whether a switch's target, not spelled as a product, is named like one (see `_NOT_PRODUCT`)."""
    low = name.lower()
    if _ACRONYM.fullmatch(name) is not None:
        return low not in _NOT_PRODUCT
    return _PROPER.fullmatch(name) is not None and low not in _NOT_PRODUCT and low not in _FIRST_NAMES


def _switches(sentence: str) -> bool:
    """Whether a user's sentence decides a move to (or from) a product: see `_SWITCH`."""
    m = _SWITCH.exact.search(sentence)
    if m is None:
        return False
    at = m.end()
    for _ in range(2):  # "from Express to Fastify 4.2": either end may be the one spelled as a product
        t = _SWITCH_TARGET.match(sentence, at)
        if t is None:
            return False
        name = t["name"].rstrip(".-")
        if t["version"] or t["code"] or _product(name):  # (`pnpm`: written as code, a name)
            return True
        # People move to cities, move teams, tickets and launches to other names: a move counts by
        # a product's spelling alone; a switch or a migration by any name.
        if _MOVE_VERB.match(m.group().split()[-1]) is None and _named(name):
            return True
        at = t.end()
    return False


# A rule, not a habit, a feeling or a figure of speech. "always" and "never" count where they order
# ("Always include ...", "make sure to always ...", "must never ...", "..., never."), not where they
# describe ("it's always crowded", "I never thought of that", "they don't always win"); a bound
# ("at least 8 hours") counts beside a need ("the service must handle at least 1,000 users").
_CONSTRAINT = Pattern(r"\b(?:must(?:\s+not)?|mustn['’]t|cannot|can['’]t|is\s+required|are\s+required"
                      r"|not\s+allowed|(?:has|have)\s+to(?!\s+(?:the|a|an|my|our|your|his|her|their|its|this|that"
                      r"|these|those|me|him|them|us)\b))\b"
                      r"|(?:^|[,;:]\s*|\b(?:please|must|should|shall|to|and|but|also|then)\s+)(?:always|never)\b"
                      r"|\bi\s+(?:always|never)\s+(?:want|need|use|prefer|require|deploy|commit|push)\b",
                      caseless=True)
_BOUND = Pattern(r"\b(?:no\s+more\s+than|at\s+most|at\s+least)\b", caseless=True)
_NEED = Pattern(r"\b(?:need|needs|must|should|requires?|required|has\s+to|have\s+to|limit|cap|keep)\b", caseless=True)
# Words of obligation that oblige nothing, cut out before the rule is looked for: "I can't wait",
# "I have to say", "I'll have to try it" (a plan of one's own), "you don't have to", "it must have
# taken weeks". What is left may still hold a rule: "I can't wait to ship, but it must run on 3.8".
_NOT_RULE = re.compile(r"\bcan(?:['’]t|not)\s+(?:wait|believe|help|thank|imagine|stop|get\s+enough|say|tell"
                       r"|remember|decide)\b|\b(?:have|has)\s+to\s+(?:say|admit|offer|be\s+honest)\b"
                       r"|(?:['’]ll|\bwill|\bmight|\bmay|\bgoing\s+to|\bgonna|\bwould|['’]d|\bcould)\s+have\s+to\b"
                       r"|\b(?:don['’]t|doesn['’]t|didn['’]t|won['’]t|not|never)\s+(?:have|has)\s+to\b"
                       r"|\bmust\s+(?:have\s+(?:been|\w+(?:ed|en)\b)|be\s+(?:nice|great|hard|fun|tough|so|really"
                       r"|amazing|awesome|wonderful|exciting|difficult))", re.IGNORECASE)
# An error message quoted without quotes ("TypeError: Cannot assign to ...") states what failed.
_ERROR_TEXT = re.compile(r"\w{0,40}(?:error|exception)\s*:|\berr!|\btraceback\b", re.IGNORECASE)
_PREFERENCE = Pattern(r"\bi\s+(?:(?:now|actually|really|still|also)\s+)?(?:prefer|like|want|dislike|hate"
                      r"|don't\s+like)\b"
                      r"|\bi(?:'d| would)\s+(?:like|rather)\b"
                      r"|\bplease\s+(?:always|never|keep|use|avoid)\b|\bmy\s+preference\s+(?:is|would\s+be)\b"
                      r"|\bi(?:['’]ve|\s+have)?\s+(?:set|stated|expressed|have)\s+a\s+preference\s+for\b",
                      caseless=True)
# "I'd like to know more about X", "I want to try making kimchi": a request of the moment, not a
# taste that lasts. Cut out before a preference is looked for; "I want to keep functions short" stays.
_REQUEST = re.compile(r"\bi(?:\s+(?:(?:just|really|also)\s+)?want|['’]d\s+(?:really\s+)?like"
                      r"|\s+would\s+like)\s+to\s+"
                      r"(?!keep\b|use\b|avoid\b|stick\b|stay\b|limit\b|prioriti[sz]e\b|minimi[sz]e\b)",
                      re.IGNORECASE)
# "... not working as well as I'd like", "more than I'd like": a measure, not a wish.
_AS_LIKED = re.compile(r"\b(?:as|than)\s+i(?:['’]d|\s+would)\s+(?:like|want)\b", re.IGNORECASE)
# "I like those ideas, thanks!", "I love it": a reply to what was just said, naming no taste of its own.
_REACTION = re.compile(r"\bi\s+(?:really\s+|also\s+|do\s+)?(?:like|love)\s+(?:it|this|that|these|those|them)"
                       r"(?:\s+(?:idea|ideas|one|ones|suggestion|suggestions|plan|approach))?"
                       r"(?=\s*(?:[,.!;]|$)|\s+(?:a\s+lot|too|so\s+much|very\s+much)\b)", re.IGNORECASE)
_TASK = Pattern(r"\btodo\b|\bwe\s+(?:still\s+)?need\s+to\b|\bnext,?\s+(?:we|i)\s+(?:should|need|will)\b"
                r"|\bdon't\s+forget\s+to\b|\bremaining\s*:|\bopen\s+task\b", caseless=True)
_TODO = Pattern(r"\bTODO\b")
# An assistant's decision counts when it reports one made ("we decided", "Decision: ..."). Its "we'll
# use X" / "let's use X" walks through its own answer ("Let's use the points (2, 3)", "we'll use a list
# for demonstration purposes"): 165 of the 168 assistant decisions of both development sets were that.
_MADE = Pattern(r"\bwe(?:'ve| have)?\s+(?:decided|chose|chosen|agreed|settled\s+on|went\s+with)\b"
                r"|^[\W_]{0,3}(?:\d{1,3}[.)]\s*[\W_]{0,3})?(?:(?:final|our|my|the|team)\s+){0,2}"
                r"decision(?:\*\*)?\s*:", caseless=True)
# A reply that only agrees to what the assistant proposed: "OK, let's do that", "Sounds good, go with
# it.", "Postgres it is". The whole reply: "OK, that didn't work", "Great, another error", "Sure, but
# what about performance?" and "ok thanks" agree to nothing.
_ASSENT_WORDS = (r"(?:ok(?:ay)?|yes|yep|yeah|sure(?:\s+thing)?|agreed|deal|perfect|sounds\s+(?:good|great)"
                 r"|that\s+works|go\s+ahead|let['’]s\s+(?:do|go\s+with)\s+(?:that|it|this)|go\s+(?:with|for)\s+it"
                 r"|do\s+it|(?:great|fine|good)(?=[\s,.!]+(?:ok|yes|sure|let|go|do|that|sounds)))")
# "Postgres it is", "Redis 7 it is": one to three words naming the choice, none of them a doubt.
_CHOSEN = (r"(?!.*\b(?:not|n['’]t|what|whatever|no|i|think|guess|still|error|broken|bad|bug)\b)"
           r"(?:[\w+#/-]+\s+){1,3}it\s+is")
_ASSENT = re.compile(rf"\s*(?:{_ASSENT_WORDS}(?:[\s,.!]+(?:{_ASSENT_WORDS}|please))*(?:[\s,.!]+{_CHOSEN})?"
                     rf"|(?:(?:great|fine|good|alright)[\s,.!]+)?{_CHOSEN})"
                     r"[\s.!]*", re.IGNORECASE)
_STACK = Pattern(r"\b(?:tech\s+)?stack\s*[:=\-]|\bbuilt\s+(?:with|on)\b|\bwritten\s+in\b|\bruns\s+on\b"
                 r"|\bwe(?:'re| are)\s+using\b|\busing\s+\w+\s+(?:for|as)\b", caseless=True)
_ARCH = Pattern(r"\barchitecture\b|\bmicroservices?\b|\bmonolith\b|\bevent[- ]driven\b"
                r"|\b(?:service|component)s?\s+(?:talks?|communicates?|calls?)\b", caseless=True)
_NAME = Pattern(r"\b(?i:my\s+name\s+is|call\s+me|I\s+am\s+called)\s+([A-Z][\w'-]+(?:\s+[A-Z][\w'-]+)?)"
                r"|\bI'm\s+([A-Z][a-z'-]+(?:\s+[A-Z][a-z'-]+)?)\b(?=[,.!]|\s+(?:and|from|here))")
_TECH = Pattern(r"\b(?:python|fastapi|django|flask|postgres(?:ql)?|mysql|sqlite|redis|kafka|rabbitmq|react"
                r"|vue|svelte|angular|typescript|javascript|node(?:\.js)?|rust|golang|java|kotlin|swift"
                r"|docker|kubernetes|k8s|terraform|aws|gcp|azure|graphql|grpc|mongodb|elasticsearch"
                r"|nginx|celery|aiohttp|pydantic|pytest|next\.js|tailwind|vercel|netlify|heroku|cloudflare"
                r"|supabase|firebase|digitalocean|dynamodb|clickhouse|bigquery|airflow|prisma|sequelize|mongoose"
                r"|nestjs|laravel|fastify|deno|pnpm|webpack|vite|gitlab|github|bitbucket)\b", caseless=True)
# Every alternative holds a digit or a "/"; the last one tries [a-z][a-z0-9]+ from every word.
_DIGIT_OR_SLASH = re.compile(r"[\d/]")
_FACT_VALUE = Pattern(r"\b\d{4}-\d{2}-\d{2}\b|\bport\s+\d+|\bv?\d+\.\d+(?:\.\d+)+\b|(?:^|\s)[~/][\w.-]+/[\w./-]+"
                      r"|\bhttps?://\S+|\b[a-z][a-z0-9]+-\d+\b", caseless=True,
                      needs=lambda text: _DIGIT_OR_SLASH.search(text) is not None)
# Facts said in words: a date the work is held to ("The deadline is March 15", "our launch is set
# for Friday"; not someone else's launch), money it may spend ("The budget is $5,000 a month"), and
# (_PERSON) the people it answers to ("My manager Priya wants weekly reports"). The subject word comes
# first, the value a few words after.
_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?"
          r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)")
_FACT_SAID = Pattern(r"\b(?:deadline|due\s+date|(?:our|my)\s+(?:\w+\s+)?launch|launch\s+date|release\s+date|go-live"
                     r"|cutoff|ship\s+date)\b"
                     r"[^.;!?]{0,40}?\b(?:is|was|moved\s+to|set\s+for|falls\s+on|on|by)\s+(?:(?:this|next|the)\s+)?"
                     rf"(?:{_MONTH}\.?\s+\d{{1,2}}\b|\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH}\b"
                     r"|(?:mon|tues|wednes|thurs|fri|satur|sun)day\b|q[1-4]\b|end\s+of\s+(?:the\s+)?(?:week|month|quarter)\b)"
                     r"|\b(?:budget|spend(?:ing)?\s+(?:cap|limit)|cost\s+(?:cap|limit))\b[^.;!?]{0,30}?"
                     r"(?:[$€£]\s?\d|\b\d[\d,.]*\s?(?:k|usd|eur|dollars|euros)\b)", caseless=True)
_PERSON = re.compile(r"\b(?i:my\s+(?:manager|boss|lead|team\s+lead|cto|ceo|client|colleague|teammate|co-?founder"
                     r"|product\s+manager|pm|reviewer|mentor)(?:,|\s+is)?)\s+[A-Z][a-z]+\b"
                     # A name, not the first word of a thing ("my PM Jira board", "my client Friday call").
                     r"(?=\s*(?:[,.;:!]|$)|\s+(?:is|was|wants|wanted|said|says|asked|asks|thinks|needs|prefers|will"
                     r"|would|has|had|and|from|at|to|who|likes|expects|approved|reviews|runs|leads)\b)")
# A fact says something of its value: "2.0.85", "Source: https://...", "Certificate: PG-13" alone
# (pasted references, a log's stamp) are not one. Words of letters only, outside any URL or path.
_PROSE_WORD = re.compile(r"(?<![\w/.:-])[A-Za-z]+(?:['’][a-z]+)?(?![\w/.-]|:\S)")
# A named component at a version ("Node.js v18.15.0", "React Hook Form version 7.43.9", "pandas 2.0.3"):
# the tech stack with its versions, from what the user states. A capitalised name may run to three
# words; a lower-case one needs a "v" or a full x.y.z (prose says "about 2.5 seconds"). Linear: a
# name starts only where its word does, the version is taken whole (possessive) and may not run on
# into a longer token ("3.11rc1").
_CAPITALISED = r"[A-Z][\w+#-]*(?:\.[A-Za-z]+)?"
_VERSION = r"v?\d++(?:\.\d++)++(?![\w-]|\.\w)"
_COMPONENT = re.compile(
    rf"(?<![\w.@/#+-])(?:(?P<name>{_CAPITALISED}(?:[ \t]+{_CAPITALISED}){{0,2}})\s+(?P<version>{_VERSION})"
    rf"|(?P<lname>[a-z][\w-]*(?:\.js)?)\s+(?P<lversion>v\d++(?:\.\d++)++(?![\w-]|\.\w)"
    r"|\d++\.\d++(?:\.\d++)++(?![\w-]|\.\w)))")
# A well-known platform at a major version alone ("PostgreSQL 16", "Python 3", "Django 5", "Node.js 20"):
# prose says "Python 3" as often as "Python 3.12". Only these names ("Node 3" is a cluster's node, "Room
# 12" a room), one or two digits ("Python 101" is a course), no unit after it ("Redis 7 ms"), not beside
# words of the past or of a comparison (`_NOT_IN_USE`). It replaces another version of its platform
# only where the sentence moves to it ("we upgraded to PostgreSQL 16", `_MOVED_TO`); otherwise it only
# adds a platform the stack lacks: "my Python 2 scripts" does not undo "we run Python 3.12".
_MAJOR = re.compile(r"(?<![\w.@/#+-])(?P<name>python|postgres(?:ql)?|mysql|mariadb|node\.js|react|django|java|redis"
                    r"|mongodb|vue(?:\.js)?|angular|kafka|elasticsearch|typescript|php|ruby|rails|kotlin|ubuntu|debian"
                    r"|postgis|rabbitmq|celery|spring\s+boot|laravel|symfony|\.net|dotnet|next\.js)"
                    r"\s+(?P<version>v?\d{1,2})(?![\w:/%-]|[.,]\d)", re.IGNORECASE)
# Words around a bare major version that say it is not what runs: a comparison, the past, others' use.
_NOT_IN_USE = Pattern(r"\b(?:between|deciding|choosing|compar\w*|versus|vs|legacy|old|older|dropped|tutorials?"
                      r"|docs|end\s+of\s+life|eol|used\s+to|was|were)\b", caseless=True)
# "... upgraded the main database to " before a bare major version: the sentence moves to it.
_MOVED_TO = re.compile(r"\b(?:upgrad|updat|bump|mov|migrat|switch)\w*\s+(?:[\w.-]+\s+){0,8}?to\s+$", re.IGNORECASE)
# A move yet to be made: it does not change the stack's version.
_PLANNED = Pattern(r"\b(?:plan\w*|should|want\w*|roadmap|next|eventually|consider\w*|going\s+to|will|would|might"
                   r"|could|may|soon|later|someday|another\s+project|side\s+project|personal|my\s+laptop)\b",
                   caseless=True)
# One platform, several spellings: the stack keys them alike.
_ALIASES = {"postgres": "postgresql", "node": "node.js", "nodejs": "node.js", "vue": "vue.js", "vuejs": "vue.js",
            "dotnet": ".net", "nextjs": "next.js"}
# "upgraded Node.js from v18.15.0 to v20.1.0": the name once, two versions.
_UPGRADE = re.compile(rf"(?<![\w.@/#+-])(?P<name>{_CAPITALISED}|[a-z][\w-]*(?:\.js)?)\s+from\s+(?P<old>{_VERSION})"
                      rf"\s+to\s+(?P<new>{_VERSION})")
_COMPONENT_VERSION_WORD = re.compile(r"\b(version|ver\.?)\s+(?=v?\d)", _I)
_IPV4 = re.compile(r"v?\d{1,3}(?:\.\d{1,3}){3}")
_DATE = re.compile(r"v?(?:19|20)\d\d\.\d{1,2}\.\d{1,2}")
# A measure, not a version: "2.5 seconds", "16.0 GB", "1.5 million".
_UNIT = re.compile(r"\s*(?:%|percent|x\b|[kmgtp]?b\b|[kmg]?hz\b|k?g\b|kgs?\b|lbs?\b|ms\b|s\b|secs?\b|seconds?\b"
                   r"|mins?\b|minutes?\b|hours?\b|hrs?\b|h\b|days?\b|weeks?\b|months?\b|years?\b|million\b"
                   r"|billion\b|thousand\b|k\b|m\b|pm\b|am\b|inch(?:es)?\b|cm\b|mm\b|points?\b|times\b|stars?\b)", _I)
# Statements that do not say the project runs it: "we can't upgrade to Node.js v20", "if we move to
# Django 5.0.1", "Error: Node.js v20.1.0 is required".
_HYPOTHETICAL = Pattern(r"\b(?:not|never|no\s+longer|can't|cannot|won't|don't|doesn't|didn't|isn't|aren't"
                        r"|shouldn't|wouldn't|if|unless|whether|maybe|might|considering|consider|instead\s+of"
                        r"|error|requires?|required|expected|deprecated|unsupported|compatible)\b",
                        caseless=True)
# Words a name does not start with, nor holds: "Using Redis 7.0" names Redis; "to 2.0.1", "See
# Figure 1.2" and "Monday 3.30" name nothing.
_NOT_COMPONENTS = frozenset((
    "a", "an", "the", "to", "from", "of", "and", "or", "is", "was", "are", "be", "at", "on", "in", "by", "for",
    "with", "via", "into", "as", "using", "use", "uses", "used", "run", "runs", "running", "install", "installed",
    "upgrade", "upgraded", "upgrading", "downgrade", "downgraded", "bumped", "pinned", "latest", "new", "old",
    "current", "currently", "now", "still", "then", "only", "took", "takes", "wait", "between", "see", "follow",
    "my", "our", "your", "its", "their", "this", "that", "these", "we", "i", "it", "about", "approx",
    "approximately", "around", "roughly", "nearly", "over", "under", "than", "since", "until", "before", "after",
    "version", "release", "date", "deadline", "step", "phase", "sprint", "chapter", "section", "figure", "fig",
    "table", "page", "part", "task", "exercise", "problem", "question", "rule", "story", "room", "lesson", "unit",
    "appendix", "equation", "listing", "example", "item", "point", "level", "tier", "milestone", "scale", "score",
    "ratio", "rate", "factor", "value", "total", "cost", "costs", "price", "latency", "week", "day", "v", "x",
    "library", "package", "module", "plugin", "adapter", "driver", "client", "server", "tool", "framework",
    "image", "api", "usd", "eur", "gbp", "ram", "cpu", "gpu", "monday", "tuesday", "wednesday", "thursday",
    "friday", "saturday", "sunday", "january", "february", "march", "april", "may", "june", "july", "august",
    "september", "october", "november", "december", "q1", "q2", "q3", "q4",
))
# A lower-case word in -ing or -ed (not -eed) is prose, not a package, in "ranging from 0.1 to 0.9"
# (no upgrading verb before it) and "the planned v1.1.0 release" (a release word after it);
# "tracing 0.1.40", "the tracing 0.1.40 crate", "upgraded keyring from 23.13.1 to 24.3.1" are packages.
_VERB_FORM = re.compile(r"[a-z]{2,40}(?:ing|[^e]ed)")
_DETERMINER = re.compile(r"\b(?:the|a|an|this|that|our|my|its|their|your)\s+$", re.IGNORECASE)
_UPGRADED = re.compile(r"\b(?:upgrad|updat|bump|mov|migrat|pinn?|downgrad)\w*\s+$", re.IGNORECASE)
_RELEASE_WORD = re.compile(r"\s+(?:release|version|build|milestone|launch|rollout|update)\b", re.IGNORECASE)
_NAMED = re.compile(r"[a-z][A-Z]|[.+#-]")  # "OAuth", "PyTorch", "Node.js", "Flask-Limiter": a product's spelling
MAX_STACK = 48  # active components a ledger keeps (the oldest go first), ahead of other extracted items
MAX_COMPONENTS = 16  # per message: what one message names beyond that is a list, not a stack

_SUPERSEDE = re.compile(r"\binstead\s+of\s+([\w.+#-]+)|\bswitch(?:ed|ing)?\s+from\s+([\w.+#-]+)\s+to\b"
                        r"|\b(?:upgrad|migrat|mov)(?:e|ed|es|ing)\s+(?:[\w ]{1,40}?\s)?from\s+([\w.+#-]+)\s+to\b"
                        r"|\bno\s+longer\s+(?:use|using|need)\s+([\w.+#-]+)|\breplac(?:e|ed|ing)\s+([\w.+#-]+)\s+with\b"
                        r"|\bdrop(?:ped|ping)?\s+([\w.+#-]+)\s+in\s+favou?r\s+of\b", _I)
_BOLD = re.compile(r"(?<![\w*])\*\*(?=[^\s*])([^*\n]{1,300}?)(?<=[^\s*])\*\*(?![\w*])")
# The closing mark of a bold label whose opening one went with the sentence's leading marks:
# "Final decision:** PostgreSQL 16".
_LEAD_BOLD = re.compile(r"^([^*\n]{1,60}?:)\*\*(?=\s|$)|^([^*\n]{1,60}?)\*\*(?=:)|^([A-Za-z][\w'-]{0,39})\*\*(?=\s)")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])|\n+")
_CODE = re.compile(r"```.*?(?:```|$)", re.DOTALL)


# What the extractors read of one message and of one sentence: every pattern is linear, and these
# bound the work a fold does per message (and what a summary line or cache entry can hold),
# whatever a client sends. Far above real prose (the dev sets' longest sentence is 14 K).
# A message stating more than MAX_STATEMENTS things floods the ledger anyway (it holds MAX_ITEMS);
# each costs a comparison with every active item of its kind.
MAX_MESSAGE_CHARS = 131_072
MAX_SENTENCE_CHARS = 16_384
MAX_SENTENCES = 1_024
MAX_STATEMENTS = 64
# A user message with this much prose (its code aside) is mostly material pasted in (a chapter, a
# contract, a log, a web page): of its sentences, only those in the user's own voice state the user's
# project. In both development sets' user messages over 2,000 characters, the others were 157 of 186
# items on LongMemEval ("you have to crawl before you walk", "petitioners must complete ...", "npm
# ERR! ...") and 1 of 13 on the coding set (a `git clone` line).
PASTED_CHARS = 2_000
# "I" not as a numeral ("Part I", "Form I-129"); lower-case before a verb ("i prefer", not "for i in"
# nor "i.e."); "us" lower-case only ("US applicants").
_NUMERAL_BEFORE = ("part", "chapter", "phase", "type", "war", "book", "volume", "act", "article", "form", "stage",
                   "title", "class", "level", "grade", "tier", "section")
_VOICE = re.compile(r"(?<![\w'’ʼ-])(?:" + "".join(f"(?<!{w} )" for w in _NUMERAL_BEFORE)
                    + r"(?:(?-i:I)(?:['’ʼ](?:m|ve|d|ll))?|(?-i:i)(?:['’ʼ](?:m|ve|d|ll)|(?=\s+(?:am|was|have|had|think"
                    r"|want|need|prefer|like|use|don['’]t|can|will|would|just|also|really|always|never|must)\b)))"
                    r"|me|my|we|we['’ʼ](?:re|ve|ll|d)|our|(?-i:us)|let['’ʼ]s|please)"
                    r"(?![\w'’ʼ-])", re.IGNORECASE)
# An order opening its sentence is the user's whoever's words follow: "Never add new dependencies."
_ORDER_OPENING = re.compile(r"[\W_]{0,3}(?:always|never|don['’]t|do\s+not|make\s+sure|avoid)\b", re.IGNORECASE)


def sentences(text: str) -> tuple[str, ...]:
    """Prose sentences of a message; fenced code is left out (it restates, it does not decide)."""
    # A fold splits each aged message twice, for summary lines and for ledger items: the last
    # few are remembered, unless long (tool output, which only the summary reads).
    return _split_sentences(text) if len(text) > 16_384 else _remembered_sentences(text)


def own_sentences(role: str, said: tuple[str, ...]) -> tuple[str, ...]:
    """Of a message's sentences (`sentences` of its text, a leading date stamp aside: "[2023/05/20
    (Sat) 07:47] ..."), those that can state its author's project: all of them, but of a user message
    whose prose (its code aside) runs past PASTED_CHARS only those in the user's own voice or giving
    an order."""
    if role == "user" and sum(map(len, said)) > PASTED_CHARS:
        return tuple(s for s in said if _VOICE.search(s) or _ORDER_OPENING.match(s))
    return said


def agreed(turn: Message) -> bool:
    """Whether `turn` is the user's short assent to a proposal."""
    return (turn.role == "user" and len(turn.text) <= 200
            and _ASSENT.fullmatch(STAMP_RE.sub("", turn.text, count=1)) is not None)


def _untagged(sentence: str) -> str:
    """`sentence` without a trailing reference tag ("... for the cache. ->-> 9,30"): numbers after a
    run of arrows point into some other record; they state nothing."""
    at = sentence.rfind("->")
    if at < 0 or sentence[at + 2:].strip(" \t,0123456789") != "" or not any(c.isdigit() for c in sentence[at:]):
        return sentence
    end = at
    while at >= 2 and sentence[at - 2: at] == "->":
        at -= 2
    return sentence[:at].rstrip() if at < end else sentence  # "a -> 5" is prose; "->-> 5" is a tag


def _split_sentences(text: str) -> tuple[str, ...]:
    text = _CODE.sub("\n", text[:MAX_MESSAGE_CHARS])
    out = []
    for s in _SENTENCE.split(text):
        s = _untagged(s[:MAX_SENTENCE_CHARS]).strip(" \t-*#>")
        if len(s) >= 3:
            out.append(s)
            if len(out) == MAX_SENTENCES:
                break
    return tuple(out)


_remembered_sentences = lru_cache(maxsize=64)(_split_sentences)


# Not statements of anything durable, whatever words they hold: a question ("so how do I make it
# always return a list?"), a greeting, a complaint ("I've been staring at this code for hours"), an
# error report ("this throws an error saying the value must be an integer"), an illustration ("For
# example, let's use AWS Secrets Manager": what an answer shows, not what the project chose).
_NOT_STATE = Pattern(
    r"\?[\s\"')\]]*$"
    r"|^(?:hmm+|um+|uh+|huh|wait|so|ok|okay|well|and|but|oh)?[\s,]*(?:how|what|why|when|where|which|who|whom|whose"
    r"|can(?!['’]t|not)|could|would|should|shall|is|are|am|was|were|do(?!\s+not\b|n['’]t)|does|did|will"
    r"|any\s+(?:idea|ideas|tips|thoughts)|is\s+there|are\s+there)\b"
    r"|^(?:hi|hello|hey|thanks|thank\s+you|good\s+(?:morning|afternoon|evening)|cheers|bye|hmm+|ugh|argh)\b"
    r"|^(?:so|and|but|now)?[\s,]*(?:i(?:'d|\s+would)\s+like\s+to\s+know|i(?:'m|\s+am|\s+was)\s+wondering"
    r"|i\s+wonder)\b"
    r"|\b(?:frustrat\w*|annoying|annoyed|staring\s+at|for\s+hours|driving\s+me|i(?:'m|\s+am)\s+(?:stuck|lost"
    r"|confused|tired|exhausted)|makes\s+no\s+sense|doesn't\s+make\s+sense|sick\s+of|tired\s+of"
    r"|(?:hate|hated)\s+(?:this|it|that|when)|so\s+(?:confusing|annoying)|no\s+idea\s+why|i\s+give\s+up"
    r"|pulling\s+my\s+hair|wasted|not\s+sure|i(?:'m|\s+am)\s+(?:getting|having|seeing|running\s+into|worried)"
    r"|i\s+keep\s+(?:getting|seeing|running)"
    r"|(?:throws|throwing|raises|raising|gives|giving|returns|returning|get|gets|got)\s+(?:me\s+)?an?\s+"
    r"(?:error|exception)|error\s+(?:saying|says|that\s+says|message\s+saying))\b"
    r"|^(?:so|and|but|now|however)?[\s,]*(?:for\s+(?:example|instance|this\s+example)|e\.g\.)(?![\w.])",
    caseless=True)
# "I've never used X": the user's history (a fact), not a rule they set.
_NEVER_DONE = Pattern(r"\bi(?:'ve|\s+have)\s+never\b|\bi\s+never\s+(?:used|tried|did|had|worked|set|configured)\b",
                      caseless=True)


# Quoted text (an error message, a name in quotes) states nothing of the speaker's: "Cannot read
# property 'text' of undefined" is no constraint. Bounded spans: linear.
_QUOTED = re.compile(r"\"[^\"\n]{0,300}\"|`[^`\n]{0,300}`|“[^”\n]{0,300}”")


def _unquoted(sentence: str) -> str:
    return _QUOTED.sub(" ", sentence) if ('"' in sentence or "`" in sentence or "“" in sentence) else sentence


def decision_at(sentence: str) -> int:
    """Where a decision sentence's deciding words start ("... and I've decided to use X": at "I've")."""
    m = _DECISION.exact.search(sentence)
    return m.start() if m is not None else 0


def is_statement(sentence: str) -> bool:
    """Not a question, a greeting or a complaint (which state never holds)."""
    return not _NOT_STATE.search(sentence, ascii_lower(sentence))


def is_rule(sentence: str, low: str | None = None) -> bool:
    """Whether a sentence sets a constraint: words that oblige, outside quotes, figures of speech and
    error messages, and not what the user never did. `low`: ascii_lower(sentence), when known."""
    lowered = low if low is not None else sentence.lower()
    if any(w in lowered for w in ("error", "exception", "err!", "traceback")) and _ERROR_TEXT.search(sentence):
        return False
    if _NEVER_DONE.search(sentence, low):
        return False
    text = _NOT_RULE.sub(" ", _unquoted(sentence))
    low_text = ascii_lower(text)
    return _CONSTRAINT.search(text, low_text) or (_BOUND.search(text, low_text) and _NEED.search(text, low_text))


def is_preference(sentence: str, low: str | None = None) -> bool:
    """Whether a sentence states a taste ("I prefer small pull requests", "I'd like the answers in
    bullet points"), not only a request of the moment ("I'd like to know more about X"). `low`:
    ascii_lower(sentence), when known."""
    if not _PREFERENCE.search(sentence, low):
        return False
    text = _AS_LIKED.sub(" ", _REACTION.sub(" ", _REQUEST.sub(" ", sentence)))
    return text == sentence or _PREFERENCE.search(text, ascii_lower(text))


def classify(sentence: str, role: str, *, joint: bool = False) -> Kind | None:
    """Which ledger kind a sentence states, if any. Users set goals, rules and tastes; both sides decide.
    `joint`: an assistant's message answering the user's assent ("OK, let's do that"), whose "we'll
    use X" states what the two agreed."""
    user = role == "user"
    sentence = sentence.replace("’", "'").replace("ʼ", "'")  # the patterns spell contractions with "'"
    low = ascii_lower(sentence)
    if _NOT_STATE.search(sentence, low):
        return None
    if user and _GOAL.search(sentence, low):
        return "goal"
    if _DECISION.search(sentence, low) and (user or joint or _MADE.search(sentence, low)):
        return "decisions"
    if user and _switches(sentence):
        return "decisions"
    if user and _NAME.search(sentence):
        return "facts"
    if user and is_rule(sentence, low):
        return "constraints"
    if user and is_preference(sentence, low):
        return "preferences"
    if (user and _TASK.search(sentence, low)) or _TODO.search(sentence):
        return "open_tasks"
    if user and _STACK.search(sentence, low) and _TECH.search(sentence, low):
        return "tech_stack"
    if user and _ARCH.search(sentence, low):
        return "architecture"
    if user and (_FACT_SAID.search(sentence, low) or _PERSON.search(sentence)):
        return "facts"
    if user and _FACT_VALUE.search(sentence, low) and len(_PROSE_WORD.findall(sentence, 0, 2000)) >= 2:
        return "facts"
    return None


def unbold(sentence: str) -> str:
    """`sentence` without an answer's bold marks, which are layout, not its words: pairs at word edges,
    and a label's closing mark whose opening one went with the sentence's leading marks ("Final
    decision:** PostgreSQL"). "2**16", "x**2", "**kwargs" and "node_modules/**" keep their stars."""
    return _LEAD_BOLD.sub(r"\1\2\3", _BOLD.sub(r"\1", sentence)) if "**" in sentence else sentence


def _clip(text: str, words: int = 60) -> str:
    return clip_words(text, words)


def clip_words(text: str, words: int = 60, chars: int = 2_000) -> str:
    """`text` cut to its first `words` words, and to `chars` characters (a word can be any length)."""
    parts = text.split()
    if len(parts) > words:
        text = " ".join(parts[:words]) + " …"
    return text if len(text) <= chars else text[:chars] + " …"


def components(sentence: str) -> Iterator[tuple[str, str, bool]]:
    """The (name, version, replaces) a statement says the project uses: ("Express", "v4.18.2", True)
    from "I've set up Express version 4.18.2". Nothing from a question, a negation or a hypothesis,
    nor from quoted text (an error message names what it requires, not what runs). `replaces`: whether
    it may replace another version of its name in the stack; a bare major version ("PostgreSQL 16")
    only where the sentence moves to it ("upgraded to ...")."""
    if not is_statement(sentence) or _HYPOTHETICAL.search(sentence, ascii_lower(sentence)):
        return
    text = _COMPONENT_VERSION_WORD.sub("v", _unquoted(sentence))
    found: list[tuple[int, str, str, bool]] = []
    for m in _UPGRADE.finditer(text):
        if not _VERB_FORM.fullmatch(m["name"]) or _UPGRADED.search(text, max(0, m.start() - 16), m.start()):
            found += [(m.start(), m["name"], m["old"], True), (m.start() + 1, m["name"], m["new"], True)]
    for m in _MAJOR.finditer(text):
        if _UNIT.match(text, m.end()) or text[max(0, m.start() - 5): m.start()].lower().endswith("from "):
            continue
        moved = _MOVED_TO.search(text, max(0, m.start() - 96), m.start()) is not None
        near = text[max(0, m.start() - 24): m.end() + 24]
        if moved and _PLANNED.search(text, ascii_lower(text)):
            moved = False  # "we plan to upgrade to PostgreSQL 17", "upgrading to 17 is on the roadmap"
        elif not moved and _NOT_IN_USE.search(near, ascii_lower(near)):
            continue
        found.append((m.start(), m["name"], m["version"], moved))
    for m in _COMPONENT.finditer(text):
        if text[max(0, m.start() - 5): m.start()].lower().endswith("from "):
            continue  # "moved to Vue 3.3.4 from Vue 2.7.14": the one left behind
        capitalised = m["name"] is not None
        version = m["version"] or m["lversion"]
        if (not capitalised and _VERB_FORM.fullmatch(m["lname"]) and _RELEASE_WORD.match(text, m.end())
                and _DETERMINER.search(text, max(0, m.start() - 8), m.start())):
            continue  # "the planned v1.1.0 release"
        words = (m["name"] or m["lname"]).split()
        while words and words[0].lower() in _NOT_COMPONENTS:
            words.pop(0)
        if not words or any(w.lower() in _NOT_COMPONENTS for w in words) or _UNIT.match(text, m.end()):
            continue
        name = " ".join(words)
        if capitalised and version.count(".") == 1 and not version.startswith("v") and not (
                _NAMED.search(name[1:]) or _TECH.search(name, ascii_lower(name))):
            continue  # "Took 2.5", "UK 2.5": a bare x.y after a capitalised word is a number
        found.append((m.start(), name, version, True))
    for _, name, version, replaces in sorted(found):
        if 1 < len(name) <= 40 and len(version) <= 24 and not _IPV4.fullmatch(version) \
                and not _DATE.fullmatch(version) and name.lower() not in _NOT_COMPONENTS:
            yield name, version, replaces


_STACK_ITEM = re.compile(r"(?P<name>.{1,40}) (?P<version>v?\d+(?:\.\d+)+)")


def _version_key(item: Item) -> tuple[str, str] | None:
    """(name, version digits) of a component, or of an edited item written like one."""
    if item.component is not None:
        version = item.text.rpartition(" ")[2]
        return item.component, version.removeprefix("v")
    m = _STACK_ITEM.fullmatch(item.text) if item.edited else None
    return (m["name"].lower(), m["version"].removeprefix("v")) if m else None


def _add_component(ledger: Ledger, name: str, version: str, *, source: int, time: str | None,
                   replaces: bool = True) -> Item | None:
    """A component at a version: nothing when the stack has it at that version already, or an edit
    names it (an edit wins); the same name at another version is replaced and kept as history
    ("Node.js v20.1.0 (since …; was: Node.js v18.15.0)")."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    digits = version.removeprefix("v")
    replaced: list[Item] = []
    refined: list[Item] = []
    for old in ledger.active("tech_stack"):
        old_key = _version_key(old)
        if old_key is not None and _ALIASES.get(old_key[0], old_key[0]) == key:
            # A bare major version ("Python 2", `_MAJOR`) only adds a platform the stack lacks, unless
            # the sentence moves to it: said in passing, it is as often another project's, or the
            # past. "React 18" after "React 18.2.0" says less, even in a move. "PostgreSQL 16.2" after
            # "PostgreSQL 16" says more of the same: no change of version to keep as history, nor a
            # new date.
            if old.edited or old_key[1] == digits or not replaces or old_key[1].startswith(digits + "."):
                return None
            (refined if digits.startswith(old_key[1] + ".") else replaced).append(old)
    item = Item(id=_next_id(ledger), text=f"{name} {version}", source=source, time=time, component=key)
    for old in refined:
        old.superseded_by = item.id
        item.was, item.time = list(old.was), old.time
    for old in replaced:
        old.superseded_by = item.id
        record_replaced(item, old)
    ledger.tech_stack.append(item)
    stack = [i for i in ledger.active("tech_stack") if is_component(i)]
    if len(stack) > MAX_STACK:  # the least recently added go
        oldest = {id(i) for i in stack[: len(stack) - MAX_STACK]}
        ledger.tech_stack = [i for i in ledger.tech_stack if id(i) not in oldest]
    _prune(ledger)
    return item


def is_component(item: Item) -> bool:
    """A stack item extracted as a component at a version (not an edit, not a sentence)."""
    return item.component is not None


def stated(found: Iterable[str], role: str, joint: bool = False) -> Iterator[tuple[str, Kind]]:
    """The sentences of `found` that state something, with their kind (`joint`: see classify)."""
    for sentence in found:
        kind = classify(sentence, role, joint=joint)
        if kind is not None:
            yield sentence, kind
            # What the user agreed to is the reply's first decision; the rest walks through it.
            joint = joint and kind != "decisions"


def extract(ledger: Ledger, turns: Sequence[Message], start: int, *, now: str | None = None) -> Ledger:
    """`ledger` updated from messages [start, start+len(turns)) by patterns alone.

    A copy when an item was added; `ledger` itself when none was, which is most folds (the aged
    messages state nothing durable, or only what the ledger already holds): no copy is made.
    """
    # Classifying does not depend on the ledger: find the statements first, copy only if any.
    # Tool output and system text are not statements of the people working.
    found = []
    for i, turn in enumerate(turns):
        if turn.role not in ("user", "assistant"):
            continue
        whole = sentences(STAMP_RE.sub("", turn.text, count=1))
        joint = turn.role == "assistant" and i > 0 and agreed(turns[i - 1])
        statements = list(islice(stated(own_sentences(turn.role, whole), turn.role, joint), MAX_STATEMENTS))
        # The user's own stack, with versions (an assistant's suggestion is not yet the project's), from
        # every sentence: "Stack: Node.js v20.1.0, ..." in a long spec is the user's in any voice.
        named = (list(islice((c for s in whole for c in components(s)), MAX_COMPONENTS))
                 if turn.role == "user" else [])
        if statements or named:
            found.append((start + i, turn.time or now, statements, named))
    if not found:
        return ledger
    out = copy_ledger(ledger)
    added = False
    for source, time, statements, named in found:  # message by message: a later one wins
        for name, version, replaces in named:
            added = _add_component(out, name, version, source=source, time=time, replaces=replaces) is not None or added
        for sentence, kind in statements:
            item = add_item(out, kind, _clip(unbold(sentence)), source=source, time=time)
            if item is None:
                continue
            added = True
            for m in _SUPERSEDE.finditer(sentence):
                # "instead of PostgreSQL." names PostgreSQL: the sentence's own stop is not the name's.
                term = next(g for g in m.groups() if g).rstrip(".-")
                # "instead of this.", "instead of them", "instead of using ...": a word any statement may
                # hold names nothing; a move names a product, a capitalised name or a word with a digit.
                if len(term) > 1 and (term[0].isupper() or _product(term) or any(c.isdigit() for c in term)):
                    supersede_mentions(out, term, item.id)
    return out if added else ledger


# -- rendering --------------------------------------------------------------------------------

# Items of each kind the state shows before any kind shows more: on a long conversation nine standing
# orders and the stack filled the whole budget, and no decision was left in it.
FIRST_ROUND = 2


def render(ledger: Ledger, budget_tokens: int, count: Callable[[str], int]) -> str:
    """The ledger as text within `budget_tokens`: most important kinds first, newest first within a kind.

    Chosen in two rounds: the newest FIRST_ROUND items of every kind (and the stack's components
    line), in kind order, then the rest in the same order. Deterministic (same ledger, same bytes):
    the block sits in the provider's cached prefix. Superseded items are left out. Items that do not
    fit are skipped, smaller later ones may fit.
    """
    if budget_tokens <= 0:
        return ""
    used = 0
    chosen: dict[Kind, list[str]] = {}
    named_line: dict[Kind, str] = {}
    rest: list[tuple[Kind, str]] = []
    for kind in RENDER_ORDER:
        items = sorted(ledger.active(kind), key=lambda i: (i.source if i.source is not None else 1 << 60,
                                                           int(i.id[1:]) if i.id[1:].isdigit() else 0),
                       reverse=True)
        if not items:
            continue
        header_cost = count(f"{TITLES[kind]}:") + 1
        named = [i for i in items if is_component(i)]
        if named:  # components on one line: "- Node.js v20.11.1 (since …; was: …), Express v4.18.2, …"
            items = [i for i in items if not is_component(i)]
            shown: list[str] = []
            for item in named:
                if budget_tokens - used < 4:
                    break
                part = f"{item.text}{history(item)}"
                extra = count(part) + (1 if shown else 2 + header_cost)
                if used + extra <= budget_tokens:
                    shown.append(part)
                    used += extra
            if shown:
                named_line[kind] = "- " + ", ".join(shown)
        lines = [f"- {item.text}{history(item)}" for item in items]
        for n, line in enumerate(lines):
            if n >= FIRST_ROUND:
                rest.append((kind, line))
                continue
            used += _take(chosen, named_line, kind, line, budget_tokens - used, header_cost, count)
    for kind, line in rest:
        if budget_tokens - used < 4:
            break  # nothing more fits: no need to count the rest
        used += _take(chosen, named_line, kind, line, budget_tokens - used, count(f"{TITLES[kind]}:") + 1, count)
    out: list[str] = []
    for kind in RENDER_ORDER:
        body = ([named_line[kind]] if kind in named_line else []) + chosen.get(kind, [])
        if body:
            out += [f"{TITLES[kind]}:", *body]
    return "\n".join(out)


def _take(chosen: dict[Kind, list[str]], named_line: dict[Kind, str], kind: Kind, line: str, room: int,
          header_cost: int, count: Callable[[str], int]) -> int:
    """Adds `line` to its kind's section when it fits `room` (with the section's header if it has
    none yet); the tokens it took."""
    if room < 4:
        return 0
    extra = count(line) + 1 + (0 if chosen.get(kind) or kind in named_line else header_cost)
    if extra > room:
        return 0
    chosen.setdefault(kind, []).append(line)
    return extra


def history(item: Item) -> str:
    """What a changed item replaced, and since when: " (since 2024-03-02; was: SQLite; before that: …)"."""
    if not item.was:
        return ""
    parts = [f"since {item.time[:10]}"] if item.time else []
    parts.append(f"was: {item.was[0]}")
    parts += [f"before that: {w}" for w in item.was[1:]]
    return " (" + "; ".join(parts) + ")"


def mark(ledger: Ledger, conversation: str) -> int:
    """Messages of `conversation` the ledger has read."""
    return ledger.marks.get(conversation, 0)


def marked(ledger: Ledger, conversation: str, upto: int) -> Ledger:
    """`ledger` (a copy when it changes) having read `conversation` up to message `upto`."""
    if ledger.marks.get(conversation, 0) >= upto:
        return ledger
    out = copy_ledger(ledger)
    marks = {k: v for k, v in out.marks.items() if k != conversation}
    marks[conversation] = upto
    while len(marks) > MAX_MARKS:
        marks.pop(next(iter(marks)))
    out.marks = marks
    return out


def unmarked(ledger: Ledger, conversation: str) -> Ledger:
    """`ledger` (a copy when it changes) having read nothing of `conversation` (it was deleted: a
    conversation created again under its id is read from its first message)."""
    if conversation not in ledger.marks:
        return ledger
    out = copy_ledger(ledger)
    out.marks = {k: v for k, v in out.marks.items() if k != conversation}
    return out


def forget_from(ledger: Ledger, conversation: str, at: int) -> Ledger | None:
    """A copy of a conversation's own ledger without what extraction took from its messages `at`
    onwards (a branch moved them aside): those items go, the items they had replaced are current
    again, and the read mark goes back to `at`; None when nothing changes. Items set through the API
    stay. Not for a project's shared ledger: its sources are positions in several conversations."""
    gone = {i.id for _, i in ledger.all_items() if not i.edited and i.source is not None and i.source >= at}
    if not gone and ledger.marks.get(conversation, 0) <= at:
        return None
    out = copy_ledger(ledger)
    # What replaced each dropped item, through any chain of dropped ones: an item they had replaced
    # takes that over (an edit that cleared or replaced the dropped item still wins), else is current.
    after = {i.id: i.superseded_by for _, i in out.all_items() if i.id in gone}

    def successor(by: str | None) -> str | None:
        seen: set[str] = set()
        while by in gone and by not in seen:
            seen.add(by)
            by = after[by]
        return None if by in gone else by

    for kind in KINDS:
        kept = [i for i in out.items(kind) if i.id not in gone]
        for item in kept:
            if item.superseded_by in gone:
                item.superseded_by = successor(item.superseded_by)
        setattr(out, kind, kept)
    if out.marks.get(conversation, 0) > at:
        out.marks[conversation] = at
    return out


def load(data: dict | None) -> Ledger:
    return Ledger.model_validate(data) if data else Ledger()
