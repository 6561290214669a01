"""`gateway serve` computes folds in child processes (foldcpu.py): the fold's CPU never runs in the
process that serves requests, a child that dies loses no fold, and the gateway keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from memory_helpers import Chat, Gateway, memory_gateway, user_text

from gateway.app import FOLDS, METRICS
from gateway.config import parse_settings
from gateway.foldcpu import FoldOutput, FoldProcessLost, ProcessCPU


def _processes(g: Gateway) -> ProcessCPU:
    pool = g.app[FOLDS]
    assert pool is not None
    assert isinstance(pool.cpu, ProcessCPU), "the in-process workers fold in a thread of the serving process"
    return pool.cpu


def _watch(cpu: ProcessCPU) -> tuple[list[Any], asyncio.Event]:
    """What each fold computation returned, and an event set once one has been handed to a child."""
    returned: list[Any] = []
    handed = asyncio.Event()
    call = cpu.call

    async def watched(fn: Callable[..., Any], *args: Any) -> Any:
        handed.set()
        out = await call(fn, *args)
        returned.append(out)
        return out

    cpu.call = watched  # type: ignore[method-assign]
    return returned, handed


async def _talk(chat: Chat, turns: int, start: int = 0) -> None:
    msgs: list[dict[str, Any]] = []
    for i in range(start, start + turns):
        msgs.append({"role": "user", "content": user_text(i)})
        _, text = await chat.send(msgs)
        msgs.append({"role": "assistant", "content": text})


async def _summary(g: Gateway, conv: str) -> dict[str, Any]:
    status, info = await g.api("GET", conv)
    assert status == 200, info
    return info


def _folds(g: Gateway, result: str) -> float:
    return g.app[METRICS].folds.labels(result=result)._value.get()  # type: ignore[no-any-return]


async def test_a_fold_is_computed_in_another_process(redis_url: str) -> None:
    """The default serve config folds in a child process: the summary is committed, computed elsewhere,
    by a process that yields the CPU to the one serving requests (SCHED_IDLE on Linux, and a higher nice)."""
    async with memory_gateway(redis_url) as g:
        cpu = _processes(g)
        returned, _ = _watch(cpu)
        await _talk(Chat(g, "openai", "proc-1"), 6)
        await g.settle()
        info = await _summary(g, "proc-1")
        assert info["summary"]["covers"] > 0
        folds = [out for out in returned if isinstance(out, FoldOutput)]
        assert folds and all(out.pid != os.getpid() for out in folds)
        assert {out.pid for out in folds} <= set(cpu.pids())
        lower = min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        for pid in cpu.pids():
            assert os.getpriority(os.PRIO_PROCESS, pid) == lower
            if hasattr(os, "SCHED_IDLE"):  # Linux: CPU time nothing else wants, and only that
                assert os.sched_getscheduler(pid) == os.SCHED_IDLE


async def test_a_killed_fold_process_loses_no_fold_and_the_gateway_keeps_serving(redis_url: str) -> None:
    """SIGKILL to the fold process while it holds a fold: the fold fails, is retried in a new process and
    committed; requests are answered all along."""
    async with memory_gateway(redis_url) as g:
        cpu = _processes(g)
        await _talk(Chat(g, "openai", "warm"), 6)  # the first fold starts the child
        await g.settle()
        [doomed] = cpu.pids()
        returned, handed = _watch(cpu)
        os.kill(doomed, signal.SIGSTOP)  # the fold handed to it cannot finish before the kill
        try:
            await _talk(Chat(g, "openai", "victim"), 6)
            await asyncio.wait_for(handed.wait(), 20)
        finally:
            os.kill(doomed, signal.SIGKILL)
        async with g.http.get(f"{g.url}/healthz") as r:
            assert r.status == 200
        await g.settle()
        info = await _summary(g, "victim")
        assert info["summary"]["covers"] > 0, "the fold the dead process held was not retried"
        assert _folds(g, "error") >= 1
        assert cpu.lost == 1
        folds = [out for out in returned if isinstance(out, FoldOutput)]
        assert folds and doomed not in {out.pid for out in folds}
        # And the conversations go on being served and folded.
        await _talk(Chat(g, "openai", "after"), 6)
        await g.settle()
        assert (await _summary(g, "after"))["summary"]["covers"] > 0


async def test_a_call_cut_short_never_answers_the_next_one() -> None:
    """A call cancelled mid-computation (a fold the workers gave up on): its answer never reaches the
    next call, which does not wait for it either (a fresh process answers). A call that raises in the
    child raises the same error here, and one that cannot be sent fails without holding a process."""
    cpu = ProcessCPU(parse_settings({}), 1)
    try:
        first = await cpu.call(os.getpid)
        slow = asyncio.ensure_future(cpu.call(time.sleep, 2.0))  # answers None after 2 s
        await asyncio.sleep(0.2)
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        pid = await asyncio.wait_for(cpu.call(os.getpid), 10)
        assert isinstance(pid, int) and pid != first
        with pytest.raises(ValueError, match="invalid literal"):
            await cpu.call(int, "not a number")
        assert await cpu.call(os.getpid) == pid  # an error in the call does not cost the process
        with pytest.raises((pickle.PicklingError, AttributeError)):
            await cpu.call(lambda: 1)  # nothing that cannot travel is sent, nor holds a process
        assert await asyncio.wait_for(cpu.call(os.getpid), 10) == pid
        assert cpu.lost == 0
    finally:
        await cpu.close(0.0)
    assert cpu.pids() == []


async def test_long_message_lists_reach_the_process_whole_and_in_order() -> None:
    """A fold's messages are pickled a slice at a time (one pickle of megabytes would hold the event
    loop): two lists of 300 and 130 messages arrive whole and in order, and the next calls are
    answered by the same process, in step."""
    import operator

    from gateway.model import Message

    def msgs(prefix: str, n: int) -> list[Message]:
        return [Message(raw={"role": "user", "content": f"{prefix}{i}"}, role="user", text=f"{prefix}{i} " * 50,
                        tokens=i, hash=f"h{prefix}{i}") for i in range(n)]

    a, b = msgs("a", 300), msgs("b", 130)
    cpu = ProcessCPU(parse_settings({}), 1)
    try:
        pid = await cpu.call(os.getpid)
        both = await cpu.call(operator.concat, a, b)
        assert [(m.text, m.tokens, m.hash) for m in both] == [(m.text, m.tokens, m.hash) for m in a + b]
        assert await cpu.call(len, a) == 300
        with pytest.raises(TypeError):
            await cpu.call(operator.concat, a, 5)
        assert await cpu.call(os.getpid) == pid
        assert cpu.lost == 0
    finally:
        await cpu.close(0.0)


async def test_stopping_the_fold_processes_fails_the_calls_still_waiting() -> None:
    """Stopped with a call in hand and another waiting for the one process: both fail (the fold is
    retried by whoever runs next), none waits forever, and the process is gone."""
    cpu = ProcessCPU(parse_settings({}), 1)
    pid = await cpu.call(os.getpid)
    running = asyncio.ensure_future(cpu.call(time.sleep, 30.0))
    waiting = asyncio.ensure_future(cpu.call(os.getpid))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await asyncio.wait_for(cpu.close(0.0), 10)
    for call in (running, waiting):
        with pytest.raises(FoldProcessLost):
            await asyncio.wait_for(call, 10)
    assert cpu.lost == 0  # stopped, not lost
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_refused_connection_to_the_fork_server_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server's socket refuses a connection while the server is going away (seen once in
    CI on a loaded machine): the child is started on a later attempt, and the fold runs, instead of
    every fold failing until the circuit breaker opens."""
    import multiprocessing.forkserver

    real = multiprocessing.forkserver.connect_to_new_process
    refused: list[int] = []

    def refuse_twice(fds: Any) -> Any:
        if len(refused) < 2:
            refused.append(1)
            raise ConnectionRefusedError(111, "Connection refused")
        return real(fds)

    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", refuse_twice)
    cpu = ProcessCPU(parse_settings({}), 1)
    try:
        assert await asyncio.wait_for(cpu.call(int, "7"), 20) == 7
        assert len(refused) == 2
    finally:
        await cpu.close(0.0)


async def test_a_fork_server_that_keeps_refusing_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """When every attempt is refused, the call fails (the fold is retried later by the workers)
    rather than waiting forever."""
    import multiprocessing.forkserver

    def refuse(fds: Any) -> Any:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", refuse)
    cpu = ProcessCPU(parse_settings({}), 1)
    try:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(cpu.call(int, "7"), 20)
    finally:
        await cpu.close(0.0)
