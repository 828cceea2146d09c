"""Reading the data directory: the startup scan (with torn-tail repair) and reading records back.

Recovery truncates only a torn *tail* (an interrupted append at the end of the last segment). A bad
frame with data after it is damage, and silently dropping it would drop acknowledged writes, so the
scan raises ``CorruptJournal`` instead and leaves every file untouched. A tail that is a complete
frame failing its checksum is still cut (a torn write into preallocated space looks exactly like
that), but reported as an ERROR naming the file, offset and lsn: it may have been an acknowledged
record that rotted.

Two kinds of frame in the middle of the log are passed over instead (``Scan.skipped``; ``read_range`` then
skips the same ones): a damaged frame its writer marked rebuildable (``FrameKind.REBUILDABLE``) whose length
the next frame confirms, and a quarantine placeholder. Saying so is the caller's job: it knows what they held.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from kvrouter.journal.frames import (
    FRAME_OVERHEAD,
    HEAD,
    Bad,
    BadFrame,
    Tear,
    damaged_frame_end,
    find_next_frame,
    parse_frame,
    torn_tail,
)
from kvrouter.journal.layout import OPERATOR_HINT, corrupt, list_segments, list_snapshots, truncate
from kvrouter.journal.snapshot_files import find_snapshot
from kvrouter.journal.store import CorruptJournal, SkippedRecord

logger = logging.getLogger("kvrouter.journal")


@attrs.frozen
class Scan:
    """What a directory holds, once any torn tail is cut."""

    last_lsn: int
    snapshot_lsn: int | None  # the newest readable snapshot: recovery starts there
    previous_snapshot_lsn: int | None  # the next older snapshot file (compaction keeps it)
    segments: list[int]  # first lsns of the segment files left on disk
    tail_first: int | None  # the segment appends continue in, or None to start a new one
    tail_size: int
    sizes_after_snapshot: array.array[int]  # payload sizes of the records after the snapshot
    skipped: tuple[SkippedRecord, ...] = ()  # damaged rebuildable records and quarantine placeholders, passed over


@attrs.frozen
class _TornTail:
    path: Path
    offset: int
    tear: Tear
    cut: int  # bytes from offset to the end of the file
    lsn: int  # the lsn the bad frame should have had
    kept: int  # the last lsn left in the log


def scan_directory(directory: Path) -> Scan:
    """Check every segment recovery needs; cut a torn tail; raise ``CorruptJournal`` on anything else."""
    snapshot_lsn, unreadable = find_snapshot(directory)
    older = [lsn for lsn, _ in list_snapshots(directory) if snapshot_lsn is not None and lsn < snapshot_lsn]
    floor = snapshot_lsn or 0
    segments = list_segments(directory)
    previous = 0  # lsn of the last valid record seen
    sizes = array.array("q")
    tail_first: int | None = None
    tail_size = 0
    torn: _TornTail | None = None
    misnamed: Path | None = None
    skipped: list[SkippedRecord] = []
    for i, (first, path) in enumerate(segments):
        is_last = i == len(segments) - 1
        if not is_last and segments[i + 1][0] - 1 <= floor:
            continue  # wholly covered by the snapshot (kept for the previous one, or left by a crash)
        data = path.read_bytes()
        offset = 0
        segment_last: int | None = None
        while offset < len(data):
            expected = first if segment_last is None else segment_last + 1
            parsed = parse_frame(data, offset)
            if isinstance(parsed, BadFrame):
                tear = torn_tail(data, offset, expected, parsed) if is_last else None
                if tear is not None:
                    torn = _TornTail(path, offset, tear, len(data) - offset, expected, previous)
                    data = data[:offset]
                    break
                passed = _passed_over(data, path, offset, expected, parsed)
                if passed is None:
                    raise CorruptJournal(_damage(data, path, offset, expected, parsed))
                (lsn, end), skip = passed
                if lsn > floor:
                    skipped.append(skip)
            else:
                lsn, end = parsed
            problem = _out_of_order(lsn, expected, previous if segment_last is None else None, floor, unreadable)
            if problem is not None:
                raise CorruptJournal(corrupt(path, offset, expected if lsn != expected else lsn, problem))
            if lsn > floor:
                sizes.append(end - offset - FRAME_OVERHEAD)
            previous = segment_last = lsn
            offset = end
        if is_last:
            last_lsn = max(previous, floor)
            if segment_last is not None and segment_last == last_lsn:
                tail_first, tail_size = first, len(data)
            elif segment_last is None and first == last_lsn + 1:
                tail_first, tail_size = first, 0  # an empty segment from an interrupted rotation
            elif segment_last is None:
                misnamed = path  # empty and misnamed: appends start a correctly named segment
                segments.pop()
    last_lsn = max(previous, floor)
    if unreadable and (newest := unreadable[0][0]) > last_lsn:
        # Falling back would silently forget records newest covered: the log no longer has them.
        raise CorruptJournal(
            f"journal corrupt: the snapshot {unreadable[0][1]} is unreadable, and the log and older "
            f"snapshots only reach lsn {last_lsn} of its {newest}. {OPERATOR_HINT}"
        )
    # Only now that the whole directory checked out does recovery change any file.
    if torn is not None:
        _log_tear(torn)
        truncate(torn.path, torn.offset)
    if misnamed is not None:
        misnamed.unlink()
    return Scan(
        last_lsn=last_lsn,
        snapshot_lsn=snapshot_lsn,
        previous_snapshot_lsn=older[0] if older else None,
        segments=[first for first, _ in segments],
        tail_first=tail_first,
        tail_size=tail_size,
        sizes_after_snapshot=sizes,
        skipped=tuple(skipped),
    )


def _out_of_order(
    lsn: int, expected: int, previous: int | None, floor: int, unreadable: list[tuple[int, Path]]
) -> str | None:
    """Why a record's lsn cannot follow what came before, or None. ``previous``: the last lsn of the previous
    segments, given for a segment's first record only (where segments may overlap or leave a gap)."""
    if lsn != expected:
        return f"found lsn {lsn} instead"
    if previous is None:
        return None
    if lsn <= previous:
        return f"the segment overlaps the previous one, which ends at lsn {previous}"
    if lsn != previous + 1 and lsn > floor + 1:
        # A gap is only allowed where the snapshot covers it.
        problem = f"records {previous + 1}..{lsn - 1} are missing"
        if unreadable:
            problem += f" (only the unreadable snapshot {unreadable[0][1].name} covered them)"
        return problem
    return None


