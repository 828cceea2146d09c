"""The journal on a NATS JetStream stream: the ``Journal`` contract with the log on the server, not on this disk.

A replica that starts on another machine, with an empty data directory, against the same stream recovers every
acknowledged record: the snapshot from the stream's object store, then the subject's tail. The pieces:
``jetstream_batch`` (how records sit in messages), ``jetstream_link`` (every nats-py call, on the asyncio thread of
``asyncio_thread``), and this module, the trio shell, which only schedules them. ``docs/operations/cluster.md``
describes the layout and what the cluster still lacks.

Why it is shaped like this:

* ``append`` only frames the record into a pending list (no await), as the file journal does. One writer task
  (``run``) takes what is pending as one message (group commit: every record appended while the previous publish was
  in flight shares the next) and publishes it, crossing to the asyncio thread once per group.
* Every publish is fenced: it carries the stream sequence of the subject's last message as this writer knows it
  (``Nats-Expected-Last-Subject-Sequence``). If another writer appended meanwhile, JetStream refuses it and this
  journal stops for good (``JournalFenced``: one line naming the cause), so two writers can never fork the log.
  A clustered stream on nats-server before 2.9.21 may still store two appends fenced on one sequence; the log is
  then the chain of messages naming their predecessor (``jetstream_batch``): the writer whose message is off it
  learns so before acknowledging anything (``JournalFenced`` too), and every read passes over such messages.
* A command is acknowledged only after JetStream acknowledged the message holding its records. That holds in every
  ``Durability`` mode (the modes differ on the file journal's fsync, which has no counterpart here); how durable a
  JetStream acknowledgement is depends on the stream (R=1 on one server: written to its store, synced by the
  server's own policy; R=3: on a majority of three servers).
* Bounded: a message holds at most the server's ``max_payload`` (less header room), one publish is in flight at a
  time, and appends past ``max_backlog_bytes`` unpublished bytes are told to wait (``has_room``).
* A publish is never cancelled halfway (nats-py swallows cancellation in places): the crossing is shielded and the
  asyncio side bounds it with its own timeout; a timeout or a lost connection fails the journal (fail-stop: whether
  the message landed is unknown, and recovery from the stream settles it).
"""

from __future__ import annotations

import array
import bisect
import logging
from collections.abc import Callable, Iterator
from typing import Final, final

import attrs
import trio

from kvrouter.journal import jetstream_batch as batch
from kvrouter.journal.asyncio_thread import AsyncioThread
from kvrouter.journal.group_commit import Batch, GroupCommit
from kvrouter.journal.jetstream_link import DEFAULT_LOG, JetStreamLink, StoredSnapshot, Tail, check_log, payloads
from kvrouter.journal.loop_idle import wait_until_loop_idle as _wait_until_loop_idle
from kvrouter.journal.store import (
    Durability,
    JournalUnreachable,
    JournalWriteFailed,
    SkippedRecord,
    Snapshot,
    SnapshotRefused,
    check_snapshot,
)

logger = logging.getLogger("kvrouter.journal")

MiB: Final = 1 << 20
DEFAULT_MAX_BACKLOG_BYTES: Final = 64 * MiB  # unpublished bytes before producers are told to wait
GATHER_MAX_SECONDS: Final = 0.001  # how long the writer waits for the loop to idle before a publish
GATHER_ENOUGH_RECORDS: Final = 64  # a backlog of this many records is published without the gather
READ_TIMEOUT_SECONDS: Final = 30.0  # one blocking read crossing (startup)
FLUSH_TIMEOUT_SECONDS: Final = 10.0  # aclose's publish of what is pending
OPEN_TIMEOUT_SECONDS: Final = 120.0  # connecting, then reading the tail (bounded per request on the asyncio side)


@attrs.frozen
class JetStreamStatistics:
    """A point-in-time view for the log line at shutdown (the file journal's statistics' counterpart)."""

    last_lsn: int
    durable_lsn: int
    pending_bytes: int
    peak_pending_bytes: int
    messages_published: int
    last_stream_sequence: int
    chain_sequence: int  # the log's last message (the last stream sequence unless that one is off the chain)


