"""Fenced snapshots on a real nats-server (JetStream on, a free port, stopped by its PID): a snapshot replaces the
stored one only if it covers more of the log, atomically, and a refused one purges nothing.

* two owners of one log: the new owner's snapshot is stored; the stale owner's older one, written after it, is
  refused, and recovery uses the newer one with every record;
* many writers racing on one object (interleaved on one connection): the stored snapshot is always the newest;
* a snapshot stored by an earlier kvrouter (nats-py's ``put``, no lsn header) is compared by the lsn its data holds,
  and one stored here is read back by nats-py's ``get``."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import nats
import pytest
import trio
from contract import TIMEOUT

from kvrouter.journal import jetstream_snapshots as snapshots
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.jetstream_link import SNAPSHOT_HEADER, bucket_of
from kvrouter.journal.store import Snapshot, SnapshotRefused
from tests.support.fleet_servers import nats_url

__all__ = ["nats_url"]  # the fixture (tests/support): one server for the module


async def durable(journal: JetStreamJournal, payloads: list[bytes]) -> None:
    lsn = 0
    for payload in payloads:
        lsn = journal.append(payload)
    with trio.fail_after(TIMEOUT):
        await journal.wait_durable(lsn)


async def test_an_older_snapshot_written_after_a_newer_one_is_refused_and_recovery_uses_the_newer(
    nats_url: str,
) -> None:
    stale = await trio.to_thread.run_sync(lambda: JetStreamJournal.open((nats_url,), "TWO_OWNERS", log="scope"))
    async with trio.open_nursery() as nursery:
        await nursery.start(stale.run)
        await durable(stale, [b"r1", b"r2"])
        # A new owner takes the log over (the stale one does not know yet), writes on, and snapshots.
        owner = await trio.to_thread.run_sync(lambda: JetStreamJournal.open((nats_url,), "TWO_OWNERS", log="scope"))
        await nursery.start(owner.run)
        await durable(owner, [b"r3", b"r4", b"r5"])
        with trio.fail_after(TIMEOUT):
            await owner.write_snapshot(Snapshot(4, b"up to r4"))
            with pytest.raises(SnapshotRefused, match="the stored one is newer"):
                await stale.write_snapshot(Snapshot(2, b"up to r2"))
        assert stale.latest_snapshot() is None  # its own view is unchanged
        await stale.aclose()
        await owner.aclose()
    recovered = await trio.to_thread.run_sync(lambda: JetStreamJournal.open((nats_url,), "TWO_OWNERS", log="scope"))
    try:
        assert recovered.latest_snapshot() == Snapshot(4, b"up to r4")
        assert await trio.to_thread.run_sync(lambda: list(recovered.read())) == [(5, b"r5")]
        assert recovered.last_lsn == 5
    finally:
        await recovered.aclose()


async def test_racing_writers_leave_the_newest_snapshot(nats_url: str) -> None:
    rounds = await trio.to_thread.run_sync(asyncio.run, race(nats_url))
    assert [stored for stored, _ in rounds] == [newest for _, newest in rounds]


async def race(url: str) -> list[tuple[int, int]]:
    """20 rounds, each of 4 writers putting snapshots newer than the stored one at once, interleaved on one
    connection; after each round, the lsn the stored snapshot covers, and the newest of the round's."""
    nc, js = await connected(url, "RACE")
    rng = random.Random(7)
    found = []
    try:
        for round_ in range(1, 21):
            lsns = [10 * round_ + offset for offset in rng.sample(range(10), 4)]
            await asyncio.gather(*(put(js, lsn) for lsn in lsns))
            found.append(((await snapshots.stored_meta(js, bucket_of("RACE"), "scope")).lsn, max(lsns)))
    finally:
        await nc.close()
    return found


async def put(js: Any, lsn: int) -> bool:
    data = SNAPSHOT_HEADER.pack(lsn, 0) + b"x" * 200_000  # two chunks: the writers interleave between them
    return await snapshots.put_if_newer(js, bucket_of("RACE"), "scope", data, lsn, 0)


async def connected(url: str, stream: str) -> tuple[Any, Any]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.create_object_store(bucket_of(stream))
    return nc, js


async def test_a_snapshot_an_earlier_build_stored_is_compared_by_its_data(nats_url: str) -> None:
    outcome = await trio.to_thread.run_sync(asyncio.run, earlier_build(nats_url))
    assert outcome == (False, True, SNAPSHOT_HEADER.pack(12, 3) + b"newer")


async def earlier_build(url: str) -> tuple[bool, bool, bytes]:
    nc, js = await connected(url, "EARLIER")
    try:
        objects = await js.object_store(bucket_of("EARLIER"))
        await objects.put("scope", SNAPSHOT_HEADER.pack(10, 3) + b"as an earlier build stored it")
        older = await snapshots.put_if_newer(js, bucket_of("EARLIER"), "scope", b"", 9, 3)
        newer = SNAPSHOT_HEADER.pack(12, 3) + b"newer"
        stored = await snapshots.put_if_newer(js, bucket_of("EARLIER"), "scope", newer, 12, 3)
        return older, stored, (await objects.get("scope")).data
    finally:
        await nc.close()
