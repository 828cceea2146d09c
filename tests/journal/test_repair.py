"""Operator tools on a stopped journal: inspect it without changing it, cut it after an lsn."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio

from kvrouter.journal.file import FileJournal
from kvrouter.journal.layout import segment_name, snapshot_name
from kvrouter.journal.repair import (
    CannotTruncate,
    DamagedFrame,
    RecordInfo,
    SnapshotInfo,
    inspect_records,
    inspect_snapshots,
    truncate_after,
)
from kvrouter.journal.store import CorruptJournal, Durability, Snapshot

TIMEOUT = 10
PAYLOADS = [f"payload number {i}: ".encode() + bytes([i]) * (10 * i) for i in range(1, 9)]


async def write(
    path: Path, payloads: list[bytes], snapshots: dict[int, bytes] | None = None, **options: object
) -> None:
    """Append ``payloads``, writing each snapshot once its lsn is reached."""
    journal = await trio.to_thread.run_sync(partial(FileJournal.open, path, Durability.ALWAYS, **options))  # type: ignore[arg-type]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for payload in payloads:
                lsn = journal.append(payload)
                if snapshots and lsn in snapshots:
                    await journal.write_snapshot(Snapshot(lsn, snapshots[lsn]))
            await journal.aclose()


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("journal-*.log"))


def first_lsns(path: Path) -> list[int]:
    return [int(p.name[8:28]) for p in segment_files(path)]


def snapshot_names(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("snapshot-*"))


def contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def records(path: Path) -> list[tuple[int, bytes]]:
    return list(FileJournal.open(path, Durability.ALWAYS).read())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_inspect_lists_each_record_and_snapshot_without_changing_a_byte(tmp_path: Path) -> None:
    await write(tmp_path, PAYLOADS, {3: b"state@3"}, segment_bytes=200)
    segment = segment_files(tmp_path)[-1]
    segment.write_bytes(segment.read_bytes() + b"\x00" * 7)  # a tail recovery would cut
    (tmp_path / snapshot_name(6)).write_bytes(b"rotten")
    before = contents(tmp_path)

    found = list(inspect_records(tmp_path, head_bytes=16))
    snapshots = inspect_snapshots(tmp_path)

    assert contents(tmp_path) == before
    listed = [entry for entry in found if isinstance(entry, RecordInfo)]
    assert [(r.lsn, r.size, r.head) for r in listed] == [(i, len(p), p[:16]) for i, p in enumerate(PAYLOADS, 1)]
    assert all(r.segment.startswith("journal-") for r in listed)
    damaged = [entry for entry in found if isinstance(entry, DamagedFrame)]
    assert damaged == [DamagedFrame(segment.name, damaged[0].offset, 9, damaged[0].problem, 7)]
    assert snapshots[0].lsn == 6 and snapshots[0].problem is not None
    assert snapshots[1] == SnapshotInfo(3, snapshot_name(3), 16 + len(b"state@3"), None)
    assert [r.lsn for r in inspect_records(tmp_path, after_lsn=6) if isinstance(r, RecordInfo)] == [7, 8]


async def test_truncating_before_a_poison_record_leaves_a_journal_that_opens_and_continues(tmp_path: Path) -> None:
    await write(tmp_path, PAYLOADS, {2: b"state@2", 6: b"state@6"}, segment_bytes=200)

    done = truncate_after(tmp_path, 4)

    assert done.lsn == 4 and done.records_removed == 4
    assert done.bytes_removed == sum(16 + len(p) for p in PAYLOADS[4:])
    assert done.snapshots_deleted == [snapshot_name(6)]  # it includes records 5 and 6
    assert snapshot_names(tmp_path) == [snapshot_name(2)]
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    assert journal.last_lsn == 4
    assert journal.latest_snapshot() == Snapshot(2, b"state@2")
    assert list(journal.read()) == [(3, PAYLOADS[2]), (4, PAYLOADS[3])]
    await write(tmp_path, [b"after the repair"])
    assert records(tmp_path)[-1] == (5, b"after the repair")


async def test_truncating_deletes_later_segments_and_cuts_the_one_holding_the_lsn(tmp_path: Path) -> None:
    await write(tmp_path, PAYLOADS, segment_bytes=120)
    firsts = first_lsns(tmp_path)
    assert len(firsts) > 3

    done = truncate_after(tmp_path, 2)

    assert done.segment_cut in (None, segment_name(max(f for f in firsts if f <= 2)))
    assert done.segments_deleted == [segment_name(f) for f in firsts if f > 2]
    assert first_lsns(tmp_path) == [f for f in firsts if f <= 2]
    assert records(tmp_path) == [(1, PAYLOADS[0]), (2, PAYLOADS[1])]


async def test_truncating_at_mid_log_damage_lets_the_journal_open_again(tmp_path: Path) -> None:
    await write(tmp_path, PAYLOADS)
    (segment,) = segment_files(tmp_path)
    damaged_at = sum(16 + len(p) for p in PAYLOADS[:5])  # the frame of lsn 6
    flip_byte(segment, damaged_at + 20)
    with pytest.raises(CorruptJournal, match="lsn 6"):
        FileJournal.open(tmp_path, Durability.ALWAYS)

    with pytest.raises(CannotTruncate, match="record 6 is damaged"):
        truncate_after(tmp_path, 6)
    done = truncate_after(tmp_path, 5)

    size = sum(16 + len(p) for p in PAYLOADS)
    assert (done.segment_cut, done.bytes_removed) == (segment.name, size - damaged_at)  # 6 (damaged), 7, 8
    assert segment.stat().st_size == damaged_at
    assert records(tmp_path) == list(enumerate(PAYLOADS, 1))[:5]


async def test_truncating_where_only_a_dropped_snapshot_holds_the_records_is_refused(tmp_path: Path) -> None:
    await write(tmp_path, PAYLOADS, {3: b"state@3", 5: b"state@5", 7: b"state@7"}, segment_bytes=1)
    before = contents(tmp_path)
    assert snapshot_name(3) not in before  # compaction kept 5 and 7, and the log after 5

    with pytest.raises(CannotTruncate, match=r"records 1\.\.4 are no longer in the log"):
        truncate_after(tmp_path, 4)
    assert contents(tmp_path) == before

    done = truncate_after(tmp_path, 6)
    assert done.snapshots_deleted == [snapshot_name(7)]
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    assert (journal.latest_snapshot(), list(journal.read())) == (Snapshot(5, b"state@5"), [(6, PAYLOADS[5])])


def test_truncating_an_empty_directory_is_a_no_op(tmp_path: Path) -> None:
    assert truncate_after(tmp_path, 0).records_removed == 0
    with pytest.raises(CannotTruncate, match=r"records 1\.\.3"):
        truncate_after(tmp_path, 3)
