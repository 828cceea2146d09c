"""MemoryJournal's simulation hooks (its Journal behaviour is covered by the shared contract)."""

from __future__ import annotations

import trio

from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.store import Snapshot


async def test_crash_copy_holds_the_durable_records_and_the_snapshot() -> None:
    journal = MemoryJournal()
    for i in range(1, 6):
        journal.append(f"r{i}".encode())
    await journal.write_snapshot(Snapshot(2, b"s2"))

    restarted = journal.crash_copy()

    assert restarted.latest_snapshot() == Snapshot(2, b"s2")
    assert list(restarted.read()) == [(3, b"r3"), (4, b"r4"), (5, b"r5")]
    assert (restarted.last_lsn, restarted.records_since_snapshot, restarted.bytes_since_snapshot) == (5, 3, 6)
    # The copy and the "crashed" original no longer share anything.
    assert restarted.append(b"after restart") == 6
    assert journal.append(b"zombie") == 6
    assert list(restarted.read(5)) == [(6, b"after restart")]
    assert list(journal.read(5)) == [(6, b"zombie")]


async def test_run_starts_at_once_and_returns_after_aclose() -> None:
    journal = MemoryJournal()
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            assert journal.append(b"x") == 1
            await journal.aclose()
