"""Session bindings over replica sync (the selection service's affinity topic): real ZMQ sockets on 127.0.0.1
and the real clock, as test_replicator.py. A binding made on one replica is applied (and journaled) on its
peers, newest version wins, and a peer's binding passes the same checks as its other messages: CURVE on the
link, per-peer rate, and ids this replica does not know are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import zmq

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Reserve, UpsertWorker
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.sessions import SessionBinding
from kvrouter.actors.peers.peer_limits import PeerLimits
from kvrouter.actors.peers.replica_wire import (
    AFFINITY_TOPIC,
    TOPIC,
    Free,
    ReplicaEvent,
    SessionAffinity,
    encode,
    encode_affinity,
)
from kvrouter.actors.peers.replicator import DropReason, ReplicaSecurity, Replicator
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket
from kvrouter.journal.memory import MemoryJournal
from tests.peers.test_replica_security import Keys, free_port, prove, raw_publisher
from tests.peers.test_replicator import SCOPE, WORKER, eventually, running

TTL = 60 * 1_000_000_000


async def start_system(nursery: trio.Nursery) -> tuple[ActorSystem, MemoryJournal]:
    """A selection service's actors with worker 7 (ranks 0 and 1) in its catalog."""
    journal = MemoryJournal()
    system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
    await nursery.start(journal.run)
    await nursery.start(system.run)
    record = WorkerRecord(WORKER, "m", "g", endpoint="http://w7", block_size=16, data_parallel_size=2)
    await system.ask(SCOPE, UpsertWorker(record, use_kv_events=False))
    return system, journal


async def start(
    nursery: trio.Nursery,
    system: ActorSystem,
    *,
    router_id: int,
    port: int = 0,
    peers: tuple[str, ...] = (),
    security: ReplicaSecurity | None = None,
) -> Replicator:
    replicator = Replicator(
        system,
        port=port,
        peers=peers,
        router_id=router_id,
        host="127.0.0.1",
        security=security,
        session_ttl_ns=TTL,
    )
    await nursery.start(replicator.run)
    return replicator


async def book(system: ActorSystem, reservation_id: str, dp_rank: int, session_id: str, writer_id: int) -> None:
    """What a /select_and_reserve with ``session_id`` applies: a booking that pins the session."""
    at = system.clock.now_ns()
    command = Reserve(
        reservation_id,
        WORKER,
        dp_rank,
        (1, 2),
        8,
        session_id=session_id,
        session_ttl_ns=TTL,
        writer_id=writer_id,
        at=at,
    )
    assert isinstance(await system.ask(SCOPE, command), Accepted)


def binding(system: ActorSystem, session_id: str) -> SessionBinding | None:
    state = system.state(SCOPE)
    return state.selection.sessions.get(session_id) if state is not None else None


def pinned(system: ActorSystem, session_id: str) -> WorkerRank | None:
    found = binding(system, session_id)
    return WorkerRank(found.worker_id, found.dp_rank) if found is not None else None


async def both_topics(xpub: TrioZmqSocket) -> None:
    """Until the replicator's SUB has subscribed to both topics."""
    seen: set[bytes] = set()
    while seen != {TOPIC, AFFINITY_TOPIC}:
        frames = await xpub.recv_multipart()
        if frames[0][:1] == b"\x01":
            seen.add(frames[0][1:])


