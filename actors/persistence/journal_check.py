"""A dry run of recovery over a stopped data directory: where it would stop, and why. Changes no byte.

The journal's own checks (frames, checksums, lsns: ``journal/repair.py``) cannot see a record that is
intact but that this build cannot decode or apply (a poison record); only replaying it can. ``kvrouter
journal inspect`` prints this check, and ``kvrouter journal truncate-after`` refuses a cut that would
leave such a record in the log.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import attrs

from kvrouter.actors.core.events import EVENT_TAGS
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record
from kvrouter.actors.persistence.recovery import PoisonRecord, replay
from kvrouter.actors.persistence.snapshots import UnreadableSnapshot, restore_snapshot
from kvrouter.journal.frames import MAX_PAYLOAD_BYTES, BadFrame, parse_frame, torn_tail
from kvrouter.journal.layout import list_segments, snapshot_name
from kvrouter.journal.repair import DamagedFrame, QuarantinedRecord, inspect_records, inspect_snapshots
from kvrouter.journal.snapshot_files import decode_snapshot_file
from kvrouter.journal.store import Snapshot

HEAD_SHOWN = 32  # bytes of an undecodable record shown


@attrs.frozen
class Stop:
    """Recovery would refuse to start at ``lsn``; ``kind`` is record (poison), damage, gap or snapshot."""

    kind: str
    lsn: int
    problem: str
    movable: bool = False  # only this record need go: the records after it are intact (``kvrouter journal quarantine``)


@attrs.frozen
class TornTail:
    """Bytes at the end of the last segment that recovery cuts (an append a crash interrupted)."""

    segment: str
    offset: int
    size: int
    why: str
    suspicious: bool  # a complete frame failing its checksum: recovery logs it as an error


@attrs.frozen
class RecoveryCheck:
    snapshot_lsn: int  # recovery starts from this snapshot (0: from the first record)
    last_lsn: int  # the last record recovery would apply (or pass over: ``skipped``)
    replayed: int  # records replayed after the snapshot
    scopes: int  # scopes recovered up to last_lsn
    stop: Stop | None
    torn_tail: TornTail | None
    skipped: tuple[int, ...] = ()  # damaged rebuildable records and quarantine placeholders recovery passes over


def describe_record(payload: bytes) -> str:
    """One line saying what a record holds: its scope and event tags, or why it does not decode."""
    try:
        record = decode_record(payload)
    except RecordFormatError as exc:
        return f"UNDECODABLE ({_one_line(str(exc))}); starts {payload[:HEAD_SHOWN]!r}"
    tags = Counter(EVENT_TAGS[type(event)] for event in record.events)
    events = ", ".join(tag if count == 1 else f"{tag} x{count}" for tag, count in tags.items())
    return f"{record.scope.describe()}: {events or 'no events'}"


def check_recovery(path: str | Path, upto: int | None = None) -> RecoveryCheck:
    """Replay the directory as recovery would (records up to ``upto`` only, if given), without writing."""
    directory = Path(path)
    base, states, stop = _restore_newest_snapshot(directory, upto)
    last = base
    replayed = 0
    torn: TornTail | None = None
    skipped: list[int] = []
    if stop is None:
        segments = list_segments(directory)
        last_segment = segments[-1][1].name if segments else None
        for entry in inspect_records(directory, after_lsn=base, head_bytes=MAX_PAYLOAD_BYTES):
            if entry.lsn <= base:
                continue  # in a segment kept only for an older snapshot: recovery does not read it
            if upto is not None and entry.lsn > upto:
                break
            if isinstance(entry, DamagedFrame):
                torn = _torn_tail(directory, entry) if entry.segment == last_segment else None
                if torn is None and entry.rebuildable and entry.lsn == last + 1:
                    skipped.append(entry.lsn)  # as the startup scan: passed over
                    last = entry.lsn
                    continue
                if torn is None:
                    problem = f"{entry.problem} in {entry.segment} at byte offset {entry.offset}"
                    stop = Stop("damage", entry.lsn, problem, movable=entry.end is not None)
                break
            if entry.lsn != last + 1:
                stop = Stop("gap", last + 1, f"records {last + 1}..{entry.lsn - 1} are missing")
                break
            if isinstance(entry, QuarantinedRecord):
                skipped.append(entry.lsn)
                last = entry.lsn
                continue
            try:
                replay(states, [(entry.lsn, entry.head)])
            except PoisonRecord as exc:
                stop = Stop("record", exc.lsn, exc.problem, movable=True)
                break
            last = entry.lsn
            replayed += 1
    return RecoveryCheck(base, last, replayed, len(states), stop, torn, tuple(skipped))


def _restore_newest_snapshot(directory: Path, upto: int | None) -> tuple[int, dict[ScopeKey, ScopeState], Stop | None]:
    """Recovery starts from the newest readable snapshot (one a cut at ``upto`` keeps)."""
    for info in inspect_snapshots(directory):
        if info.problem is not None or (upto is not None and info.lsn > upto):
            continue
        decoded = decode_snapshot_file((directory / info.name).read_bytes(), info.lsn)
        assert isinstance(decoded, Snapshot)
        try:
            return info.lsn, restore_snapshot(decoded.payload), None
        except UnreadableSnapshot as exc:
            return info.lsn, {}, Stop("snapshot", info.lsn, f"{snapshot_name(info.lsn)}: {exc.problem}")
    return 0, {}, None


def _torn_tail(directory: Path, damaged: DamagedFrame) -> TornTail | None:
    data = (directory / damaged.segment).read_bytes()
    bad = parse_frame(data, damaged.offset)
    if not isinstance(bad, BadFrame):
        return None  # a valid frame with an unexpected lsn: damage, not a tear
    tear = torn_tail(data, damaged.offset, damaged.lsn, bad)
    if tear is None:
        return None
    return TornTail(damaged.segment, damaged.offset, damaged.remaining, tear.why, tear.suspicious)


def _one_line(text: str) -> str:
    return " ".join(text.split())
