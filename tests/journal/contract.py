"""The behaviour every ``Journal`` must show, written once and run against each implementation.

Shape borrowed from eventsourcing's persistence test cases: a base class with hooks, subclassed per
backend (``test_journal_contract.py``). Simulations run on ``MemoryJournal`` and production on
``FileJournal``, so anything the actors rely on belongs here, where both must pass it.
"""

from __future__ import annotations

import pytest
import trio

from kvrouter.journal.store import Journal, Snapshot, SnapshotStaging

TIMEOUT = 10  # seconds; real files under the real clock, so only a hang should ever reach it

PAYLOADS = [b"first", b"", b"\x00\xff" * 300, b"x" * 10_000, b"last"]


class JournalContract:
    """Subclasses implement ``make_journal`` and ``restart``; the tests start ``run`` themselves."""

    def make_journal(self) -> Journal:
        """A new, empty journal whose writer has not been started."""
        raise NotImplementedError

    async def restart(self, journal: Journal) -> Journal:
        """What a restarted process opens after ``journal`` stopped (writer not started)."""
        raise NotImplementedError

    async def started(self, nursery: trio.Nursery, journal: Journal | None = None) -> Journal:
        journal = journal if journal is not None else self.make_journal()
        await nursery.start(journal.run)
        return journal

    async def append_durably(self, journal: Journal, payloads: list[bytes]) -> list[int]:
        lsns = [journal.append(p) for p in payloads]
        with trio.fail_after(TIMEOUT):
            await journal.wait_durable(journal.last_lsn)
        return lsns

    # -- appending and reading --------------------------------------------------------------------

    async def test_a_new_journal_is_empty(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        assert (journal.last_lsn, journal.durable_lsn) == (0, 0)
        assert list(journal.read()) == []
        assert journal.latest_snapshot() is None
        assert (journal.records_since_snapshot, journal.bytes_since_snapshot) == (0, 0)
        assert journal.has_room()

    async def test_append_assigns_consecutive_lsns_from_one(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        assert [journal.append(p) for p in PAYLOADS] == [1, 2, 3, 4, 5]
        assert journal.last_lsn == 5

    async def test_read_returns_the_appended_payloads_in_order(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS)
        assert list(journal.read()) == list(enumerate(PAYLOADS, 1))
        assert list(journal.read(after_lsn=2)) == list(enumerate(PAYLOADS, 1))[2:]
        assert list(journal.read(after_lsn=5)) == []

    async def test_a_rebuildable_record_reads_like_any_other_and_survives_a_restart(
        self, nursery: trio.Nursery
    ) -> None:
        journal = await self.started(nursery)
        lsns = [journal.append(payload, index % 2 == 1) for index, payload in enumerate(PAYLOADS)]
        with trio.fail_after(TIMEOUT):
            await journal.wait_durable(lsns[-1])
        assert list(journal.read()) == list(enumerate(PAYLOADS, 1))
        await journal.aclose()
        restarted = await self.restart(journal)
        assert list(restarted.read()) == list(enumerate(PAYLOADS, 1))
        assert restarted.skipped_records == ()

    async def test_wait_durable_returns_once_the_lsn_is_covered(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        for payload in PAYLOADS:
            lsn = journal.append(payload)
            with trio.fail_after(TIMEOUT):
                await journal.wait_durable(lsn)
            assert journal.durable_lsn >= lsn
        with trio.fail_after(TIMEOUT):
            await journal.wait_durable(3)  # already durable: returns at once
        with pytest.raises(ValueError, match="has not been appended"):
            await journal.wait_durable(journal.last_lsn + 1)

    async def test_counters_track_records_and_payload_bytes(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS)
        assert journal.records_since_snapshot == 5
        assert journal.bytes_since_snapshot == sum(map(len, PAYLOADS))

    # -- snapshots --------------------------------------------------------------------------------

    async def test_snapshot_drops_the_records_it_covers(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        payloads = [f"event {i}".encode() for i in range(1, 11)]
        await self.append_durably(journal, payloads)
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(6, b"state up to 6"))
        tail = list(enumerate(payloads, 1))[6:]
        assert list(journal.read()) == tail
        assert list(journal.read(after_lsn=6)) == tail
        assert list(journal.read(after_lsn=8)) == tail[2:]
        assert journal.records_since_snapshot == 4
        assert journal.bytes_since_snapshot == sum(len(p) for _, p in tail)
        assert journal.last_lsn == 10

    async def test_latest_snapshot_round_trips_and_only_moves_forward(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS)
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(2, b"two"))
            assert journal.latest_snapshot() == Snapshot(2, b"two")
            await journal.write_snapshot(Snapshot(4, b"\x00four\xff"))
            assert journal.latest_snapshot() == Snapshot(4, b"\x00four\xff")
            with pytest.raises(ValueError, match="older than the latest snapshot"):
                await journal.write_snapshot(Snapshot(3, b"three"))
            with pytest.raises(ValueError, match="outside the journal"):
                await journal.write_snapshot(Snapshot(6, b"six"))
        assert journal.latest_snapshot() == Snapshot(4, b"\x00four\xff")

    # -- restart ----------------------------------------------------------------------------------

    async def test_restart_sees_the_same_records(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS)
        reopened = await self.started(nursery, await self.restart(journal))
        assert reopened.last_lsn == reopened.durable_lsn == 5
        assert list(reopened.read()) == list(enumerate(PAYLOADS, 1))
        assert reopened.records_since_snapshot == 5
        assert reopened.bytes_since_snapshot == sum(map(len, PAYLOADS))

    async def test_appends_after_restart_continue_the_sequence(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS[:2])
        reopened = await self.started(nursery, await self.restart(journal))
        assert await self.append_durably(reopened, PAYLOADS[2:]) == [3, 4, 5]
        again = await self.started(nursery, await self.restart(reopened))
        assert list(again.read()) == list(enumerate(PAYLOADS, 1))

    async def test_restart_after_a_snapshot_gives_snapshot_and_tail(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        await self.append_durably(journal, PAYLOADS)
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(3, b"state"))
        reopened = await self.started(nursery, await self.restart(journal))
        assert reopened.latest_snapshot() == Snapshot(3, b"state")
        assert list(reopened.read()) == list(enumerate(PAYLOADS, 1))[3:]
        assert reopened.records_since_snapshot == 2
        assert reopened.bytes_since_snapshot == len(PAYLOADS[3]) + len(PAYLOADS[4])
        assert await self.append_durably(reopened, [b"six"]) == [6]

    # -- lifecycle --------------------------------------------------------------------------------

    async def test_aclose_ends_run_and_refuses_appends(self) -> None:
        journal = self.make_journal()
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(journal.run)
                journal.append(b"kept")
                await journal.aclose()  # run returns by itself: the nursery needs no cancel
        assert journal.durable_lsn == 1
        with pytest.raises(trio.ClosedResourceError):
            journal.append(b"too late")
        await journal.aclose()  # idempotent


class StagedSnapshotContract(JournalContract):
    """``SnapshotStaging``: a snapshot written by a stager (in production, a forked child) is invisible
    until the journal installs it, and a discarded one never shows."""

    def staging(self, journal: Journal) -> SnapshotStaging:
        assert isinstance(journal, SnapshotStaging)
        return journal

    async def test_a_staged_snapshot_shows_only_once_installed(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        staging = self.staging(journal)
        await self.append_durably(journal, PAYLOADS)
        staging.snapshot_stager()(Snapshot(3, b"staged at three"))
        assert journal.latest_snapshot() is None
        assert list(journal.read()) == list(enumerate(PAYLOADS, 1))
        with trio.fail_after(TIMEOUT):
            await staging.install_staged_snapshot(3)
        assert journal.latest_snapshot() == Snapshot(3, b"staged at three")
        assert list(journal.read()) == list(enumerate(PAYLOADS, 1))[3:]
        assert journal.records_since_snapshot == 2
        reopened = await self.started(nursery, await self.restart(journal))
        assert reopened.latest_snapshot() == Snapshot(3, b"staged at three")

    async def test_a_discarded_staging_leaves_the_latest_snapshot(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        staging = self.staging(journal)
        await self.append_durably(journal, PAYLOADS)
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(2, b"two"))
            staging.snapshot_stager()(Snapshot(4, b"four"))
            await staging.discard_staged_snapshot(4)
            await staging.discard_staged_snapshot(4)  # nothing left: still fine
            with pytest.raises(FileNotFoundError):
                await staging.install_staged_snapshot(4)
        assert journal.latest_snapshot() == Snapshot(2, b"two")
        reopened = await self.started(nursery, await self.restart(journal))
        assert reopened.latest_snapshot() == Snapshot(2, b"two")
        assert list(reopened.read()) == list(enumerate(PAYLOADS, 1))[2:]

    async def test_installing_checks_the_lsn_like_write_snapshot(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        staging = self.staging(journal)
        await self.append_durably(journal, PAYLOADS)
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(4, b"four"))
            with pytest.raises(ValueError, match="older than the latest snapshot"):
                await staging.install_staged_snapshot(3)
            with pytest.raises(ValueError, match="outside the journal"):
                await staging.install_staged_snapshot(6)
        assert journal.latest_snapshot() == Snapshot(4, b"four")

    async def test_a_snapshot_written_meanwhile_does_not_remove_a_newer_staging(self, nursery: trio.Nursery) -> None:
        journal = await self.started(nursery)
        staging = self.staging(journal)
        await self.append_durably(journal, PAYLOADS)
        staging.snapshot_stager()(Snapshot(5, b"five, staged"))
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(2, b"two"))  # compacts
            await staging.install_staged_snapshot(5)
        assert journal.latest_snapshot() == Snapshot(5, b"five, staged")
