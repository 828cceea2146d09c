"""FileJournal beyond the shared contract: damaged files, compaction, group commit, backpressure, faults.

These use real files, so they run under the real clock with ``trio.fail_after`` (never autojump: the
clock would jump while a worker thread is inside fsync).
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

import kvrouter.journal.segment_writer as segment_writer_module
from kvrouter.journal.file import FileJournal
from kvrouter.journal.frames import encode_frame
from kvrouter.journal.layout import segment_name, snapshot_name
from kvrouter.journal.store import CorruptJournal, Durability, Snapshot

TIMEOUT = 10
PAYLOADS = [f"record {i}".encode() * i for i in range(1, 6)]  # five frames of different sizes


@asynccontextmanager
async def running(
    path: Path, durability: Durability = Durability.ALWAYS, **options: object
) -> AsyncIterator[FileJournal]:
    """An open journal with its writer started; closed cleanly (flushed, fsynced) on exit."""
    # Through a thread, as the service does it: open() is blocking but must not need the trio thread.
    journal = await trio.to_thread.run_sync(partial(FileJournal.open, path, durability, **options))  # type: ignore[arg-type]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            yield journal
            await journal.aclose()


async def fill(path: Path, payloads: list[bytes], **options: object) -> None:
    async with running(path, **options) as journal:  # type: ignore[arg-type]
        for payload in payloads:
            journal.append(payload)


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("journal-*.log"))


def snapshot_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("snapshot-*"))


def directory_contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def frame_offset(payloads: list[bytes], index: int) -> int:
    """Byte offset of the frame holding payloads[index] when they all sit in one segment."""
    return sum(16 + len(p) for p in payloads[:index])


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def records(journal: FileJournal) -> list[tuple[int, bytes]]:
    return list(journal.read())


# -- torn tails -----------------------------------------------------------------------------------


def cut_inside_last_frame(segment: Path) -> None:
    segment.write_bytes(segment.read_bytes()[:-3])


def append_zeros(segment: Path) -> None:
    segment.write_bytes(segment.read_bytes() + bytes(4096))


def append_garbage(segment: Path) -> None:
    segment.write_bytes(segment.read_bytes() + b"\xde\xad\xbe\xef" * 3)


def damage_last_payload(segment: Path) -> None:
    flip_byte(segment, segment.stat().st_size - 1)


@pytest.mark.parametrize(
    ("damage", "kept", "torn_at", "level"),
    [
        (cut_inside_last_frame, 4, frame_offset(PAYLOADS, 4), logging.WARNING),
        # Whole, but its checksum fails: maybe an acknowledged record that rotted, so an ERROR.
        (damage_last_payload, 4, frame_offset(PAYLOADS, 4), logging.ERROR),
        (append_zeros, 5, frame_offset(PAYLOADS, 5), logging.WARNING),
        (append_garbage, 5, frame_offset(PAYLOADS, 5), logging.WARNING),
    ],
    ids=["cut-mid-frame", "bad-crc-final-frame", "trailing-zeros", "trailing-garbage"],
)
async def test_a_torn_tail_is_truncated_and_appends_continue(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path], None],
    kept: int,
    torn_at: int,
    level: int,
) -> None:
    await fill(tmp_path, PAYLOADS)
    (segment,) = segment_files(tmp_path)
    damage(segment)
    caplog.set_level(logging.WARNING, logger="kvrouter.journal")

    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    (logged,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert logged.levelno == level
    message = logged.getMessage()
    assert segment.name in message and f"offset {torn_at}" in message, message
    if level == logging.ERROR:
        assert f"lsn {kept + 1}" in message
    assert segment.stat().st_size == torn_at  # the tail is gone from the file, not just skipped
    assert journal.last_lsn == journal.durable_lsn == kept
    assert records(journal) == list(enumerate(PAYLOADS, 1))[:kept]
    async with running(tmp_path) as reopened:
        assert reopened.append(b"after the tear") == kept + 1
    async with running(tmp_path) as again:
        assert records(again) == [*list(enumerate(PAYLOADS, 1))[:kept], (kept + 1, b"after the tear")]


# -- damage that is not a torn tail ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset_in_frame", "what"),
    [(16 + 3, "payload"), (0, "length field"), (5, "checksum field")],
)
async def test_damage_before_valid_records_refuses_to_start(tmp_path: Path, offset_in_frame: int, what: str) -> None:
    await fill(tmp_path, PAYLOADS)
    (segment,) = segment_files(tmp_path)
    offset = frame_offset(PAYLOADS, 1)  # the frame of lsn 2, followed by three valid frames
    flip_byte(segment, offset + offset_in_frame)
    damaged = segment.read_bytes()

    with pytest.raises(CorruptJournal) as raised:
        FileJournal.open(tmp_path, Durability.ALWAYS)

    message = str(raised.value)
    assert segment.name in message and f"offset {offset}" in message and "lsn 2" in message, what
    # It tells the operator what to do: the records after it are intact, so move only this one out.
    assert f"`kvrouter journal quarantine --data-dir {tmp_path} --lsn 2 --yes`" in message and "backup" in message
    assert "\n" not in message
    assert segment.read_bytes() == damaged  # nothing was truncated: the evidence stays


async def test_a_bad_frame_in_a_closed_segment_is_fatal_even_at_its_end(tmp_path: Path) -> None:
    await fill(tmp_path, PAYLOADS, segment_bytes=1)  # one frame per segment
    first = segment_files(tmp_path)[0]
    first.write_bytes(first.read_bytes()[:-2])  # looks torn, but later segments hold acknowledged data

    with pytest.raises(CorruptJournal, match=first.name):
        FileJournal.open(tmp_path, Durability.ALWAYS)


async def test_a_missing_segment_is_fatal(tmp_path: Path) -> None:
    await fill(tmp_path, PAYLOADS, segment_bytes=1)  # one frame per segment
    segment_files(tmp_path)[2].unlink()  # lsn 3

    with pytest.raises(CorruptJournal, match=r"records 3\.\.3 are missing"):
        FileJournal.open(tmp_path, Durability.ALWAYS)


# -- snapshots and compaction ---------------------------------------------------------------------


async def test_a_leftover_snapshot_tmp_is_ignored_then_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(tmp_path) as journal:
        for payload in PAYLOADS:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(3, b"three"))
    leftover = tmp_path / (snapshot_name(5) + ".tmp")
    leftover.write_bytes(encode_frame(5, b"interrupted")[:-4])  # a crash mid-write
    caplog.set_level(logging.WARNING, logger="kvrouter.journal")

    async with running(tmp_path) as journal:
        assert journal.latest_snapshot() == Snapshot(3, b"three")
        assert records(journal) == list(enumerate(PAYLOADS, 1))[3:]
        assert any(leftover.name in r.getMessage() for r in caplog.records)
        await journal.write_snapshot(Snapshot(5, b"five"))
    assert not leftover.exists()


async def test_an_unreadable_latest_snapshot_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(tmp_path) as journal:
        for payload in PAYLOADS:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(3, b"three"))
    # A newer snapshot whose bytes rotted before its compaction ran: the log still covers it.
    newer = tmp_path / snapshot_name(5)
    newer.write_bytes(encode_frame(5, b"five"))
    flip_byte(newer, 18)
    caplog.set_level(logging.WARNING, logger="kvrouter.journal")

    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    assert journal.latest_snapshot() == Snapshot(3, b"three")
    assert records(journal) == list(enumerate(PAYLOADS, 1))[3:]
    assert journal.last_lsn == 5
    assert any(newer.name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)


async def test_an_unreadable_newest_snapshot_falls_back_to_the_previous_one_kept_by_compaction(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    payloads = [f"record {i}".encode() for i in range(1, 8)]
    async with running(tmp_path) as journal:
        for payload in payloads[:3]:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(3, b"state@3"))
        for payload in payloads[3:5]:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(5, b"state@5"))
        for payload in payloads[5:]:
            journal.append(payload)
    assert snapshot_files(tmp_path) == [snapshot_name(3), snapshot_name(5)]
    assert segment_files(tmp_path)[0].name == segment_name(4)  # lsns 1..3 exist only in snapshot 3
    newest = tmp_path / snapshot_name(5)
    flip_byte(newest, 18)  # bit rot in the newest snapshot
    caplog.set_level(logging.WARNING, logger="kvrouter.journal")

    async with running(tmp_path) as journal:
        assert journal.latest_snapshot() == Snapshot(3, b"state@3")
        assert records(journal) == list(enumerate(payloads, 1))[3:]
        assert journal.last_lsn == 7
        assert any(newest.name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)
        journal.append(b"record 8")
        await journal.wait_durable(8)
        await journal.write_snapshot(Snapshot(8, b"state@8"))
        assert snapshot_files(tmp_path) == [snapshot_name(3), snapshot_name(8)]  # the rotten one is gone


async def test_unreadable_snapshots_without_the_log_they_replaced_are_fatal(tmp_path: Path) -> None:
    async with running(tmp_path, segment_bytes=1) as journal:
        for payload in PAYLOADS:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(2, b"two"))
        await journal.write_snapshot(Snapshot(4, b"four"))
    assert segment_files(tmp_path)[0].name == segment_name(3)  # lsns 1..2 exist only in the snapshots
    only = tmp_path / snapshot_name(4)
    flip_byte(only, 18)
    flip_byte(tmp_path / snapshot_name(2), 18)
    append_zeros(segment_files(tmp_path)[-1])  # a torn tail too: it must not be "repaired" either
    before = directory_contents(tmp_path)

    with pytest.raises(CorruptJournal, match=only.name):
        FileJournal.open(tmp_path, Durability.ALWAYS)
    assert directory_contents(tmp_path) == before


def first_lsns(path: Path) -> list[int]:
    return [int(p.name[8:28]) for p in segment_files(path)]


async def test_compaction_keeps_two_snapshots_and_the_log_after_the_older(tmp_path: Path) -> None:
    payloads = [f"{i:04d}".encode() * 5 for i in range(1, 31)]  # 20-byte payloads, 36-byte frames
    async with running(tmp_path, segment_bytes=100) as journal:  # two frames per segment
        for payload in payloads:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(20, b"state@20"))
        # The previous "snapshot" is the empty state: every record is still needed to fall back to it.
        assert first_lsns(tmp_path)[0] == 1
        assert snapshot_files(tmp_path) == [snapshot_name(20)]
        await journal.write_snapshot(Snapshot(26, b"state@26"))
        firsts = first_lsns(tmp_path)
        assert firsts[0] == 21  # [1,2] .. [19,20] are gone; nothing after lsn 20 is
        assert firsts == sorted(set(firsts)) and len(firsts) == journal.statistics().segments
        assert snapshot_files(tmp_path) == [snapshot_name(20), snapshot_name(26)]
        assert records(journal) == list(enumerate(payloads, 1))[26:]  # reads start at the newest

    async with running(tmp_path, segment_bytes=100) as journal:
        assert journal.latest_snapshot() == Snapshot(26, b"state@26")
        assert records(journal) == list(enumerate(payloads, 1))[26:]
        assert journal.last_lsn == 30
        journal.append(b"31")
        await journal.wait_durable(31)
        await journal.write_snapshot(Snapshot(30, b"state@30"))
        assert snapshot_files(tmp_path) == [snapshot_name(26), snapshot_name(30)]
        assert first_lsns(tmp_path)[0] == 27
        assert records(journal) == [(31, b"31")]

    async with running(tmp_path, segment_bytes=100) as journal:
        assert journal.latest_snapshot() == Snapshot(30, b"state@30")
        assert records(journal) == [(31, b"31")]


async def test_a_snapshot_can_outlive_an_unsynced_log_tail(tmp_path: Path) -> None:
    # Under OFF/BATCH a power loss can keep the (fsynced) snapshot at lsn 7 but lose log records 6..7.
    await fill(tmp_path, PAYLOADS[:5])
    (tmp_path / snapshot_name(7)).write_bytes(encode_frame(7, b"state@7"))

    async with running(tmp_path) as journal:
        assert journal.last_lsn == 7
        assert records(journal) == []
        assert journal.append(b"eight") == 8
    async with running(tmp_path) as journal:
        assert journal.latest_snapshot() == Snapshot(7, b"state@7")
        assert records(journal) == [(8, b"eight")]


async def test_fresh_discards_the_journal_and_nothing_else(tmp_path: Path) -> None:
    async with running(tmp_path) as journal:
        for payload in PAYLOADS:
            journal.append(payload)
        await journal.write_snapshot(Snapshot(2, b"two"))
    (tmp_path / "operator-notes.txt").write_text("keep me")

    async with running(tmp_path, fresh=True) as journal:
        assert (journal.last_lsn, journal.latest_snapshot(), records(journal)) == (0, None, [])
        assert journal.append(b"new") == 1
    assert (tmp_path / "operator-notes.txt").read_text() == "keep me"
    assert snapshot_files(tmp_path) == []
    async with running(tmp_path) as journal:
        assert records(journal) == [(1, b"new")]


async def test_open_creates_a_missing_directory(tmp_path: Path) -> None:
    async with running(tmp_path / "a" / "b") as journal:
        journal.append(b"x")
    assert segment_files(tmp_path / "a" / "b") == [tmp_path / "a" / "b" / segment_name(1)]


# -- the writer -----------------------------------------------------------------------------------


async def test_segments_rotate_by_size(tmp_path: Path) -> None:
    payloads = [bytes([i]) * 50 for i in range(20)]  # 66-byte frames: three fit in 200 bytes
    async with running(tmp_path, segment_bytes=200) as journal:
        for payload in payloads:
            journal.append(payload)
        await journal.wait_durable(20)
        assert journal.statistics().segments == 7
    files = segment_files(tmp_path)
    assert [f.name for f in files] == [segment_name(n) for n in (1, 4, 7, 10, 13, 16, 19)]
    assert all(f.stat().st_size <= 200 for f in files)
    async with running(tmp_path, segment_bytes=200) as journal:
        assert records(journal) == list(enumerate(payloads, 1))


async def test_group_commit_shares_fsyncs_between_concurrent_writers(tmp_path: Path) -> None:
    writers, per_writer = 8, 50

    async with running(tmp_path, Durability.ALWAYS) as journal:

        async def writer(name: int) -> None:
            for i in range(per_writer):
                lsn = journal.append(f"{name}:{i}".encode())
                await journal.wait_durable(lsn)
                assert journal.statistics().synced_lsn >= lsn  # ALWAYS: acknowledged only after fsync

        async with trio.open_nursery() as nursery:
            for name in range(writers):
                nursery.start_soon(writer, name)
        stats = journal.statistics()

    total = writers * per_writer
    assert stats.durable_lsn == stats.synced_lsn == total
    assert 0 < stats.batches_written < total
    assert 0 < stats.fsyncs < total
    async with running(tmp_path) as journal:
        stored = [payload.decode() for _, payload in journal.read()]
    assert len(stored) == total
    for name in range(writers):  # each writer's records keep its own order
        assert [s for s in stored if s.startswith(f"{name}:")] == [f"{name}:{i}" for i in range(per_writer)]


async def test_identical_appends_give_identical_files(tmp_path: Path) -> None:
    rng = random.Random("journal-determinism")
    payloads = [rng.randbytes(rng.randrange(0, 300)) for _ in range(200)]

    async with running(tmp_path / "a", Durability.ALWAYS, segment_bytes=2048) as one:
        for payload in payloads:  # one record per batch
            await one.wait_durable(one.append(payload))
    async with running(tmp_path / "b", Durability.OFF, segment_bytes=2048) as other:
        for payload in payloads:  # whatever batching the writer finds
            other.append(payload)

    assert len(segment_files(tmp_path / "a")) > 5
    assert directory_contents(tmp_path / "a") == directory_contents(tmp_path / "b")


async def test_a_full_backlog_blocks_the_producer_until_the_writer_drains(tmp_path: Path) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS, max_backlog_bytes=100)
    journal.append(b"a" * 40)  # 56 bytes framed
    assert journal.has_room()
    journal.append(b"b" * 40)  # 112 > 100
    assert not journal.has_room()
    with trio.move_on_after(0.05) as waited:
        await journal.wait_for_room()  # no writer yet: nothing can drain
    assert waited.cancelled_caught

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await journal.wait_for_room()
            assert journal.has_room()
            await journal.aclose()
    stats = journal.statistics()
    assert stats.pending_bytes == 0 and stats.peak_pending_bytes == 112


async def test_nothing_is_durable_until_the_writer_has_written_it(tmp_path: Path) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    journal.append(b"not yet")
    with trio.move_on_after(0.05) as waited:
        await journal.wait_durable(1)
    assert waited.cancelled_caught
    assert journal.durable_lsn == 0 and records(journal) == []

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await journal.wait_durable(1)
            assert records(journal) == [(1, b"not yet")]
            await journal.aclose()


async def test_batch_mode_fsyncs_within_the_interval_after_the_last_write(tmp_path: Path) -> None:
    async with running(tmp_path, Durability.BATCH, batch_interval=0.02) as journal:
        await journal.wait_durable(journal.append(b"one"))
        await journal.wait_durable(journal.append(b"two"))  # acknowledged after write(2) alone
        for _ in range(400):  # no further writes: the timer alone must fsync, well within 2 s
            if journal.statistics().synced_lsn == 2:
                break
            await trio.sleep(0.005)
        assert journal.statistics().synced_lsn == 2


async def test_batch_mode_shares_an_fsync_among_the_writes_of_an_interval(tmp_path: Path) -> None:
    async with running(tmp_path, Durability.BATCH, batch_interval=0.5) as journal:
        for i in range(50):  # each acknowledged before the next: 50 separate writes
            await journal.wait_durable(journal.append(b"%d" % i))
        stats = journal.statistics()
    assert stats.batches_written == 50
    assert stats.fsyncs <= 3  # one right away, then at most one per 0.5 s


async def test_off_mode_fsyncs_only_on_close(tmp_path: Path) -> None:
    async with running(tmp_path, Durability.OFF, batch_interval=0.001) as journal:
        for payload in PAYLOADS:
            journal.append(payload)
        await journal.wait_durable(5)
        await trio.sleep(0.05)
        assert (journal.statistics().fsyncs, journal.statistics().synced_lsn) == (0, 0)
    assert journal.statistics().fsyncs == 1 and journal.statistics().synced_lsn == 5


async def test_a_write_error_stops_the_writer_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def failing_write(fd: int, data: object, offset: int) -> int:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segment_writer_module, "write_all_at", failing_write)
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    with trio.fail_after(TIMEOUT), pytest.RaisesGroup(pytest.RaisesExc(OSError, match="Input/output")):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            journal.append(b"lost")
            await trio.sleep_forever()

    assert len(calls) == 1  # fail-stop: no retry
    assert journal.durable_lsn == 0  # never acknowledged
    # Said once, by the service that stops on it (api/process/exit_reasons.py): the journal itself stays quiet.
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    with pytest.raises(trio.BrokenResourceError):
        await journal.wait_durable(1)
    with pytest.raises(trio.BrokenResourceError):
        journal.append(b"more")
    with pytest.raises(trio.BrokenResourceError):
        await journal.run()  # and it cannot be restarted
    await journal.aclose()
    monkeypatch.undo()
    assert FileJournal.open(tmp_path, Durability.ALWAYS).last_lsn == 0


async def test_a_cancelled_writer_still_keeps_every_appended_record(tmp_path: Path) -> None:
    journal = FileJournal.open(tmp_path, Durability.OFF)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for payload in PAYLOADS:
                journal.append(payload)
            nursery.cancel_scope.cancel()  # e.g. another task crashed
    assert journal.statistics().synced_lsn == 5
    assert records(FileJournal.open(tmp_path, Durability.OFF)) == list(enumerate(PAYLOADS, 1))
