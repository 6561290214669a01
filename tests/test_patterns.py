"""The extractors' patterns: linear in their input, same answers as before, bounded per message."""

from __future__ import annotations

import re
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import state, summarizer
from gateway.model import Message

# The patterns as they were before they were made linear: the answers must not change.
OLD_STATE_VALUE = re.compile(
    r"\d[\w.:/-]*|[\w.-]*/[\w./-]+|[A-Z]{2,}-\d+|\b[a-z]+_[a-z0-9_]+\b|\b[A-Z][a-z]+[A-Z]\w*")
OLD_SUMMARY_VALUES = re.compile(r"\d[\w.:/-]*|[\w.-]*/[\w./-]+|[A-Z]{2,}-\d+|\b[a-z]+_[a-z0-9_]+\b")
_EXT = "py|js|ts|go|rs|yaml|yml|json|toml|md|sql|sh|cfg|ini|txt|html|css"
OLD_PATH = re.compile(r"(?:^|[\s(\"'`])(?:~|\.{0,2})/[\w.-]+(?:/[\w.-]+)*|\b[\w-]+/[\w.-]+\.\w{1,5}\b"
                      rf"|\b[\w-]+\.(?:{_EXT})\b")

# Few characters, the ones the patterns care about, so hypothesis finds the edges.
texts = st.text(alphabet="aAbZ19-_./: ~`(\"é", max_size=40)


@settings(max_examples=3000, deadline=None)
@given(texts)
def test_value_patterns_answer_as_before(text: str) -> None:
    """The linear value patterns find exactly what the quadratic ones found, on any text."""
    assert state._VALUE.findall(text) == OLD_STATE_VALUE.findall(text)
    assert summarizer._VALUES.findall(text) == OLD_SUMMARY_VALUES.findall(text)
    path = summarizer._SIGNALS[2][0].exact
    assert (path.search(text) is not None) == (OLD_PATH.search(text) is not None)


def test_a_huge_token_in_a_decision_is_extracted_in_bounded_time() -> None:
    """A 1 MB message (a decision around one 96 KB word, then a 1 MB word) folds in seconds, not minutes."""
    # In a child process so a regression fails on the deadline instead of hanging the suite.
    code = (
        "from gateway import state, summarizer\n"
        "from gateway.model import Message\n"
        "for body in ('We decided to use ' + 'a' * 96000 + ' for the cache.', 'A' * 1_000_000,\n"
        "             'We decided to use ' + 'a-' * 500_000 + '.', 'TODO item. ' * 100_000,\n"
        "             'I run Python ' + '1.' * 500_000 + 'x', 'Node.js v' + '1' * 1_000_000 + 'rc',\n"
        "             'We use pandas ' * 100_000 + ' ->' * 100_000 + ' 1', \"Let's switch to \" + 'ab' * 500_000,\n"
        "             \"We're moving to \" * 100_000 + 'x', 'Python 1 ' * 200_000, 'The deadline is ' * 100_000,\n"
        "             'My budget ' + '1,' * 500_000):\n"
        "    t = Message(raw={}, role='user', text=body, tokens=0, hash='')\n"
        "    lines = summarizer.extract_lines([t])\n"
        "    ledger = state.extract(state.Ledger(), [t], 0)\n"
        "    assert all(len(line) < 2100 for _, line in lines), max(len(line) for _, line in lines)\n"
        "    assert all(len(i.text) < 2100 for _, i in ledger.all_items())\n"
        "    assert sum(1 for _ in ledger.all_items()) <= state.MAX_STATEMENTS + state.MAX_COMPONENTS\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_huge_message_still_yields_its_decision() -> None:
    """Clipping keeps what a long message says first: its decision is still a summary line and an item."""
    body = "We decided to use Postgres 16.2 for the ledger. " + "filler words here. " * 60_000
    t = Message(raw={}, role="user", text=body, tokens=0, hash="")
    assert any("Postgres 16.2" in line for _, line in summarizer.extract_lines([t]))
    assert any("Postgres 16.2" in item.text for _, item in state.extract(state.Ledger(), [t], 0).all_items())