def _passed_over(
    data: bytes, path: Path, offset: int, lsn: int, bad: BadFrame
) -> tuple[tuple[int, int], SkippedRecord] | None:
    """((lsn, end), what was skipped) when the bad frame at ``offset`` (expected to hold ``lsn``) is one recovery
    passes over: a quarantine placeholder, or a damaged rebuildable frame whose length the next frame confirms."""
    if bad.kind is Bad.QUARANTINED:
        return (bad.lsn, offset + HEAD.size + bad.length), SkippedRecord(bad.lsn, path.name, offset, True)
    if bad.rebuildable:
        end = damaged_frame_end(data, offset, bad, lsn)
        if end is not None:
            return (lsn, end), SkippedRecord(lsn, path.name, offset, False)
    return None


def _damage(data: bytes, path: Path, offset: int, lsn: int, bad: BadFrame) -> str:
    """The refusal for damage mid-log: naming the quarantine of that one record when the records after it can
    be found (they are intact, and only this one is lost), else the cut before it."""
    movable = damaged_frame_end(data, offset, bad, lsn) is not None or find_next_frame(data, offset, lsn) is not None
    return corrupt(path, offset, lsn, bad.detail, quarantine=movable)


def _log_tear(torn: _TornTail) -> None:
    if torn.tear.suspicious:
        logger.error(
            "journal %s: the final frame at byte offset %d (lsn %d) is complete but fails its checksum; "
            "truncating it (%d bytes) as a torn append, the log now ends at lsn %d. If lsn %d had been "
            "acknowledged, this is disk damage: check the disk and keep a copy of the file",
            torn.path,
            torn.offset,
            torn.lsn,
            torn.cut,
            torn.kept,
            torn.lsn,
        )
    else:
        logger.warning(
            "journal %s: torn tail at offset %d (%s); truncating %d bytes, the log now ends at lsn %d",
            torn.path,
            torn.offset,
            torn.tear.why,
            torn.cut,
            torn.kept,
        )


def read_range(
    directory: Path, floor: int, limit: int, covered: Callable[[], int], skip: frozenset[int] = frozenset()
) -> Iterator[tuple[int, bytes]]:
    """Yield (lsn, payload) for floor < lsn <= limit from the segment files, checking each frame.

    ``covered()`` is the current snapshot lsn: a segment that vanished below it was compacted while
    we read, which is not damage. Quarantine placeholders and the damaged rebuildable records in ``skip``
    (the lsns the startup scan passed over) are not yielded; any other bad frame raises ``CorruptJournal``.
    """
    if floor >= limit:
        return
    segments = list_segments(directory)
    expected: int | None = None
    for i, (first, path) in enumerate(segments):
        if first > limit:
            return
        next_first = segments[i + 1][0] if i + 1 < len(segments) else None
        if next_first is not None and next_first - 1 <= floor:
            continue  # every record in it is at or below the floor
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if next_first is not None and next_first - 1 <= covered():
                continue
            raise
        offset = 0
        while offset < len(data):
            here = first if expected is None else expected
            parsed = parse_frame(data, offset)
            if isinstance(parsed, BadFrame):
                passed = _passed_over(data, path, offset, here, parsed)
                if passed is None or (not passed[1].quarantined and here not in skip):
                    raise CorruptJournal(corrupt(path, offset, here, parsed.detail))
                (lsn, end), _ = passed
                payload = None
            else:
                lsn, end = parsed
                payload = data[offset + FRAME_OVERHEAD : end]
            if expected is not None and lsn != expected:
                raise CorruptJournal(corrupt(path, offset, expected, f"found lsn {lsn}"))
            if lsn > floor and payload is not None:
                yield lsn, payload
            if lsn >= limit:
                return
            expected = lsn + 1
            offset = end
