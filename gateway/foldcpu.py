"""Where a fold's CPU runs: a thread of this process, or processes of its own (`gateway serve`).

A local (extractive) fold is all CPU: sentence scoring over the aged messages, the summary's cap,
the state ledger's extraction. In a thread it still holds the interpreter lock, so every request
the serving process handles waits behind it. `gateway serve` therefore hands it to
`memory.worker.fold_processes` child processes (`ProcessCPU`); `gateway worker`, which serves no
requests, and code that builds a `FoldWorker` alone keep a thread (`ThreadCPU`).

What crosses the process boundary is plain data: the previous summary text, the aged messages
without their provider-native `raw` (the summarizer reads role, text, tokens and time), the stored
ledger JSON; back come the summary, its token count and the ledger's new JSON (None: unchanged).
They travel over one socket per child, which the event loop itself writes and reads: no thread of
the serving process takes part in a hand-off (see ProcessCPU).

The children start from a fork server that has imported the summarizer and loaded its encoding
once (foldwarm.py): a child costs a fork, not an interpreter start and a second of loading, and
`gateway serve` starts them with its workers (`ProcessCPU.start`). A program that embeds the
gateway must guard its main module (`if __name__ == "__main__"`): each child imports it again, as
multiprocessing's children do. A child that dies (killed, out of memory) fails the fold it was
running like any failed fold (the worker retries it with backoff), and a new child takes its place.
Children ignore SIGINT and SIGTERM: `gateway serve` decides when they stop (`ProcessCPU.close`,
after the workers' grace period); if the gateway itself dies they exit at once (`_exit_with`).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gateway import fold, state
from gateway.config import Settings
from gateway.logs import get_logger
from gateway.model import Message
from gateway.pace import Pace
from gateway.summarizer import build_summarizer
from gateway.tokens import FALLBACK_ENCODING, TokenCounter

log = get_logger("gateway.foldcpu")

_START_RETRY_DELAYS = (0.05, 0.5)  # seconds before each further attempt to start a child
_WARM_ENV = "GATEWAY_FOLD_ENCODING"  # foldwarm.ENV (not imported here: foldwarm imports this module)

T = TypeVar("T")


class FoldProcessLost(RuntimeError):
    """The process computing a fold died before answering; the fold is retried like any failure."""


@dataclass(slots=True)
class StateChange:
    """A ledger update computed ahead of its CAS write: from the ledger stored at `version`.

    `dumped` is the new ledger's JSON, None when the fold left it as it was. `updated` is the new
    ledger itself when it was computed in this process (then it is remembered for the next fold).
    """

    version: int
    dumped: dict[str, Any] | None
    tokens_in: int = 0
    tokens_out: int = 0
    updated: state.Ledger | None = None


@dataclass(slots=True)
class FoldOutput:
    summary: fold.SummaryResult
    tokens: int  # of the summary's text
    state: StateChange
    pid: int  # the process that computed it


class LedgerCache:
    """Validated ledgers by state key, each with the JSON it was read or written as (LRU).

    Most folds leave the ledger as it was, so the next fold reads the same JSON back: comparing
    it with the JSON last seen (one C-level dict comparison) replaces validating it again
    (pydantic, ~1.5 us an item, up to state.MAX_ITEMS). A ledger is never changed in place
    (extract and apply_update work on copies), so the same object can be handed out again.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._by_key: OrderedDict[str, tuple[dict[str, Any], state.Ledger]] = OrderedDict()

    def load(self, key: str, data: dict[str, Any] | None) -> state.Ledger:
        """`state.load(data)`, without validating `data` again when it is the JSON last seen for `key`."""
        if not data:
            return state.load(data)
        known = self._by_key.get(key)
        if known is not None and known[0] == data:
            self._by_key.move_to_end(key)
            return known[1]
        ledger = state.load(data)
        self.remember(key, data, ledger)
        return ledger

    def remember(self, key: str, data: dict[str, Any], ledger: state.Ledger) -> None:
        self._by_key[key] = (data, ledger)
        self._by_key.move_to_end(key)
        if len(self._by_key) > self.size:
            self._by_key.popitem(last=False)


