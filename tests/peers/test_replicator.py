"""Replicator: two in-process actor systems (or one and a hand-driven ZMQ peer) on 127.0.0.1.

Real clock and real ZMQ: an autojump clock would fire the socket adapter's safety timeouts while the
kernel is still moving bytes. Every link is proven live before the test asserts on it (a SUB misses
what was published before it connected: the ZMQ slow joiner).
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import zmq

from kvrouter.actors.core.commands import AddRequest, CompletePrefill, ExpireStale, FreeRequest, RegisterWorker
from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.peers.replica_wire import (
    TOPIC,
    AddRequestData,
    Free,
    MarkPrefillCompleted,
    PrefillLoadHint,
    ReplicaEvent,
    decode,
    encode,
)
from kvrouter.actors.peers.replicator import DropReason, Replicator, random_router_id, validate_endpoint
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.journal.memory import MemoryJournal
from tests.peers.test_replica_wire import (
    GOLDEN_ADD,
    GOLDEN_ADD_NO_PREFILL,
    GOLDEN_FREE,
    GOLDEN_PREFILL_COMPLETE,
    REFERENCE_ROUTER_ID,
)

SCOPE = ScopeKey("m", "g")
WORKER = 7
SETTLE = 0.3  # how long "nothing more arrives" is watched for


@attrs.define
class Node:
    system: ActorSystem
    journal: MemoryJournal
    replicator: Replicator
    endpoint: str

    def requests(self) -> dict:
        state = self.system.state(SCOPE)
        return dict(state.requests) if state is not None else {}


async def start_node(
    nursery: trio.Nursery, *, router_id: int, peers: tuple[str, ...] = (), register: bool = True, **options: int
) -> Node:
    journal = MemoryJournal()
    system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
    await nursery.start(journal.run)
    await nursery.start(system.run)
    if register:
        await system.ask(SCOPE, RegisterWorker(WORKER, block_size=16, dp_start=0, dp_size=2))
    replicator = Replicator(system, port=0, peers=peers, router_id=router_id, host="127.0.0.1", **options)
    endpoint = await nursery.start(replicator.run)
    return Node(system, journal, replicator, endpoint)


@asynccontextmanager
async def running() -> AsyncIterator[trio.Nursery]:
    """A nursery cancelled on exit, within a deadline: shutdown itself is part of every test."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            yield nursery
            nursery.cancel_scope.cancel()


async def within(seconds: float, predicate: Callable[[], bool]) -> bool:
    """Poll ``predicate`` (state lives in other tasks' hands) until true or ``seconds`` pass."""
    with trio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling another task's state
            await trio.sleep(0.005)
        return True
    return False


