"""Retrieval layer (draft v1: tunable)."""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Excerpt:
    index: int
    score: float


@dataclass(frozen=True, slots=True)
class RankingParams:
    k1: float = 1.2
    b: float = 0.75
    stop_words: bool = True
    stem: bool = True
    strip_stamp: bool = True
    neighbour_weight: float = 0.3
    neighbour_mode: str = "sum"  # sum | max
    session_weight: float = 0.0
    session_k1: float = 1.2
    session_b: float = 0.75
    user_boost: float = 1.0
    cost_alpha: float = 0.0
    recent_weight: float = 0.0
    recent_terms: int = 0
    meta_stop: bool = False
    session_gap: float = 1800.0

    @classmethod
    def plain(cls) -> RankingParams:
        return cls(stop_words=False, stem=False, strip_stamp=False, neighbour_weight=0.0)


_TOKEN_RE = re.compile(r"[a-z0-9]+")
_STAMP_RE = re.compile(r"^\s*\[(\d{4})[/-](\d{1,2})[/-](\d{1,2})(?: \(\w+\))?(?: (\d{1,2}):(\d{2}))?\]\s*")

_STOP = frozenset(
    """a about above after again against all am an and any are aren as at be because been before being
below between both but by can cannot could couldn did didn do does doesn doing don down during each few
for from further had hadn has hasn have haven having he her here hers herself him himself his how i if in
into is isn it its itself just let ll m me more most mustn my myself no nor not now o of off on once only
or other our ours ourselves out over own re s same shan she should shouldn so some such t than that the
their theirs them themselves then there these they this those through to too under until up ve very was
wasn we were weren what when where which while who whom why will with won would wouldn you your yours
yourself yourselves also really like get got im ive id youre dont thats its""".split()
)
# Words that say "this is a memory question" rather than what it is about.
_META = frozenset(
    """remind reminding remember recall previous previously earlier conversation conversations chat chats
discussed discuss talked mentioned mention told tell wondering going back looking wanted follow""".split()
)


