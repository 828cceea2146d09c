"""Snapshot files: written atomically, read back with their checksum checked, and the compaction policy.

Writing is two steps so that another process can do the slow one: ``stage_snapshot_file`` writes and
fsyncs ``snapshot-<lsn>.snap.tmp`` (plain file I/O, no locks, no trio: safe in a forked child), and
``install_snapshot_file`` renames it into place and fsyncs the directory (the journal does that, once
the records the snapshot covers are durable). Recovery ignores ``.tmp`` files.

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
import zlib
from pathlib import Path

from kvrouter.journal.frames import FRAME_OVERHEAD, HEADER, LSN, MAX_PAYLOAD_BYTES, BadFrame, parse_frame
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


def staged_snapshot_path(directory: Path, lsn: int) -> Path:
    return directory / (snapshot_name(lsn) + ".tmp")


def stage_snapshot_file(directory: Path, snapshot: Snapshot) -> None:
    """Write and fsync the snapshot's ``.tmp`` file (replacing any earlier one at that lsn).

    Only ``os`` calls and a checksum: a forked child of the multi-threaded service may call it.
    """
    size = len(snapshot.payload)
    if size > MAX_PAYLOAD_BYTES:
        # A bigger frame would be written fine and then refused by every reader as corrupt.
        raise ValueError(f"snapshot payload of {size} bytes exceeds MAX_PAYLOAD_BYTES ({MAX_PAYLOAD_BYTES})")
    crc = zlib.crc32(snapshot.payload, zlib.crc32(LSN.pack(snapshot.lsn)))
    fd = os.open(staged_snapshot_path(directory, snapshot.lsn), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, HEADER.pack(LSN.size + size, crc, snapshot.lsn))
        write_all(fd, snapshot.payload)  # (not concatenated with the header: the payload can be big)
        os.fsync(fd)
    finally:
        os.close(fd)


def install_snapshot_file(directory: Path, lsn: int) -> None:
    """Atomically rename the staged file into place and fsync the directory: whole or absent."""
    os.replace(staged_snapshot_path(directory, lsn), directory / snapshot_name(lsn))
    fsync_dir(directory)


def discard_staged_snapshot_file(directory: Path, lsn: int) -> None:
    """Remove what a failed or abandoned staging left (if anything)."""
    staged_snapshot_path(directory, lsn).unlink(missing_ok=True)


def write_snapshot_file(directory: Path, snapshot: Snapshot) -> None:
    """Both steps in one call: tmp file, fsync, atomic rename, fsync the directory."""
    stage_snapshot_file(directory, snapshot)
    install_snapshot_file(directory, snapshot.lsn)


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
    recovery from ``previous`` needs; delete every other snapshot file, every ``.tmp`` file at or
    below ``newest``, and every closed segment wholly covered by ``previous``. Returns the first lsns
    of the deleted segments.

    The last segment on disk is never deleted: the writer may still be appending to it. A ``.tmp``
    above ``newest`` may be a snapshot being staged right now; the first snapshot past it removes it.
    """
    floor = previous or 0
    deleted: set[int] = set()
    for (first, path), (next_first, _) in itertools.pairwise(list_segments(directory)):
        if next_first - 1 <= floor:
            path.unlink()
            deleted.add(first)
    keep = {snapshot_name(newest)} | ({snapshot_name(previous)} if previous is not None else set())
    for path in directory.iterdir():
        staged = SNAPSHOT_TMP_RE.fullmatch(path.name)
        stale = int(staged[1]) <= newest if staged else SNAPSHOT_RE.fullmatch(path.name) and path.name not in keep
        if stale:
            path.unlink()
    fsync_dir(directory)
    return deleted