class LocalFold:
    """A local summarizer's fold, computed whole where it is called (a worker thread or a child)."""

    def __init__(self, summarizer: fold.Summarizer, max_summary_tokens: int, ledgers: LedgerCache | None = None,
                 *, keep: bool = True, timeline_tokens: int = 0) -> None:
        self.summarizer = summarizer
        self.max_summary_tokens = max_summary_tokens
        self.timeline_tokens = timeline_tokens
        self.ledgers = ledgers or LedgerCache()
        self.keep = keep  # hand the new Ledger back with its JSON (only useful within one process)

    def fold(self, text: str, aged: Sequence[Message], covers: int, state_key: str,
             state_data: dict[str, Any] | None, state_version: int, now: str,
             conversation: str = "") -> FoldOutput:
        result = fold.run_local(fold.fold_summary(self.summarizer, text, aged, covers,
                                                  max_tokens=self.max_summary_tokens,
                                                  timeline_tokens=self.timeline_tokens))
        change = self.state(state_key, state_data, state_version, aged, covers, now, conversation)
        return FoldOutput(result, self.summarizer.count(result.text), change, os.getpid())

    def state(self, state_key: str, state_data: dict[str, Any] | None, state_version: int,
              aged: Sequence[Message], start: int, now: str, conversation: str = "") -> StateChange:
        ledger = self.ledgers.load(state_key, state_data)
        updated, tin, tout = fold.run_local(read_turns(self.summarizer, ledger, aged, start, conversation, now))
        if updated is ledger or updated == ledger:
            return StateChange(state_version, None, tin, tout)
        dumped = updated.dump()
        # What the store will hold if the CAS write succeeds: the next fold reads it back as is.
        self.ledgers.remember(state_key, dumped, updated)
        return StateChange(state_version, dumped, tin, tout, updated if self.keep else None)


async def read_turns(summarizer: fold.Summarizer, ledger: state.Ledger, turns: Sequence[Message], start: int,
                     conversation: str, now: str) -> tuple[state.Ledger, int, int]:
    """The ledger with what turns [start, start+len) establish, less those it has read already
    (memory.py reads a conversation's first messages before it folds at all), marked as read.

    A fold marks only a ledger it changes (most folds leave it unwritten): its reads start at the
    summary's coverage anyway."""
    skip = max(0, min(len(turns), state.mark(ledger, conversation) - start)) if conversation else 0
    tin = tout = 0
    updated = ledger
    if skip < len(turns):
        updated, tin, tout = await summarizer.update_state(ledger, turns[skip:], start + skip, now=now)
    if updated is ledger or not conversation:
        return updated, tin, tout
    return state.marked(updated, conversation, start + len(turns)), tin, tout


