"""An in-memory journal for simulations and tests: the ``Journal`` contract without files or threads.

Every append is durable the moment it is made, so under ``MockClock(autojump_threshold=0)`` nothing
waits on real I/O and a simulation stays reproducible from its seed. ``crash_copy`` is the fault
hook: it returns what a restarted process would find (the durable records and the latest snapshot).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import final

import trio

from kvrouter.journal.group_commit import GroupCommit
from kvrouter.journal.store import SkippedRecord, Snapshot, check_snapshot


@final
class MemoryJournal:
    """Records live in a list indexed by ``lsn - first_lsn``; a snapshot drops the records it covers."""

    def __init__(self) -> None:
        self._records: list[bytes] = []
        self._first_lsn = 1  # the lsn of self._records[0]
        self._commit = GroupCommit()  # every append is its own batch, written at once
        self._snapshot: Snapshot | None = None
        self._bytes_since_snapshot = 0
        self._closed = trio.Event()

    # -- the Journal protocol ---------------------------------------------------------------------

    @property
    def last_lsn(self) -> int:
        return self._commit.last_lsn

    @property
    def durable_lsn(self) -> int:
        # Nothing can be lost between append and a crash here: durable == appended.
        return self._commit.durable_lsn

    @property
    def bytes_since_snapshot(self) -> int:
        """Payload bytes of the records after the latest snapshot."""
        return self._bytes_since_snapshot

    @property
    def records_since_snapshot(self) -> int:
        return self._commit.last_lsn - (self._snapshot.lsn if self._snapshot is not None else 0)

    @property
    def skipped_records(self) -> tuple[SkippedRecord, ...]:
        return ()  # nothing here is ever damaged

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        if self._closed.is_set():
            raise trio.ClosedResourceError("the journal is closed")
        self._records.append(bytes(payload))
        commit = self._commit
        lsn = commit.append(len(payload))
        commit.batch_written(commit.take_batch())
        self._bytes_since_snapshot += len(payload)
        return lsn

    def has_room(self) -> bool:
        return True

    async def wait_for_room(self) -> None:
        await trio.lowlevel.checkpoint()

    async def wait_durable(self, lsn: int) -> None:
        if lsn > self._commit.last_lsn:
            raise ValueError(f"lsn {lsn} has not been appended (last_lsn is {self._commit.last_lsn})")
        # Already durable; still checkpoint so a caller in a loop stays cancellable under sims.
        await trio.lowlevel.checkpoint()

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        self._commit.call_when_durable(lsn, callback)  # every append is durable at once: calls it now

    def read(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        start = max(after_lsn + 1, self._first_lsn)
        # Materialise the slice now: the caller sees the log as of the call, like FileJournal.
        chunk = self._records[start - self._first_lsn :]
        return iter(list(enumerate(chunk, start)))

    def latest_snapshot(self) -> Snapshot | None:
        return self._snapshot

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        check_snapshot(snapshot.lsn, self._commit.last_lsn, self._snapshot.lsn if self._snapshot is not None else None)
        await trio.lowlevel.checkpoint()
        covered = snapshot.lsn - self._first_lsn + 1
        if covered > 0:
            del self._records[:covered]
            self._first_lsn = snapshot.lsn + 1
        self._snapshot = snapshot
        self._bytes_since_snapshot = sum(len(p) for p in self._records)

    # -- service shape shared with FileJournal ----------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """No writer is needed; this only lets the shell start either journal with ``nursery.start``.

        It returns once ``aclose`` has been called, like ``FileJournal.run``.
        """
        task_status.started()
        await self._closed.wait()

    async def aclose(self) -> None:
        """Refuse further appends and let ``run`` return. Idempotent."""
        self._closed.set()
        await trio.lowlevel.checkpoint()

    # -- fault injection --------------------------------------------------------------------------

    def crash_copy(self) -> MemoryJournal:
        """What a restarted process would see: the durable records and the latest snapshot.

        The copy shares nothing mutable with this journal, so the "crashed" original can be dropped
        (or keep running, to model a partitioned zombie) without affecting the restarted one.
        """
        copy = MemoryJournal()
        copy._records = list(self._records)
        copy._first_lsn = self._first_lsn
        copy._commit = GroupCommit(self.durable_lsn)
        copy._snapshot = self._snapshot
        copy._bytes_since_snapshot = self._bytes_since_snapshot
        return copy
