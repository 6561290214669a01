"""Token counting: offline encodings, per-message overhead, calibration."""

from __future__ import annotations

import hashlib
import random
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from gateway import tokens
from gateway.config import ModelSettings, Settings
from gateway.tokens import FALLBACK_ENCODING, PER_MESSAGE_TOKENS, TokenCounter, available_offline

MODELS = Settings().models


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_counts_offline_with_cl100k(no_network: None) -> None:
    """Claude and unknown models count with cl100k from the bundled file, without any network."""
    counter = TokenCounter(MODELS)
    assert counter.encoding("claude-sonnet-4-20250514").name == FALLBACK_ENCODING
    assert counter.count("hello world", "claude-sonnet-4") == 2
    assert counter.count("hello world", "some-unknown-model") == 2
    assert counter.count("", "gpt-4o") == 0


def test_o200k_comes_offline_from_the_bundled_file(no_network: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With an empty tiktoken cache and no network, o200k models count with o200k: the bundled file
    (the one tiktoken would download, by its sha256) is put in the cache and loaded from there."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    tokens.load_encoding.cache_clear()
    try:
        assert not available_offline("o200k_base")
        counter = TokenCounter(MODELS)
        enc = counter.encoding("gpt-4o-mini")
        assert (enc.name, enc.n_vocab) == ("o200k_base", 200019)
        assert available_offline("o200k_base")
        text = "Die Konfiguration liegt in config/gateway.yaml; 日本語のテキストも数えます。"
        assert counter.count(text, "gpt-4o") == len(enc.encode_ordinary(text))
        assert counter.count(text, "gpt-4o") != counter.count(text, "claude-sonnet-4-5")  # not cl100k
    finally:
        tokens.load_encoding.cache_clear()


def test_o200k_model_falls_back_without_a_usable_file(no_network: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A model configured for o200k uses cl100k when o200k is neither cached nor bundled, and a bundled
    file whose hash is not tiktoken's is never put in the cache."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    tokens.load_encoding.cache_clear()
    try:
        monkeypatch.setitem(tokens._DOWNLOADED, "o200k_base", (tokens._DOWNLOADED["o200k_base"][0], "0" * 64))
        assert not tokens.seed_cache("o200k_base") and not any(tmp_path.iterdir())
        monkeypatch.setattr(tokens, "_BUNDLED", {})
        assert TokenCounter(MODELS).encoding("gpt-4o").name == FALLBACK_ENCODING
    finally:
        tokens.load_encoding.cache_clear()


def test_corrupt_cached_file_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached o200k file whose hash is wrong does not count as available (tiktoken would re-download)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    url = tokens._DOWNLOADED["o200k_base"][0]
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"not the real file")
    assert not available_offline("o200k_base")


def test_cache_path_follows_tiktoken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cache location honours TIKTOKEN_CACHE_DIR, then DATA_GYM_CACHE_DIR; "" disables it."""
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path))
    assert tokens.tiktoken_cache_path("u") == str(tmp_path / hashlib.sha1(b"u").hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert tokens.tiktoken_cache_path("u") is None


def test_o200k_used_for_its_models_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models configured for o200k count with o200k whenever tiktoken can load it without a download."""
    loaded: list[str] = []
    fallback = tiktoken.get_encoding(tokens.FALLBACK_ENCODING)

    class Fake:
        name = "o200k_base"

        def encode_ordinary(self, text: str) -> list[int]:
            return [0] * len(text)

    def fake_get_encoding(name: str) -> Any:
        loaded.append(name)
        return Fake() if name == "o200k_base" else fallback

    tokens.load_encoding.cache_clear()
    monkeypatch.setattr(tokens, "available_offline", lambda name: name == "o200k_base")
    monkeypatch.setattr(tokens.tiktoken, "get_encoding", fake_get_encoding)
    try:
        counter = TokenCounter(MODELS)
        assert counter.encoding("gpt-4o-2024-08-06").name == "o200k_base"
        assert counter.encoding("claude-sonnet-4-5").name == fallback.name
        assert "o200k_base" in loaded
    finally:
        tokens.load_encoding.cache_clear()


def test_special_token_text_is_plain_text() -> None:
    """User text containing "<|endoftext|>" is counted as ordinary text, never raising."""
    counter = TokenCounter(MODELS)
    assert counter.count("say <|endoftext|> now") > 3
    long = "padding words " * 50 + "<|endoftext|>"
    assert counter.count(long) == counter.count(long)  # cached path too


def test_count_message_adds_overhead() -> None:
    """A message costs its text's tokens plus a fixed per-message overhead."""
    counter = TokenCounter(MODELS)
    assert counter.count_message("hello world") == counter.count("hello world") + PER_MESSAGE_TOKENS == 6


def test_long_text_count_is_cached_and_exact() -> None:
    """Repeated long texts (system prompts) are counted once and give the same exact count."""
    counter = TokenCounter(MODELS)
    text = "The quick brown fox jumps over the lazy dog. " * 100
    expected = len(counter.encoding().encode_ordinary(text))
    assert counter.count(text) == expected
    assert counter.count(text) == expected
    assert len(counter._counts) == 1


def test_the_count_cache_stays_bounded_and_evicts_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its size the cache drops its oldest counts, one per new text, and keeps the newest: counting
    many new messages evicts at a constant cost each (a plain dict's front deletions made each eviction
    walk every deleted slot before it)."""
    monkeypatch.setattr(tokens, "_COUNT_CACHE_SIZE", 100)
    counter = TokenCounter(MODELS)
    for i in range(1000):
        counter.count(f"message {i}")
    assert len(counter._counts) == 100
    enc = counter.encoding()
    kept = {hash((enc.name, hash(f"message {i}"), len(f"message {i}"))) for i in range(900, 1000)}
    assert set(counter._counts) == kept


def test_calibration_is_a_clamped_ema_per_model() -> None:
    """calibrate() moves the model's factor towards reported/estimated, clamped to 0.5..2.0."""
    counter = TokenCounter(MODELS)
    assert counter.factor("claude-sonnet-4") == 1.0
    counter.calibrate("claude-sonnet-4-20250514", 100, 120)
    assert counter.factor("claude-sonnet-4") == pytest.approx(1.2)
    counter.calibrate("claude-sonnet-4", 100, 100)
    assert 1.0 < counter.factor("claude-sonnet-4") < 1.2
    assert counter.factor("gpt-4o") == 1.0  # per model
    for _ in range(50):
        counter.calibrate("gpt-4o", 100, 10_000)
    assert counter.factor("gpt-4o") == 2.0
    counter.calibrate("gpt-4o", 0, 100)  # ignored: nothing to compare
    assert counter.factor("gpt-4o") == 2.0


def test_unknown_model_names_stay_bounded() -> None:
    """Client-chosen model names cannot grow the counter's caches without bound."""
    counter = TokenCounter({"default": ModelSettings()})
    for i in range(3000):
        counter.count("hi", f"m-{i}")
        counter.calibrate(f"m-{i}", 10, 11)
    assert len(counter._encodings) <= 1024
    assert set(counter._factors) == {"default"}


def _odd_text(rng: random.Random, n: int) -> str:
    # Characters around which pre-tokenisers behave differently: newlines, runs of spaces, "/" and
    # "[" after a newline, contractions, digits, punctuation, Unicode spaces and letters, emoji.
    alphabet = ["\n", "\n", "\r\n", " ", "  ", "\t", "[", "/", "'s", "'", "a", "Word", "x1", "123", "4567",
                ".", "?", "!\n", "#", "é", "日本", "\u00a0", "\u2028", "\u3000", "\x1f", "😀", "-", "//", ":"]
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("encoding", [FALLBACK_ENCODING, "o200k_base"])
def test_long_texts_counted_by_pieces_are_exact(encoding: str) -> None:
    """Counts assembled from cached pieces (lines, a text and its trailing separator) equal whole-text counts."""
    enc = tokens.load_encoding(encoding)
    assert enc.name == encoding
    counter = TokenCounter({"default": ModelSettings(encoding=None if encoding == FALLBACK_ENCODING
                                                     else "o200k_base")})
    assert counter.encoding().name == enc.name
    rng = random.Random(7)
    texts = [_odd_text(rng, 2000) for _ in range(40)]
    texts.append("## Relevant earlier excerpts\n" + "\n\n".join(
        f"[message {i}, user, 2023-05-08T13:56:00]\nLine one?\n  indented\n/path\n[x] done\n" for i in range(60)))
    for text in texts:
        assert counter.count(text) == len(enc.encode_ordinary(text))
    # A counted text followed by whitespace is counted from its cached count and its last word.
    for text in [_odd_text(rng, rng.randint(1, 300)) for _ in range(300)]:
        counter.count(text)
        for sep in ("\n\n", " ", "  \n", "\t\n\n", "\u00a0\n"):
            assert counter.count(text + sep) == len(enc.encode_ordinary(text + sep))


@pytest.mark.parametrize("encoding", [FALLBACK_ENCODING, "o200k_base"])
def test_a_long_text_is_encoded_in_slices_and_counted_exactly(encoding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding returns every token as a Python int, built holding the interpreter lock: a long text
    with no line to cut at (one paragraph of 600 KB, odd characters and all) is encoded in slices of
    at most 128K characters, cut at word breaks, and its count is the whole text's."""
    counter = TokenCounter({"default": ModelSettings(encoding=None if encoding == FALLBACK_ENCODING
                                                     else "o200k_base")})
    enc = counter.encoding()
    rng = random.Random(11)
    text = "".join(_odd_text(rng, 12).replace("\n", " ").replace("\r", " ") + " word" for _ in range(30_000))
    assert len(text) > 600_000 and "\n" not in text
    whole = len(enc.encode_ordinary(text))
    calls: list[int] = []
    real = enc.encode_ordinary
    monkeypatch.setattr(type(enc), "encode_ordinary", lambda self, t: calls.append(len(t)) or real(t))
    assert counter.count(text) == whole
    assert len(calls) >= 5 and max(calls) <= 2 * 65536


def test_a_long_text_with_no_word_break_is_encoded_in_slices_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Base64 has no break that keeps the count exact: it is cut anyway, and the count is off by
    no more than a token a cut."""
    import base64

    counter = TokenCounter(MODELS)
    enc = counter.encoding()
    text = base64.b64encode(random.Random(3).randbytes(450_000)).decode()
    whole = len(enc.encode_ordinary(text))
    calls: list[int] = []
    real = enc.encode_ordinary
    monkeypatch.setattr(type(enc), "encode_ordinary", lambda self, t: calls.append(len(t)) or real(t))
    got = counter.count(text)
    assert max(calls) <= 2 * 65536 and abs(got - whole) <= len(calls)


def test_block_of_counted_texts_encodes_only_what_is_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of texts counted before (excerpts) encodes only its new headers and the words at the joins."""
    counter = TokenCounter(MODELS)
    texts = [f"Message {i}: " + f"words of message {i} " * 20 + "and a question?" for i in range(10)]
    for text in texts:
        counter.count(text)  # as on arrival
    calls: list[str] = []
    enc = counter.encoding()
    real = enc.encode_ordinary
    monkeypatch.setattr(type(enc), "encode_ordinary", lambda self, text: calls.append(text) or real(text))
    block = "## Excerpts\n" + "\n\n".join(f"[message {i}, user]\n{t}" for i, t in enumerate(texts))
    assert counter.count(block) == len(real(block))
    assert max(len(c) for c in calls) < 20  # headers and last words, never a whole text
    calls.clear()
    assert counter.count(block) == len(real(block))  # cached whole
    assert calls == []


def test_counting_from_two_threads_at_the_cache_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Folds count in a worker thread while requests count on the loop: eviction never raises."""
    monkeypatch.setattr(tokens, "_COUNT_CACHE_SIZE", 8)
    counter = tokens.TokenCounter(Settings().models)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(20_000):
                counter.count(f"text {seed} {i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