async def eventually(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    assert await within(seconds, predicate), "condition not reached in time"


async def prove_link(source: Node, target: Node) -> None:
    """Retry a probe admission on ``source`` until ``target`` applies it, then free every probe."""
    probes = []
    for attempt in itertools.count():
        request_id = f"probe-{source.replicator.router_id}-{attempt}"
        probes.append(request_id)
        await source.system.ask(SCOPE, AddRequest(request_id, WORKER, 0, (), 0))
        if await within(0.2, lambda r=request_id: r in target.requests()):  # type: ignore[misc]
            break
    for request_id in probes:
        await source.system.ask(SCOPE, FreeRequest(request_id))
    await eventually(lambda: not any(r.startswith("probe-") for r in target.requests()))


# -- two kvrouter replicas ----------------------------------------------------------------------------


async def test_lifecycle_replicates_without_echo() -> None:
    async with running() as nursery:
        a = await start_node(nursery, router_id=1)
        b = await start_node(nursery, router_id=2, peers=(a.endpoint,))
        assert a.replicator.register_peer(b.endpoint)
        await prove_link(a, b)
        await prove_link(b, a)
        a_records, b_records = a.journal.last_lsn, b.journal.last_lsn
        b_published, a_received = b.replicator.stats.published, a.replicator.stats.received

        before = WallClock().now_ns()
        await a.system.ask(SCOPE, AddRequest("r1", WORKER, 1, (1, 2, 3), 12, at=1))
        await eventually(lambda: "r1" in b.requests())
        request = b.requests()["r1"]
        assert (request.rank, request.sequence_hashes) == (WorkerRank(WORKER, 1), (1, 2, 3))
        assert request.started_at >= before  # the receiver's clock, not the publisher's `at`
        rank = b.system.state(SCOPE).ranks[WorkerRank(WORKER, 1)]  # type: ignore[union-attr]
        assert (rank.prefill_tokens, rank.active_decode_blocks) == (12, 3)

        await a.system.ask(SCOPE, CompletePrefill("r1"))
        await eventually(lambda: rank.prefill_tokens == 0)
        assert "r1" in b.requests()  # blocks stay until the free
        await a.system.ask(SCOPE, FreeRequest("r1"))
        await eventually(lambda: "r1" not in b.requests())
        assert rank.active_decode_blocks == 0

        await trio.sleep(SETTLE)
        assert a.journal.last_lsn == a_records + 3  # A's own three decisions, nothing echoed back
        assert b.journal.last_lsn == b_records + 3  # B journals what it applied ...
        assert b.replicator.stats.published == b_published  # ... and never re-publishes it
        assert a.replicator.stats.received == a_received
        # Only frees of probes whose admission went out before the link was live (the slow joiner).
        assert set(a.replicator.stats.dropped) <= {DropReason.UNKNOWN_REQUEST}
        assert set(b.replicator.stats.dropped) <= {DropReason.UNKNOWN_REQUEST}


async def test_outbound_bytes_match_the_reference() -> None:
    """For the calls that produced the golden captures, kvrouter publishes the same bytes."""
    async with running() as nursery:
        journal = MemoryJournal()
        system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
        await nursery.start(journal.run)
        await nursery.start(system.run)
        await system.ask(SCOPE, RegisterWorker(WORKER, block_size=16, dp_start=0, dp_size=2))
        replicator = Replicator(system, port=0, peers=(), router_id=REFERENCE_ROUTER_ID, host="127.0.0.1")
        endpoint = await nursery.start(replicator.run)
        with open_socket(zmq.SUB, options={zmq.SUBSCRIBE: TOPIC}) as sub:
            sub.socket.connect(endpoint)
            for attempt in itertools.count():  # slow joiner: until one probe gets through
                await system.ask(SCOPE, AddRequest(f"probe-{attempt}", WORKER, 0, (), 0))
                with trio.move_on_after(0.2):
                    await sub.recv_multipart()
                    break
            await drain(sub)

            await system.ask(SCOPE, AddRequest("r1", WORKER, 1, (1, 2, 2**64 - 1), 40))
            assert await sub.recv_multipart() == [TOPIC, GOLDEN_ADD]
            await system.ask(SCOPE, AddRequest("r2", WORKER, 0, (), 0))
            assert await sub.recv_multipart() == [TOPIC, GOLDEN_ADD_NO_PREFILL]
            await system.ask(SCOPE, CompletePrefill("r1"))
            assert await sub.recv_multipart() == [TOPIC, GOLDEN_PREFILL_COMPLETE]
            await system.ask(SCOPE, FreeRequest("r1"))
            assert await sub.recv_multipart() == [TOPIC, GOLDEN_FREE]

            # Not published: no-op decisions (1.6.1 does republish a repeated prefill_complete), a free
            # of an unknown request (as 1.6.1), expiry, registration.
            await system.ask(SCOPE, CompletePrefill("r2"))
            await system.ask(SCOPE, FreeRequest("never"))
            await system.ask(SCOPE, ExpireStale(max_age_ns=0, at=WallClock().now_ns() + 10**12))  # expires r2
            await system.ask(SCOPE, RegisterWorker(8, block_size=16, dp_start=0, dp_size=1))
            assert "r2" not in system.state(SCOPE).requests  # type: ignore[union-attr]
            await system.ask(SCOPE, AddRequest("sentinel", 8, 0, (), 0))
            sentinel = decode(await sub.recv_multipart())
            assert (sentinel.request_id, sentinel.rank) == ("sentinel", WorkerRank(8, 0))
        assert replicator.stats.outbox_dropped == 0 and replicator.stats.unpublishable == 0


async def test_free_of_a_request_active_before_start_names_its_rank() -> None:
    async with running() as nursery:
        journal = MemoryJournal()
        system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
        await nursery.start(journal.run)
        await nursery.start(system.run)
        await system.ask(SCOPE, RegisterWorker(WORKER, block_size=16, dp_start=0, dp_size=2))
        await system.ask(SCOPE, AddRequest("pre", WORKER, 1, (5,), 3))
        replicator = Replicator(system, port=0, peers=(), router_id=9, host="127.0.0.1")
        endpoint = await nursery.start(replicator.run)
        with open_socket(zmq.SUB, options={zmq.SUBSCRIBE: TOPIC}) as sub:
            sub.socket.connect(endpoint)
            for attempt in itertools.count():
                await system.ask(SCOPE, AddRequest(f"probe-{attempt}", WORKER, 0, (), 0))
                with trio.move_on_after(0.2):
                    await sub.recv_multipart()
                    break
            await drain(sub)
            await system.ask(SCOPE, CompletePrefill("pre"))
            await system.ask(SCOPE, FreeRequest("pre"))
            expected = [
                ReplicaEvent("m", "g", 16, "pre", WORKER, 1, data, 9) for data in (MarkPrefillCompleted(), Free())
            ]
            assert [decode(await sub.recv_multipart()) for _ in expected] == expected


async def drain(sub: TrioZmqSocket) -> None:
    """Discard what is queued now and what arrives in the next moment (the probes)."""
    while True:
        with trio.move_on_after(SETTLE):
            await sub.recv_multipart()
            continue
        return


# -- a hand-driven peer --------------------------------------------------------------------------------


@asynccontextmanager
async def raw_peer() -> AsyncIterator[tuple[TrioZmqSocket, str]]:
    """An XPUB: a PUB that also reports subscriptions, so tests know when a SUB is live."""
    with open_socket(zmq.XPUB) as xpub:
        port = xpub.socket.bind_to_random_port("tcp://127.0.0.1")
        yield xpub, f"tcp://127.0.0.1:{port}"


def add(
    request_id: str,
    *,
    router_id: int = 50,
    model: str = "m",
    group: str = "g",
    block_size: int = 16,
    worker_id: int = WORKER,
    dp_rank: int = 0,
) -> list[bytes]:
    data = AddRequestData((1, 2), True, None, PrefillLoadHint(4))
    return encode(ReplicaEvent(model, group, block_size, request_id, worker_id, dp_rank, data, router_id))


async def test_receiver_drop_rules() -> None:
    async with running() as nursery, raw_peer() as (xpub, endpoint):
        b = await start_node(nursery, router_id=2, peers=(endpoint,))
        assert await xpub.recv_multipart() == [b"\x01" + TOPIC]  # B's SUB is live
        records = b.journal.last_lsn
        for frames in (
            add("ok1"),
            add("other-model", model="x"),
            add("other-group", group="default"),
            add("other-block-size", block_size=32),
            add("unregistered-rank", dp_rank=2),
            add("unregistered-worker", worker_id=99),
            add("own", router_id=2),
            [TOPIC, b"\xc1"],
            [TOPIC + b"x", add("longer-topic")[1]],  # passes the SUB's prefix filter; 1.6.1 drops it
            encode(ReplicaEvent("m", "g", 16, "never-added", WORKER, 0, Free(), 50)),  # unknown id: dropped
            add("ok2"),
        ):
            await xpub.send_multipart(frames)
        await eventually(lambda: "ok2" in b.requests())
        stats = b.replicator.stats
        assert set(b.requests()) == {"ok1", "ok2"}
        assert b.system.state(SCOPE).ranks[WorkerRank(WORKER, 0)].prefill_tokens == 8  # type: ignore[union-attr]
        assert stats.dropped == {
            DropReason.UNKNOWN_SCOPE: 2,
            DropReason.BLOCK_SIZE_MISMATCH: 1,
            DropReason.UNREGISTERED_RANK: 2,
            DropReason.OWN_ROUTER: 1,
            DropReason.MALFORMED: 2,
            DropReason.UNKNOWN_REQUEST: 1,
        }
        assert (stats.received, stats.applied) == (11, 2)
        assert b.journal.last_lsn == records + 2  # the unknown free changed nothing
        assert stats.published == 0


async def test_peers_register_and_deregister_while_running() -> None:
    async with running() as nursery, raw_peer() as (xpub, endpoint):
        b = await start_node(nursery, router_id=2)
        replicator = b.replicator
        assert replicator.peers() == []
        assert replicator.register_peer(endpoint) is True
        assert replicator.register_peer(endpoint) is False
        assert replicator.register_peer("tcp://127.0.0.1:1") is True
        assert replicator.peers() == sorted([endpoint, "tcp://127.0.0.1:1"])
        with pytest.raises(ValueError, match=r"^invalid ZMQ endpoint `bogus`: missing scheme$"):
            replicator.register_peer("bogus")
        with pytest.raises(ValueError, match=r"^failed to register replica peer `tcp://\*:5`$"):
            replicator.register_peer("tcp://*:5")  # valid text, refused by zmq (1.6.1 answers the same)
        assert replicator.peers() == sorted([endpoint, "tcp://127.0.0.1:1"])

        assert await xpub.recv_multipart() == [b"\x01" + TOPIC]
        await xpub.send_multipart(add("while-registered"))
        await eventually(lambda: "while-registered" in b.requests())

        assert replicator.deregister_peer(endpoint) is True
        assert replicator.deregister_peer(endpoint) is False
        with pytest.raises(ValueError, match="missing TCP port"):
            replicator.deregister_peer("tcp://127.0.0.1")
        assert replicator.peers() == ["tcp://127.0.0.1:1"]
        assert await xpub.recv_multipart() == [b"\x00" + TOPIC]  # the SUB is gone
        await xpub.send_multipart(add("after-deregister"))
        assert not await within(SETTLE, lambda: "after-deregister" in b.requests())

        assert replicator.register_peer(endpoint) is True  # and back again
        assert await xpub.recv_multipart() == [b"\x01" + TOPIC]
        await xpub.send_multipart(add("re-registered"))
        await eventually(lambda: "re-registered" in b.requests())


async def test_peers_before_start_and_startup_errors() -> None:
    async with running() as nursery:
        journal = MemoryJournal()
        system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
        await nursery.start(journal.run)
        await nursery.start(system.run)
        with pytest.raises(ValueError, match=r"^invalid replica peer endpoint `bogus`$"):  # 1.6.1's CLI text
            Replicator(system, port=0, peers=["bogus"], router_id=1)
        with pytest.raises(ValueError, match="router_id"):
            Replicator(system, port=0, peers=[], router_id=0)
        idle = Replicator(system, port=0, peers=["tcp://127.0.0.1:2"], router_id=1, host="127.0.0.1")
        assert idle.register_peer("tcp://127.0.0.1:3") is True  # recorded; connects when run starts
        assert idle.deregister_peer("tcp://127.0.0.1:2") is True
        assert idle.peers() == ["tcp://127.0.0.1:3"]

        refused = Replicator(system, port=0, peers=["tcp://127.0.0.1:2", "tcp://*:5"], router_id=1, host="127.0.0.1")
        with pytest.raises(ValueError, match=r"failed to register replica peer `tcp://\*:5`"):
            await nursery.start(refused.run)
        assert refused._observe not in system.observers  # a replicator that failed to start stays detached


async def test_outbox_overflow_drops_newest_without_blocking() -> None:
    async with running() as nursery:
        node = await start_node(nursery, router_id=3, outbox_size=3)
        state = node.system.state(SCOPE)
        assert state is not None
        command = AddRequest("x", WORKER, 0, (), 0)
        # Ten decisions within one actor turn (no checkpoint in between): the observer never waits.
        for i in range(10):
            node.replicator._observe(state, command, (RequestAdded(f"x{i}", WORKER, 0, (), 0, 0),))
        # Three wait in the outbox; a fourth may have gone straight to the drain task if it was parked.
        stats = node.replicator.stats
        assert stats.outbox_dropped in (6, 7)
        assert node.replicator.outbox_statistics().current_buffer_used == 3
        await eventually(lambda: stats.published == 10 - stats.outbox_dropped)
        assert node.replicator.outbox_statistics().current_buffer_used == 0


async def test_remote_decisions_are_not_published() -> None:
    async with running() as nursery:
        node = await start_node(nursery, router_id=3)
        state: ScopeState | None = node.system.state(SCOPE)
        assert state is not None
        remote = AddRequest("x", WORKER, 0, (), 0, remote=True)
        node.replicator._observe(state, remote, (RequestAdded("x", WORKER, 0, (), 0, 0),))
        assert node.replicator.outbox_statistics().current_buffer_used == 0


async def test_shutdown_leaves_no_open_sockets() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with running() as nursery, raw_peer() as (xpub, endpoint):
            node = await start_node(nursery, router_id=4, peers=(endpoint, "tcp://127.0.0.1:1"))
            assert await xpub.recv_multipart() == [b"\x01" + TOPIC]
            node.replicator.register_peer("tcp://127.0.0.1:2")
            assert node.replicator.deregister_peer("tcp://127.0.0.1:1")
        del node
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_random_router_id_is_a_nonzero_u64() -> None:
    ids = {random_router_id() for _ in range(100)}
    assert all(0 < i < 2**64 for i in ids) and len(ids) == 100


# Each text below is 1.6.1's answer to POST /replica_sync/register_peer with that endpoint (400 body), or
# None where it answered 201. ("tcp://*:5" passes validation; zmq then refuses it.)
PORT = "invalid TCP port: "
ENDPOINTS = {
    "bogus": "invalid ZMQ endpoint `bogus`: missing scheme",
    "": "invalid ZMQ endpoint ``: missing scheme",
    "tcp:/x": "invalid ZMQ endpoint `tcp:/x`: missing scheme",
    "tcp://": "invalid ZMQ endpoint `tcp://`: missing address",
    "ipc://": "invalid ZMQ endpoint `ipc://`: missing address",
    "inproc://": "invalid ZMQ endpoint `inproc://`: missing address",
    "foo://x:1": "invalid ZMQ endpoint `foo://x:1`: unsupported scheme `foo`",
    "TCP://127.0.0.1:5": "invalid ZMQ endpoint `TCP://127.0.0.1:5`: unsupported scheme `TCP`",
    "://x": "invalid ZMQ endpoint `://x`: unsupported scheme ``",
    " tcp://127.0.0.1:5": "invalid ZMQ endpoint ` tcp://127.0.0.1:5`: unsupported scheme ` tcp`",
    "tcp://127.0.0.1": "invalid ZMQ endpoint `tcp://127.0.0.1`: missing TCP port",
    "tcp://[": "invalid ZMQ endpoint `tcp://[`: missing TCP port",
    "tcp://x:1:2": "invalid ZMQ endpoint `tcp://x:1:2`: missing TCP port",
    "tcp://::1:5": "invalid ZMQ endpoint `tcp://::1:5`: missing TCP port",
    "tcp://a:1;b:2": "invalid ZMQ endpoint `tcp://a:1;b:2`: missing TCP port",
    "tcp://x:1:abc": "invalid ZMQ endpoint `tcp://x:1:abc`: missing TCP port",
    "tcp://:5": "invalid ZMQ endpoint `tcp://:5`: missing TCP host",
    "tcp://:abc": "invalid ZMQ endpoint `tcp://:abc`: missing TCP host",
    "tcp://[::1]": "invalid ZMQ endpoint `tcp://[::1]`: missing closing `]`",
    "tcp://[::1]x:5": "invalid ZMQ endpoint `tcp://[::1]x:5`: missing closing `]`",
    "tcp://[::1:abc": "invalid ZMQ endpoint `tcp://[::1:abc`: missing closing `]`",
    "tcp://127.0.0.1:": "invalid ZMQ endpoint `tcp://127.0.0.1:`: " + PORT + "cannot parse integer from empty string",
    "tcp://127.0.0.1:abc": "invalid ZMQ endpoint `tcp://127.0.0.1:abc`: " + PORT + "invalid digit found in string",
    "tcp://127.0.0.1:-1": "invalid ZMQ endpoint `tcp://127.0.0.1:-1`: " + PORT + "invalid digit found in string",
    "tcp://127.0.0.1:+": "invalid ZMQ endpoint `tcp://127.0.0.1:+`: " + PORT + "invalid digit found in string",
    "tcp://a:1;b": "invalid ZMQ endpoint `tcp://a:1;b`: " + PORT + "invalid digit found in string",
    "tcp://x:5 ": "invalid ZMQ endpoint `tcp://x:5 `: " + PORT + "invalid digit found in string",
    "tcp://x:65536": "invalid ZMQ endpoint `tcp://x:65536`: " + PORT + "number too large to fit in target type",
    "tcp://[::1]:": "invalid ZMQ endpoint `tcp://[::1]:`: " + PORT + "cannot parse integer from empty string",
    "tcp://127.0.0.1:0": None,
    "tcp://127.0.0.1:05": None,
    "tcp://x:00000000000000000000005": None,
    "tcp://x:65535": None,
    "tcp://[::1]:5": None,
    "tcp://[]:5": None,
    "tcp://x]:5": None,
    "tcp://a;b:1": None,
    "tcp://no-such-host.invalid:5": None,
    "tcp://*:5": None,
    "tcp://127.0.0.1:+5": None,
    "ipc:///tmp/x.sock": None,
    "ipc://x:y": None,
    "ipc://@abstract": None,
    "inproc://x": None,
}


@pytest.mark.parametrize(("endpoint", "message"), ENDPOINTS.items(), ids=[repr(e) for e in ENDPOINTS])
def test_validate_endpoint_matches_1_6_1(endpoint: str, message: str | None) -> None:
    assert validate_endpoint(endpoint) == message