class FoldCPU(Protocol):
    """Runs a local fold's computation off the event loop."""

    async def fold(self, text: str, aged: Sequence[Message], covers: int, state_key: str,
                   state_data: dict[str, Any] | None, state_version: int, now: str,
             conversation: str = "") -> FoldOutput: ...

    async def state(self, state_key: str, state_data: dict[str, Any] | None, state_version: int,
                    aged: Sequence[Message], start: int, now: str, conversation: str = "") -> StateChange: ...

    async def call(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def close(self, grace: float = 10.0) -> None: ...


class ThreadCPU:
    """Fold CPU in a thread of this process (`gateway worker`, a `FoldWorker` built alone)."""

    def __init__(self, summarizer: fold.Summarizer, max_summary_tokens: int, timeline_tokens: int = 0) -> None:
        self.local = LocalFold(summarizer, max_summary_tokens, timeline_tokens=timeline_tokens)

    async def fold(self, text: str, aged: Sequence[Message], covers: int, state_key: str,
                   state_data: dict[str, Any] | None, state_version: int, now: str,
                   conversation: str = "") -> FoldOutput:
        return await asyncio.to_thread(self.local.fold, text, aged, covers, state_key, state_data, state_version, now,
                                       conversation)

    async def state(self, state_key: str, state_data: dict[str, Any] | None, state_version: int,
                    aged: Sequence[Message], start: int, now: str, conversation: str = "") -> StateChange:
        return await asyncio.to_thread(self.local.state, state_key, state_data, state_version, aged, start, now,
                                       conversation)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def close(self, grace: float = 10.0) -> None:
        return None


# -- in a child process ----------------------------------------------------------------------------

_CHILD: LocalFold | None = None


def _start_child(settings: Settings) -> None:
    """Executor initializer: the child's own token counter and extractive summarizer."""
    global _CHILD
    # Ctrl-C or a SIGTERM to the whole process group reaches the children too: the parent stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A gateway killed outright (SIGKILL, out of memory) never stops its children, and a child
    # never reads EOF on its job queue (it holds that pipe's write end too): it would outlive the
    # gateway, holding its stdout. Its parent's sentinel becomes readable when the gateway dies.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), name="fold-parent-watch", daemon=True).start()
    # A fold is background work: whenever the serving process (this child's parent) wants the CPU,
    # it goes first. On a shared core a child at nice +10 still held the loop back about once a fold
    # (scripts/bench_fold_stall.py); Linux's SCHED_IDLE runs it only on CPU time nothing else wants,
    # so a gateway kept at 100% CPU falls behind on folds, not on requests. Elsewhere, ten nice
    # levels below the gateway; failing both, the same priority.
    with contextlib.suppress(AttributeError, OSError):
        os.nice(10)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    counter = TokenCounter(settings.models)
    model = settings.memory.summarizer.model
    summarizer = build_summarizer(settings, lambda text: counter.count(text, model), mode="extractive")
    _CHILD = LocalFold(summarizer, settings.memory.max_summary_tokens, keep=False,
                       timeline_tokens=settings.memory.timeline_tokens)


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(0)


def _child() -> LocalFold:
    if _CHILD is None:
        raise RuntimeError("fold process not initialised")
    return _CHILD


def child_fold(text: str, aged: Sequence[Message], covers: int, state_key: str,
               state_data: dict[str, Any] | None, state_version: int, now: str,
               conversation: str = "") -> FoldOutput:
    return _child().fold(text, aged, covers, state_key, state_data, state_version, now, conversation)


def child_state(state_key: str, state_data: dict[str, Any] | None, state_version: int,
                aged: Sequence[Message], start: int, now: str, conversation: str = "") -> StateChange:
    return _child().state(state_key, state_data, state_version, aged, start, now, conversation)


_HEADER = struct.Struct("!Q")  # a message's length, before it on the socket


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes from `sock`; None at EOF (the gateway closed its end or died)."""
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


@dataclass(frozen=True, slots=True)
class _Slices:
    """Stands, in a call's arguments, for a list of messages sent after them: `count` frames, each
    a slice of _SLICE messages pickled."""

    count: int


_SLICE = 64


def _frames(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[bytes]:
    """A call as frames for the socket: (fn, args), then each long message list's slices. Run in a
    thread: one pickle.dumps over a fold of megabytes would hold the interpreter lock throughout
    (the event loop with it); between slices the loop gets its turn."""
    head: list[Any] = []
    tails: list[bytes] = []
    pace = Pace()
    for a in args:
        if isinstance(a, (list, tuple)) and len(a) > _SLICE and isinstance(a[0], Message):
            pieces = []
            for i in range(0, len(a), _SLICE):
                pieces.append(pickle.dumps(list(a[i:i + _SLICE]), protocol=pickle.HIGHEST_PROTOCOL))
                pace.spent(len(pieces[-1]))
            head.append(_Slices(len(pieces)))
            tails += pieces
        else:
            head.append(a)
    first = pickle.dumps((fn, tuple(head)), protocol=pickle.HIGHEST_PROTOCOL)
    return [_HEADER.pack(len(f)) + f for f in (first, *tails)]


def _recv_frame(sock: socket.socket) -> bytes | None:
    header = _recv_exactly(sock, _HEADER.size)
    return None if header is None else _recv_exactly(sock, _HEADER.unpack(header)[0])


def _serve_child(sock: socket.socket, settings: Settings) -> None:
    """A fold process: initialise, then answer one call at a time until the gateway's end closes
    (or the gateway stops reading: an answer nobody waits for ends the process quietly)."""
    _start_child(settings)
    with sock, contextlib.suppress(OSError):
        while (body := _recv_frame(sock)) is not None:
            # (What the gateway pickled unpickles here: the same code. Were it not to, the frames
            # after it could not be told from the next call's, and the process ends instead.)
            fn, args = pickle.loads(body)
            parts: list[bytes] = []
            for a in args:
                for _ in range(a.count if isinstance(a, _Slices) else 0):
                    part = _recv_frame(sock)
                    if part is None:
                        return
                    parts.append(part)
            try:
                slices = iter(parts)
                args = [[m for _ in range(a.count) for m in pickle.loads(next(slices))]
                        if isinstance(a, _Slices) else a for a in args]
                answer = pickle.dumps((True, fn(*args)), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # the call's own failure, raised again in the gateway
                try:
                    answer = pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception:
                    answer = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
            sock.sendall(_HEADER.pack(len(answer)) + answer)


@dataclass(eq=False, slots=True)
class _Process:
    process: multiprocessing.process.BaseProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class ProcessCPU:
    """Fold CPU in `processes` child processes (`gateway serve`), started with the workers (`start`).

    Each child has one socket to this process, driven by the event loop: a call is pickled here
    (a fold's messages travel without `raw`), written, and its answer read when it arrives. No
    thread of this process takes part. `ProcessPoolExecutor`'s manager and feeder threads did, and
    on a busy CPU the loop waited for them at each hand-off (scripts/bench_fold_stall.py). A child
    answers one call at a time."""

    def __init__(self, settings: Settings, processes: int) -> None:
        self.settings = settings
        self.processes = processes
        self._ctx: Any = None
        self._children: list[_Process] = []
        self._idle: asyncio.Queue[_Process | None] | None = None  # None: stopped (passed on to the next waiter)
        self._starting: asyncio.Lock | None = None
        self._warming: asyncio.Task[None] | None = None
        self._closed = False
        self.lost = 0  # children found dead with a call in hand

    def _context(self) -> Any:
        if self._ctx is None:
            self._ctx = multiprocessing.get_context("forkserver")
            # Both only apply when the fork server starts (once per process): its children then
            # fork with the summarizer's modules and its encoding loaded (foldwarm.py).
            os.environ[_WARM_ENV] = self._encoding()
            self._ctx.set_forkserver_preload(["gateway.foldwarm"])
        return self._ctx

    def _encoding(self) -> str:
        models = self.settings.models
        chosen = models.get(TokenCounter(models).model_key(self.settings.memory.summarizer.model))
        return chosen.encoding if chosen is not None and chosen.encoding else FALLBACK_ENCODING

    def start(self) -> None:
        """Start the children now (in the background), not at the first fold: a fold then never
        waits for a process to start."""
        self._warming = asyncio.get_running_loop().create_task(self._warm())

    async def _warm(self) -> None:
        try:
            await self._fill()
        except Exception as exc:  # the first fold tries again, and fails like any fold if it must
            log.warning("fold.processes_not_started", error=f"{type(exc).__name__}: {exc}")
        else:
            log.info("fold.processes_started", processes=sorted(self.pids()))

    def pids(self) -> list[int]:
        """The children's process ids (none before the first fold)."""
        return [c.process.pid for c in self._children if c.process.pid is not None]

    async def _fill(self) -> None:
        """Start children until there are `processes` of them."""
        if self._idle is None or self._starting is None:
            self._idle, self._starting = asyncio.Queue(), asyncio.Lock()
        if len(self._children) >= self.processes:
            return  # the usual case, every call: no lock to take
        async with self._starting:
            while len(self._children) < self.processes and not self._closed:
                started = await self._start_one()
                self._children.append(started)
                self._idle.put_nowait(started)

    async def _start_one(self) -> _Process:
        for attempt in range(len(_START_RETRY_DELAYS) + 1):
            parent, child = socket.socketpair()
            try:
                process = self._context().Process(target=_serve_child, args=(child, self.settings),
                                                  name="gateway-fold", daemon=True)
                try:
                    # Forking through the fork server is a round trip of a few ms: not on the loop.
                    await asyncio.to_thread(process.start)
                finally:
                    child.close()
                reader, writer = await asyncio.open_connection(sock=parent)
                return _Process(process, reader, writer)
            except (ConnectionError, FileNotFoundError, EOFError) as exc:
                # The fork server went away between multiprocessing's liveness check and our
                # request (refused, reset, or closed before it answered): the next attempt finds it
                # dead and starts another. (A server alive without its socket file fails every time.)
                parent.close()
                if attempt == len(_START_RETRY_DELAYS):
                    raise
                log.warning("fold.process_start_retried", attempt=attempt + 1, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(_START_RETRY_DELAYS[attempt])
            except BaseException:
                parent.close()  # a child started all the same reads EOF and exits
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _acquire(self) -> _Process:
        while True:
            if self._closed:
                raise FoldProcessLost("the fold processes are stopped")
            await self._fill()
            assert self._idle is not None
            child = await self._idle.get()
            if child is None:
                self._idle.put_nowait(None)
                raise FoldProcessLost("the fold processes are stopped")
            if child.process.is_alive():
                return child
            self._drop(child)  # died while idle (killed, out of memory): replaced before use

    def _drop(self, child: _Process) -> None:
        if child in self._children:
            self._children.remove(child)
        child.writer.close()
        if child.process.is_alive():
            child.process.kill()
        # Reaped when it has exited; join() here would wait on the loop.
        threading.Thread(target=child.process.join, name="fold-reap", daemon=True).start()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a child process; `fn` and the arguments must pickle (module-level functions)."""
        frames = await asyncio.to_thread(_frames, fn, args)  # before a child is taken
        child = await self._acquire()
        try:
            child.writer.writelines(frames)
            await child.writer.drain()
            header = await child.reader.readexactly(_HEADER.size)
            ok, value = pickle.loads(await child.reader.readexactly(_HEADER.unpack(header)[0]))
        except (asyncio.IncompleteReadError, OSError) as exc:  # OSError: ConnectionError too
            self._drop(child)
            if not self._closed:
                self.lost += 1
                log.warning("fold.process_lost", detail="a fold process died; the fold is retried in a new one")
            raise FoldProcessLost("the fold process died before answering") from exc
        except BaseException:
            # Cancelled mid-call (a fold the workers gave up on): its answer would reach the next
            # call, so this child computes nothing more.
            self._drop(child)
            raise
        assert self._idle is not None
        self._idle.put_nowait(child)
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    async def fold(self, text: str, aged: Sequence[Message], covers: int, state_key: str,
                   state_data: dict[str, Any] | None, state_version: int, now: str,
                   conversation: str = "") -> FoldOutput:
        return await self.call(child_fold, text, fold.slim(aged), covers, state_key, state_data, state_version, now,
                               conversation)

    async def state(self, state_key: str, state_data: dict[str, Any] | None, state_version: int,
                    aged: Sequence[Message], start: int, now: str, conversation: str = "") -> StateChange:
        return await self.call(child_state, state_key, state_data, state_version, fold.slim(aged), start, now,
                               conversation)

    async def close(self, grace: float = 10.0) -> None:
        """Stop the children: at once when idle, a running computation within `grace` seconds, else killed."""
        self._closed = True
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(BaseException):
                await self._warming
            self._warming = None
        children, self._children = self._children, []
        for c in children:
            c.writer.close()  # an idle child reads EOF and exits; a busy one after its answer
        if self._idle is not None:
            self._idle.put_nowait(None)  # a call still waiting for a child fails instead of waiting forever

        def reap() -> None:
            deadline = time.monotonic() + grace
            for c in children:
                c.process.join(max(0.0, deadline - time.monotonic()))
            for c in children:
                if c.process.is_alive():  # a fold the workers gave up on after the grace period
                    c.process.kill()
                    c.process.join()

        await asyncio.to_thread(reap)


def fold_cpu(settings: Settings, summarizer: fold.Summarizer, processes: int) -> FoldCPU:
    """`processes` children for a local summarizer's folds (0: a thread of this process)."""
    if processes > 0:
        return ProcessCPU(settings, processes)
    return ThreadCPU(summarizer, settings.memory.max_summary_tokens, settings.memory.timeline_tokens)
