"""Retrieval layer: which earlier messages to forward, verbatim and whole, for the newest user turn.

A long request is rewritten to system + state + summary + recent window, plus a block of "relevant
earlier excerpts" just before the newest user turn. This module picks those excerpts: an incremental,
pure-Python lexical index over one conversation's messages (by position), searched with the newest
user message under a token budget. No I/O; the caller owns the message texts and the rendering.

Ranking (why each step is there, with what it gained on the development set, is in
docs/retrieval.md; `scripts/tune_retrieval.py` measures it):

1. BM25 (k1 1.2, b 0.75) per message over lower-cased words with stop words dropped and a light
   suffix stemmer, a leading "[2023/08/11 (Fri) 15:58]" stamp stripped so dates don't match as words.
2. Query words that only say "this is a memory question" (remind, previous, conversation,
   mentioned) are dropped: they match every chatty message.
3. Neighbours: a message also scores 0.3 x the scores of the messages right before and after it in
   the same session: a question and its answer sit side by side and the answer often does not
   repeat the question's words.
4. Knapsack fill: messages are taken greedily by score per token, not by score: evidence is
   mostly short user messages, while a long answer matching on a few words eats the budget.
5. Whole sessions: each session is scored as one BM25 document; every message of a session above
   the median session gets 0.35 x (its excess / the best excess) x the best message score. Facts on
   one topic are spread over a session's messages. Relative to the median so that a prior lifting
   every session alike (a one-session conversation) changes nothing.
6. Time: "two months ago", "last Tuesday", "in March", "March 3rd" are resolved against the
   question's time (`query_time`, else a leading stamp in the query, else the latest indexed
   message) and, at indexing, against each message's own time. Messages whose day or resolved
   event days fall in the question's span get 0.5 x the best score (skipped when the span covers
   most of the conversation).
7. Recent messages: a query of at most 3 content words ("and the second one?") takes the 8 rarest
   indexed words of the last two `recent` texts at weight 0.2.
8. Reach back (`reach_back`, given the window's first position): nothing is recalled when a message of
   the recent window matches the question at least `reach_back` times as well (raw BM25) as the best
   earlier one: the question is about what the window already holds, and new excerpts would only be
   written to the provider's cache to be read past. Questions that name a time, or ask what was said
   (steps 10 and 11's phrasing in a sentence ending in "?" or opening with "list", "tell me", ...),
   always reach back.
9. Openings: a question about the start ("when I first described my setup", "the initial
   deadline", "originally") gives the messages of the first session 0.3 x the best score: in a
   project's conversation the start is where the setup, the first plan and the deadlines are said.
10. Speaker: a question about what one side said ("the order in which I brought up", "what did you
   recommend") doubles the scores of that side's messages.
11. Order: a question about the order things were raised in ("the order in which I brought up", "in
   order") adds to each user message sharing its words its own BM25 score (at most the best) x the
   share of the message's words that the two messages before it in its session did not have: where
   a subject was raised, not where it was worked through.

Cost: `add` is O(message length), up to the 128,000 characters it reads of a longer one. Postings are
per-term `bytearray`s of native uint32 `position << 8 | tf` (tf capped at 255, read through
`memoryview.cast`), a bare int while a term has one posting. Not `array('I')`: arrays are objects
the cyclic GC tracks, and its full collections walked every term of every cached conversation on the
event loop; a dict of strings to ints and bytearrays is not tracked at all. Terms are interned so
cached conversations share their strings. `search` reads a question's two ends only and ranks by at
most 64 of its words, the rarest; it walks the postings of those that rank (not those in more than
half the messages), reads per-session frequencies cached per queried term (brought up to date from
new postings only), and is O(messages) for the time prior only when the question names a time.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
import struct
import sys
import unicodedata
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta

# Native uint32, the item format memoryview.cast("I") reads back.
_ONE = struct.Struct("=I").pack
_PAIR = struct.Struct("=II").pack
# A `_sess_tf` entry's own objects (dict slot, tuple, int, bytes header), besides its packed bytes.
SESS_TF_BYTES = 160

__all__ = ["Excerpt", "RankingParams", "RetrievalIndex"]


@dataclass(slots=True)  # built per hit per search: not frozen, whose __init__ costs 3x
class Excerpt:
    index: int  # position of the message in the conversation (0-based)
    score: float


@dataclass(frozen=True, slots=True)
class RankingParams:
    """Tuning knobs; the defaults are the measured method (see the module docstring)."""

    k1: float = 1.2
    b: float = 0.75
    stop_words: bool = True
    stem: bool = True
    strip_stamp: bool = True
    meta_stop: bool = True
    neighbour_weight: float = 0.3
    session_weight: float = 0.35
    session_k1: float = 1.2
    time_weight: float = 0.5
    # A question about the start ("when I first described my setup", "the initial deadline") favours
    # the conversation's first session by this share of the best score.
    opening_weight: float = 0.3
    # A question about what one side said ("the order in which I brought up", "what did you
    # recommend") multiplies the scores of that side's messages by 1 + this.
    speaker_weight: float = 1.0
    # A question about the order things were raised in adds to a user message sharing its words this
    # share of its own score (at most the best one) times the share of its words that were new where
    # it was said.
    survey_weight: float = 1.0
    cost_alpha: float = 1.0
    recent_weight: float = 0.2
    recent_terms: int = 8
    recent_texts: int = 2
    # Only a query this short (in distinct content words) is expanded: longer ones carry their subject.
    recent_max_query_words: int = 3
    # A gap longer than this (or a message opening with a date stamp) starts a new session.
    session_gap_s: float = 1800.0
    # Hybrid search (`dense` given): "sum" adds to the lexical score dense_weight x the best lexical
    # score x the cosine's excess over the dense list's last entry, relative to the best cosine's;
    # "rrf" scores dense_weight / (rrf_k + rank) per list a message is ranked in (lexical after its
    # priors, dense by cosine). Reciprocal ranks are nearly flat down a list, so the fill's
    # per-token value then prefers the shortest messages: "sum" kept more evidence.
    fusion: str = "sum"
    dense_weight: float = 0.5
    rrf_k: float = 60.0

    @classmethod
    def plain(cls) -> RankingParams:
        """Plain BM25 on raw words, greedy by score: the baseline the refinements are measured against."""
        return cls(
            stop_words=False, stem=False, strip_stamp=False, meta_stop=False, neighbour_weight=0.0,
            session_weight=0.0, time_weight=0.0, opening_weight=0.0, cost_alpha=0.0, recent_weight=0.0,
            speaker_weight=0.0, survey_weight=0.0,
        )


# --------------------------------------------------------------------------------------------- text

_WORD_RE = re.compile(r"[a-z0-9]+")
# Text with other scripts: words of any script's letters and digits, accents folded ("München" and
# "Munchen" meet), and Chinese and Japanese (written without spaces) as overlapping character pairs.
_UNICODE_WORD_RE = re.compile(r"[^\W_]+")
_MARKS_RE = re.compile(r"[\u0300-\u036f]+")  # combining accents, as NFKD splits them off
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
# "[2023/08/11 (Fri) 15:58] " as LongMemEval-style clients stamp a session's first message.
STAMP_RE = re.compile(
    r"^\s*\[(\d{4})[/-](\d{1,2})[/-](\d{1,2})(?:\s*\(\w+\))?(?:[ T](\d{1,2}):(\d{2})(?::\d{2})?)?\]\s*"
)

_STOP = frozenset(
    {
        "a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any",
        "are", "aren", "as", "at", "be", "because", "been", "before", "being", "below", "between", "both",
        "but", "by", "can", "cannot", "could", "couldn", "d", "did", "didn", "do", "does", "doesn",
        "doing", "don", "dont", "down", "during", "each", "few", "for", "from", "further", "get", "got",
        "had", "hadn", "has", "hasn", "have", "haven", "having", "he", "her", "here", "hers", "herself",
        "him", "himself", "his", "how", "i", "id", "if", "im", "in", "into", "is", "isn", "it", "its",
        "itself", "ive", "just", "let", "ll", "m", "me", "more", "most", "mustn", "my", "myself", "no",
        "nor", "not", "now", "o", "of", "off", "on", "once", "only", "or", "other", "our", "ours",
        "ourselves", "out", "over", "own", "re", "really", "s", "same", "shan", "she", "should",
        "shouldn", "so", "some", "such", "t", "than", "that", "thats", "the", "their", "theirs", "them",
        "themselves", "then", "there", "these", "they", "this", "those", "through", "to", "too", "under",
        "until", "up", "ve", "very", "was", "wasn", "we", "were", "weren", "what", "when", "where",
        "which", "while", "who", "whom", "why", "will", "with", "won", "would", "wouldn", "you", "youre",
        "your", "yours", "yourself", "yourselves"
    }
)
# "when I first described my setup", "the initial deadline", "at the start": the conversation's opening.
_OPENING = re.compile(r"\b(?:first|initial(?:ly)?|original(?:ly)?|outset|started|began)\b"
                      r"|\b(?:at|in)\s+the\s+(?:start|beginning)\b|\bto\s+start\s+(?:my|our|the|this)\b",
                      re.IGNORECASE)
# "the order in which I brought up", "list them in order": a question about the order of what was raised.
_SURVEY = re.compile(r"\b(?:in\s+(?:the\s+)?(?:order|sequence)(?!\s+(?:to|for|that)\b)|order\s+in\s+which"
                     r"|chronolog\w*)\b",
                     re.IGNORECASE)
# A sentence's end: ".", "!" or "?" before a space or the text's end ("Node.js" goes on), or a line break.
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
# An order to recall, opening a sentence that ends without a question mark.
_RECALL_ORDER = re.compile(r"\s*(?:please\s+|can\s+you\s+|could\s+you\s+)?(?:list|walk|remind|recap|tell|summari[sz]e"
                           r"|give|show|describe|go\s+over)\b", re.IGNORECASE)


def _asks_what_was_said(phrasing: str) -> bool:
    """Does the question ask what was said ("when did I bring up", "what did you recommend", "list in
    order what I raised")? Only in a sentence that asks: one ending in "?", or opening with an order to
    recall. "The ones you mentioned were great." and "I've been told to use X." ask nothing."""
    ends = [(m.start(), m.end()) for m in _SENTENCE_END.finditer(phrasing)]  # once: linear in the phrasing
    starts = [e for _, e in ends]
    for pattern in (_USER_SAID, _ASSISTANT_SAID, _SURVEY):
        for m in pattern.finditer(phrasing):
            i = bisect.bisect_left(ends, (m.end(), 0))
            if i < len(ends) and phrasing[ends[i][0]] == "?":
                return True
            j = bisect.bisect_right(starts, m.start())
            if _RECALL_ORDER.match(phrasing, starts[j - 1] if j else 0):
                return True
    return False


_MAX_TERMS = 64  # distinct words a question is searched by, the rarest in the conversation
# Characters the request path indexes at each end of a longer message: 128,000 in all (about 32K
# tokens, which only a history of about 400K tokens has the excerpt budget to quote).
INDEX_END = 64_000
_QUERY_END = 4000  # characters searched at each end of a longer question (and of the recent texts)
_PHRASING = 1000  # characters at each end of a question that say what kind of question it is
# Who the question asks about: what the user said ("the order in which I brought up", "did I
# mention") or what the assistant did ("you recommended", "what did you suggest"). Past tense or a
# did-question only: "can you list", "thank you for sharing", "I want you to explain" ask for an
# answer now. One optional word between: linear in the question.
_PAST = (r"(?:mentioned|brought|asked|said|told|shared|described|discussed|talked|raised|listed|explained"
         r"|recommended|suggested|gave|given|provided|proposed|covered)")
_BASE = (r"(?:mention|bring|ask|say|tell|share|describe|discuss|talk|raise|list|explain|recommend|suggest"
         r"|give|provide|propose|cover)")
_HAVE = r"(?:['’](?:ve|d)|\s+have|\s+had)?"
_USER_SAID = re.compile(rf"\bI{_HAVE}\s+(?:\w+\s+)?{_PAST}\b|\bdid\s+I\s+(?:\w+\s+)?{_BASE}\b", re.IGNORECASE)
_ASSISTANT_SAID = re.compile(rf"\byou{_HAVE}\s+(?:\w+\s+)?{_PAST}\b|\b(?:did|have|had)\s+you\s+(?:\w+\s+)?{_BASE}\b",
                             re.IGNORECASE)
_ROLE = {"user": 1, "assistant": 2}  # `_roles` codes; 0: any other (tool, system)


def _ends(text: str, n: int) -> str:
    """`text` if it is at most 2n characters, else its first and last n, cut between words."""
    if len(text) <= 2 * n:
        return text
    head, tail = text[:n], text[-n:]
    cut = head.rfind(" ", n - 100)
    head = head[:cut] if cut > 0 else head
    cut = tail.find(" ", 0, 100)
    return head + "\n" + (tail[cut + 1:] if cut >= 0 else tail)


# Words that only say "this is a question about our history"; they match every chatty message.
_META = frozenset(
    {
        "remind", "reminding", "remember", "recall", "previous", "previously", "earlier", "conversation",
        "conversations", "chat", "chats", "discussed", "discuss", "talked", "mentioned", "mention",
        "told", "tell", "wondering", "going", "back", "looking", "wanted", "follow"
    }
)


@functools.lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
    """Light suffix stripping (plurals, -ing, -ed, final e, doubled consonant) applied alike to text and
    query, so collect/collecting, complete/completed, take/taking, add/added meet."""
    w = word
    if len(w) <= 3 or w.isdigit():
        return sys.intern(w)
    if w.endswith(("ies", "ied")) and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("sses") or w.endswith(("ches", "shes", "xes", "zes")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    elif len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
    elif len(w) > 4 and w.endswith("ed"):
        w = w[:-2]
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    if len(w) > 3 and w[-1] == w[-2] and w[-1] not in "lsz" and not w[-1].isdigit():
        w = w[:-1]  # running -> run, added -> ad like add -> ad
    return sys.intern(w)


def _words(text: str, p: RankingParams, *, query: bool = False) -> list[str]:
    low = text.lower().replace("'", "").replace("’", "")
    words = _WORD_RE.findall(low) if low.isascii() else _unicode_words(low)
    if p.stop_words:
        words = [w for w in words if w not in _STOP]
    if query and p.meta_stop:
        words = [w for w in words if w not in _META]
    if p.stem:
        return [stem(w) for w in words]
    return [sys.intern(w) for w in words]


def _unicode_words(low: str) -> list[str]:
    # Recomposed after the accents go: a Japanese voiced kana (デ) is its base and a mark in NFKD.
    folded = unicodedata.normalize("NFC", _MARKS_RE.sub("", unicodedata.normalize("NFKD", low)))
    words: list[str] = []
    for word in _UNICODE_WORD_RE.findall(folded):
        if not _CJK_RE.search(word):
            words.append(word)
            continue
        at = 0
        for run in _CJK_RE.finditer(word):
            if run.start() > at:
                words.append(word[at:run.start()])
            han = run.group()
            words += [han] if len(han) == 1 else [han[i:i + 2] for i in range(len(han) - 1)]
            at = run.end()
        if at < len(word):
            words.append(word[at:])
    return words


# --------------------------------------------------------------------------------------------- time

_NUMBERS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "a few": 3, "a couple of": 2,
    "couple of": 2, "several": 4,
}
_UNIT_DAYS = {"day": 1.0, "week": 7.0, "month": 30.44, "year": 365.25}
_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        (
            "january", "february", "march", "april", "may", "june", "july", "august", "september",
            "october", "november", "december",
        )
    )
}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS["sept"] = 9
_WEEKDAYS = {
    d: i for i, d in enumerate(("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"))
}

_NUM = (
    r"(\d{1,3}|an?|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|a few|(?:a )?couple of"
    r"|several)"
)
_MONTH = (
    r"(jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sept?(?:ember)?"
    r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_WEEKDAY = r"(monday|tuesday|wednesday|thursday|friday|saturday|sunday)"
# Every alternative starts at a word boundary with one of these characters: tested once up front,
# most positions fail before any alternative is tried (a third faster on the dev set's texts).
_TIME_RE = re.compile(
    r"\b(?=[\dacdefijlmnopsty])(?:"
    rf"{_NUM} (day|week|month|year)s? ago\b"  # 1-2
    r"|(the day before yesterday|yesterday|today|tonight|this morning|this afternoon|last night)\b"  # 3
    r"|(?:last|past|previous) (week|weekend|month|year)\b"  # 4
    rf"|(?:last|this past) {_WEEKDAY}\b"  # 5
    rf"|{_MONTH}\.? (\d{{1,2}})(?:st|nd|rd|th)?\b(?!:)"  # 6-7
    rf"|(\d{{1,2}})(?:st|nd|rd|th)? of {_MONTH}\b"  # 8-9
    rf"|(?:in|during|since|early|late|mid|of|last) {_MONTH}\b(?! \d)"  # 10
    r"|(\d{4})[/-](\d{1,2})[/-](\d{1,2})\b"  # 11-13
    r")"
)

_Span = tuple[int, int]  # inclusive range of date ordinals


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None


def _month_span(year: int, month: int) -> _Span:
    first = date(year, month, 1)
    nxt = date(year + (month == 12), month % 12 + 1, 1)
    return first.toordinal(), nxt.toordinal() - 1


def _past_date(ref: date, month: int, day: int) -> date | None:
    """The latest month/day on or before `ref` (a date mentioned without a year is in the past)."""
    for year in (ref.year, ref.year - 1):
        try:
            d = date(year, month, day)
        except ValueError:
            return None
        if d <= ref + timedelta(days=1):
            return d
    return None


def _time_spans(text: str, ref: date) -> list[_Span]:
    """Date spans that the time expressions of `text`, said on `ref`, point to; none at the calendar's
    ends (a question dated in the year 9999 has no "day after" nor a next month to bound a span)."""
    try:
        return _spans(text, ref)
    except (ValueError, OverflowError):
        return []


def _spans(text: str, ref: date) -> list[_Span]:
    spans: list[_Span] = []
    r = ref.toordinal()
    for m in _TIME_RE.finditer(text.lower()):
        g = m.groups()
        if g[0]:
            n = int(g[0]) if g[0].isdigit() else _NUMBERS.get(g[0], 1)
            back = n * _UNIT_DAYS[g[1]]
            # The further back, the vaguer: "two months ago" is some day within a few weeks of it.
            tol = 0 if g[1] == "day" else max(2, round(0.25 * back))
            spans.append((r - round(back) - tol, r - round(back) + tol))
        elif g[2]:
            back = {"the day before yesterday": 2, "yesterday": 1, "last night": 1}.get(g[2], 0)
            spans.append((r - back, r - back))
        elif g[3]:
            unit = g[3]
            if unit == "week":
                spans.append((r - 13, r - 1))
            elif unit == "weekend":
                sat = r - ((ref.weekday() - 5) % 7 or 7)
                spans.append((sat, sat + 1))
            elif unit == "month":
                y, mo = (ref.year, ref.month - 1) if ref.month > 1 else (ref.year - 1, 12)
                spans.append(_month_span(y, mo))
            else:
                spans.append((date(ref.year - 1, 1, 1).toordinal(), date(ref.year - 1, 12, 31).toordinal()))
        elif g[4]:
            back = (ref.weekday() - _WEEKDAYS[g[4]]) % 7 or 7
            spans.append((r - back, r - back))
        elif g[5] or g[8]:
            month = _MONTHS[(g[5] or g[8])[:4] if (g[5] or g[8]).startswith("sept") else (g[5] or g[8])[:3]]
            d = _past_date(ref, month, int(g[6] or g[7]))
            if d is not None:
                spans.append((d.toordinal(), d.toordinal()))
        elif g[9]:
            month = _MONTHS[g[9][:4] if g[9].startswith("sept") else g[9][:3]]
            year = ref.year if month <= ref.month else ref.year - 1
            spans.append(_month_span(year, month))
        elif g[10]:
            try:
                d = date(int(g[10]), int(g[11]), int(g[12]))
            except ValueError:
                continue
            spans.append((d.toordinal(), d.toordinal()))
    return spans


# -------------------------------------------------------------------------------------------- index

_EPOCH = datetime(1970, 1, 1)
_EPOCH_DAY = _EPOCH.toordinal()


def _wall_seconds(when: datetime) -> float:
    # Wall-clock seconds, offsets ignored: a conversation's times share one zone in practice, and
    # naive and aware values must still compare without raising.
    return (when.replace(tzinfo=None) - _EPOCH).total_seconds()


def _day(seconds: float) -> int:
    return _EPOCH_DAY + int(seconds // 86400)


class RetrievalIndex:
    """Incremental lexical index over one conversation's messages, by position."""

    __slots__ = (
        "_cost", "_events", "_index_end", "_last_secs", "_lengths", "_novelty", "_p", "_postings",
        "_roles", "_secs", "_sess_len", "_sess_start", "_sess_tf", "_session", "_tokens", "_total_len", "side_bytes",
    )

    def __init__(self, params: RankingParams | None = None, *, index_end: int | None = INDEX_END) -> None:
        """`index_end`: characters indexed at each end of a longer message (None: all of it, for an
        index built off the event loop)."""
        self._p = params or RankingParams()
        self._index_end = index_end
        # term -> postings `position << 8 | tf`, ascending; a bare int while the term has one posting,
        # since ~40% of a conversation's words occur once and an array costs 80 bytes of overhead.
        self._postings: dict[str, int | bytearray] = {}
        # Query term -> (postings consumed, `session << 32 | tf summed over the session's messages`
        # ascending): the session prior's per-session frequencies, brought up to date from the new
        # postings when the term is queried again, instead of summing every posting per query.
        # Only queried terms with several postings: a copy for every term would double the index.
        self._sess_tf: dict[str, tuple[int, bytes]] = {}  # packed array("Q"), bytes for the GC's sake
        self.side_bytes = 0  # what `_sess_tf` holds, roughly: searches grow it (recall.py counts it)
        self._lengths = array("I")  # indexed words per message (BM25 length)
        self._tokens = array("I")  # caller's token count per message (budgeting)
        self._cost = array("d")  # max(tokens, 1) ** cost_alpha: the fill's divisor, computed once
        self._session = array("I")  # session number per message
        self._roles = bytearray()  # 1: the user's message, 2: the assistant's, 0: other
        self._secs = array("d")  # wall-clock seconds of the message's time, NaN if unknown
        self._last_secs = math.nan  # latest known time: the reference for session gaps
        self._sess_start = array("I")  # first position of each session
        self._sess_len = array("I")  # indexed words per session
        self._events: dict[int, tuple[_Span, ...]] = {}  # position -> dates its text talks about
        # Per message, 0-255: the share of a user message's words that the two messages before it in
        # its session did not have (a new subject raised), 0 for other messages.
        self._novelty = bytearray()
        self._total_len = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, index: int, role: str, text: str, time: str | None, tokens: int) -> int:
        """Index the message at `index` (must equal len(self): appends only). Returns how many
        distinct terms it posted (what it grew the index by)."""
        if index != len(self._lengths):
            raise ValueError(f"add({index}) on an index of {len(self._lengths)} messages: appends only")
        p = self._p
        when = _parse_time(time)
        stamped = False
        if p.strip_stamp and text:
            m = STAMP_RE.match(text)
            if m:
                stamped = True
                text = text[m.end():]
                if when is None:
                    when = _stamp_time(m)
        # Indexing runs on the request path (the request after a message is stored): a pasted
        # megabyte is read at its ends, and found by the words there only.
        if self._index_end is not None:
            text = _ends(text, self._index_end)
        terms = _words(text, p) if text else []
        tf: dict[str, int] = {}
        for t in terms:
            tf[t] = tf.get(t, 0) + 1

        secs = _wall_seconds(when) if when is not None else math.nan
        new_session = index == 0 or stamped
        if not new_session and secs == secs:
            prev = self._last_secs
            if prev == prev:
                gap = secs - prev
                new_session = gap > p.session_gap_s or gap < 0
        if new_session:
            self._sess_start.append(index)
            self._sess_len.append(0)
        self._session.append(len(self._sess_start) - 1)

        postings = self._postings
        novelty = 0
        if role == "user" and tf:
            # A word was in one of the two messages before this one in its session exactly when its
            # latest posting (they ascend) is at or after the first of them.
            floor = max(index - 2, self._sess_start[-1]) << 8
            seen = 0
            for t in tf:
                plist = postings.get(t)
                if plist is not None and (plist if isinstance(plist, int) else _last(plist)) >= floor:
                    seen += 1
            novelty = round(255 * (len(tf) - seen) / len(tf))
        self._novelty.append(novelty)
        for t, f in tf.items():
            packed = index << 8 | min(f, 255)
            plist = postings.get(t)
            if plist is None:
                postings[t] = packed
            elif isinstance(plist, int):
                postings[t] = bytearray(_PAIR(plist, packed))
            else:
                plist += _ONE(packed)
        self._sess_len[-1] += len(terms)
        self._secs.append(secs)
        if secs == secs:
            self._last_secs = secs
        if when is not None and p.time_weight > 0 and text:
            spans = _time_spans(text, when.date())
            if spans:
                self._events[index] = tuple(spans)
        self._lengths.append(len(terms))
        self._roles.append(_ROLE.get(role, 0))
        self._tokens.append(max(0, tokens))
        self._cost.append(max(tokens, 1) ** p.cost_alpha)
        self._total_len += len(terms)
        return len(tf)

    def truncate(self, length: int) -> None:
        """Forget positions >= length (the conversation branched)."""
        length = max(0, length)
        if length >= len(self._lengths):
            return
        floor = length << 8
        # Postings are ascending by position, so the forgotten ones are each list's tail.
        postings = self._postings
        for t in list(postings):
            plist = postings[t]
            if isinstance(plist, int):
                if plist >= floor:
                    del postings[t]
                continue
            view = memoryview(plist).cast("I")
            keep = len(view)
            while keep and view[keep - 1] >= floor:
                keep -= 1
            first = view[0] if keep else 0
            view.release()  # a bytearray with a live view cannot shrink
            if keep <= 1:
                if keep:
                    postings[t] = first
                else:
                    del postings[t]
            else:
                del plist[keep * 4:]
        self._total_len -= sum(self._lengths[length:])
        del self._lengths[length:]
        del self._tokens[length:]
        del self._secs[length:]
        self._last_secs = next((t for t in reversed(self._secs) if t == t), math.nan)
        for i in [i for i in self._events if i >= length]:
            del self._events[i]
        del self._cost[length:]
        del self._roles[length:]
        del self._novelty[length:]
        del self._session[length:]
        nsess = self._session[-1] + 1 if length else 0
        del self._sess_start[nsess:]
        del self._sess_len[nsess:]
        if nsess:
            start = self._sess_start[-1]
            self._sess_len[-1] = sum(self._lengths[start:length])
        self._sess_tf.clear()  # rare (a branch): rebuilt from the postings as terms are queried
        self.side_bytes = 0

    def search(
        self,
        query: str,
        *,
        budget_tokens: int,
        exclude: Callable[[int], bool] | set[int] | frozenset[int] | range = frozenset(),
        recent: Sequence[str] = (),
        query_time: str | None = None,
        dense: Sequence[tuple[int, float]] = (),
        window_start: int | None = None,
        reach_back: float = 0.0,
        min_relevance: float = 0.0,
    ) -> list[Excerpt]:
        """Best-matching messages, greedily filling budget_tokens with WHOLE messages (a message whose
        tokens exceed the remaining budget is skipped, smaller ones may still fit); returned in
        conversation order (ascending index). `exclude`: positions never returned (the window, messages
        already forwarded). `recent`: texts of the latest turns for optional query expansion.
        `query_time`: ISO time of the question if known. `dense`: (position, cosine) of the messages
        closest to the query by embedding, best first (gateway/embed.py), fused with the lexical ranks.
        `window_start`, `reach_back`: the recent window's first position and step 8 of the ranking.
        `min_relevance`: messages scoring under this share of the best candidate are left out even
        when the budget has room (smaller requests; questions that need many weak matches lose some)."""
        n = len(self._lengths)
        if n == 0 or budget_tokens <= 0 or not (query or dense):
            return []
        p = self._p
        when = _parse_time(query_time)
        if p.strip_stamp:
            m = STAMP_RE.match(query)
            if m:
                query = query[m.end():]
                when = when or _stamp_time(m)
        # A long message (a pasted file) is searched by its two ends, where its question is: scoring
        # costs a pass over each distinct word's postings, and this runs on the event loop.
        query = _ends(query, _QUERY_END)
        postings = self._postings
        weights: dict[str, float] = dict.fromkeys(_words(query, p, query=True), 1.0)
        # What kind of question it is shows in its phrasing, at either end of a long message (a
        # question after pasted code): the patterns read those ends only, whatever the message's size.
        phrasing = _ends(query, _PHRASING)
        ordered = p.survey_weight > 0 and _SURVEY.search(phrasing) is not None
        short = 0 < len(weights) <= p.recent_max_query_words
        if len(weights) > _MAX_TERMS:
            # A message of many words (code, a pasted page) ranks by its rarest ones: they carry the
            # ranking, and each word costs a pass over its postings.
            known = sorted((t for t in weights if t in postings), key=lambda t: _df(postings[t]))
            weights = dict.fromkeys(known[:_MAX_TERMS], 1.0)
        asked = dict(weights)  # the question's own words (step 8 judges on these)
        if p.recent_weight > 0 and recent and short:
            extra = {
                t
                for text in recent[-p.recent_texts:]
                for t in _words(_ends(text, _QUERY_END), p, query=True)
                if t not in weights and t in postings
            }
            for t in sorted(extra, key=lambda t: (_df(postings[t]), t))[: p.recent_terms]:
                weights[t] = p.recent_weight
        spans: list[_Span] = []
        if p.time_weight > 0:
            if when is not None:
                spans = _time_spans(query, when.date())
            else:
                last = self._last_secs
                if last == last:
                    spans = _time_spans(query, date.fromordinal(_day(last)))
        if not weights and not spans and not dense:
            return []

        scores = self._bm25(weights, n)
        raw = scores if p.neighbour_weight > 0 else dict(scores)  # (the priors add to `scores` in place)
        toks = self._tokens
        if (reach_back > 0 and window_start is not None and not spans and scores
                and not _asks_what_was_said(phrasing)):
            # On the question's own words: the expansion's come from the window's last texts.
            own = scores if len(asked) == len(weights) else self._bm25(asked, n)
            skip = exclude if callable(exclude) else exclude.__contains__
            in_window = max((v for d, v in own.items() if d >= window_start), default=0.0)
            # Only what the budget can quote reaches back: a pasted file past it would recall its weaker rivals.
            earlier = max((v for d, v in own.items() if d < window_start and not skip(d) and toks[d] <= budget_tokens),
                          default=0.0)
            # No earlier message shares a word with it: only the embeddings can say whether it reaches back.
            if in_window > 0 and in_window >= reach_back * earlier and (earlier > 0 or not dense):
                return []
        if p.neighbour_weight > 0 and scores:
            scores = self._spread_to_neighbours(scores, n)
        # The priors are scaled by the best score a message the budget could quote has: a pasted file
        # too long to quote would otherwise set a scale that no quotable message's score shows.
        top = max((v for d, v in scores.items() if toks[d] <= budget_tokens), default=0.0)
        if not top and min_relevance > 0 and not dense:
            # No quotable message shares a word with the question: the priors alone would decide what
            # passes, and min_relevance asks for matches.
            return []
        top = top or 1.0
        if p.session_weight > 0 and scores:
            self._add_session_prior(weights, scores, n, top)
        if spans:
            self._add_time_prior(spans, scores, n, top)
        # (Not when the first session is most of the conversation: it would say nothing.)
        if (p.opening_weight > 0 and len(self._sess_start) > 1 and 2 * self._sess_start[1] <= n
                and _OPENING.search(phrasing) is not None):
            bonus = p.opening_weight * top
            get = scores.get
            for d in range(self._sess_start[1]):
                scores[d] = get(d, 0.0) + bonus
        if ordered and raw:
            # "The order in which I brought up ..." is answered by the messages where the user raised
            # each subject: user messages on its words, by how new their words were where they were said.
            # Scaled by the message's own match: a message sharing only "list" or "order" with the
            # question gains no more than its own small score.
            bonus = p.survey_weight / 255
            novelty, roles = self._novelty, self._roles
            get = scores.get
            for d, v in raw.items():
                if roles[d] == 1 and novelty[d]:
                    scores[d] = get(d, 0.0) + bonus * novelty[d] * min(v, top)
        if p.speaker_weight > 0 and scores:
            asked_user = _USER_SAID.search(phrasing) is not None
            if asked_user != (_ASSISTANT_SAID.search(phrasing) is not None):
                side, boost = (1 if asked_user else 2), 1.0 + p.speaker_weight
                roles = self._roles
                scores = {d: v * boost if roles[d] == side else v for d, v in scores.items()}
        if dense:
            scores = self._fuse(scores, dense, exclude, budget_tokens)
        return self._fill(scores, budget_tokens, exclude, min_relevance)

    # ---------------------------------------------------------------------------------- internals

    def _bm25(self, weights: dict[str, float], n: int) -> dict[int, float]:
        p = self._p
        k1, b = p.k1, p.b
        lengths = self._lengths
        avgdl = self._total_len / n or 1.0
        # Per-document BM25 length factor, folded so the inner loop is one multiply-add.
        c0, c1 = k1 * (1.0 - b), k1 * b / avgdl
        scores: dict[int, float] = {}
        get = scores.get
        found = [(w, e) for t, w in weights.items() if (e := self._postings.get(t)) is not None]
        # A term in more than half the messages barely ranks (idf <= ln 2) yet costs a pass over
        # most of the index: skip it whenever the query has a rarer term to rank by.
        if any(_df(e) <= n // 2 for _, e in found):
            found = [f for f in found if _df(f[1]) <= n // 2]
        for w, entry in found:
            plist: Sequence[int] = (entry,) if isinstance(entry, int) else memoryview(entry).cast("I")
            df = len(plist)
            idf = w * math.log(1.0 + (n - df + 0.5) / (df + 0.5)) * (k1 + 1.0)
            for packed in plist:
                d = packed >> 8
                f = packed & 255
                scores[d] = get(d, 0.0) + idf * f / (f + c0 + c1 * lengths[d])
        return scores

    def _spread_to_neighbours(self, base: dict[int, float], n: int) -> dict[int, float]:
        session = self._session
        nw = self._p.neighbour_weight
        scores = dict(base)
        get = scores.get
        for d, s in base.items():
            sd = session[d]
            if d > 0 and session[d - 1] == sd:
                scores[d - 1] = get(d - 1, 0.0) + nw * s
            if d + 1 < n and session[d + 1] == sd:
                scores[d + 1] = get(d + 1, 0.0) + nw * s
        return scores

    def _add_session_prior(
        self, weights: dict[str, float], scores: dict[int, float], n: int, top: float
    ) -> None:
        nsess = len(self._sess_start)
        if nsess <= 1:
            return  # one session is its own median: no session stands out
        k1 = self._p.session_k1
        sess_scores: dict[int, float] = {}
        for t, w in weights.items():
            plist = self._session_tf(t)
            if not plist:
                continue
            sdf = len(plist)
            idf = w * math.log(1.0 + (nsess - sdf + 0.5) / (sdf + 0.5))
            for packed in plist:
                s = packed >> 32
                f = packed & 0xFFFFFFFF
                sess_scores[s] = sess_scores.get(s, 0.0) + idf * f * (k1 + 1.0) / (f + k1)
        # Relative to a typical session (the median, usually 0): a prior that lifts every session alike,
        # as in a one-session conversation, would only let short off-topic turns win on density.
        values = sorted(sess_scores.values())
        mid = len(values) - nsess + (nsess - 1) // 2  # median over all sessions, unmatched ones being 0
        typical = values[mid] if mid >= 0 else 0.0
        best = values[-1] - typical
        if best <= 0:
            return
        scale = self._p.session_weight * top / best
        starts = self._sess_start
        get = scores.get
        for s, v in sess_scores.items():
            if v <= typical:
                continue
            bonus = scale * (v - typical)
            end = starts[s + 1] if s + 1 < nsess else n
            for d in range(starts[s], end):
                scores[d] = get(d, 0.0) + bonus

    def _session_tf(self, term: str) -> Sequence[int]:
        """`session << 32 | tf` per session containing `term`, ascending (message tfs as capped in postings)."""
        entry = self._postings.get(term)
        if entry is None:
            return ()
        session = self._session
        if isinstance(entry, int):
            return (session[entry >> 8] << 32 | (entry & 255),)
        done, kept = self._sess_tf.get(term) or (0, None)
        sess = array("Q")
        if kept is not None:
            sess.frombytes(kept)
        view = memoryview(entry).cast("I")
        if done < len(view):
            for i in range(done, len(view)):
                packed = view[i]
                s = session[packed >> 8]
                if sess and sess[-1] >> 32 == s:
                    sess[-1] += packed & 255
                else:
                    sess.append(s << 32 | (packed & 255))
            packed_tf = sess.tobytes()
            self._sess_tf[term] = (len(view), packed_tf)
            self.side_bytes += len(packed_tf) + (SESS_TF_BYTES if kept is None else -len(kept))
        return sess

    def _add_time_prior(self, spans: list[_Span], scores: dict[int, float], n: int, top: float) -> None:
        secs = self._secs
        events = self._events
        hits: list[int] = []
        for d in range(n):
            t = secs[d]
            day = _day(t) if t == t else -1
            if any(a <= day <= b for a, b in spans) or (
                d in events and any(a <= eb and ea <= b for ea, eb in events[d] for a, b in spans)
            ):
                hits.append(d)
        # A span that covers most of the conversation says nothing about which message to pick.
        if not hits or len(hits) * 2 > n:
            return
        bonus = self._p.time_weight * top
        get = scores.get
        for d in hits:
            scores[d] = get(d, 0.0) + bonus

    def _fuse(
        self,
        scores: dict[int, float],
        dense: Sequence[tuple[int, float]],
        exclude: Callable[[int], bool] | set[int] | frozenset[int] | range,
        budget: int,
    ) -> dict[int, float]:
        p = self._p
        n = len(self._lengths)
        dense = [(d, c) for d, c in dense if 0 <= d < n]
        if not dense:
            return scores
        if p.fusion == "sum":
            toks = self._tokens  # (the scale of what the budget can quote, as for the priors)
            top = max((v for d, v in scores.items() if toks[d] <= budget), default=0.0) or 1.0
            floor = dense[-1][1]
            span = dense[0][1] - floor
            fused = dict(scores)
            if span > 0:
                scale = p.dense_weight * top / span
                for d, c in dense:
                    fused[d] = fused.get(d, 0.0) + scale * (c - floor)
            return fused
        excluded = exclude if callable(exclude) else exclude.__contains__
        k = p.rrf_k
        lexical = sorted((d for d in scores if not excluded(d)), key=scores.__getitem__, reverse=True)
        fused = {d: 1.0 / (k + r) for r, d in enumerate(lexical, 1)}
        get = fused.get
        for r, (d, _) in enumerate(dense, 1):
            fused[d] = get(d, 0.0) + p.dense_weight / (k + r)
        return fused

    def _fill(
        self,
        scores: dict[int, float],
        budget: int,
        exclude: Callable[[int], bool] | set[int] | frozenset[int] | range,
        min_relevance: float = 0.0,
    ) -> list[Excerpt]:
        excluded = exclude if callable(exclude) else exclude.__contains__
        toks = self._tokens
        if min_relevance > 0 and scores:
            best = max((v for d, v in scores.items() if not excluded(d) and toks[d] <= budget), default=0.0)
            scores = {d: v for d, v in scores.items() if v >= min_relevance * best}
        if self._p.cost_alpha > 0:
            # Value per token: a long answer matching on a few words should not crowd out ten short turns.
            div = self._cost
            value = {d: s / div[d] for d, s in scores.items()}
            ranked = sorted(value, key=value.__getitem__, reverse=True)
        else:
            ranked = sorted(scores, key=scores.__getitem__, reverse=True)
        left = budget
        out: list[Excerpt] = []
        for d in ranked:
            cost = toks[d]
            if cost > left or excluded(d):
                continue
            left -= cost
            out.append(Excerpt(d, scores[d]))
            if left <= 0:
                break
        out.sort(key=lambda e: e.index)
        return out


def _last(plist: bytearray) -> int:
    """The latest posting of a term's list."""
    return int.from_bytes(plist[-4:], sys.byteorder)


def _df(plist: int | bytearray) -> int:
    return 1 if isinstance(plist, int) else len(plist) >> 2


def _stamp_time(m: re.Match[str]) -> datetime | None:
    try:
        return datetime(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0), int(m[5] or 0))
    except ValueError:
        return None
