"""Group commit that fills (Durability.ALWAYS): the writer takes its batch once the loop has nothing else
runnable, so appends made a few scheduling turns apart share one fsync; a loop that never idles still
gets its fsync (the gather is bounded); the trio internal this relies on is where it is expected.

The burst test runs under a MockClock that never advances, so the bound cannot cut the gather short
however slowly the machine runs: which records share a batch depends on scheduling turns alone.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import trio
import trio.testing

import kvrouter.journal.file as file_module
import kvrouter.journal.loop_idle as loop_idle
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
    # The journal's idle wait calls trio.testing's, its public home. If a trio upgrade moves or changes it, this
    # fails instead of the group commit silently degrading.
    assert file_module._wait_until_loop_idle is loop_idle.wait_until_loop_idle
    assert "wait_all_tasks_blocked" in inspect.getsource(loop_idle.wait_until_loop_idle)
    assert list(inspect.signature(trio.testing.wait_all_tasks_blocked).parameters) == ["cushion"]


def test_a_service_starts_without_loading_pytest_or_the_nats_client() -> None:
    # trio.testing imports pytest where it is installed (~90 ms), and the NATS client costs ~40 ms: neither is
    # loaded before a service with the file journal is ready (restart-to-ready counts every import).
    probe = (
        "import sys, kvrouter.api.cli.main, kvrouter.api.process.main;"
        "print(sorted(m for m in ('pytest', 'nats', 'trio.testing') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def test_records_nobody_waits_for_are_held_back_and_share_the_first_waiters_fsync(
    tmp_path: Path, mock_clock: object
) -> None:
    # Like a KV flood: one record per run, each appended once the loop has gone idle, nobody waiting for any of
    # them. The writer used to take each alone (a write, an fsync and a thread round trip per run); now it holds
    # them back, and the first caller who waits for durability gets all of them written with one fsync. The
    # clock never moves, so the hold can only end by the waiter.
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        before = journal.statistics()
        for n in range(3):
            journal.append(b"kv run %d" % n)
            await trio.testing.wait_all_tasks_blocked()
        held = journal.statistics()
        await journal.wait_durable(3)
        after = journal.statistics()
        await journal.aclose()
    assert (held.batches_written - before.batches_written, held.durable_lsn) == (0, 0)
    assert (after.batches_written - before.batches_written, after.fsyncs - before.fsyncs) == (1, 1)
    assert after.synced_lsn == 3


async def test_a_durability_callback_ends_the_hold(tmp_path: Path, mock_clock: object) -> None:
    # A client's write behind held-back KV records (its reply waits through call_when_durable): written at once,
    # with them, without waiting for the hold's time to run out (the clock never moves).
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.append(b"kv run")
        await trio.testing.wait_all_tasks_blocked()
        durable = trio.Event()
        journal.call_when_durable(journal.append(b"client write"), durable.set)
        await durable.wait()
        after = journal.statistics()
        await journal.aclose()
    assert (after.batches_written, after.synced_lsn) == (1, 2)


async def until_durable(journal: FileJournal, lsn: int) -> None:
    """Poll (waiting for durability would end the hold this is about)."""
    while journal.durable_lsn < lsn:  # noqa: ASYNC110
        await trio.sleep(0.001)


async def test_held_back_records_are_written_without_any_waiter(tmp_path: Path) -> None:
    # Nobody ever waits: the hold still ends, by time (one record) or by size (a backlog of the hold's bytes).
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    big = b"x" * (file_module.UNAWAITED_HOLD_BYTES // 4)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            journal.append(b"kv run")
            await until_durable(journal, 1)
            for _ in range(4):
                journal.append(big)
            await until_durable(journal, 5)
            assert journal.statistics().synced_lsn == 5
            await journal.aclose()


async def test_by_size_the_hold_ends_without_the_clock(tmp_path: Path, mock_clock: object) -> None:
    journal = await trio.to_thread.run_sync(FileJournal.open, tmp_path, Durability.ALWAYS)
    big = b"x" * (file_module.UNAWAITED_HOLD_BYTES // 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.append(big)
        await trio.testing.wait_all_tasks_blocked()
        assert journal.statistics().batches_written == 0  # held
        journal.append(big)  # the backlog reaches the hold's bytes: written though nobody waits
        while journal.durable_lsn < 2:
            await trio.testing.wait_all_tasks_blocked()  # (the loop idles here: the writer's gather can end)
        after = journal.statistics()
        await journal.aclose()
    assert (after.batches_written, after.synced_lsn) == (1, 2)
