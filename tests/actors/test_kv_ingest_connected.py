"""``KvIngest.connected`` (what every selection asks of every rank: is its KV stream's listener connected?) and
``all_connected`` follow the listeners as the catalog starts and stops them, and each listener's state.

Real ZMQ SUB sockets; the publisher of one endpoint is bound here, the others are absent (their listeners
stay "connecting").
"""

from __future__ import annotations

import trio
import zmq

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import RemoveWorker, UpsertWorker
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "t")


def record(ranks: int, endpoints: dict[int, str], scope: ScopeKey = SCOPE) -> WorkerRecord:
    return WorkerRecord(
        1,
        scope.model_name,
        scope.tenant_id,
        endpoint="http://w1",
        block_size=4,
        data_parallel_size=ranks,
        kv_events_endpoints=tuple(sorted(endpoints.items())),
    )


async def active(ingest: KvIngest) -> None:
    """Until worker 1's rank 0 listener is connected (a listener's state is a plain attribute: polled)."""
    with trio.fail_after(10):
        while not ingest.connected(1, 0):  # noqa: ASYNC110 - no change notification to wait on
            await trio.sleep(0.005)


async def test_connected_follows_the_listeners_and_their_state(nursery: trio.Nursery) -> None:
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    await nursery.start(system.run)
    ingest = KvIngest(system, ListenerSlots(8, "the test"))
    await nursery.start(ingest.run)
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    live = f"tcp://127.0.0.1:{publisher.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        assert ingest.connected(1, 0) is None  # no worker, no listener
        assert ingest.all_connected()  # (no listener is not connected)

        assert isinstance(await system.ask(SCOPE, UpsertWorker(record(2, {0: live, 1: "tcp://127.0.0.1:9"}))), Accepted)
        assert ingest.connected(1, 1) is False  # its publisher is absent: connecting
        assert not ingest.all_connected()
        await active(ingest)  # the publisher is there: the listener becomes active
        assert ingest.connected(1, 2) is None and ingest.connected(2, 0) is None
        assert not ingest.all_connected()  # rank 1 is still connecting

        # One rank fewer: rank 1's listener stops; rank 0's moves to the absent endpoint.
        assert isinstance(await system.ask(SCOPE, UpsertWorker(record(1, {0: "tcp://127.0.0.1:9"}))), Accepted)
        assert ingest.connected(1, 1) is None
        assert ingest.connected(1, 0) is False

        # The worker moves to another scope: its listeners there are the ones asked about.
        other = ScopeKey("m", "other")
        assert isinstance(await system.ask(SCOPE, RemoveWorker(1)), Accepted)
        assert ingest.connected(1, 0) is None
        assert isinstance(await system.ask(other, UpsertWorker(record(1, {0: live}, other))), Accepted)
        assert ingest.connected(1, 0) is False
        await active(ingest)
        assert ingest.all_connected()

        assert isinstance(await system.ask(other, RemoveWorker(1)), Accepted)
        assert ingest.connected(1, 0) is None
    finally:
        publisher.close(linger=0)
        context.term()
