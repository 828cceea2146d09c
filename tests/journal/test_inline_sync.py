"""Who writes a batch under Durability.ALWAYS: the event loop itself when someone waits for it and fsyncs are
fast; the journal's I/O thread for records nobody waits for, after a slow fsync, and for a new segment.

Fsync durations are made deterministic by a stand-in ``os.fsync`` with a chosen delay (and a bound patched to
lie between the fast and the slow delay), so the outcome does not depend on this machine's disk.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

import kvrouter.journal.file as file_module
import kvrouter.journal.segment_writer as segment_writer_module
from kvrouter.journal.file import FileJournal, JournalStatistics
from kvrouter.journal.store import Durability

TIMEOUT = 30
REAL_FSYNC = os.fsync


class Fsyncs:
    """A stand-in for ``os.fsync``: the real one, then ``delay`` seconds more (while the caller waits)."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.threads: list[str] = []

    def __call__(self, fd: int) -> None:
        REAL_FSYNC(fd)
        self.threads.append("loop" if trio.lowlevel.in_trio_run() else "thread")
        if self.delay:
            time.sleep(self.delay)


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Fsyncs:
    fake = Fsyncs()
    monkeypatch.setattr(segment_writer_module.os, "fsync", fake)
    monkeypatch.setattr(file_module, "INLINE_SYNC_MAX_SECONDS", 0.5)
    return fake


async def write_and_wait(journal: FileJournal, payload: bytes, synced: bool = True) -> JournalStatistics:
    lsn = journal.append(payload)
    await journal.wait_durable(lsn)
    stats = journal.statistics()
    assert stats.synced_lsn >= lsn or not synced  # acknowledged only after its fsync, whoever made it
    return stats


async def test_a_batch_someone_waits_for_is_fsynced_by_the_loop(tmp_path: Path, fsyncs: Fsyncs) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            first = await write_and_wait(journal, b"creates the segment")
            second = await write_and_wait(journal, b"goes into it")
            third = await write_and_wait(journal, b"and again")
            await journal.aclose()
    assert first.inline_batches == 0  # a new segment (preallocation, directory fsync) goes to the thread
    assert (second.inline_batches, third.inline_batches) == (1, 2)
    assert (third.batches_written, third.durable_lsn) == (3, 3)
    reopened = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    assert reopened.statistics().last_lsn == 3  # what the loop fsynced is there after a restart


async def test_records_nobody_waits_for_are_fsynced_by_the_thread(tmp_path: Path, fsyncs: Fsyncs) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await write_and_wait(journal, b"creates the segment")
            lsn = journal.append(b"a KV event: nobody waits for it")
            for _ in range(2000):  # written once its hold ends
                if journal.statistics().durable_lsn >= lsn:
                    break
                await trio.sleep(0.005)
            stats = journal.statistics()
            last = fsyncs.threads[-1]
            await journal.aclose()
    assert (stats.batches_written, stats.inline_batches) == (2, 0)
    assert last == "thread"


async def test_after_a_slow_fsync_the_thread_writes_until_fsyncs_are_fast_again(tmp_path: Path, fsyncs: Fsyncs) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await write_and_wait(journal, b"creates the segment")
            assert (await write_and_wait(journal, b"fast")).inline_batches == 1
            fsyncs.delay = 0.6  # over the bound: the disk is struggling
            assert (await write_and_wait(journal, b"slow, in the loop")).inline_batches == 2
            slow = await write_and_wait(journal, b"slow, in the thread")
            fsyncs.delay = 0.0
            recovering = await write_and_wait(journal, b"fast again, still in the thread")
            back = await write_and_wait(journal, b"back in the loop")
            order = fsyncs.threads[-4:]
            await journal.aclose()
    assert (slow.inline_batches, recovering.inline_batches, back.inline_batches) == (2, 2, 3)
    assert order == ["loop", "thread", "thread", "loop"]


async def test_batch_and_off_still_write_small_batches_in_the_loop(tmp_path: Path, fsyncs: Fsyncs) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.BATCH)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            await write_and_wait(journal, b"creates the segment", synced=False)
            stats = await write_and_wait(journal, b"a small write", synced=False)
            await journal.aclose()
    assert stats.inline_batches == 1
