"""Snapshot files: written atomically, read back with their checksum checked, and the compaction policy.

Compaction keeps the newest two snapshots and every segment needed to recover from the older one,
so that a newest snapshot found unreadable at startup (bit rot, a bad disk block) costs a longer
replay instead of the data: recovery falls back to the previous snapshot plus the log after it.
Before the second snapshot exists, "the previous one" is the empty state at lsn 0, so no segment is
deleted by the first snapshot. The disk holds at most about two snapshot intervals of log.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

from kvrouter.journal.frames import FRAME_OVERHEAD, BadFrame, encode_frame, parse_frame
from kvrouter.journal.layout import (
    SNAPSHOT_RE,
    SNAPSHOT_TMP_RE,
    fsync_dir,
    list_segments,
    list_snapshots,
    snapshot_name,
    write_all,
)
from kvrouter.journal.store import Snapshot

logger = logging.getLogger("kvrouter.journal")


def write_snapshot_file(directory: Path, snapshot: Snapshot) -> None:
    """tmp file, fsync, atomic rename, fsync the directory: the file is either whole or absent."""
    final_path = directory / snapshot_name(snapshot.lsn)
    tmp_path = final_path.with_name(final_path.name + ".tmp")
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, encode_frame(snapshot.lsn, snapshot.payload))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp_path, final_path)
    fsync_dir(directory)


def decode_snapshot_file(data: bytes, lsn: int) -> Snapshot | str:
    """The snapshot in a file's bytes, or why they are not one (``lsn`` comes from the file name)."""
    parsed = parse_frame(data, 0)
    if isinstance(parsed, BadFrame):
        return parsed.detail
    frame_lsn, end = parsed
    if end != len(data):
        return f"{len(data) - end} unexpected bytes after the snapshot frame"
    if frame_lsn != lsn:
        return f"the frame says lsn {frame_lsn}, the file name says {lsn}"
    return Snapshot(lsn=lsn, payload=data[FRAME_OVERHEAD:])


def find_snapshot(directory: Path) -> tuple[int | None, list[tuple[int, Path]]]:
    """The lsn of the newest readable snapshot file, and the newer ones that were unreadable."""
    for path in directory.iterdir():
        if SNAPSHOT_TMP_RE.fullmatch(path.name):
            logger.warning("journal: ignoring %s, left over from an interrupted snapshot write", path)
    unreadable: list[tuple[int, Path]] = []
    for lsn, path in list_snapshots(directory):
        decoded = decode_snapshot_file(path.read_bytes(), lsn)
        if isinstance(decoded, Snapshot):
            return lsn, unreadable
        logger.warning("journal: snapshot %s is unreadable (%s); trying an older one", path, decoded)
        unreadable.append((lsn, path))
    return None, unreadable


def compact(directory: Path, newest: int, previous: int | None) -> set[int]:
    """Keep the snapshots at ``newest`` and ``previous`` (None: the empty state) and the segments
    recovery from ``previous`` needs; delete every other snapshot (and ``.tmp``) file and every closed
    segment wholly covered by ``previous``. Returns the first lsns of the deleted segments.

    The last segment on disk is never deleted: the writer may still be appending to it.
    """
    floor = previous or 0
    deleted: set[int] = set()
    for (first, path), (next_first, _) in itertools.pairwise(list_segments(directory)):
        if next_first - 1 <= floor:
            path.unlink()
            deleted.add(first)
    keep = {snapshot_name(newest)} | ({snapshot_name(previous)} if previous is not None else set())
    for path in directory.iterdir():
        match = SNAPSHOT_RE.fullmatch(path.name) or SNAPSHOT_TMP_RE.fullmatch(path.name)
        if match and path.name not in keep:
            path.unlink()
    fsync_dir(directory)
    return deleted
