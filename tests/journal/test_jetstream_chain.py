"""The log as the chain of messages naming their predecessor: what readers pass over, and two writers racing on one
fence on a real 3-node nats-server cluster (clustered streams before nats-server 2.9.21 may store both appends; the
Debian package is 2.9.10). Skips when nats-server is not installed."""

from __future__ import annotations

import asyncio
import types
from functools import partial
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
import trio
from contract import TIMEOUT

from kvrouter.actors.cluster.forwarder import Relayed
from kvrouter.actors.cluster.service import write_outcome
from kvrouter.actors.mailbox import OutcomeUnknown
from kvrouter.actors.service_support import decode_failure
from kvrouter.journal import jetstream_batch as batch
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.jetstream_link import Fetched, JetStreamLink
from kvrouter.journal.store import JournalFenced, JournalWriteFailed
from kvrouter.simulations.process_faults.servers import nats_cluster
from tests.support.fleet_servers import require_nats

ROUNDS = 12


def test_a_second_append_on_one_fence_and_what_follows_it_are_off_the_chain() -> None:
    chain = batch.Chain()
    assert chain.take(5, 3)  # the first message read anchors the chain (what it follows was purged)
    assert chain.take(8, 5)  # writer A, fenced on 5
    assert not chain.take(9, 5)  # writer B, fenced on 5 too, stored by the race: off the chain
    assert not chain.take(11, 9)  # B went on after its own message: still off
    assert chain.take(12, 8)  # A recovered past B's messages: fenced on 11, following 8 on the chain
    assert chain.tail == 12


def test_a_message_from_before_the_prev_header_follows_its_fence() -> None:
    """The layout's one change: messages written before ``Kvr-Prev`` existed are read as following their fence."""
    old = {batch.LSN_HEADER: "4", batch.FORMAT_HEADER: "1", batch.FENCE_HEADER: "17"}
    assert batch.prev_of(old, 20) == 17
    assert batch.prev_of(batch.headers(4, 17, 12), 20) == 12
    with pytest.raises(batch.MalformedBatch, match="Kvr-Prev"):
        batch.prev_of({batch.LSN_HEADER: "4", batch.FORMAT_HEADER: "1"}, 20)


class StoredSubject:
    """What ``JetStreamLink`` asks of JetStream, over a subject's stored messages (sequence -> headers)."""

    def __init__(self, stored: dict[int, dict[str, str]]) -> None:
        self.stored = stored

    def jetstream(self, timeout: float) -> StoredSubject:
        return self

    async def get_msg(self, stream: str, seq: int, subject: str, next: bool) -> Any:
        for at in sorted(self.stored):
            if at >= seq:
                return types.SimpleNamespace(seq=at, headers=self.stored[at])
        raise nats.js.errors.NotFoundError

    async def get_last_msg(self, stream: str, subject: str) -> Any:
        return types.SimpleNamespace(seq=max(self.stored))


def on_chain(stored: dict[int, dict[str, str]], seq: int, fence: int, prev: int) -> bool:
    link = JetStreamLink(StoredSubject(stored), "S", "scope")
    return asyncio.run(link._on_chain(seq, fence, prev))


def test_a_writer_finds_out_whether_its_message_is_on_the_chain() -> None:
    own = batch.headers(4, 10, 10)
    assert on_chain({13: own}, 13, 10, 10)  # other subjects' messages between: none of its own
    assert not on_chain({11: batch.headers(4, 10, 10), 13: own}, 13, 10, 10)  # another took its place
    assert on_chain({11: batch.headers(3, 9, 7), 13: own}, 13, 10, 10)  # one off the chain is no rival
    assert on_chain({2: batch.headers(1, 0, 0)}, 2, 0, 0)  # the first message of an empty subject anchors it
    assert not on_chain({1: batch.headers(1, 0, 0), 2: batch.headers(1, 0, 0)}, 2, 0, 0)


def test_a_writer_that_cannot_see_every_message_since_its_fence_does_not_decide() -> None:
    """Another writer's snapshot purged its message at 11 (its message 12 names it): whether 13 is on the chain
    that readers anchor at 12 cannot be told, so its outcome is unknown rather than acknowledged."""
    stored = {12: batch.headers(5, 11, 11), 13: batch.headers(4, 10, 10)}
    with pytest.raises(JournalWriteFailed, match="purged"):
        on_chain(stored, 13, 10, 10)


def test_a_tail_read_that_finds_its_start_purged_by_a_first_snapshot_reads_again() -> None:
    """No snapshot when the read began; one stored meanwhile purged the records it covers: the first message read
    starts past lsn 1, so the read is made again (with the snapshot) instead of missing records 1 to 39."""
    link = JetStreamLink(StoredSubject({30: {}}), "S", "scope")

    async def no_snapshot() -> None:
        return None

    async def purged(start: int) -> list[Fetched]:
        return [Fetched(20, 40, 19, batch.frame(b"x", False)), Fetched(30, 41, 20, batch.frame(b"y", False))]

    link.load_snapshot = no_snapshot  # type: ignore[method-assign]
    link.fetch = purged  # type: ignore[method-assign]
    assert asyncio.run(link._read_tail()) is None


def test_an_owners_504_or_500_for_a_forwarded_write_is_an_unknown_outcome_not_a_503() -> None:
    for status in (504, 500):
        failure = decode_failure(write_outcome(Relayed(status, b'{"error": "no reply"}', b"application/json")))
        assert isinstance(failure, OutcomeUnknown) and str(failure) == "no reply"


async def race(servers: tuple[str, ...], log: str) -> list[bytes]:
    """Two writers open the same log, holding one record (both fenced on its message), and append at the same
    moment; what they acknowledged."""
    first = await trio.to_thread.run_sync(partial(JetStreamJournal.open, servers, "RACE", log=log, replicas=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        with trio.fail_after(TIMEOUT):
            await first.wait_durable(first.append(b"start"))
        await first.aclose()
    writers = []
    for n in range(2):  # each through a server of its own, as two replicas would be
        rotated = servers[n:] + servers[:n]
        opened = partial(JetStreamJournal.open, rotated, "RACE", log=log, replicas=3)
        writers.append(await trio.to_thread.run_sync(opened))
    acknowledged: list[bytes] = []

    async def write(journal: JetStreamJournal, payload: bytes) -> None:
        lsn = journal.append(payload)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(journal.run)
                with trio.fail_after(TIMEOUT):
                    await journal.wait_durable(lsn)
                acknowledged.append(payload)
                await journal.aclose()
        except* (JournalFenced, trio.BrokenResourceError):
            pass  # this writer was refused: it acknowledged nothing
        await journal.aclose()

    async with trio.open_nursery() as nursery:
        for n, journal in enumerate(writers):
            nursery.start_soon(write, journal, f"writer {n}".encode())
    return acknowledged


@pytest.mark.slow
async def test_two_writers_racing_on_one_fence_never_both_acknowledge_and_the_log_holds_what_one_did(
    tmp_path: Path,
) -> None:
    with nats_cluster(require_nats(), tmp_path, 3) as nodes:
        servers = tuple(node.url for node in nodes)
        for round_ in range(ROUNDS):
            log = f"race{round_}"
            acknowledged = await race(servers, log)
            assert len(acknowledged) <= 1, acknowledged
            reader = await trio.to_thread.run_sync(partial(JetStreamJournal.open, servers, "RACE", log=log))
            try:
                held = [payload for _, payload in reader.read()]
            finally:
                await reader.aclose()
            assert held[0] == b"start"
            assert held[1:] == acknowledged  # what was acknowledged, and never both: the second append is passed over
