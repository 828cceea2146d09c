"""Damage in the middle of the log: what opening skips, what it refuses, and the repairs (quarantine, the cut).

A writer marks a record rebuildable (``append(payload, rebuildable=True)``); found damaged at open, such a record
is passed over (``skipped_records``) when the frame after it confirms where it ends. Any other damaged record
refuses the open, naming the quarantine of that one record when the records after it can be found.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio

from kvrouter.journal.file import FileJournal
from kvrouter.journal.frames import (
    FRAME_OVERHEAD,
    HEAD,
    KIND_SHIFT,
    Bad,
    BadFrame,
    FrameKind,
    encode_frame,
    parse_frame,
    quarantine_frame,
)
from kvrouter.journal.layout import quarantine_name, segment_name
from kvrouter.journal.repair import (
    CannotQuarantine,
    DamagedFrame,
    QuarantinedRecord,
    RecordInfo,
    inspect_records,
    plan_quarantine,
    plan_truncation,
    quarantine,
    truncate_after,
)
from kvrouter.journal.store import CorruptJournal, Durability, SkippedRecord

GOLDEN = Path(__file__).parent / "golden"
TIMEOUT = 10
# (payload, rebuildable): lsn 3 is a worker's KV events in the middle of clients' writes.
HISTORY = [(b"client write %d" % n, n in (3, 5)) for n in range(1, 8)]


async def write(path: Path, history: list[tuple[bytes, bool]] = HISTORY) -> None:
    journal = await trio.to_thread.run_sync(partial(FileJournal.open, path, Durability.ALWAYS))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for payload, rebuildable in history:
                journal.append(payload, rebuildable)
            await journal.aclose()


def segment(path: Path) -> Path:
    return path / segment_name(1)


def frame_offset(lsn: int, history: list[tuple[bytes, bool]] = HISTORY) -> int:
    return sum(FRAME_OVERHEAD + len(payload) for payload, _ in history[: lsn - 1])


def flip(path: Path, offset: int, mask: int = 0x04) -> None:
    data = bytearray(segment(path).read_bytes())
    data[offset] ^= mask
    segment(path).write_bytes(bytes(data))


def records(path: Path) -> list[tuple[int, bytes]]:
    return list(FileJournal.open(path, Durability.ALWAYS).read())


def intact(*lsns: int) -> list[tuple[int, bytes]]:
    return [(lsn, HISTORY[lsn - 1][0]) for lsn in lsns]


async def test_a_damaged_rebuildable_record_is_skipped_and_every_other_read(tmp_path: Path) -> None:
    await write(tmp_path)
    flip(tmp_path, frame_offset(3) + FRAME_OVERHEAD + 4)  # a bit in lsn 3's payload

    journal = FileJournal.open(tmp_path, Durability.ALWAYS)  # before: CorruptJournal

    assert journal.skipped_records == (SkippedRecord(3, segment(tmp_path).name, frame_offset(3), False),)
    assert list(journal.read()) == intact(1, 2, 4, 5, 6, 7)
    assert journal.statistics().damaged_skipped == 1
    assert journal.last_lsn == 7
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        assert journal.append(b"after") == 8
        await journal.aclose()
    assert records(tmp_path) == [*intact(1, 2, 4, 5, 6, 7), (8, b"after")]


@pytest.mark.parametrize(
    ("where", "mask"),
    [
        (FRAME_OVERHEAD + 4, 0x04),  # the payload of an ordinary record
        (3, 0x01),  # the length of a rebuildable record: its kind shares the word, so it is not trusted
        (0, 0x20),  # one kind bit of an ordinary record, and its payload below
    ],
)
async def test_other_damage_refuses_the_open_and_names_the_quarantine(tmp_path: Path, where: int, mask: int) -> None:
    lsn = 3 if where == 3 else 4
    await write(tmp_path)
    flip(tmp_path, frame_offset(lsn) + where, mask)
    if where == 0:
        flip(tmp_path, frame_offset(lsn) + FRAME_OVERHEAD)
    before = segment(tmp_path).read_bytes()

    with pytest.raises(CorruptJournal) as refused:
        FileJournal.open(tmp_path, Durability.ALWAYS)

    message = str(refused.value)
    assert f"(lsn {lsn})" in message and "\n" not in message
    assert f"`kvrouter journal quarantine --data-dir {tmp_path} --lsn {lsn} --yes`" in message
    assert segment(tmp_path).read_bytes() == before


async def test_no_damage_of_up_to_two_bits_in_the_kind_makes_an_ordinary_record_rebuildable() -> None:
    frame = bytearray(encode_frame(9, b"a client's write"))
    frame[-1] ^= 0x01  # the payload is damaged
    for bits in (1, 2, 4, 3, 5, 6):
        flipped = bytearray(frame)
        flipped[0] ^= bits << (KIND_SHIFT - 24)
        parsed = parse_frame(bytes(flipped), 0)
        assert isinstance(parsed, BadFrame) and parsed.kind is Bad.CHECKSUM and not parsed.rebuildable


async def test_a_quarantine_placeholder_needs_its_own_checksum() -> None:
    placeholder = quarantine_frame(4, 64)
    parsed = parse_frame(placeholder, 0)
    assert isinstance(parsed, BadFrame) and (parsed.kind, parsed.lsn, HEAD.size + parsed.length) == (
        Bad.QUARANTINED,
        4,
        64,
    )
    damaged = bytearray(placeholder)
    damaged[-1] ^= 0x01
    assert parse_frame(bytes(damaged), 0) == BadFrame(Bad.CHECKSUM, "checksum mismatch", 64 - HEAD.size)
    # An ordinary frame whose kind bits read as a placeholder's is still an ordinary, intact frame.
    ordinary = bytearray(encode_frame(4, bytes(64 - FRAME_OVERHEAD)))
    ordinary[0] |= FrameKind.QUARANTINED << (KIND_SHIFT - 24)
    assert parse_frame(bytes(ordinary), 0) == (4, 64)


async def test_quarantine_moves_one_record_out_and_keeps_every_other(tmp_path: Path) -> None:
    await write(tmp_path)
    at = frame_offset(4)
    flip(tmp_path, at + FRAME_OVERHEAD + 4)
    damaged = segment(tmp_path).read_bytes()
    size = FRAME_OVERHEAD + len(HISTORY[3][0])

    plan = plan_quarantine(tmp_path, 4)
    assert segment(tmp_path).read_bytes() == damaged and not (tmp_path / quarantine_name(4)).exists()
    done = quarantine(tmp_path, 4)

    assert done == plan and (done.offset, done.size, done.kept_in) == (at, size, quarantine_name(4))
    assert done.problem == "checksum mismatch" and not done.rebuildable
    assert (tmp_path / quarantine_name(4)).read_bytes() == damaged[at : at + size]  # kept exactly as it was
    after = segment(tmp_path).read_bytes()
    assert after[:at] == damaged[:at] and after[at + size :] == damaged[at + size :]  # every other byte stays
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    assert journal.skipped_records == (SkippedRecord(4, segment(tmp_path).name, at, True),)
    assert list(journal.read()) == intact(1, 2, 3, 5, 6, 7)
    assert journal.statistics().damaged_skipped == 0  # (a placeholder is not damage)
    entries = list(inspect_records(tmp_path))
    assert entries[3] == QuarantinedRecord(4, segment(tmp_path).name, at, size)


async def test_quarantine_refuses_what_it_should_not_move(tmp_path: Path) -> None:
    await write(tmp_path)
    flip(tmp_path, frame_offset(4) + FRAME_OVERHEAD + 4)
    quarantine(tmp_path, 4)
    before = segment(tmp_path).read_bytes()

    with pytest.raises(CannotQuarantine, match="record 4 is already quarantined"):
        quarantine(tmp_path, 4)
    with pytest.raises(CannotQuarantine, match="record 5 is intact"):
        quarantine(tmp_path, 5)
    with pytest.raises(CannotQuarantine, match="the log holds no record 9"):
        quarantine(tmp_path, 9)
    assert segment(tmp_path).read_bytes() == before
    # An intact record the caller knows recovery cannot use (a poison record) may go too.
    assert quarantine(tmp_path, 5, intact=True).problem is None
    assert records(tmp_path) == intact(1, 2, 3, 6, 7)


async def test_a_second_quarantine_of_a_reused_lsn_keeps_both_copies(tmp_path: Path) -> None:
    await write(tmp_path)
    flip(tmp_path, frame_offset(6) + FRAME_OVERHEAD + 4)
    first = quarantine(tmp_path, 6)
    truncate_after(tmp_path, 5)
    await write(tmp_path, [(b"reused lsn 6", False), (b"reused lsn 7", False)])
    flip(tmp_path, frame_offset(6) + FRAME_OVERHEAD + 4)

    second = quarantine(tmp_path, 6)

    assert (first.kept_in, second.kept_in) == (quarantine_name(6), quarantine_name(6, 1))
    assert (tmp_path / second.kept_in).read_bytes() != (tmp_path / first.kept_in).read_bytes()


async def test_the_cut_counts_every_record_it_removes_past_damage(tmp_path: Path) -> None:
    await write(tmp_path)
    flip(tmp_path, frame_offset(3) + FRAME_OVERHEAD + 4)
    flip(tmp_path, frame_offset(4) + FRAME_OVERHEAD + 4)

    plan = plan_truncation(tmp_path, 2)  # before: "remove 0 records", and the cut then removed all five

    assert (plan.records_removed, plan.damaged_removed, plan.unreadable_bytes) == (3, 2, 0)
    assert plan.segment_cut == segment(tmp_path).name and plan.cut_offset == frame_offset(3)
    found = list(inspect_records(tmp_path, head_bytes=0))
    assert [(type(e).__name__, e.lsn) for e in found] == [
        ("RecordInfo", 1),
        ("RecordInfo", 2),
        ("DamagedFrame", 3),
        ("DamagedFrame", 4),
        *[("RecordInfo", lsn) for lsn in (5, 6, 7)],
    ]
    assert isinstance(found[2], DamagedFrame) and found[2].rebuildable and not found[3].rebuildable  # type: ignore[union-attr]
    # The damaged rebuildable record below the cut is no reason to refuse it: recovery skips it.
    flip(tmp_path, frame_offset(4) + FRAME_OVERHEAD + 4)
    assert plan_truncation(tmp_path, 5).records_removed == 2


async def test_past_a_damaged_length_the_next_record_is_found_by_its_lsn(tmp_path: Path) -> None:
    await write(tmp_path)
    flip(tmp_path, frame_offset(3) + 3, 0x40)  # lsn 3's length is wrong: its frame seems to end elsewhere

    found = list(inspect_records(tmp_path, head_bytes=0))

    damaged = found[2]
    assert isinstance(damaged, DamagedFrame) and damaged.end == frame_offset(4) and not damaged.rebuildable
    assert [e.lsn for e in found[3:] if isinstance(e, RecordInfo)] == [4, 5, 6, 7]
    assert quarantine(tmp_path, 3).size == frame_offset(4) - frame_offset(3)
    assert records(tmp_path) == intact(1, 2, 4, 5, 6, 7)


# -- the frame format: golden files -----------------------------------------------------------------------------


def test_frames_written_before_kinds_existed_read_as_they_did() -> None:
    data = (GOLDEN / "frames.v1.log").read_bytes()
    payloads = [b"record 1: a client's write", b"record 2: a worker's KV events", b"record 3: a client's write"]
    assert data == b"".join(encode_frame(lsn, p) for lsn, p in enumerate(payloads, 1))  # RECORD frames unchanged
    offset, read = 0, []
    while offset < len(data):
        parsed = parse_frame(data, offset)
        assert not isinstance(parsed, BadFrame)
        read.append(parsed[0])
        offset = parsed[1]
    assert read == [1, 2, 3]


def test_frames_with_kinds_match_their_golden_file(tmp_path: Path) -> None:
    data = (GOLDEN / "frames.v2.log").read_bytes()
    moved = 16 + len(b"record 4: moved out by kvrouter journal quarantine")
    expected = b"".join(
        [
            encode_frame(1, b"record 1: a client's write"),
            encode_frame(2, b"record 2: a worker's KV events", FrameKind.REBUILDABLE),
            encode_frame(3, b"record 3: a client's write"),
            quarantine_frame(4, moved),
            encode_frame(5, b"record 5: a worker's KV events", FrameKind.REBUILDABLE),
        ]
    )
    assert data == expected
    assert data[FRAME_OVERHEAD + 26] >> 5 == FrameKind.REBUILDABLE  # the kind: the top bits of the first word
    segment(tmp_path).write_bytes(data)
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    assert [lsn for lsn, _ in journal.read()] == [1, 2, 3, 5]
    assert [record.lsn for record in journal.skipped_records] == [4]
