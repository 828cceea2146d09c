"""The JetStream journal against a real nats-server (JetStream on, store in the test's directory, a free port,
stopped by its PID): the shared journal contract, fencing between two writers, message bounds, startup errors.
Skips when nats-server is not installed."""

from __future__ import annotations

import asyncio
import itertools
from functools import partial
from pathlib import Path

import nats
import pytest
import trio
from contract import TIMEOUT, JournalContract

from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.store import Durability, Journal, JournalFenced, JournalUnreachable, Snapshot
from kvrouter.simulations.process_faults.servers import nats_cluster
from tests.support.fleet_servers import NatsServer, nats_url, require_nats
from tests.support.processes import free_port

__all__ = ["nats_url"]  # the fixture (tests/support): one server for the module

_streams = itertools.count(1)


def open_journal(url: str, stream: str) -> JetStreamJournal:
    return JetStreamJournal.open((url,), stream, Durability.ALWAYS)


class TestJetStreamJournal(JournalContract):
    @pytest.fixture(autouse=True)
    def _server(self, nats_url: str) -> None:
        self.url = nats_url
        self.stream = f"JOURNAL{next(_streams)}"

    def make_journal(self) -> Journal:
        return open_journal(self.url, self.stream)

    async def restart(self, journal: Journal) -> Journal:
        await journal.aclose()
        return await trio.to_thread.run_sync(open_journal, self.url, self.stream)

    async def test_a_journal_on_another_connection_sees_the_records(self, nursery: trio.Nursery) -> None:
        """What a replica on another machine sees: a second open of the stream, the first still running."""
        journal = await self.started(nursery)
        await self.append_durably(journal, [b"a", b"b", b"c"])
        with trio.fail_after(TIMEOUT):
            await journal.write_snapshot(Snapshot(2, b"up to b"))
        other = open_journal(self.url, self.stream)
        try:
            assert other.latest_snapshot() == Snapshot(2, b"up to b")
            assert list(other.read()) == [(3, b"c")]
            assert other.last_lsn == 3
        finally:
            await other.aclose()


async def test_a_second_writer_is_fenced_and_the_log_does_not_fork(nats_url: str) -> None:
    first = open_journal(nats_url, "FENCED")
    second = open_journal(nats_url, "FENCED")  # both start at the same end of the log
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        first.append(b"first writer, 1")
        with trio.fail_after(TIMEOUT):
            await first.wait_durable(1)
        second.append(b"second writer, 1")  # buffered; its publish is refused
        with pytest.raises(JournalFenced, match="another writer appended"), trio.fail_after(TIMEOUT):
            await second.run()
        with pytest.raises(trio.BrokenResourceError) as refused:
            await second.wait_durable(1)
        assert isinstance(refused.value.__cause__, JournalFenced)
        with pytest.raises(trio.BrokenResourceError):
            second.append(b"second writer, 2")  # writes stay stopped
        first.append(b"first writer, 2")  # the first writer is unaffected
        with trio.fail_after(TIMEOUT):
            await first.wait_durable(2)
        await first.aclose()
    await second.aclose()
    after = open_journal(nats_url, "FENCED")
    assert list(after.read()) == [(1, b"first writer, 1"), (2, b"first writer, 2")]
    await after.aclose()


async def test_a_group_larger_than_max_payload_is_split_into_fenced_messages(nats_url: str) -> None:
    journal = open_journal(nats_url, "SPLIT")
    payloads = [bytes([i]) * 400_000 for i in range(5)]  # 2 MB in one group; the server's max_payload is 1 MiB
    async with trio.open_nursery() as nursery:
        lsns = [journal.append(p) for p in payloads]  # before the writer runs: one group
        await nursery.start(journal.run)
        with trio.fail_after(TIMEOUT):
            await journal.wait_durable(lsns[-1])
        assert journal.statistics().messages_published >= 3
        await journal.aclose()
    reopened = open_journal(nats_url, "SPLIT")
    assert list(reopened.read()) == list(enumerate(payloads, 1))
    with pytest.raises(ValueError, match="does not fit a JetStream message"):
        reopened.append(b"x" * 2_000_000)
    await reopened.aclose()


async def test_no_server_is_one_line_naming_it() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(JournalUnreachable, match=f"cannot reach NATS at {url}"), trio.fail_after(TIMEOUT):
        await trio.to_thread.run_sync(JetStreamJournal.open, (url,), "NOWHERE")


