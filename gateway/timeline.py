"""The summary's timeline: one line per session or task, in order; older lines re-compressed, never dropped.

A session is a run of messages with no gap longer than `SESSION_GAP` between their times (and on
one date); messages without a time continue the session before them. A long session is cut at the
first user turn past `TASK_MESSAGES` messages and about `TASK_TOKENS` tokens: a line per task.
Each line says when, which messages, how the session opened, its salient terms (names,
identifiers, versions, numbers: what "what did we do about X, and in what order" questions need)
and what was decided or changed:

    - 2024-01-05 09:00-09:40 (messages 0-79): opened: set up the WebSocket server; topics: Socket.io,
      Express 4.18.2, port 3000; decided: use Redis for sessions

A fold extends the timeline with the messages it takes (the last line goes on when its session
does). Its budget grows with the conversation (`budget`). Over it, the adjacent pair of older lines
with the fewest tokens is merged into one covering both (dates, messages, the first opening, the
terms and decisions of both, cut to a line's share), repeatedly: a session's date and range stay
on some line whatever the length of the conversation.

Pure and local: regexes over the folded messages, each bounded as `state.sentences` bounds them.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gateway import state
from gateway.model import Message
from gateway.retrieval import STAMP_RE

Count = Callable[[str], int]
HEADING = "Timeline:"
SESSION_GAP = 3600.0  # seconds between two messages that start a new session
# A coding assistant's session runs for hours: past this many messages and about this many tokens
# a line ends at the next user turn, so a session's tasks get lines of their own rather than ten
# terms for fifty thousand tokens. (A chat of one-line messages keeps a line per session: its lines
# would be as long as what they cover.)
TASK_MESSAGES = 20
TASK_TOKENS = 4000
# A long conversation's timeline may take this share of the tokens it covers (at least the
# configured `timeline_tokens`): a fixed budget merged a 500K-token conversation into seven lines.
SHARE = 0.01
# ... up to this many: it goes into every rewritten request, and an edited summary must fit the
# API's 20,000 characters (api.py).
MAX_TOKENS = 4000
TERMS = 10  # salient terms a line keeps
DECISIONS = 2  # decided/changed statements a line keeps
OPENING_WORDS = 14
OPENING_MIN = 8  # words a sentence that is not a statement or question needs to open a line
# Words a user starts with that say nothing of the task ("hmm, so how do I ...", "ok so ..."): the
# opening starts after them. Anchored, each alternative a fixed word: linear in what it reads.
_FILLER = re.compile(r"(?:(?:h+m+|o+k(?:ay)?|so|well|alright|um+|uh+|yeah|yes|oh|hey|hi|hello|thanks|right)"
                     r"(?![\w'’])[,.!…-]*\s+)+", re.IGNORECASE)
DECISION_WORDS = 14

# Names, identifiers, versions, numbers, paths: a term is a token holding a digit or a joiner
# (snake_case, dotted, slashed), or a capitalised word inside a sentence. Linear: one pass of \S+.
_TOKEN = re.compile(r"\S+")
_STRIP = ".,;:!?()[]{}\"'`*"
_DIGIT = re.compile(r"\d")
_JOINED = re.compile(r"[A-Za-z0-9][_./:-][A-Za-z0-9]")
# Digits and commas only: a number when the commas group thousands ("1,000"), else a list ("3,31").
_NUMBER_LIST = re.compile(r"[\d,]+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")
_COMMON = frozenset((
    "I", "I'm", "I've", "I'd", "I'll", "Hi", "Hello", "Hey", "Thanks", "Thank", "Can", "Could", "Would", "Should",
    "What", "How", "Why", "When", "Where", "Which", "Who", "The", "This", "That", "These", "Those", "It", "It's",
    "Is", "Are", "Was", "My", "Our", "We", "You", "Your", "Let", "Let's", "Please", "Also", "And", "But", "So", "If",
    "Or", "Now", "Here", "There", "Okay", "OK", "Yes", "No", "Sure", "Great",
))
_LINE = re.compile(r"^- (?:(?P<start>\d{4}-\d\d-\d\d(?: \d\d:\d\d)?)(?:-(?P<endtime>\d\d:\d\d)"
                   r"| to (?P<end>\d{4}-\d\d-\d\d(?: \d\d:\d\d)?))? )?\(messages (?P<first>\d+)-(?P<last>\d+)\): "
                   r"(?P<body>.*)$")


@dataclass(slots=True)
class Line:
    """One timeline line: a session, or several merged."""

    start: str  # "2024-01-05 09:00" (or "" when no message had a time)
    end: str
    first: int  # message positions [first, last]
    last: int
    opening: str = ""
    terms: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # term weights while the line is built

    def render(self) -> str:
        when = self.start
        if self.end and self.end != self.start:
            same_day = self.end[:10] == self.start[:10]
            when += ("-" + self.end[11:]) if same_day and len(self.end) > 11 else " to " + self.end
        parts = []
        if self.opening:
            parts.append(f"opened: {self.opening}")
        if self.terms:
            parts.append("topics: " + ", ".join(self.terms))
        if self.decisions:
            parts.append("decided: " + " | ".join(self.decisions))
        head = f"- {when} " if when else "- "
        return f"{head}(messages {self.first}-{self.last}): " + ("; ".join(parts) or "-")


def parse(text: str) -> tuple[list[Line], str]:
    """(timeline lines, the rest of the summary) of a summary text."""
    stripped = text.lstrip()
    if not stripped.startswith(HEADING):
        return [], text
    body = stripped[len(HEADING):].lstrip("\n")
    end = body.find("\n\n")
    block, rest = (body, "") if end < 0 else (body[:end], body[end + 2:])
    lines = []
    for raw in block.splitlines():
        m = _LINE.match(raw.strip())
        if m is None:
            continue
        lines.append(_from_body(m))
    return lines, rest.strip()


def _from_body(m: re.Match[str]) -> Line:
    start = m["start"] or ""
    end = m["end"] or (start[:11] + m["endtime"] if m["endtime"] else start)
    line = Line(start=start, end=end, first=int(m["first"]), last=int(m["last"]))
    for part in m["body"].split("; "):
        key, _, value = part.partition(": ")
        if key == "opened":
            line.opening = value
        elif key == "topics":
            line.terms = [t for t in value.split(", ") if t]
        elif key == "decided":
            line.decisions = [d for d in value.split(" | ") if d]
    return line


def compose(lines: Sequence[Line], rest: str) -> str:
    """The summary text: the timeline first (it is what changes least), then the rest."""
    if not lines:
        return rest
    block = HEADING + "\n" + "\n".join(line.render() for line in lines)
    return f"{block}\n\n{rest}" if rest.strip() else block


def _stamp(time: str | None) -> tuple[str, float | None]:
    if not time:
        return "", None
    try:
        when = datetime.fromisoformat(time)
        # (timestamp() reads a naive time in the host's zone: at the calendar's ends, east of UTC, it overflows.)
        return when.strftime("%Y-%m-%d %H:%M"), when.timestamp()
    except (ValueError, OverflowError, OSError):
        return "", None


def _terms(text: str) -> list[str]:
    out = []
    for sentence in state.sentences(text):
        first = True
        for raw in _TOKEN.findall(sentence[:2000]):
            token = raw.strip(_STRIP)
            if 2 <= len(token) <= 40 and token not in _COMMON and (
                    _DIGIT.search(token) or _JOINED.search(token) or (not first and token[0].isupper())) and not (
                    "," in token and _NUMBER_LIST.fullmatch(token) and not _THOUSANDS.fullmatch(token)):
                out.append(token)
            first = raw.endswith((".", "!", "?"))
    return out


def extend(lines: list[Line], turns: Sequence[Message], start: int) -> list[Line]:
    """`lines` with messages [start, start+len(turns)) added: the last line goes on while its
    session does, then a line per new session. A new list; `lines` is left as it was."""
    out = [Line(ln.start, ln.end, ln.first, ln.last, ln.opening, list(ln.terms), list(ln.decisions),
                Counter({t: len(ln.terms) - i for i, t in enumerate(ln.terms)})) for ln in lines]
    _, last_seen = _stamp(out[-1].end.replace(" ", "T")) if out and out[-1].end else ("", None)
    current = out[-1] if out and out[-1].last == start - 1 else None
    # Messages a line takes before a user turn ends it: by the tokens of the messages at hand (a
    # stored line's own are not kept).
    task = max(TASK_MESSAGES, math.ceil(TASK_TOKENS / max(_mean_tokens(turns), 1)))
    for i, turn in enumerate(turns):
        pos = start + i
        stamp, seconds = _stamp(turn.time)
        new_session = current is None or (
            seconds is not None and last_seen is not None
            and (seconds - last_seen > SESSION_GAP or stamp[:10] != current.end[:10])) or (
            turn.role == "user" and pos - current.first >= task)
        if new_session:
            current = Line(start=stamp, end=stamp, first=pos, last=pos)
            out.append(current)
        assert current is not None
        current.last = pos
        if stamp:
            current.end = stamp
            if not current.start:
                current.start = stamp
        if seconds is not None:
            last_seen = seconds
        if turn.role not in ("user", "assistant"):
            continue
        # A leading "[2023/05/20 (Sat) 07:47]" says when, as the line's dates do: as terms it took the
        # room of topics ("2023/05/21, Sun, 12:21"), and it opened every opening.
        text = STAMP_RE.sub("", turn.text, count=1)
        sentences = state.sentences(text)
        if turn.role == "user":
            if not current.opening:
                # What was asked: the first sentence that names something and says more than a
                # greeting ("Here's my code:" or "Can you help me fix this?" says nothing of the task;
                # "I'm trying to add JWT v9.0.0, but I'm stuck" does, complaint or not), else the
                # first statement or question.
                # One pass, stopping at the first that names something: a pasted page has up to
                # MAX_SENTENCES of them.
                opening = first_asked = ""
                for sentence in sentences:
                    asked = state.is_statement(sentence) or sentence.endswith("?")
                    if asked and not first_asked:
                        first_asked = sentence
                    if (asked or len(sentence.split()) >= OPENING_MIN) and _terms(sentence):
                        opening = sentence
                        break
                opening = opening or first_asked
                filler = _FILLER.match(opening)
                if filler is not None and filler.end() < len(opening):
                    opening = opening[filler.end():]
                current.opening = state.clip_words(opening.rstrip("?.! "), OPENING_WORDS).replace("; ", ", ")
            current.counts.update(_terms(text))
        # As the state reads them: the same sentences, the same decisions.
        joint = turn.role == "assistant" and i > 0 and state.agreed(turns[i - 1])
        for sentence, kind in state.stated(state.own_sentences(turn.role, sentences), turn.role, joint):
            if kind == "decisions":
                decided = state.clip_words(sentence[state.decision_at(sentence):].rstrip(". "), DECISION_WORDS)
                decided = decided.replace("; ", ", ").replace(" | ", ", ")
                current.decisions = [*current.decisions, decided][-DECISIONS:]
    for line in out:
        line.terms = [t.replace(", ", " ").replace("; ", " ") for t, _ in line.counts.most_common(TERMS)]
    return out


def _merge(a: Line, b: Line) -> Line:
    """One line for two adjacent ones: both ranges, a's opening, the terms of both (alternating, so
    each keeps its most frequent), b's decisions (the later ones) after a's."""
    terms: list[str] = []
    for pair in zip(a.terms, b.terms, strict=False):
        terms += [t for t in pair if t not in terms]
    terms += [t for t in a.terms[len(b.terms):] + b.terms[len(a.terms):] if t not in terms]
    return Line(start=a.start or b.start, end=b.end or a.end, first=a.first, last=b.last,
                opening=a.opening or b.opening, terms=terms[:TERMS],
                decisions=[*a.decisions, *b.decisions][-DECISIONS:])


def budget(timeline_tokens: int, covered: int, turns: Sequence[Message], held: int = 0) -> int:
    """Tokens the timeline of a conversation `covered` messages long may take: SHARE of the tokens it
    covers, estimated from the messages just folded (`turns`), and never less than it takes already
    (`held`): merges are not undone, and one fold of short messages ("ok", "go on") must not merge a
    grown timeline down for good. At most MAX_TOKENS, at least `timeline_tokens`."""
    grown = int(SHARE * covered * _mean_tokens(turns))
    return max(timeline_tokens, min(max(grown, held), MAX_TOKENS))


def _mean_tokens(turns: Sequence[Message]) -> float:
    return sum(t.tokens for t in turns) / len(turns) if turns else 0.0


def size(line: Line, count: Count) -> int:
    """Tokens a line takes in the summary block, its newline included."""
    return count(line.render()) + 1


def cap(lines: list[Line], max_tokens: int, count: Count) -> list[Line]:
    """The lines within max_tokens, never dropping one: the adjacent pair of older lines (the newest
    stays whole) with the fewest tokens together is merged, the oldest on a tie, until they fit."""
    out = list(lines)
    sizes = [size(line, count) for line in out]
    total = sum(sizes)
    while total > max_tokens and len(out) > 2:
        i = min(range(len(out) - 2), key=lambda k: (sizes[k] + sizes[k + 1], k))
        merged = _merge(out[i], out[i + 1])
        merged_size = size(merged, count)
        total += merged_size - sizes[i] - sizes[i + 1]
        out[i: i + 2] = [merged]
        sizes[i: i + 2] = [merged_size]
    return out
