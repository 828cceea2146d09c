"""The data directory's file names, and the small blocking file operations everything else uses.

Layout (anything else in the directory is left alone)::

    journal-<first lsn:020d>.log     segments, each a run of frames with consecutive LSNs
    snapshot-<lsn:020d>.snap         a snapshot: exactly one frame whose lsn is the snapshot's
    snapshot-<lsn:020d>.snap.tmp     a snapshot being written (ignored by recovery)
    quarantine-<lsn:020d>.frame      a record ``kvrouter journal quarantine`` moved out of the log, exactly as it
                                     was (ignored by recovery, kept by --fresh: for whoever looks into the damage)
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Final

logger = logging.getLogger("kvrouter.journal")

SEGMENT_RE: Final = re.compile(r"journal-(\d{20})\.log")
SNAPSHOT_RE: Final = re.compile(r"snapshot-(\d{20})\.snap")
SNAPSHOT_TMP_RE: Final = re.compile(r"snapshot-(\d{20})\.snap\.tmp")

OPERATOR_HINT: Final = (
    "Refusing to start: the records from here on cannot be trusted, and dropping them silently could "
    "lose acknowledged writes. Restore the data directory from a backup, or start with --fresh to "
    "discard the journal (all journaled state is lost)."
)


def segment_name(first_lsn: int) -> str:
    return f"journal-{first_lsn:020d}.log"


def snapshot_name(lsn: int) -> str:
    return f"snapshot-{lsn:020d}.snap"


def quarantine_name(lsn: int, attempt: int = 0) -> str:
    """The file a quarantined record's bytes go to (``attempt`` > 0: the name is taken by another copy)."""
    return f"quarantine-{lsn:020d}.frame" if attempt == 0 else f"quarantine-{lsn:020d}.{attempt}.frame"


def corrupt(path: Path, offset: int, lsn: int, problem: str, *, quarantine: bool = False) -> str:
    """The message of a ``CorruptJournal`` about one place in one file.

    ``quarantine``: the records after this one are intact, so moving only this one out is the repair to name.
    """
    inspect = f"`kvrouter journal inspect --data-dir {path.parent}` shows the log"
    if quarantine:
        return (
            f"journal corrupt: {path} at byte offset {offset} (lsn {lsn}): {problem}. Refusing to start: skipping "
            f"this record could lose an acknowledged write. The records after it are intact: to move only this one "
            f"out of the log (kept in a file beside it) and keep every other, run `kvrouter journal quarantine "
            f"--data-dir {path.parent} --lsn {lsn} --yes` ({inspect} and what the record held), or restore the data "
            f"directory from a backup."
        )
    cut = (
        f"To keep the records before it, cut the log there: `kvrouter journal truncate-after --data-dir "
        f"{path.parent} --lsn {lsn - 1} --yes` ({inspect})."
    )
    return f"journal corrupt: {path} at byte offset {offset} (lsn {lsn}): {problem}. {OPERATOR_HINT} {cut}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """(first lsn, path) of every segment file, oldest first."""
    found = []
    for path in directory.iterdir():
        if match := SEGMENT_RE.fullmatch(path.name):
            found.append((int(match[1]), path))
    return sorted(found)


def list_snapshots(directory: Path) -> list[tuple[int, Path]]:
    """(lsn, path) of every complete snapshot file, newest first (``.tmp`` files are not listed)."""
    found = []
    for path in directory.iterdir():
        if match := SNAPSHOT_RE.fullmatch(path.name):
            found.append((int(match[1]), path))
    return sorted(found, reverse=True)


def is_journal_file(name: str) -> bool:
    return bool(SEGMENT_RE.fullmatch(name) or SNAPSHOT_RE.fullmatch(name) or SNAPSHOT_TMP_RE.fullmatch(name))


def write_all_at(fd: int, data: memoryview | bytes, offset: int) -> int:
    """pwrite all of ``data`` at ``offset`` (preallocated files are written in place, not appended);
    returns the offset after it."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
    return offset


def write_all(fd: int, data: memoryview | bytes) -> None:
    """os.write may write less than asked (e.g. just before ENOSPC): loop until all is written."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate(path: Path, size: int) -> None:
    """Cut ``path`` to ``size`` bytes, durably."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(directory: Path) -> None:
    """``fresh=True``: delete the journal's own files, nothing else in the directory."""
    for path in directory.iterdir():
        if is_journal_file(path.name):
            path.unlink()
    fsync_dir(directory)
    logger.warning("journal: --fresh discarded every segment and snapshot in %s", directory)
