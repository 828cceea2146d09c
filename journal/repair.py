"""Operator tools on a stopped journal: look at it record by record, move one record out, cut it after an LSN.

Recovery refuses to start on a record it cannot use (a poison record: damaged, or one this build
cannot decode or apply) and names its LSN. ``inspect_records`` and ``inspect_snapshots`` show what
the directory holds without changing a byte; ``quarantine`` moves one record out of the log (into a file
beside it) and keeps every other; ``truncate_after`` drops every record after a chosen LSN, and the
snapshots that include them, so that the service starts again without them.

These work on the files directly and are blocking. The caller must make sure no kvrouter process
has the directory open (the service holds a lock on it while it runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from kvrouter.journal.frames import (
    FRAME_OVERHEAD,
    HEAD,
    MAX_BODY,
    Bad,
    BadFrame,
    damaged_frame_end,
    find_next_frame,
    parse_frame,
    quarantine_frame,
)
from kvrouter.journal.layout import (
    SNAPSHOT_TMP_RE,
    fsync_dir,
    list_segments,
    list_snapshots,
    quarantine_name,
    truncate,
    write_all_at,
)
from kvrouter.journal.snapshot_files import decode_snapshot_file
from kvrouter.journal.store import Snapshot

DEFAULT_HEAD_BYTES = 32


@attrs.frozen
class RecordInfo:
    lsn: int
    segment: str  # file name
    offset: int  # of the frame in the segment
    size: int  # payload bytes
    head: bytes  # the payload's first bytes


@attrs.frozen
class DamagedFrame:
    """A frame at ``offset`` that is not the record ``lsn`` should be."""

    segment: str
    offset: int
    lsn: int  # the lsn expected there
    problem: str
    remaining: int  # bytes from offset to the end of the file
    # Where the next record starts, if it can be found (the records after it are then read on); None: reading
    # that segment stopped here.
    end: int | None = None
    rebuildable: bool = False  # its writer marked it rebuildable and its length is confirmed: recovery skips it
    head: bytes = b""  # the damaged payload's first bytes (as far as ``end`` tells where it ends)


@attrs.frozen
class QuarantinedRecord:
    """The placeholder ``quarantine`` left where record ``lsn`` was (recovery passes over it)."""

    lsn: int
    segment: str
    offset: int
    size: int  # bytes of the frame


@attrs.frozen
class SnapshotInfo:
    lsn: int
    name: str
    size: int  # bytes of the file
    problem: str | None  # None when the file is a readable snapshot


def inspect_records(
    path: str | Path, *, after_lsn: int = 0, head_bytes: int = DEFAULT_HEAD_BYTES
) -> Iterator[RecordInfo | DamagedFrame | QuarantinedRecord]:
    """Every record in the segment files (lsn > ``after_lsn``) in order, read-only.

    A frame that fails its checks (damage, a torn tail, preallocated zeros, an unexpected lsn) is reported as a
    ``DamagedFrame`` (whatever its lsn); reading goes on after it when the next record can be found (its own length
    says where, or a valid frame of the next lsn further on), else with the next segment.
    """
    for first, segment in list_segments(Path(path)):
        data = segment.read_bytes()
        offset = 0
        expected = first
        while offset < len(data):
            parsed = parse_frame(data, offset)
            if isinstance(parsed, BadFrame) and parsed.kind is Bad.QUARANTINED and parsed.lsn == expected:
                size = HEAD.size + parsed.length
                if expected > after_lsn:
                    yield QuarantinedRecord(expected, segment.name, offset, size)
                expected += 1
                offset += size
                continue
            if isinstance(parsed, BadFrame):
                damaged = _damaged(data, segment.name, offset, expected, parsed, head_bytes)
                yield damaged
                if damaged.end is None:
                    break
                expected += 1
                offset = damaged.end
                continue
            lsn, end = parsed
            if lsn != expected:
                yield DamagedFrame(segment.name, offset, expected, f"found lsn {lsn} instead", len(data) - offset)
                break
            if lsn > after_lsn:
                start = offset + FRAME_OVERHEAD
                yield RecordInfo(lsn, segment.name, offset, end - start, data[start : min(end, start + head_bytes)])
            expected = lsn + 1
            offset = end


def _damaged(data: bytes, segment: str, offset: int, lsn: int, bad: BadFrame, head_bytes: int) -> DamagedFrame:
    confirmed = damaged_frame_end(data, offset, bad, lsn)
    end = confirmed if confirmed is not None else find_next_frame(data, offset, lsn)
    start = offset + FRAME_OVERHEAD
    head = data[start : min(end, start + head_bytes)] if end is not None else b""
    rebuildable = confirmed is not None and bad.rebuildable
    return DamagedFrame(segment, offset, lsn, bad.detail, len(data) - offset, end, rebuildable, head)


def inspect_snapshots(path: str | Path) -> list[SnapshotInfo]:
    """Every snapshot file, newest first, each checked (frame, checksum, lsn); read-only."""
    found = []
    for lsn, snapshot in list_snapshots(Path(path)):
        data = snapshot.read_bytes()
        decoded = decode_snapshot_file(data, lsn)
        problem = None if isinstance(decoded, Snapshot) else decoded
        found.append(SnapshotInfo(lsn, snapshot.name, len(data), problem))
    return found


@attrs.frozen
class Truncation:
    """What ``truncate_after`` changed (or, from ``plan_truncation``, would change)."""

    lsn: int  # the last lsn left in the log
    records_removed: int  # readable records dropped
    bytes_removed: int  # from the segment files
    segments_deleted: list[str]
    segment_cut: str | None  # the segment cut short, if any
    snapshots_deleted: list[str]
    cut_offset: int = 0  # where segment_cut is cut
    damaged_removed: int = 0  # damaged records dropped (not counted in records_removed)
    quarantined_removed: int = 0  # quarantine placeholders dropped
    unreadable_bytes: int = 0  # dropped bytes past damage where no further record could be found


class CannotTruncate(Exception):
    """Cutting there would leave a journal that cannot recover; nothing was changed."""


@attrs.define
class _Tally:
    """What a cut after ``lsn`` drops, counted while the records are read."""

    lsn: int
    cut: tuple[str, int] | None = None  # (segment name, offset of the first frame to drop)
    records: int = 0
    damaged: int = 0
    quarantined: int = 0
    unreadable: int = 0

    def drop(self, entry: RecordInfo | DamagedFrame | QuarantinedRecord) -> None:
        if self.cut is None:
            self.cut = (entry.segment, entry.offset)
        if isinstance(entry, RecordInfo):
            self.records += 1
        elif isinstance(entry, QuarantinedRecord):
            self.quarantined += 1
        else:
            self.damaged += 1
            if entry.end is None:
                self.unreadable += entry.remaining  # (the damaged frame and all after it in its segment)


def plan_truncation(path: str | Path, lsn: int) -> Truncation:
    """What ``truncate_after(path, lsn)`` would do, changing nothing; raises ``CannotTruncate`` as it would."""
    directory = Path(path)
    if lsn < 0:
        raise ValueError("lsn must be >= 0")
    snapshots = inspect_snapshots(directory)
    base = max((s.lsn for s in snapshots if s.lsn <= lsn and s.problem is None), default=0)
    tally = _Tally(lsn)
    needed = base + 1  # the next record the kept log must hold
    for entry in inspect_records(directory, head_bytes=0):
        if entry.lsn <= base:
            continue  # covered by the snapshot the cut keeps (or kept only for an older one): recovery does not read it
        if entry.lsn > lsn:
            tally.drop(entry)
            continue
        if isinstance(entry, DamagedFrame) and not entry.rebuildable:
            raise CannotTruncate(
                f"record {entry.lsn} is damaged ({entry.problem} in {entry.segment} at byte offset {entry.offset}): "
                f"move it out of the log first (quarantine), or truncate after lsn {entry.lsn - 1} or earlier"
            )
        if entry.lsn >= needed:
            if entry.lsn > needed:
                raise CannotTruncate(_missing(needed, entry.lsn - 1, snapshots))
            needed += 1
    if needed <= lsn:
        raise CannotTruncate(_missing(needed, lsn, snapshots))
    return _truncation(directory, tally, snapshots)


def _truncation(directory: Path, tally: _Tally, snapshots: list[SnapshotInfo]) -> Truncation:
    lsn = tally.lsn
    doomed_snapshots = [s.name for s in snapshots if s.lsn > lsn]
    for path_ in directory.iterdir():
        match = SNAPSHOT_TMP_RE.fullmatch(path_.name)
        if match and int(match[1]) > lsn:
            doomed_snapshots.append(path_.name)
    deleted = [segment for first, segment in list_segments(directory) if first > lsn]
    bytes_removed = sum(segment.stat().st_size for segment in deleted)
    segment_cut, cut_offset = None, 0
    if tally.cut is not None and all(tally.cut[0] != segment.name for segment in deleted):
        segment_cut, cut_offset = tally.cut
        bytes_removed += (directory / segment_cut).stat().st_size - cut_offset
    return Truncation(
        lsn,
        tally.records,
        bytes_removed,
        [segment.name for segment in deleted],
        segment_cut,
        sorted(doomed_snapshots),
        cut_offset,
        tally.damaged,
        tally.quarantined,
        tally.unreadable,
    )


def truncate_after(path: str | Path, lsn: int) -> Truncation:
    """Drop every record after ``lsn`` and every snapshot that includes one; keep everything else.

    Refuses (``CannotTruncate``, nothing changed) when the log that would be left is not a clean run
    of records from a readable snapshot (or from the first record) up to ``lsn``: a damaged record at
    or before ``lsn`` (but a rebuildable one recovery skips), or records at or before ``lsn`` that only a
    newer snapshot still holds.

    Crash-safe order: snapshots after ``lsn`` go first, then whole segments from the newest back, then
    the cut; an interruption leaves a shorter log that recovers, and running it again finishes.
    """
    directory = Path(path)
    plan = plan_truncation(directory, lsn)
    for name in plan.snapshots_deleted:
        (directory / name).unlink()
    fsync_dir(directory)
    for name in reversed(plan.segments_deleted):
        (directory / name).unlink()
    fsync_dir(directory)
    if plan.segment_cut is not None:
        truncate(directory / plan.segment_cut, plan.cut_offset)
    return plan


def _missing(first: int, last: int, snapshots: list[SnapshotInfo]) -> str:
    newer = [s.name for s in snapshots if s.lsn >= last and s.problem is None]
    where = f" (only in {newer[-1]})" if newer else ""
    return (
        f"records {first}..{last} are no longer in the log{where}: cutting there would leave nothing to "
        "recover them from; choose a later lsn"
    )


@attrs.frozen
class Quarantine:
    """What ``quarantine`` moved (or, from ``plan_quarantine``, would move) out of the log."""

    lsn: int
    segment: str
    offset: int
    size: int  # bytes of the frame, header included
    kept_in: str  # the file beside the log that holds them, exactly as they were
    problem: str | None  # why it is damaged, or None for an intact record the caller asked to move
    rebuildable: bool  # damaged, and its writer marked it rebuildable (recovery skips it anyway)
    head: bytes = b""  # the payload's first bytes as they are on disk


class CannotQuarantine(Exception):
    """That record cannot be moved out; nothing was changed."""


def plan_quarantine(path: str | Path, lsn: int, *, intact: bool = False) -> Quarantine:
    """What ``quarantine(path, lsn)`` would do, changing nothing; raises ``CannotQuarantine`` as it would.

    Only a damaged record is moved, unless ``intact``: then an intact one too (the caller knows recovery cannot
    use it: this module does not read payloads)."""
    directory = Path(path)
    for entry in inspect_records(directory, after_lsn=max(lsn - 1, 0), head_bytes=MAX_BODY):
        if entry.lsn < lsn:
            continue
        if entry.lsn > lsn:
            break
        if isinstance(entry, QuarantinedRecord):
            where = f"{entry.segment} at byte offset {entry.offset}"
            raise CannotQuarantine(f"record {lsn} is already quarantined ({where})")
        if isinstance(entry, RecordInfo):
            if not intact:
                raise CannotQuarantine(
                    f"record {lsn} is intact (its checksum holds) and recovery can use it: quarantine moves out a "
                    "damaged record, or one recovery cannot use"
                )
            size = FRAME_OVERHEAD + entry.size
            return Quarantine(lsn, entry.segment, entry.offset, size, _kept_in(directory, lsn), None, False, entry.head)
        if entry.end is None:
            raise CannotQuarantine(
                f"record {lsn} is damaged ({entry.problem} in {entry.segment} at byte offset {entry.offset}) and no "
                "record after it can be found in that segment: if it is the log's torn tail, recovery cuts it by "
                f"itself; otherwise cut the log before it (truncate after lsn {lsn - 1})"
            )
        size = entry.end - entry.offset
        if size < FRAME_OVERHEAD:
            raise CannotQuarantine(f"record {lsn} takes {size} bytes, too few for a placeholder: cut the log instead")
        kept = _kept_in(directory, lsn)
        return Quarantine(lsn, entry.segment, entry.offset, size, kept, entry.problem, entry.rebuildable, entry.head)
    raise CannotQuarantine(f"the log holds no record {lsn}")


def quarantine(path: str | Path, lsn: int, *, intact: bool = False) -> Quarantine:
    """Move record ``lsn`` out of the log: its bytes go, exactly as they are, to a new file beside the log
    (``Quarantine.kept_in``), and a placeholder of the same size takes its place, which recovery passes over
    (``FrameKind.QUARANTINED``). Every other byte of the log stays as it is. Refuses as ``plan_quarantine`` does.

    Crash-safe order: the copy is written and made durable before the record is overwritten; an interruption
    leaves the record damaged, and running it again finishes (the first copy is never overwritten).
    """
    directory = Path(path)
    plan = plan_quarantine(directory, lsn, intact=intact)
    segment = directory / plan.segment
    with segment.open("rb") as file:
        file.seek(plan.offset)
        original = file.read(plan.size)
    _write_new_file(directory / plan.kept_in, original)
    fd = os.open(segment, os.O_WRONLY)
    try:
        write_all_at(fd, quarantine_frame(lsn, plan.size), plan.offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return plan


def _kept_in(directory: Path, lsn: int) -> str:
    """A name no file has yet: an lsn can be quarantined again after a cut (lsns are reused)."""
    attempt = 0
    while (directory / quarantine_name(lsn, attempt)).exists():
        attempt += 1
    return quarantine_name(lsn, attempt)


def _write_new_file(path: Path, data: bytes) -> None:
    """``data`` in a new file at ``path``, durably (the file, then its name)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all_at(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
