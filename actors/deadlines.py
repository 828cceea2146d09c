"""Reply deadlines without a cancel scope per request.

A cancel scope and its timer cost 10-30 µs per request here; instead every waiter goes into one
queue and a single task wakes at the oldest deadline. The deadline is the same for every waiter, so
the queue is in deadline order: appending and dropping settled waiters from its front are O(1).
A waiter past its deadline is marked ``timed_out`` and woken (``done.set()``); whoever waits on it
then answers "no reply in time". What it was waiting for goes on regardless.

Bound: the asks in flight (each behind a bounded mailbox), plus the ones settled behind a late one,
at most one deadline's worth of requests; they leave as the front of the queue settles or times out.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

import trio


class Waiter(Protocol):
    deadline: float
    timed_out: bool

    @property
    def done(self) -> trio.Event: ...


class Deadlines:
    def __init__(self, seconds: float = math.inf) -> None:
        if not seconds > 0:
            raise ValueError(f"a reply deadline must be > 0 seconds, not {seconds}")
        self.seconds = seconds
        self._waiting: deque[Waiter] = deque()
        self._added = trio.Event()
        self.timeouts = 0

    def track(self, waiter: Waiter) -> None:
        """Wake ``waiter`` as timed out if its ``done`` is not set within ``seconds`` from now."""
        if self.seconds == math.inf:
            return
        waiting = self._waiting
        while waiting and waiting[0].done.is_set():
            waiting.popleft()  # settled in time: forget them as new ones arrive
        waiter.deadline = trio.current_time() + self.seconds
        waiting.append(waiter)
        if len(waiting) == 1:
            self._added.set()

    async def run(self) -> None:
        """The one task that enforces deadlines (start it in the owner's nursery)."""
        waiting = self._waiting
        while True:
            if not waiting:
                self._added = trio.Event()
                await self._added.wait()
                continue
            head = waiting[0]
            if head.done.is_set():
                waiting.popleft()
            elif trio.current_time() < head.deadline:
                await trio.sleep_until(head.deadline)
            else:
                waiting.popleft()
                head.timed_out = True
                self.timeouts += 1
                head.done.set()