@final
class JetStreamJournal:
    """Build it with ``await JetStreamJournal.open(...)``; start ``run``; end with ``aclose``."""

    def __init__(
        self, thread: AsyncioThread, link: JetStreamLink, tail: Tail, durability: Durability, max_backlog_bytes: int
    ) -> None:
        self._thread = thread
        self._link = link
        self._durability = durability
        self._max_backlog_bytes = max_backlog_bytes
        self._max_body = link.max_payload - batch.HEADER_RESERVE
        stored = tail.snapshot
        self._snapshot: Snapshot | None = stored.snapshot if stored is not None else None
        snapshot_lsn = self._snapshot.lsn if self._snapshot is not None else 0
        # Per message from the replay start: its first lsn and stream sequence (``read`` finds where to start).
        self._index_lsn = array.array("q")
        self._index_seq = array.array("q")
        # Payload bytes after the snapshot: _cum[i] is the running total after record snapshot_lsn+1+i.
        self._cum = array.array("q")
        self._total_bytes = 0
        self._bytes_at_snapshot = 0
        last_lsn = snapshot_lsn
        for message in tail.messages:
            self._index_lsn.append(message.first_lsn)
            self._index_seq.append(message.seq)
            for offset, size in enumerate(message.sizes):
                lsn = message.first_lsn + offset
                if lsn > snapshot_lsn:
                    self._total_bytes += size
                    self._cum.append(self._total_bytes)
                last_lsn = max(last_lsn, lsn)
        self._last_seq = tail.last_seq  # the fence of the next publish
        self._chain_seq = tail.chain_seq  # the message the next publish follows on the chain (``Kvr-Prev``)
        self._commit = GroupCommit(last_lsn, wake=self._wake_waiters)
        self.call_when_durable = self._commit.call_when_durable  # type: ignore[method-assign]
        self._pending: list[bytes] = []  # framed records not yet taken by the writer
        self._pending_first = last_lsn + 1  # the lsn of _pending[0]
        self._progress = trio.Event()
        self._wakeup = trio.Event()
        self._snapshot_lock = trio.Lock()
        self._published = 0
        self._running = False
        self._writer_done = trio.Event()
        self._closing = False
        self._closed = False

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        servers: tuple[str, ...],
        stream: str,
        durability: Durability = Durability.ALWAYS,
        *,
        fresh: bool = False,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        log: str = DEFAULT_LOG,
        replicas: int | None = None,
    ) -> JetStreamJournal:
        """Connect, make sure the stream and the snapshot bucket exist, and read where the log ends.

        ``log``: which log of the stream (a subject token): ``log`` for a service's one journal, another name for
        each of many journals sharing the stream (a cluster's scopes), each fenced on its own subject.
        Blocking, as ``FileJournal.open``: run it before serving, or through ``trio.to_thread.run_sync``.
        Raises ``JournalUnreachable`` (one line naming the server) when NATS or JetStream does not answer.
        ``fresh=True`` first empties the journal's subject and deletes its snapshot.
        ``replicas``: the stream's replica count (created with it if missing; a stream with another count is refused
        with ``JournalUnreachable``); None takes the stream as it is (created with 1).
        """
        check_log(log)  # before connecting: a bad name leaves nothing open
        thread = AsyncioThread(f"kvrouter-journal-{stream}-{log}")
        thread.start_blocking()
        try:
            link = thread.call_blocking(
                JetStreamLink.connect, servers, stream, log, replicas, timeout=OPEN_TIMEOUT_SECONDS
            )
            try:
                tail = thread.call_blocking(link.prepare, fresh, timeout=OPEN_TIMEOUT_SECONDS)
            except BaseException:
                thread.call_blocking(link.close, timeout=OPEN_TIMEOUT_SECONDS)
                raise
        except BaseException:
            thread.stop_blocking()
            raise
        return cls(thread, link, tail, durability, max_backlog_bytes)

    @staticmethod
    def check(servers: tuple[str, ...], stream: str, replicas: int | None = None) -> None:
        """Connect, make sure the stream and its snapshot bucket exist, disconnect: what a service whose journals
        open later (a cluster replica's, one per scope) checks at start. Blocking; ``JournalUnreachable``."""
        thread = AsyncioThread(f"kvrouter-journal-{stream}-check")
        thread.start_blocking()
        try:
            link = thread.call_blocking(
                JetStreamLink.connect, servers, stream, DEFAULT_LOG, replicas, timeout=OPEN_TIMEOUT_SECONDS
            )
            try:
                thread.call_blocking(link.ensure, timeout=OPEN_TIMEOUT_SECONDS)
            finally:
                thread.call_blocking(link.close, timeout=OPEN_TIMEOUT_SECONDS)
        finally:
            thread.stop_blocking()

    # -- the Journal protocol ---------------------------------------------------------------------

    @property
    def durability(self) -> Durability:
        return self._durability

    @property
    def stream(self) -> str:
        return self._link.stream

    @property
    def last_lsn(self) -> int:
        return self._commit.last_lsn

    @property
    def durable_lsn(self) -> int:
        return self._commit.durable_lsn

    @property
    def bytes_since_snapshot(self) -> int:
        return self._total_bytes - self._bytes_at_snapshot

    @property
    def records_since_snapshot(self) -> int:
        return self._commit.last_lsn - (self._snapshot.lsn if self._snapshot is not None else 0)

    @property
    def skipped_records(self) -> tuple[SkippedRecord, ...]:
        return ()  # JetStream stores messages whole and checksummed: nothing is skipped

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        commit = self._commit
        if commit.failure is not None:
            raise trio.BrokenResourceError("the journal writer failed") from commit.failure
        if self._closing:
            raise trio.ClosedResourceError("the journal is closed")
        framed = batch.frame(payload, rebuildable)
        if len(framed) > self._max_body:
            raise ValueError(f"payload of {len(payload)} bytes does not fit a JetStream message ({self._max_body})")
        self._pending.append(framed)
        self._total_bytes += len(payload)
        self._cum.append(self._total_bytes)
        if not self._wakeup.is_set():
            self._wakeup.set()
        return commit.append(len(framed))

    def has_room(self) -> bool:
        return self._commit.unwritten <= self._max_backlog_bytes

    async def wait_for_room(self) -> None:
        while not self.has_room():
            self._raise_if_failed()
            await self._progress.wait()

    async def wait_durable(self, lsn: int) -> None:
        commit = self._commit
        if commit.durable_lsn >= lsn:
            return
        if lsn > commit.last_lsn:
            raise ValueError(f"lsn {lsn} has not been appended (last_lsn is {commit.last_lsn})")
        while commit.durable_lsn < lsn:
            self._raise_if_failed()
            await self._progress.wait()

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        self._commit.call_when_durable(lsn, callback)  # (replaced per instance in __init__)

    def read(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield the records after ``after_lsn`` and the snapshot, up to ``durable_lsn`` as of the call.

        Blocks on the stream (one crossing per chunk of messages): startup, recovery and tests only."""
        floor = max(after_lsn, self._snapshot.lsn if self._snapshot is not None else 0)
        limit = self._commit.durable_lsn
        if floor >= limit:
            return iter(())
        at = bisect.bisect_right(self._index_lsn, floor + 1) - 1
        return self._read_from(int(self._index_seq[max(at, 0)]), floor, limit)

    def _read_from(self, seq: int, floor: int, limit: int) -> Iterator[tuple[int, bytes]]:
        while True:
            chunk = self._thread.call_blocking(self._link.fetch, seq, timeout=READ_TIMEOUT_SECONDS)
            if not chunk:  # records up to ``limit`` are acknowledged, so on the stream: a failed read, not the end
                raise JournalUnreachable(
                    f"JetStream did not deliver {self._link.subject} from sequence {seq} (records up to lsn {limit} "
                    "are on it); the log was not read whole"
                )
            for lsn, payload in payloads(message for message in chunk if self._on_chain(message.seq)):
                if lsn > limit:
                    return
                if lsn > floor:
                    yield lsn, payload
                if lsn == limit:
                    return
            seq = chunk[-1].seq + 1

    def _on_chain(self, seq: int) -> bool:
        """Whether the message at ``seq`` is one of the log's (the index holds the chain's messages only)."""
        at = bisect.bisect_left(self._index_seq, seq)
        return at < len(self._index_seq) and self._index_seq[at] == seq

    def latest_snapshot(self) -> Snapshot | None:
        return self._snapshot

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        """Store ``snapshot`` in the stream's object store with the stream sequence its replay starts from, then
        purge the messages before that sequence (the subject keeps its last message: the fence needs one).

        Fenced: only if the stored snapshot covers less (``jetstream_snapshots``); ``SnapshotRefused`` otherwise,
        with nothing stored or purged and this journal's own view unchanged."""
        async with self._snapshot_lock:
            current = self._snapshot.lsn if self._snapshot is not None else None
            check_snapshot(snapshot.lsn, self._commit.last_lsn, current)
            await self.wait_durable(snapshot.lsn)
            keep = self._first_message_after(snapshot.lsn)
            replay_from = int(self._index_seq[keep]) if keep < len(self._index_seq) else 0
            with trio.CancelScope(shield=True):  # (bounded on the asyncio side)
                stored = await self._thread.call(self._link.store_snapshot, StoredSnapshot(snapshot, replay_from))
            if not stored:
                raise SnapshotRefused(
                    f"the snapshot of {self._link.subject} at lsn {snapshot.lsn} was not stored: the stored one is "
                    "newer (another writer took this log over); nothing was purged"
                )
            del self._index_lsn[:keep]
            del self._index_seq[:keep]
            covered = snapshot.lsn - (current or 0)
            if covered > 0:
                self._bytes_at_snapshot = self._cum[covered - 1]
                del self._cum[:covered]
            self._snapshot = snapshot

    def _first_message_after(self, lsn: int) -> int:
        """The index of the message holding ``lsn + 1``; if it is not published yet, of the last message (kept as
        the fence's anchor); 0 when there is none."""
        count = len(self._index_lsn)
        if count == 0:
            return 0
        if lsn >= self._commit.durable_lsn:
            return count - 1
        return max(bisect.bisect_right(self._index_lsn, lsn + 1) - 1, 0)

    # -- the writer -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The single writer task: ``await nursery.start(journal.run)``; returns after ``aclose``.

        Cancelled (a crash elsewhere), it still publishes what was appended (shielded, bounded) before re-raising.
        A failed publish is raised at once (fail-stop) as ``JournalWriteFailed`` or ``JournalFenced``."""
        if self._running:
            raise RuntimeError("the journal writer is already running")
        self._raise_if_failed()
        self._running = True
        task_status.started()
        try:
            await self._write_loop()
        except trio.Cancelled:
            # The owner is gone: keep what was appended (bounded), then close, as aclose would.
            self._closing = True
            with trio.CancelScope(shield=True):
                with trio.move_on_after(FLUSH_TIMEOUT_SECONDS):
                    if self._commit.failure is None:
                        await self._publish_pending()
                if not self._closed:
                    self._closed = True
                    await self._thread.stop(before=self._link.close)
            raise
        finally:
            self._running = False
            self._writer_done.set()

    async def _write_loop(self) -> None:
        commit = self._commit
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            if commit.last_lsn - commit.durable_lsn < GATHER_ENOUGH_RECORDS:
                # Let the burst this append belongs to (other requests a few turns behind) join the group.
                with trio.move_on_after(GATHER_MAX_SECONDS):
                    await _wait_until_loop_idle()
            await self._publish_pending()

    async def _publish_pending(self) -> None:
        """Publish everything pending, one message per ``max_payload`` worth, each fenced on the one before."""
        while self._pending:
            body, count, nbytes = self._take_message()
            first = self._pending_first
            with trio.CancelScope(shield=True):  # never cancelled halfway: bounded on the asyncio side
                try:
                    seq = await self._thread.call(self._link.publish, body, first, self._last_seq, self._chain_seq)
                except JournalWriteFailed as exc:
                    self._fail(exc)
                    raise
            del self._pending[:count]
            self._pending_first = first + count
            self._last_seq = self._chain_seq = seq
            self._index_lsn.append(first)
            self._index_seq.append(seq)
            self._published += 1
            self._commit.batch_written(Batch(first + count - 1, nbytes))

    def _take_message(self) -> tuple[bytes, int, int]:
        """The body of the next message: the pending records that fit ``max_payload``; how many; their bytes."""
        limit, size, count = self._max_body, 0, 0
        for framed in self._pending:
            if size + len(framed) > limit:
                break
            size += len(framed)
            count += 1
        return b"".join(self._pending[:count]), count, size

    async def aclose(self) -> None:
        """Publish every appended record, refuse further appends, let ``run`` return, close the connection.

        Idempotent. After a writer failure nothing is published (fail-stop); the connection is only closed."""
        self._closing = True
        self._wakeup.set()
        with trio.CancelScope(shield=True):
            if self._closed:
                return
            if self._running:
                await self._writer_done.wait()
            elif self._commit.failure is None and self._pending:
                with trio.move_on_after(FLUSH_TIMEOUT_SECONDS):
                    await self._publish_pending()
            if self._closed:
                return
            self._closed = True
            await self._thread.stop(before=self._link.close)

    def statistics(self) -> JetStreamStatistics:
        commit = self._commit
        return JetStreamStatistics(
            last_lsn=commit.last_lsn,
            durable_lsn=commit.durable_lsn,
            pending_bytes=commit.unwritten,
            peak_pending_bytes=commit.peak_unwritten,
            messages_published=self._published,
            last_stream_sequence=self._last_seq,
            chain_sequence=self._chain_seq,
        )

    def _wake_waiters(self) -> None:
        event, self._progress = self._progress, trio.Event()
        event.set()

    def _fail(self, exc: JournalWriteFailed) -> None:
        logger.debug("JetStream journal write failed; stopping (fail-stop): %s", exc)
        self._commit.fail(exc)

    def _raise_if_failed(self) -> None:
        if self._commit.failure is not None:
            raise trio.BrokenResourceError("the journal writer failed") from self._commit.failure
