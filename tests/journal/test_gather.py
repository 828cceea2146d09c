"""Group commit that fills (Durability.ALWAYS): the writer takes its batch once the loop has nothing else
runnable, so appends made a few scheduling turns apart share one fsync; a loop that never idles still
gets its fsync (the gather is bounded); the trio internal this relies on is where it is expected.

The burst test runs under a MockClock that never advances, so the bound cannot cut the gather short
however slowly the machine runs: which records share a batch depends on scheduling turns alone.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import trio
import trio.testing

import kvrouter.journal.file as file_module
from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import Durability

TIMEOUT = 30


async def test_appends_a_few_scheduling_turns_apart_share_one_fsync(tmp_path: Path, mock_clock: object) -> None:
    # Like a burst of requests read in one turn: each is parsed and decided a different number of turns
    # later, then appends and waits for durability. Taking the batch at the first append (the old writer)
    # gave the later ones a second fsync.
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    durable: list[int] = []

    async def request(turns: int) -> None:
        for _ in range(turns):
            await trio.lowlevel.checkpoint()
        lsn = journal.append(b"request %d" % turns)
        await journal.wait_durable(lsn)
        assert journal.statistics().synced_lsn >= lsn  # acknowledged only after its fsync
        durable.append(lsn)

    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        before = journal.statistics()
        async with trio.open_nursery() as burst:
            for turns in range(8):
                burst.start_soon(request, turns)
        after = journal.statistics()
        await journal.aclose()
    assert sorted(durable) == list(range(1, 9))
    assert (after.batches_written - before.batches_written, after.fsyncs - before.fsyncs) == (1, 1)


async def test_a_loop_that_never_idles_still_gets_its_fsync(tmp_path: Path) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)

    async def busy() -> None:  # always runnable: the loop never runs out of work
        while True:
            await trio.lowlevel.checkpoint()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            nursery.start_soon(busy)
            for n in range(3):
                await journal.wait_durable(journal.append(b"record %d" % n))
            assert journal.statistics().synced_lsn == 3
            nursery.cancel_scope.cancel()


async def test_a_backlog_that_fills_a_batch_is_written_without_waiting_for_the_loop(
    tmp_path: Path, mock_clock: object
) -> None:
    # Like a streamed message's writes, appended in one actor turn: the batch is full already, so the writer
    # takes it in the turn it wakes, and what is appended a couple of turns later (the next message's turn)
    # gets the next fsync, written while the loop was busy. Gathering until the loop idles merged the two.
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    enough = file_module.GATHER_ENOUGH_RECORDS
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        before = journal.statistics()
        for n in range(enough):
            journal.append(b"first turn %d" % n)
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        for n in range(enough):
            last = journal.append(b"second turn %d" % n)
        await journal.wait_durable(last)
        after = journal.statistics()
        await journal.aclose()
    assert after.synced_lsn == 2 * enough
    assert (after.batches_written - before.batches_written, after.fsyncs - before.fsyncs) == (2, 2)


def test_the_trio_idle_detector_the_writer_uses_is_trios_own() -> None:
    # FileJournal imports it from trio._core (trio.testing would load pytest into the service). If a trio
    # upgrade moves or changes it, this fails instead of the group commit silently degrading.
    assert file_module._wait_until_loop_idle is trio.testing.wait_all_tasks_blocked
    assert list(inspect.signature(file_module._wait_until_loop_idle).parameters) == ["cushion"]
