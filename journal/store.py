"""The journal contract shared by the file journal (production) and the memory journal (simulations).

The journal knows nothing about the domain (it imports nothing from ``actors`` or ``api``): it stores
opaque payloads under a global, gap-free log sequence number (LSN) and opaque snapshot payloads. The
domain's codec, snapshot encoding and recovery (snapshot + fold of the tail) live in
``actors/persistence/``.

Appending is synchronous (it only assigns the LSN and buffers the bytes) so that an actor can
append and apply its events without an await in between. Durability is awaited separately with
``wait_durable(lsn)``: a caller replies to its client only after that returns.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import attrs
import trio


class Durability(enum.Enum):
    """When an appended record counts as acknowledged."""

    ALWAYS = "always"  # after the group-committed fsync that covers it
    BATCH = "batch"  # after write(2); fsync at most every few ms in the background
    OFF = "off"  # after write(2); never fsync (the OS decides)


class DataDirectoryInUse(Exception):
    """Another process holds the data directory: startup must stop."""


class CorruptJournal(Exception):
    """A record in the middle of the log failed its checksum: startup must stop."""


class JournalUnreachable(Exception):
    """The journal's server (NATS JetStream) cannot be reached, or refuses the journal's layout, at startup:
    the service cannot start (one line naming the server)."""


class JournalWriteFailed(OSError):
    """A remote journal (JetStream) failed a write at run time: its writer stops for good (fail-stop, as a failed
    fsync stops the file journal). An ``OSError`` so that the shell handles it as any journal write failure."""


class JournalFenced(JournalWriteFailed):
    """The log already holds records this writer did not write (another writer appended to its subject): the append
    was refused, so the log does not fork, and this writer stops for good."""


class SnapshotRefused(OSError):
    """A remote journal (JetStream) did not store a snapshot because the stored one is newer (another writer took
    the log over): nothing was replaced or purged; the journal goes on (its next append is fenced)."""


@attrs.frozen
class SkippedRecord:
    """A record the log holds but ``read`` does not yield: damaged (its checksum fails) where its writer marked it
    rebuildable, or a placeholder ``kvrouter journal quarantine`` left for a record it moved out."""

    lsn: int
    segment: str  # file name
    offset: int  # of the frame in the segment
    quarantined: bool  # False: damaged and rebuildable


@attrs.frozen
class Snapshot:
    lsn: int  # every record with lsn <= this one is folded into payload
    payload: bytes


class Journal(Protocol):
    @property
    def last_lsn(self) -> int:
        """The LSN of the last appended record (0 when the log is empty)."""

    @property
    def durable_lsn(self) -> int:
        """The LSN up to which records are acknowledged under the journal's durability."""

    @property
    def bytes_since_snapshot(self) -> int: ...

    @property
    def records_since_snapshot(self) -> int: ...

    @property
    def skipped_records(self) -> tuple[SkippedRecord, ...]:
        """The records ``read`` passes over (found when the journal was opened), oldest first."""

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        """Assign the next LSN to ``payload`` and buffer it; never blocks, never awaits.

        ``rebuildable``: the writer can give this record back from another source, so if it is later found
        damaged, opening the journal skips it (``skipped_records``) instead of refusing to start.
        """

    def has_room(self) -> bool:
        """False while the unwritten backlog is over its bound (callers then ``wait_for_room``)."""

    async def wait_for_room(self) -> None: ...

    async def wait_durable(self, lsn: int) -> None:
        """Return once ``durable_lsn >= lsn``."""

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, from the journal's task) once ``lsn`` is durable, or
        if the journal fails; at once if it already is. Cheaper than a task per waiter."""

    def read(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield (lsn, payload) for every stored record with lsn > after_lsn, in order.

        "Stored" means durable as of the call (lsn <= durable_lsn), and records covered by the latest
        snapshot count as dropped, so the first record yielded is after both after_lsn and the snapshot.
        """

    def latest_snapshot(self) -> Snapshot | None: ...

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` atomically; from then on ``read`` and ``latest_snapshot`` start from it.

        The records and older snapshots it covers are dropped, except what an implementation keeps on
        disk to fall back on if this snapshot later proves unreadable (see ``journal/snapshot_files``).
        """

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The journal's service task: start it with ``nursery.start``; it returns after ``aclose``."""

    async def aclose(self) -> None:
        """Make every appended record durable, refuse further appends, and let ``run`` return."""


@runtime_checkable
class SnapshotStaging(Protocol):
    """Optional: a snapshot written by another process (a forked child), then installed by the journal.

    ``FileJournal`` has it; ``MemoryJournal`` does not (simulations snapshot inline with
    ``write_snapshot``, so a snapshot lands at a deterministic point). ``write_snapshot`` is
    ``stage`` then ``install`` in one call.
    """

    def snapshot_stager(self) -> Callable[[Snapshot], None]:
        """A blocking function that writes a snapshot where ``install_staged_snapshot`` finds it.

        It touches neither this object nor trio nor any lock, so a forked child can call it. The staged
        snapshot is invisible (recovery, ``latest_snapshot``) until it is installed.
        """

    async def install_staged_snapshot(self, lsn: int) -> None:
        """Make the snapshot staged at ``lsn`` the latest, with ``write_snapshot``'s checks and compaction
        (waiting first until its records are durable). Raises if nothing is staged there."""

    async def discard_staged_snapshot(self, lsn: int) -> None:
        """Remove whatever a failed or abandoned staging at ``lsn`` left; the latest snapshot is untouched."""


def check_snapshot(lsn: int, last_lsn: int, current_lsn: int | None) -> None:
    """Reject a snapshot of records that were never appended, or one older than the current snapshot.

    Both would silently corrupt recovery (which starts from the latest snapshot), so fail loudly.
    """
    if not 0 <= lsn <= last_lsn:
        raise ValueError(f"snapshot lsn {lsn} is outside the journal (last_lsn is {last_lsn})")
    if current_lsn is not None and lsn < current_lsn:
        raise ValueError(f"snapshot lsn {lsn} is older than the latest snapshot ({current_lsn})")
