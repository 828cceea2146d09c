"""The production journal: the trio shell around segment files, one writer task, group commit.

The pieces, one job each: ``frames`` (the record layout and torn-tail rules), ``layout`` (file names,
small blocking helpers), ``scan`` (the startup check and reading records back), ``snapshot_files``
(atomic snapshot files, compaction), ``segment_writer`` (the blocking writes and fsyncs),
``group_commit`` (which LSNs are durable). This module only schedules them.

Why it is shaped like this:

* ``append`` only frames the payload into an in-memory buffer, so an actor can append and apply its
  events without an await in between. The single writer task (``run``) swaps that buffer out and
  writes it in one thread call: every record appended while the previous write or fsync was in the
  kernel shares the next one (group commit), whichever actor appended it.
* Where a segment ends is decided at append time, from record sizes alone, so the bytes on disk do not
  depend on how the writer happened to batch them (identical inputs give identical files).
* Under ALWAYS, records nobody waits for yet (a KV flood's) are held back a few milliseconds so that several
  share a write and an fsync; the first waiter (or enough bytes) ends the hold (``_hold_unawaited``).
* Any OSError from write or fsync stops the writer for good (fail-stop): after a failed fsync the
  page cache no longer tells us what is on disk, and retrying can acknowledge lost data.
"""

from __future__ import annotations

import array
import functools
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, final

import attrs
import trio

from kvrouter.journal.frames import FRAME_OVERHEAD, HEAD, LSN, LSN_BYTES, MAX_PAYLOAD_BYTES, REBUILDABLE_BITS
from kvrouter.journal.group_commit import Batch, GroupCommit
from kvrouter.journal.io_thread import IoThread
from kvrouter.journal.latency import BucketCounts
from kvrouter.journal.layout import OPERATOR_HINT, discard, fsync_dir, snapshot_name
from kvrouter.journal.loop_idle import wait_until_loop_idle as _wait_until_loop_idle
from kvrouter.journal.scan import Scan, read_range, scan_directory
from kvrouter.journal.segment_writer import Chunk, SegmentWriter
from kvrouter.journal.snapshot_files import (
    compact,
    decode_snapshot_file,
    discard_staged_snapshot_file,
    install_snapshot_file,
    stage_snapshot_file,
)
from kvrouter.journal.store import CorruptJournal, Durability, SkippedRecord, Snapshot, check_snapshot

logger = logging.getLogger("kvrouter.journal")

MiB: Final = 1 << 20
DEFAULT_SEGMENT_BYTES: Final = 64 * MiB
DEFAULT_MAX_BACKLOG_BYTES: Final = 64 * MiB  # unwritten bytes before producers are told to wait
DEFAULT_BATCH_INTERVAL: Final = 0.005  # seconds between fsyncs under Durability.BATCH

# ALWAYS: the longest the writer waits for the loop to run out of work before it fsyncs anyway (see _gather).
GATHER_MAX_SECONDS: Final = 0.001
# ALWAYS: a backlog of at least this many records is written at once, without the gather (see _write_loop).
GATHER_ENOUGH_RECORDS: Final = 64
# BATCH and OFF write batches up to this size from the loop itself (see _write_pending).
INLINE_WRITE_BYTES = 256 * 1024
# ALWAYS: a batch someone waits for, up to this size, is written and fsynced by the event loop itself while the last
# fsync took at most INLINE_SYNC_MAX_SECONDS (see _writes_inline); otherwise the I/O thread does it.
INLINE_SYNC_BYTES: Final = 1 * MiB
INLINE_SYNC_MAX_SECONDS: Final = 0.002
# ALWAYS: records nobody waits for (a worker's KV events: never acknowledged, and a crash that loses them is repaired
# by the worker's replay) are held back until someone waits for a durable lsn, or for at most this long, or until
# this much is pending (see _hold_unawaited). A KV flood then costs one write and fsync per ~7 runs instead of one
# per run: each thread call costs the event loop ~50-100 us (its scheduling, and the GIL handed to the writer thread
# and back 4-5 times), the loop is what bounds ingest, and its fsyncs were ~10 % of the service's CPU.
UNAWAITED_HOLD_SECONDS: Final = 0.01
UNAWAITED_HOLD_BYTES: Final = 512 * 1024


