"""Group-commit bookkeeping, shared by both journals: which LSNs are appended, taken, durable.

Pure (no files, no trio, no clock), so the rules are unit-tested on their own and the journals are
left with their I/O. The cycle is::

    append(nbytes) -> lsn        any number of times (the producers)
    take_batch() -> Batch        everything appended and not yet written (the writer)
    batch_written(batch)         that batch is durable: durable_lsn moves, callbacks due are called
    fail(exc)                    the writer stopped for good: every waiter is called, nothing is durable

A batch that was taken but never reported written (its write was interrupted) is simply part of the
next one: ``take_batch`` always covers every unwritten byte. ``wake`` is called after every change of
``durable_lsn`` and on failure, so a shell can wake the tasks it keeps waiting on its own events.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple


class Batch(NamedTuple):  # (a tuple: MemoryJournal makes one per append)
    last_lsn: int
    nbytes: int  # the unwritten bytes it covers (the journal decides what a byte counts)


def _nothing() -> None:
    pass


class GroupCommit:
    """Attributes are read-only outside: change them through the methods."""

    __slots__ = ("_callbacks", "_peak", "durable_lsn", "failure", "last_lsn", "unwritten", "wake")

    def __init__(self, last_lsn: int = 0, *, wake: Callable[[], None] = _nothing) -> None:
        self.last_lsn = last_lsn  # the last appended lsn
        self.durable_lsn = last_lsn  # every lsn up to this one is durable
        self.unwritten = 0  # bytes appended and not yet reported written (the backlog)
        self._peak = 0  # the largest backlog seen at a take_batch (appends only ever grow it)
        self.failure: BaseException | None = None
        self.wake = wake
        # (lsn, callback) to call once lsn is durable, in lsn order; bounded by the append backlog.
        self._callbacks: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def append(self, nbytes: int) -> int:
        """Assign the next lsn to a record of ``nbytes`` unwritten bytes (on every request's path: lean)."""
        self.unwritten += nbytes
        self.last_lsn += 1
        return self.last_lsn

    @property
    def peak_unwritten(self) -> int:
        """The largest backlog so far (it peaks right before a batch is taken, or now)."""
        return max(self._peak, self.unwritten)

    def take_batch(self) -> Batch:
        if self.unwritten > self._peak:
            self._peak = self.unwritten
        return Batch(self.last_lsn, self.unwritten)

    def batch_written(self, batch: Batch) -> None:
        """``batch`` is durable: move ``durable_lsn``, call the callbacks now due, wake the shell."""
        if batch.last_lsn < self.durable_lsn or batch.nbytes > self.unwritten:
            raise ValueError(f"batch up to lsn {batch.last_lsn} was already reported (durable: {self.durable_lsn})")
        self.unwritten -= batch.nbytes
        self.durable_lsn = batch.last_lsn
        self.wake()
        callbacks = self._callbacks
        while callbacks and callbacks[0][0] <= batch.last_lsn:
            callbacks.popleft()[1]()

    @property
    def awaited(self) -> bool:
        """Whether a callback waits for an lsn to become durable."""
        return bool(self._callbacks)

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``lsn`` is durable or the journal fails; at once if either is so."""
        if self.durable_lsn >= lsn or self.failure is not None:
            callback()
        else:
            self._callbacks.append((lsn, callback))  # lsns only grow: the deque stays sorted

    def fail(self, exc: BaseException) -> None:
        """The writer stopped for good: call every waiting callback (they find out from the journal)."""
        self.failure = exc
        self.wake()
        callbacks = self._callbacks
        while callbacks:
            callbacks.popleft()[1]()
