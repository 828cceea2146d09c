"""Operator tools on a stopped journal: look at it record by record, and cut it after an LSN.

Recovery refuses to start on a record it cannot use (a poison record: damaged, or one this build
cannot decode or apply) and names its LSN. ``inspect_records`` and ``inspect_snapshots`` show what
the directory holds without changing a byte; ``truncate_after`` drops every record after a chosen
LSN, and the snapshots that include them, so that the service starts again without them.

These work on the files directly and are blocking. The caller must make sure no kvrouter process
has the directory open (the service holds a lock on it while it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs

from kvrouter.journal.frames import FRAME_OVERHEAD, BadFrame, parse_frame
from kvrouter.journal.layout import SNAPSHOT_TMP_RE, fsync_dir, list_segments, list_snapshots, truncate
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
    """Where reading a segment stopped: the frame at ``offset`` is not the record ``lsn`` should be."""

    segment: str
    offset: int
    lsn: int  # the lsn expected there
    problem: str
    remaining: int  # bytes from offset to the end of the file


@attrs.frozen
class SnapshotInfo:
    lsn: int
    name: str
    size: int  # bytes of the file
    problem: str | None  # None when the file is a readable snapshot


def inspect_records(
    path: str | Path, *, after_lsn: int = 0, head_bytes: int = DEFAULT_HEAD_BYTES
) -> Iterator[RecordInfo | DamagedFrame]:
    """Every record in the segment files (lsn > ``after_lsn``) in order, read-only.

    A frame that fails its checks (damage, a torn tail, preallocated zeros, an unexpected lsn) is
    reported as a ``DamagedFrame``, and reading goes on with the next segment.
    """
    for first, segment in list_segments(Path(path)):
        data = segment.read_bytes()
        offset = 0
        expected = first
        while offset < len(data):
            parsed = parse_frame(data, offset)
            if isinstance(parsed, BadFrame):
                yield DamagedFrame(segment.name, offset, expected, parsed.detail, len(data) - offset)
                break
            lsn, end = parsed
            if lsn != expected:
                yield DamagedFrame(segment.name, offset, expected, f"found lsn {lsn} instead", len(data) - offset)
                break
            if lsn > after_lsn:
                start = offset + FRAME_OVERHEAD
                yield RecordInfo(lsn, segment.name, offset, end - start, data[start : min(end, start + head_bytes)])
            expected = lsn + 1
            offset = end


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
    records_removed: int  # readable records dropped (what follows damage in its segment cannot be counted)
    bytes_removed: int  # from the segment files
    segments_deleted: list[str]
    segment_cut: str | None  # the segment cut short, if any
    snapshots_deleted: list[str]
    cut_offset: int = 0  # where segment_cut is cut


class CannotTruncate(Exception):
    """Cutting there would leave a journal that cannot recover; nothing was changed."""


def plan_truncation(path: str | Path, lsn: int) -> Truncation:
    """What ``truncate_after(path, lsn)`` would do, changing nothing; raises ``CannotTruncate`` as it would."""
    directory = Path(path)
    if lsn < 0:
        raise ValueError("lsn must be >= 0")
    snapshots = inspect_snapshots(directory)
    base = max((s.lsn for s in snapshots if s.lsn <= lsn and s.problem is None), default=0)
    cut: tuple[str, int] | None = None  # (segment name, offset of the first frame to drop)
    removed = 0
    needed = base + 1  # the next record the kept log must hold
    for entry in inspect_records(directory, head_bytes=0):
        if isinstance(entry, DamagedFrame):
            if entry.lsn <= base:
                continue  # in a segment kept only for an older snapshot: recovery does not read it
            if entry.lsn <= lsn:
                raise CannotTruncate(
                    f"record {entry.lsn} is damaged ({entry.problem} in {entry.segment} at byte offset "
                    f"{entry.offset}): truncate after lsn {entry.lsn - 1} or earlier"
                )
            if cut is None:
                cut = (entry.segment, entry.offset)
        elif entry.lsn > lsn:
            removed += 1
            if cut is None:
                cut = (entry.segment, entry.offset)
        elif entry.lsn >= needed:
            if entry.lsn > needed:
                raise CannotTruncate(_missing(needed, entry.lsn - 1, snapshots))
            needed += 1
    if needed <= lsn:
        raise CannotTruncate(_missing(needed, lsn, snapshots))

    doomed_snapshots = [s.name for s in snapshots if s.lsn > lsn]
    for path_ in directory.iterdir():
        match = SNAPSHOT_TMP_RE.fullmatch(path_.name)
        if match and int(match[1]) > lsn:
            doomed_snapshots.append(path_.name)
    deleted = [segment for first, segment in list_segments(directory) if first > lsn]
    bytes_removed = sum(segment.stat().st_size for segment in deleted)
    segment_cut, cut_offset = None, 0
    if cut is not None and all(cut[0] != segment.name for segment in deleted):
        segment_cut, cut_offset = cut
        bytes_removed += (directory / segment_cut).stat().st_size - cut_offset
    return Truncation(
        lsn,
        removed,
        bytes_removed,
        [segment.name for segment in deleted],
        segment_cut,
        sorted(doomed_snapshots),
        cut_offset,
    )


def truncate_after(path: str | Path, lsn: int) -> Truncation:
    """Drop every record after ``lsn`` and every snapshot that includes one; keep everything else.

    Refuses (``CannotTruncate``, nothing changed) when the log that would be left is not a clean run
    of records from a readable snapshot (or from the first record) up to ``lsn``: a damaged record at
    or before ``lsn``, or records at or before ``lsn`` that only a newer snapshot still holds.

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