async def test_a_server_without_jetstream_is_refused_at_open(tmp_path: Path) -> None:
    require_nats()
    server = NatsServer(tmp_path, jetstream=False)
    await server.start()
    try:
        with pytest.raises(JournalUnreachable, match="is JetStream enabled"):
            await trio.to_thread.run_sync(open_journal, server.url, "PLAIN")
    finally:
        await server.stop()


async def test_fresh_empties_the_subject_and_the_snapshot_and_appends_start_again(nats_url: str) -> None:
    journal = open_journal(nats_url, "FRESH")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for payload in (b"a", b"b", b"c"):
            journal.append(payload)
        with trio.fail_after(TIMEOUT):
            await journal.wait_durable(3)
            await journal.write_snapshot(Snapshot(2, b"two"))
        await journal.aclose()
    fresh = await trio.to_thread.run_sync(lambda: JetStreamJournal.open((nats_url,), "FRESH", fresh=True))
    assert (fresh.last_lsn, fresh.latest_snapshot(), list(fresh.read())) == (0, None, [])
    async with trio.open_nursery() as nursery:
        await nursery.start(fresh.run)
        assert fresh.append(b"new") == 1
        with trio.fail_after(TIMEOUT):
            await fresh.wait_durable(1)  # the fence of an emptied subject: no message expected
        await fresh.aclose()
    again = open_journal(nats_url, "FRESH")
    assert list(again.read()) == [(1, b"new")]
    await again.aclose()


async def test_logs_of_one_stream_have_their_own_records_fences_and_snapshots(nats_url: str) -> None:
    """A cluster's scopes: many named logs in one stream, each a journal of its own (subject and snapshot object)."""
    first = JetStreamJournal.open((nats_url,), "LOGS", log="scope-a")
    second = JetStreamJournal.open((nats_url,), "LOGS", log="scope-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await nursery.start(second.run)
        first.append(b"a1")
        first.append(b"a2")
        second.append(b"b1")  # fenced on its own subject: the other log's messages do not refuse it
        with trio.fail_after(TIMEOUT):
            await first.wait_durable(2)
            await second.wait_durable(1)
            await first.write_snapshot(Snapshot(1, b"a up to 1"))
        await first.aclose()
        await second.aclose()
    again_a = JetStreamJournal.open((nats_url,), "LOGS", log="scope-a")
    again_b = JetStreamJournal.open((nats_url,), "LOGS", log="scope-b")
    try:
        assert again_a.latest_snapshot() == Snapshot(1, b"a up to 1")
        assert list(again_a.read()) == [(2, b"a2")]
        assert again_b.latest_snapshot() is None
        assert list(again_b.read()) == [(1, b"b1")]
    finally:
        await again_a.aclose()
        await again_b.aclose()
    with pytest.raises(ValueError, match="subject token"):
        JetStreamJournal.open((nats_url,), "LOGS", log="not.a.token")


async def test_a_stream_with_another_replica_count_is_refused_in_one_line(nats_url: str) -> None:
    first = await trio.to_thread.run_sync(open_journal, nats_url, "REPLICAS")  # created R=1
    await first.aclose()
    opened = partial(JetStreamJournal.open, (nats_url,), "REPLICAS", replicas=3)
    with pytest.raises(JournalUnreachable, match="exists with 1 replica\\(s\\), not the 3 of --jetstream-replicas"):
        await trio.to_thread.run_sync(opened)
    again = await trio.to_thread.run_sync(partial(JetStreamJournal.open, (nats_url,), "REPLICAS", replicas=1))
    await again.aclose()


async def test_a_stream_on_three_routed_servers_is_created_with_three_replicas(tmp_path: Path) -> None:
    with nats_cluster(require_nats(), tmp_path, 3) as nodes:
        servers = tuple(node.url for node in nodes)
        journal = await trio.to_thread.run_sync(partial(JetStreamJournal.open, servers, "THREE", replicas=3))
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            with trio.fail_after(TIMEOUT):
                await journal.wait_durable(journal.append(b"replicated"))
            await journal.aclose()
        stream, bucket = await trio.to_thread.run_sync(asyncio.run, replica_counts(servers[0], "THREE"))
        assert (stream, bucket) == (3, 3)  # the snapshots as replicated as the records


async def replica_counts(url: str, stream: str) -> tuple[int, int]:
    """The stream's replica count and its snapshot bucket's (asyncio: nats-py)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        records = await js.stream_info(stream)
        snapshots = await js.stream_info(f"OBJ_{stream}_snapshots")
        return records.config.num_replicas or 1, snapshots.config.num_replicas or 1
    finally:
        await nc.close()