@attrs.frozen
class JournalStatistics:
    """A point-in-time view for metrics; ``synced_lsn`` lags ``durable_lsn`` under BATCH and OFF."""

    last_lsn: int
    durable_lsn: int
    synced_lsn: int  # covered by an fsync
    pending_bytes: int  # appended but not yet written (the backlog bounded by max_backlog_bytes)
    peak_pending_bytes: int
    batches_written: int
    fsyncs: int  # of segment files (directory fsyncs are not counted)
    segments: int
    inline_batches: int = 0  # batches the event loop wrote itself (no I/O thread): see ``_writes_inline``
    damaged_skipped: int = 0  # damaged rebuildable records the startup scan passed over (``skipped_records``)


@final
class FileJournal:
    """The ``Journal`` contract on files. Build it with ``FileJournal.open``; start ``run``; end with ``aclose``."""

    def __init__(
        self,
        directory: Path,
        durability: Durability,
        scan: Scan,
        *,
        max_backlog_bytes: int,
        segment_bytes: int,
        batch_interval: float,
    ) -> None:
        self._dir = directory
        self._durability = durability
        self._max_backlog_bytes = max_backlog_bytes
        self._segment_bytes = segment_bytes
        self._batch_interval = batch_interval

        self._progress = trio.Event()  # generation event: set and replaced after each batch
        self._commit = GroupCommit(scan.last_lsn, wake=self._wake_waiters)
        self.call_when_durable = self._commit.call_when_durable  # type: ignore[method-assign]
        self._synced_lsn = scan.last_lsn
        self._snapshot_lsn: int | None = scan.snapshot_lsn
        self._previous_snapshot_lsn: int | None = scan.previous_snapshot_lsn  # kept by compaction
        self._skipped = scan.skipped
        self._skip = frozenset(record.lsn for record in scan.skipped if not record.quarantined)

        # Payload bytes since the snapshot: _cum[i] is the running total after record snapshot_lsn+1+i,
        # so a snapshot at any appended lsn knows exactly how many bytes remain after it.
        self._cum = array.array("q")
        total = 0
        for size in scan.sizes_after_snapshot:
            total += size
            self._cum.append(total)
        self._total_bytes = total
        self._bytes_at_snapshot = 0

        # Append side (trio thread only): the buffer the writer has not taken yet, and where in it a
        # new segment starts.
        self._pending = bytearray()
        self._splits: list[tuple[int, int]] = []  # (offset in _pending, first lsn of the new segment)
        self._inflight: list[Chunk] = []  # taken by the writer, not yet known to be written
        self._tail_size = scan.tail_size  # bytes in the newest segment, counting pending frames
        self._tail_first: int | None = scan.tail_first if scan.tail_size else None
        self._force_rotate = scan.tail_first is None  # no reusable segment: the next append starts one
        self._segments: list[int] = list(scan.segments)

        # Writer side: the segment files (only touched while holding _io_lock, possibly from _io).
        self._io_lock = trio.Lock()
        # Segments are preallocated (fsync then need not grow the file); OFF never fsyncs.
        preallocate = segment_bytes if durability is not Durability.OFF else 0
        self._segment_writer = SegmentWriter(directory, scan.tail_first, preallocate)
        self._io: IoThread | None = None  # the writer's thread for write + fsync, started on first use

        self._snapshot_lock = trio.Lock()
        self._wakeup = trio.Event()  # set by append/aclose to wake an idle writer
        self._writer_idle = False  # the writer waits on _wakeup
        # Set while the writer holds back records nobody waits for (ALWAYS): whoever starts waiting sets it.
        self._awaited: trio.Event | None = None
        self._durable_waiters = 0  # tasks in wait_durable
        # The pending bytes at which held-back records are written anyway (bounded by the backlog's own bound).
        self._hold_bytes = min(UNAWAITED_HOLD_BYTES, max_backlog_bytes)
        self._last_sync = float("-inf")
        self._batches = 0
        self._inline_batches = 0
        self._fsyncs = 0
        # For metrics: how long each batch took to write (and fsync, under ``always``), read at scrape time.
        self.batch_write_seconds = BucketCounts()
        self.fsync_seconds = self._segment_writer.fsync_seconds
        self._running = False
        self._closing = False
        self._closed = False

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        durability: Durability,
        *,
        fresh: bool = False,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
    ) -> FileJournal:
        """Open (creating if needed) the journal in ``path`` and recover its end state.

        Blocking: run it before serving, or through ``trio.to_thread.run_sync``. It truncates a torn
        tail (logged), passes over damaged records their writer marked rebuildable and quarantine
        placeholders (``skipped_records``: the caller says so), and raises ``CorruptJournal`` for
        anything else that is damaged (see ``scan``).
        ``fresh=True`` first deletes every segment and snapshot file in the directory.
        """
        if segment_bytes <= 0 or max_backlog_bytes < 0 or batch_interval < 0:
            raise ValueError("segment_bytes must be > 0; max_backlog_bytes and batch_interval >= 0")
        directory = Path(path)
        if not directory.is_dir():
            directory.mkdir(parents=True)
            fsync_dir(directory.parent)  # or a crash could forget the directory and all within
        if fresh:
            discard(directory)
        return cls(
            directory,
            durability,
            scan_directory(directory),
            max_backlog_bytes=max_backlog_bytes,
            segment_bytes=segment_bytes,
            batch_interval=batch_interval,
        )

    # -- the Journal protocol ---------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._dir

    @property
    def durability(self) -> Durability:
        return self._durability

    @property
    def last_lsn(self) -> int:
        return self._commit.last_lsn

    @property
    def durable_lsn(self) -> int:
        return self._commit.durable_lsn

    @property
    def bytes_since_snapshot(self) -> int:
        """Payload bytes of the records after the latest snapshot (frame overhead not counted)."""
        return self._total_bytes - self._bytes_at_snapshot

    @property
    def records_since_snapshot(self) -> int:
        return self._commit.last_lsn - (self._snapshot_lsn or 0)

    @property
    def skipped_records(self) -> tuple[SkippedRecord, ...]:
        return self._skipped

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        """Frame ``payload`` under the next LSN into the pending buffer and wake the writer.

        ``rebuildable`` sets the frame's kind (``frames.FrameKind``): found damaged later, it is skipped."""
        commit = self._commit
        if commit.failure is not None:
            raise trio.BrokenResourceError("the journal writer failed") from commit.failure
        if self._closing:
            raise trio.ClosedResourceError("the journal is closed")
        size = len(payload)
        if size > MAX_PAYLOAD_BYTES:
            raise ValueError(f"payload of {size} bytes exceeds MAX_PAYLOAD_BYTES ({MAX_PAYLOAD_BYTES})")
        frame = FRAME_OVERHEAD + size
        lsn = commit.append(frame)
        tail = self._tail_size + frame
        if self._force_rotate or (tail > self._segment_bytes and tail != frame):  # (never rotate an empty one)
            self._splits.append((len(self._pending), lsn))
            self._force_rotate = False
            self._tail_first = lsn
            tail = frame
        elif self._tail_first is None:
            self._tail_first = lsn
        self._tail_size = tail
        lsn_bytes = LSN.pack(lsn)
        pending = self._pending
        word = (LSN_BYTES + size) | REBUILDABLE_BITS if rebuildable else LSN_BYTES + size
        pending += HEAD.pack(word, zlib.crc32(payload, zlib.crc32(lsn_bytes)))
        pending += lsn_bytes
        pending += payload
        total = self._total_bytes = self._total_bytes + size
        self._cum.append(total)
        if self._writer_idle:  # (cheaper than setting an Event that is already set, per append)
            self._writer_idle = False
            self._wakeup.set()
        elif self._awaited is not None and len(pending) >= self._hold_bytes:
            self._awaited.set()  # held back long enough: write it
        return lsn

    def has_room(self) -> bool:
        return self._commit.unwritten <= self._max_backlog_bytes

    async def wait_for_room(self) -> None:
        """Block the producer until the writer has drained the backlog to the bound.

        Returns at once, without a checkpoint, when there is room: this sits on the hot path.
        """
        while not self.has_room():
            self._raise_if_failed()
            await self._progress.wait()

    async def wait_durable(self, lsn: int) -> None:
        """Return once ``durable_lsn >= lsn``; at once (no checkpoint) when it already is."""
        commit = self._commit
        if commit.durable_lsn >= lsn:
            return
        if lsn > commit.last_lsn:
            raise ValueError(f"lsn {lsn} has not been appended (last_lsn is {commit.last_lsn})")
        self._durable_waiters += 1
        try:
            while commit.durable_lsn < lsn:
                self._raise_if_failed()
                if self._awaited is not None:
                    self._awaited.set()  # someone waits now: write what was held back
                await self._progress.wait()
        finally:
            self._durable_waiters -= 1

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        # Replaced per instance by GroupCommit's own method in __init__ (one call fewer per request).
        self._commit.call_when_durable(lsn, callback)

    def read(self, after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield the records after ``after_lsn`` and after the snapshot, up to ``durable_lsn`` as of now.

        Reads the files synchronously (startup, recovery, tests): do not call it on a hot path.
        """
        floor = max(after_lsn, self._snapshot_lsn or 0)
        return read_range(self._dir, floor, self._commit.durable_lsn, lambda: self._snapshot_lsn or 0, self._skip)

    def latest_snapshot(self) -> Snapshot | None:
        """Read the latest snapshot back from its file (it is not kept in memory: it can be big)."""
        while (lsn := self._snapshot_lsn) is not None:
            path = self._dir / snapshot_name(lsn)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                if self._snapshot_lsn != lsn:
                    continue  # replaced by a newer snapshot while we looked
                raise
            snapshot = decode_snapshot_file(data, lsn)
            if isinstance(snapshot, str):
                raise CorruptJournal(f"{path}: {snapshot}. {OPERATOR_HINT}")
            return snapshot
        return None

    async def write_snapshot(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` atomically, then compact: keep it and the previous snapshot, and the
        segments recovery from the previous one needs (see ``snapshot_files``).

        It first waits until the snapshot's records are durable, so a crash can never leave a snapshot
        that is ahead of its own log's acknowledged records. The segment currently being appended to is
        closed at the next append (not deleted now); a later snapshot removes it.
        """
        await self._before_install(snapshot.lsn)
        async with self._snapshot_lock:
            check_snapshot(snapshot.lsn, self._commit.last_lsn, self._snapshot_lsn)  # another may have won
            await trio.to_thread.run_sync(stage_snapshot_file, self._dir, snapshot)
            await self._install(snapshot.lsn)

    # -- snapshots staged by another process (SnapshotStaging) ------------------------------------

    def snapshot_stager(self) -> Callable[[Snapshot], None]:
        """``stage_snapshot_file`` bound to this directory: plain file I/O, safe in a forked child."""
        return functools.partial(stage_snapshot_file, self._dir)

    async def install_staged_snapshot(self, lsn: int) -> None:
        """``write_snapshot`` for a snapshot a stager already wrote and fsynced at ``lsn``."""
        await self._before_install(lsn)
        async with self._snapshot_lock:
            check_snapshot(lsn, self._commit.last_lsn, self._snapshot_lsn)
            await self._install(lsn)

    async def discard_staged_snapshot(self, lsn: int) -> None:
        # Unlinking a big file can take milliseconds (freeing its extents): not on the loop.
        await trio.to_thread.run_sync(discard_staged_snapshot_file, self._dir, lsn)

    async def _before_install(self, lsn: int) -> None:
        check_snapshot(lsn, self._commit.last_lsn, self._snapshot_lsn)
        if self._closing:
            raise trio.ClosedResourceError("the journal is closed")
        await self.wait_durable(lsn)

    async def _install(self, lsn: int) -> None:
        """Under ``_snapshot_lock``: rename the staged file into place, then move the bookkeeping and compact."""
        await trio.to_thread.run_sync(install_snapshot_file, self._dir, lsn)
        if lsn != self._snapshot_lsn:  # (rewriting the same lsn keeps the same previous)
            self._previous_snapshot_lsn = self._snapshot_lsn
        self._advance_snapshot(lsn)
        if self._tail_first is not None and self._tail_first <= lsn:
            self._force_rotate = True
        previous = self._previous_snapshot_lsn
        deleted = await trio.to_thread.run_sync(compact, self._dir, lsn, previous)
        self._segments = [first for first in self._segments if first not in deleted]

    def _advance_snapshot(self, lsn: int) -> None:
        """Move the snapshot bookkeeping to ``lsn``: only records after it count as "since"."""
        covered = lsn - (self._snapshot_lsn or 0)
        if covered > 0:
            self._bytes_at_snapshot = self._cum[covered - 1]
            del self._cum[:covered]
        self._snapshot_lsn = lsn

    # -- the writer -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The single writer task: ``await nursery.start(journal.run)``.

        Each turn takes everything appended so far and writes it in one thread call (under ALWAYS the
        fsync is in the same call), then acknowledges all of it at once. A thread call is never
        abandoned: trio cannot cancel it, and we do not ask it to.

        Shutdown order: (1) stop the producers (actors drained, no more appends); (2) ``await
        journal.aclose()``, which flushes and fsyncs what is pending, closes the segment and makes
        this method return; (3) leave the nursery. If this task is cancelled instead (a crash
        elsewhere, Ctrl-C), it finishes the write in progress, then flushes and fsyncs the remaining
        appended records (shielded) before re-raising. An OSError is raised at once (fail-stop).
        """
        if self._running:
            raise RuntimeError("the journal writer is already running")
        self._raise_if_failed()  # fail-stop: a failed journal is never written to again
        self._running = True
        task_status.started()
        try:
            await self._write_loop()
        except trio.Cancelled:
            if self._commit.failure is None:
                await self.aclose()
            raise
        finally:
            self._running = False

    async def aclose(self) -> None:
        """Flush and fsync every appended record (in every durability mode), close the segment file,
        refuse further appends and let ``run`` return. Idempotent.

        The flush is shielded from cancellation: a cancelled shutdown must still keep what actors
        appended. After a writer failure nothing is flushed (fail-stop); the file is only closed.
        """
        self._closing = True
        self._wakeup.set()
        if self._awaited is not None:
            self._awaited.set()
        with trio.CancelScope(shield=True):
            async with self._io_lock:
                if self._closed:
                    return
                if self._commit.failure is not None:
                    await trio.to_thread.run_sync(self._segment_writer.close, False)
                    self._closed = True
                    return
                chunks, batch = self._take_batch()
                try:
                    created, fsyncs = await trio.to_thread.run_sync(self._segment_writer.flush_and_close, chunks)
                except OSError as exc:
                    self._fail(exc)
                    raise
                self._synced_lsn = batch.last_lsn
                if chunks:
                    self._batch_written(batch, created, fsyncs)
                else:
                    self._fsyncs += fsyncs
                self._closed = True
                if self._io is not None:
                    self._io.close()
                    self._io = None

    def statistics(self) -> JournalStatistics:
        commit = self._commit
        return JournalStatistics(
            last_lsn=commit.last_lsn,
            durable_lsn=commit.durable_lsn,
            synced_lsn=self._synced_lsn,
            pending_bytes=commit.unwritten,
            peak_pending_bytes=commit.peak_unwritten,
            batches_written=self._batches,
            fsyncs=self._fsyncs,
            segments=len(self._segments),
            inline_batches=self._inline_batches,
            damaged_skipped=len(self._skip),
        )

    async def _write_loop(self) -> None:
        batch_mode = self._durability is Durability.BATCH
        always = self._durability is Durability.ALWAYS
        commit = self._commit
        while not self._closing:
            if always and self._pending and not self._is_awaited():
                await self._hold_unawaited()
            if self._pending:
                # A backlog that already fills a batch (a streamed message's writes, applied in one actor turn)
                # is taken in this very step, before the loop runs anything else: its fsync then runs in the
                # thread while the loop decides what comes next (the next message's writes get the next fsync
                # instead of waiting for this one's gather to end). Under the bound, gather as before.
                if (
                    self._durability is Durability.ALWAYS
                    and commit.last_lsn - commit.durable_lsn < GATHER_ENOUGH_RECORDS
                ):
                    await self._gather()
                await self._write_pending()
            elif batch_mode and self._synced_lsn < self._commit.durable_lsn:
                # A write is not yet covered by an fsync: make sure one happens within batch_interval
                # of the last one even if no further append arrives.
                deadline = self._last_sync + self._batch_interval
                if trio.current_time() >= deadline:
                    await self._sync_pending_writes()
                else:
                    with trio.move_on_at(deadline):
                        await self._wait_for_work()
            else:
                await self._wait_for_work()

    async def _gather(self) -> None:
        """ALWAYS: hold the fsync until the loop has nothing else runnable (GATHER_MAX_SECONDS at most).

        A request's append is often only the first of a burst: the other connections whose bytes were
        read in the same turn are still being parsed and decided, a few scheduling turns behind it.
        Taking the batch at the first append would give them the *next* fsync, a whole fsync later.
        Waiting until no task is runnable and no socket is ready lets the whole burst share one fsync;
        at low load the loop is idle a turn after the append, so this costs a scheduling turn, and under
        load the batch grows with the work in flight. The bound keeps a loop that never idles (a flood
        of reads or KV events) from starving the writer.
        """
        with trio.move_on_after(GATHER_MAX_SECONDS):
            await _wait_until_loop_idle()

    def _is_awaited(self) -> bool:
        """Whether anyone waits for a durable lsn (or for room), or the backlog must go out anyway."""
        return (
            self._commit.awaited
            or self._durable_waiters > 0
            or len(self._pending) >= self._hold_bytes
            or self._commit.last_lsn - self._commit.durable_lsn >= GATHER_ENOUGH_RECORDS
        )

    async def _hold_unawaited(self) -> None:
        """ALWAYS: nobody waits for what is pending (a KV flood's records: see ``UNAWAITED_HOLD_SECONDS``), so
        let more join it before the write and fsync: until someone waits for a durable lsn (a callback, or
        ``wait_durable``), ``UNAWAITED_HOLD_BYTES`` are pending, the journal closes, or the time is up.

        ``call_when_durable`` is swapped for one that also wakes the writer for as long as this lasts, so the
        requests' path pays nothing for it the rest of the time."""
        awaited = self._awaited = trio.Event()
        self.call_when_durable = self._call_when_durable_now  # type: ignore[method-assign]
        try:
            with trio.move_on_after(UNAWAITED_HOLD_SECONDS):
                await awaited.wait()
        finally:
            self._awaited = None
            self.call_when_durable = self._commit.call_when_durable  # type: ignore[method-assign]

    def _call_when_durable_now(self, lsn: int, callback: Callable[[], None]) -> None:
        """``call_when_durable`` while records are held back: the callback ends the hold."""
        self._commit.call_when_durable(lsn, callback)
        if self._awaited is not None:
            self._awaited.set()

    async def _wait_for_work(self) -> None:
        self._wakeup = trio.Event()
        self._writer_idle = True
        try:
            await self._wakeup.wait()
        finally:
            self._writer_idle = False

    async def _write_pending(self) -> None:
        # The lock is taken without a scheduling turn when it is free (it is, unless a snapshot or aclose
        # holds it): ``async with`` would let other tasks append to the batch before it is taken. A cancelled
        # writer still stops here (the thread call below is shielded, and a full backlog skips the gather).
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._io_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._io_lock.acquire()
        try:
            await self._write_batch()
        finally:
            self._io_lock.release()
        if self._durability is Durability.BATCH and trio.current_time() - self._last_sync >= self._batch_interval:
            await self._sync_pending_writes()

    async def _write_batch(self) -> None:
        """Under ``_io_lock``: take the pending frames and write them (and fsync them, under ALWAYS)."""
        if self._closing:
            return  # aclose took (or will take) the pending bytes
        always = self._durability is Durability.ALWAYS
        chunks, batch = self._take_batch()
        writer = self._segment_writer
        started = time.perf_counter()
        inline = self._writes_inline(chunks, batch.nbytes, always)
        try:
            if inline:
                created, fsyncs = writer.write(chunks, always)
            else:
                created, fsyncs = await self._io_thread().run(writer.write, chunks, always)
        except OSError as exc:
            self._fail(exc)
            raise
        if always:
            self._synced_lsn = batch.last_lsn
            self._last_sync = trio.current_time()
        self.batch_write_seconds.observe(time.perf_counter() - started)
        self._batch_written(batch, created, fsyncs)
        if inline:
            # Only now a checkpoint: a cancellation here cannot leave written chunks to be written again.
            self._inline_batches += 1
            await trio.lowlevel.checkpoint()

    def _writes_inline(self, chunks: list[Chunk], nbytes: int, always: bool) -> bool:
        """Whether the event loop writes this batch itself instead of handing it to the I/O thread.

        BATCH and OFF: a small write(2) into the page cache takes microseconds, a thread round trip ~80 µs of this
        loop's time. ALWAYS: a batch someone waits for (a request's answer waits for its fsync) is fsynced here too,
        while fsyncs are fast. The hand-over costs more than the overlap it buys: the thread must be woken and
        scheduled, and then woken the loop, and on a busy machine each wake-up can wait out another task's time
        slice (measured on 2 cores: a batch's write took ~1.2-1.9 ms through the thread against ~0.4-0.6 ms of
        fsync; inline ~0.6-0.95 ms, and the streamed lifecycle and the HTTP lifecycle at 16 clients ran faster,
        the latter's p99 about halved). Records nobody waits for (a KV flood's) keep the thread: the loop keeps
        answering reads during their fsync. A slow fsync (over ``INLINE_SYNC_MAX_SECONDS``: a disk under stress)
        sends the next batches to the thread, so a stalling disk blocks the loop for at most one fsync; they come
        back once the thread's fsyncs are fast again. New segments (preallocation, a directory fsync) always go to
        the thread."""
        if any(chunk.new_segment is not None for chunk in chunks):
            return False
        if not always:
            return nbytes <= INLINE_WRITE_BYTES
        return (
            nbytes <= INLINE_SYNC_BYTES
            and (self._commit.awaited or self._durable_waiters > 0)
            and self._segment_writer.last_fsync_seconds <= INLINE_SYNC_MAX_SECONDS
        )

    async def _sync_pending_writes(self) -> None:
        """BATCH only: fsync what was written and acknowledged without one."""
        async with self._io_lock:
            if self._closing:
                return
            target = self._commit.durable_lsn
            try:
                fsyncs = await self._io_thread().run(self._segment_writer.fsync)
            except OSError as exc:
                self._fail(exc)
                raise
            self._fsyncs += fsyncs
            self._synced_lsn = target
            self._last_sync = trio.current_time()

    def _take_batch(self) -> tuple[list[Chunk], Batch]:
        """Move the pending frames (after any chunks a cancelled write left behind) into a batch."""
        chunks = self._inflight
        buf, splits = self._pending, self._splits
        self._pending, self._splits = bytearray(), []
        view = memoryview(buf)
        starts: list[tuple[int, int | None]] = [(0, None), *splits]
        for i, (start, first) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(buf)
            if end > start:
                chunks.append(Chunk(first, view[start:end]))
        # Kept until written, so a cancelled thread call cannot lose them.
        return chunks, self._commit.take_batch()

    def _batch_written(self, batch: Batch, created: list[int], fsyncs: int) -> None:
        self._inflight = []
        self._segments.extend(created)
        self._batches += 1
        self._fsyncs += fsyncs
        self._commit.batch_written(batch)

    def _io_thread(self) -> IoThread:
        if self._io is None:
            self._io = IoThread()
        return self._io

    def _wake_waiters(self) -> None:
        event, self._progress = self._progress, trio.Event()
        event.set()

    def _fail(self, exc: OSError) -> None:
        # Debug only: the error stops the service, whose owner says what happened and what to do in one line.
        logger.debug(
            "journal write to %s failed; stopping (fail-stop, no retry): %s. Restart recovers "
            "every acknowledged record from the journal.",
            self._dir,
            exc,
        )
        self._commit.fail(exc)  # waiters raise BrokenResourceError instead of hanging

    def _raise_if_failed(self) -> None:
        if self._commit.failure is not None:
            raise trio.BrokenResourceError("the journal writer failed") from self._commit.failure