async def test_a_binding_made_on_one_replica_is_taken_by_its_curve_peer(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    port_a, port_b = free_port(), free_port()
    end_a, end_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    keys.make("a", end_a)
    keys.make("b", end_b)
    async with running() as nursery:
        system_a, _ = await start_system(nursery)
        system_b, journal_b = await start_system(nursery)
        security_a = ReplicaSecurity(keys.curve("a", keys.trust_dir("a", "b")))
        security_b = ReplicaSecurity(keys.curve("b", keys.trust_dir("b", "a")))
        a = await start(nursery, system_a, router_id=1, port=port_a, peers=(end_b,), security=security_a)
        b = await start(nursery, system_b, router_id=2, port=port_b, peers=(end_a,), security=security_b)
        await prove(system_a, system_b)  # bindings share the link (and its order) with the admissions

        await book(system_a, "r1", 1, "chat", writer_id=1)
        await eventually(lambda: pinned(system_b, "chat") == WorkerRank(WORKER, 1))
        ours, theirs = binding(system_a, "chat"), binding(system_b, "chat")
        assert ours is not None and theirs is not None
        assert theirs.version == ours.version and theirs.version[1] == 1
        assert theirs.ttl_ns == TTL
        assert b.stats.published == 0  # a peer's binding is not published again (no echo)
        # Journaled on B: a restart from B's journal alone knows the pin.
        assert pinned_after_recovery(journal_b) == WorkerRank(WORKER, 1)

        # B moves the session (a later version): A follows.
        await prove(system_b, system_a)
        await book(system_b, "r2", 0, "chat", writer_id=2)
        await eventually(lambda: pinned(system_a, "chat") == WorkerRank(WORKER, 0))
        moved = binding(system_a, "chat")
        assert moved is not None and moved.version[1] == 2 and moved.version > ours.version
        assert a.stats.refused_subscribers == b.stats.refused_subscribers == 0


def pinned_after_recovery(journal: MemoryJournal) -> WorkerRank | None:
    sessions = recover(journal).states[SCOPE].selection.sessions
    found = sessions.get("chat")
    return WorkerRank(found.worker_id, found.dp_rank) if found is not None else None


def affinity(session_id: str, *, worker_id: int = WORKER, dp_rank: int | None = 0, **fields: object) -> list[bytes]:
    values: dict[str, object] = {
        "model_name": "m",
        "routing_group": "g",
        "session_id": session_id,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "sequence": 10,
        "writer_id": 50,
        **fields,
    }
    return encode_affinity(SessionAffinity(**values))  # type: ignore[arg-type]


async def test_forged_bindings_for_unknown_ids_change_nothing() -> None:
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, journal = await start_system(nursery)
        replicator = await start(nursery, system, router_id=2, peers=(endpoint,))
        await both_topics(xpub)
        records = journal.last_lsn
        forged = [
            affinity("s", model_name="no-such-model"),
            affinity("s", worker_id=999),  # a worker that is not registered
            affinity("s", dp_rank=5),  # a rank it does not have
            affinity("s", worker_id=999, dp_rank=None),
            affinity("s", writer_id=2),  # our own router id: our own binding coming back
            affinity("x" * 5000),  # an id longer than the HTTP API accepts
            [AFFINITY_TOPIC, b"\xc1"],
        ]
        for frames in forged:
            await xpub.send_multipart(frames)
        await xpub.send_multipart(affinity("control", dp_rank=None))  # no rank: the worker's first
        await eventually(lambda: replicator.stats.received == len(forged) + 1)
        await eventually(lambda: journal.last_lsn == records + 1)  # the control's binding, nothing else
        state = system.state(SCOPE)
        assert state is not None and list(state.selection.sessions) == ["control"]
        assert pinned(system, "control") == WorkerRank(WORKER, 0)
        assert replicator.stats.dropped == {
            DropReason.UNKNOWN_SCOPE: 1,
            DropReason.UNREGISTERED_RANK: 3,
            DropReason.OWN_ROUTER: 1,
            DropReason.OVER_LIMIT: 1,
            DropReason.MALFORMED: 1,
        }
        assert replicator.stats.applied == 1


async def test_a_peer_flooding_bindings_is_rate_limited() -> None:
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, _ = await start_system(nursery)
        limits = PeerLimits(rate=50.0, burst=5)
        replicator = await start(
            nursery, system, router_id=2, peers=(endpoint,), security=ReplicaSecurity(limits=limits)
        )
        link = replicator.peer_stats()[endpoint]
        await both_topics(xpub)
        for i in range(40):
            await xpub.send_multipart(affinity(f"flood-{i}"))
        await eventually(lambda: link.received == 40)
        assert link.rate_limited == 40 - replicator.stats.applied > 0
        assert replicator.stats.dropped[DropReason.RATE_LIMITED] == link.rate_limited


async def test_a_replica_without_affinity_does_not_subscribe_to_bindings() -> None:
    """The slot tracker, or a selection service without --session-affinity-ttl-secs (1.6.1's slot tracker
    subscribes to the slot-tracker topic only)."""
    async with running() as nursery, raw_publisher() as (xpub, endpoint):
        system, _ = await start_system(nursery)
        plain = Replicator(system, port=0, peers=(endpoint,), router_id=2, host="127.0.0.1")
        await nursery.start(plain.run)
        assert await xpub.recv_multipart() == [b"\x01" + TOPIC]
        await xpub.send_multipart(affinity("ignored"))
        await xpub.send_multipart(affinity("ignored-too"))
        # A positive control on the same pipe, after them: had they been subscribed to, they would come first.
        control = encode(ReplicaEvent("m", "g", 16, "control", WORKER, 0, Free(), 50))
        await xpub.send_multipart(control)
        await eventually(lambda: plain.stats.received >= 1)
        assert plain.stats.received == 1 and plain.stats.dropped == {DropReason.UNKNOWN_REQUEST: 1}
        with pytest.raises(zmq.Again):  # and no subscription to the affinity topic came
            xpub.socket.recv_multipart(zmq.NOBLOCK)
        assert binding(system, "ignored") is None
