"""The blocking half of the writer: segment files opened, preallocated, written, fsynced and closed.

Only one thread at a time uses a ``SegmentWriter`` (``FileJournal`` holds its I/O lock around every
call, which may run in the journal's I/O thread). Where each chunk goes was decided at append time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import attrs

from kvrouter.journal.latency import BucketCounts
from kvrouter.journal.layout import fsync_dir, segment_name, write_all_at


@attrs.frozen
class Chunk:
    """Framed records to write; ``new_segment`` is the first lsn of a segment this chunk starts."""

    new_segment: int | None
    data: memoryview


class SegmentWriter:
    def __init__(self, directory: Path, tail_first: int | None, preallocate_bytes: int) -> None:
        self._dir = directory
        self._fd: int | None = None
        self._fd_first = tail_first  # the segment the next unsplit chunk goes to
        self._offset = 0  # where the next frame goes in the open segment
        self._preallocate_bytes = preallocate_bytes  # 0: grow the file as it is written
        self._dirty = False
        self.fsync_seconds = BucketCounts()  # each segment fsync's duration, for metrics
        self.last_fsync_seconds = 0.0  # the latest one's (the journal's choice of who writes: ``_writes_inline``)

    def write(self, chunks: list[Chunk], sync: bool) -> tuple[list[int], int]:
        """Write ``chunks`` in order (with ``sync``, then fsync); returns (segments created, fsyncs)."""
        created: list[int] = []
        fsyncs = 0
        for chunk in chunks:
            if chunk.new_segment is not None:
                fsyncs += self.close(True)
                first = chunk.new_segment
                self._fd = os.open(self._dir / segment_name(first), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                self._offset = 0
                self._preallocate()
                self._fd_first = first
                fsync_dir(self._dir)  # the new name itself must survive a crash
                created.append(first)
            elif self._fd is None:
                assert self._fd_first is not None, "a chunk without a segment to continue"
                self._fd = os.open(self._dir / segment_name(self._fd_first), os.O_WRONLY)
                self._offset = os.fstat(self._fd).st_size
                self._preallocate()
            self._offset = write_all_at(self._fd, chunk.data, self._offset)
            self._dirty = True
        if sync:
            fsyncs += self.fsync()
        return created, fsyncs

    def fsync(self) -> int:
        if self._fd is None or not self._dirty:
            return 0
        started = time.perf_counter()
        os.fsync(self._fd)
        took = self.last_fsync_seconds = time.perf_counter() - started
        self.fsync_seconds.observe(took)
        self._dirty = False
        return 1

    def close(self, sync: bool) -> int:
        """Close the current segment, cutting its unused preallocated tail; with ``sync``, fsync it
        first (a closed segment is final). Returns the fsyncs made."""
        if self._fd is None:
            return 0
        if self._preallocate_bytes and os.fstat(self._fd).st_size > self._offset:
            os.ftruncate(self._fd, self._offset)
            self._dirty = True
        fsyncs = self.fsync() if sync else 0
        os.close(self._fd)
        self._fd = None
        return fsyncs

    def flush_and_close(self, chunks: list[Chunk]) -> tuple[list[int], int]:
        created, fsyncs = self.write(chunks, False) if chunks else ([], 0)
        return created, fsyncs + self.close(True)

    def _preallocate(self) -> None:
        """Reserve the segment's blocks up front: an fsync that need not also grow the file takes
        about half as long (measured here: ~110 µs instead of ~210 µs). The zeros past the last
        frame are cut when the segment is closed, and by recovery after a crash."""
        assert self._fd is not None
        target = self._offset + self._preallocate_bytes
        if self._preallocate_bytes and os.fstat(self._fd).st_size < target:
            try:
                os.posix_fallocate(self._fd, self._offset, self._preallocate_bytes)
                os.fsync(self._fd)
            except OSError:  # a filesystem without fallocate: write as it grows
                self._preallocate_bytes = 0
