"""Work threads that hand the interpreter lock back to the event loop as they go.

A thread running many short Python steps (parsing 2,000 records, pickling a fold's messages) keeps
the lock until the event loop has asked for it for a whole switch interval (5 ms), and gets it
back at once: the loop then turns once every 5 ms or so for as long as the thread runs. A thread
that lets go itself (`time.sleep(0)`) every `STEP_BYTES` of input lets a waiting loop in at once
(docs/architecture.md, Long requests and the event loop)."""

from __future__ import annotations

import time

STEP_BYTES = 256 << 10


class Pace:
    """Call `spent(n)` after each step of `n` bytes; every STEP_BYTES the lock is let go."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = STEP_BYTES

    def spent(self, n: int) -> None:
        self.left -= n
        if self.left <= 0:
            self.left = STEP_BYTES
            time.sleep(0)  # releases the lock: a thread waiting for it (the event loop) runs now