def _stem(w: str) -> str:
    n = len(w)
    if n <= 3 or w.isdigit():
        return w
    if w.endswith("ies") and n > 4:
        w = w[:-3] + "y"
    elif w.endswith("sses"):
        w = w[:-2]
    elif w.endswith(("ches", "shes", "xes", "zes")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    n = len(w)
    if n > 5 and w.endswith("ing"):
        w = w[:-3]
    elif n > 4 and w.endswith("ed"):
        w = w[:-2]
    else:
        return w
    if len(w) > 2 and w[-1] == w[-2] and w[-1] not in "lsz":
        w = w[:-1]
    return w


def _analyse(text: str, p: RankingParams, query: bool = False) -> list[str]:
    words = _TOKEN_RE.findall(text.lower().replace("'", ""))
    if p.stop_words:
        words = [w for w in words if w not in _STOP]
    if query and p.meta_stop:
        words = [w for w in words if w not in _META]
    if p.stem:
        words = [_stem(w) for w in words]
    return words


def _parse_time(s: str | None) -> float:
    if not s:
        return math.nan
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return math.nan


class RetrievalIndex:
    def __init__(self, params: RankingParams | None = None) -> None:
        self._p = params or RankingParams()
        self._postings: dict[str, array[int]] = {}
        self._lengths = array("I")
        self._tokens = array("I")
        self._roles = bytearray()
        self._times = array("d")
        self._session = array("I")
        self._total_len = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, index: int, role: str, text: str, time: str | None, tokens: int) -> None:
        if index != len(self._lengths):
            raise ValueError(f"add({index}) on an index of {len(self._lengths)} messages")
        p = self._p
        stamped = False
        if p.strip_stamp:
            m = _STAMP_RE.match(text)
            if m:
                stamped = True
                text = text[m.end():]
        terms = _analyse(text, p)
        tf: dict[str, int] = {}
        for t in terms:
            tf[t] = tf.get(t, 0) + 1
        for t, n in tf.items():
            plist = self._postings.get(t)
            if plist is None:
                plist = self._postings[t] = array("I")
            plist.append(index << 8 | min(n, 255))
        ts = _parse_time(time)
        if index == 0:
            sess = 0
        else:
            prev = self._times[-1]
            gap = ts - prev
            new = stamped or (gap == gap and (gap > p.session_gap or gap < 0))
            sess = self._session[-1] + (1 if new else 0)
        self._lengths.append(len(terms))
        self._tokens.append(max(0, tokens))
        self._roles.append(0 if role == "user" else 1)
        self._times.append(ts)
        self._session.append(sess)
        self._total_len += len(terms)

    def truncate(self, length: int) -> None:
        if length >= len(self._lengths):
            return
        length = max(0, length)
        floor = length << 8
        for t in list(self._postings):
            plist = self._postings[t]
            while plist and plist[-1] >= floor:
                plist.pop()
            if not plist:
                del self._postings[t]
        self._total_len -= sum(self._lengths[length:])
        del self._lengths[length:]
        del self._tokens[length:]
        del self._roles[length:]
        del self._times[length:]
        del self._session[length:]

    def search(
        self,
        query: str,
        *,
        budget_tokens: int,
        exclude: Callable[[int], bool] | set[int] | range = frozenset(),  # type: ignore[assignment]
        recent: Sequence[str] = (),
        query_time: str | None = None,
    ) -> list[Excerpt]:
        n = len(self._lengths)
        if n == 0 or budget_tokens <= 0:
            return []
        p = self._p
        if p.strip_stamp:
            m = _STAMP_RE.match(query)
            if m:
                query = query[m.end():]
        qw: dict[str, float] = {}
        for t in _analyse(query, p, query=True):
            qw[t] = 1.0
        if not qw:
            return []
        if p.recent_weight > 0 and recent:
            extra: dict[str, int] = {}
            for r in recent:
                for t in _analyse(r, p, query=True):
                    if t not in qw and t in self._postings:
                        extra[t] = extra.get(t, 0) + 1
            cand = sorted(extra, key=lambda t: len(self._postings[t]))[: p.recent_terms]
            for t in cand:
                qw[t] = p.recent_weight
        avgdl = self._total_len / n or 1.0
        scores: dict[int, float] = {}
        lengths = self._lengths
        session = self._session
        k1, b = p.k1, p.b
        use_sess = p.session_weight > 0
        sess_scores: dict[int, float] = {}
        nsess = session[-1] + 1
        for t, w in qw.items():
            plist = self._postings.get(t)
            if not plist:
                continue
            df = len(plist)
            idf = w * math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            sess_tf: dict[int, int] = {}
            for packed in plist:
                d = packed >> 8
                f = packed & 255
                norm = k1 * (1.0 - b + b * lengths[d] / avgdl)
                scores[d] = scores.get(d, 0.0) + idf * f * (k1 + 1.0) / (f + norm)
                if use_sess:
                    s = session[d]
                    sess_tf[s] = sess_tf.get(s, 0) + f
            if use_sess:
                sdf = len(sess_tf)
                sidf = w * math.log(1.0 + (nsess - sdf + 0.5) / (sdf + 0.5))
                for s, f in sess_tf.items():
                    sat = f / (f + p.session_k1)
                    sess_scores[s] = sess_scores.get(s, 0.0) + sidf * sat
        if p.neighbour_weight > 0:
            base = scores
            scores = dict(base)
            nw = p.neighbour_weight
            for d, s in base.items():
                for e in (d - 1, d + 1):
                    if 0 <= e < n and session[e] == session[d]:
                        if p.neighbour_mode == "sum":
                            scores[e] = scores.get(e, 0.0) + nw * s
                        else:
                            cur = base.get(e, 0.0)
                            scores[e] = max(scores.get(e, 0.0), cur + nw * s)
        if use_sess and sess_scores:
            top = max(sess_scores.values()) or 1.0
            sw = p.session_weight
            # spread the session prior to every message of a matching session
            sess_members: dict[int, list[int]] = {}
            for d in range(n):
                s = session[d]
                if s in sess_scores:
                    sess_members.setdefault(s, []).append(d)
            for s, members in sess_members.items():
                bonus = sw * sess_scores[s] / top
                for d in members:
                    scores[d] = scores.get(d, 0.0) + bonus
        if p.user_boost != 1.0:
            roles = self._roles
            for d in scores:
                if roles[d] == 0:
                    scores[d] *= p.user_boost
        excluded = exclude if callable(exclude) else exclude.__contains__
        toks = self._tokens
        if p.cost_alpha > 0:
            a = p.cost_alpha
            key = {d: s / (max(toks[d], 1) ** a) for d, s in scores.items()}
            ranked = sorted(scores.items(), key=lambda kv: key[kv[0]], reverse=True)
        else:
            ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
        left = budget_tokens
        out: list[Excerpt] = []
        for d, s in ranked:
            if excluded(d):
                continue
            cost = toks[d]
            if cost > left:
                continue
            left -= cost
            out.append(Excerpt(d, s))
            if left <= 0:
                break
        out.sort(key=lambda e: e.index)
        return out
