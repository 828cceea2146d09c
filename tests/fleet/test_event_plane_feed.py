"""Dynamo's event plane as a KV feed of the liveness watch (``EventPlaneIngest.connected``, ``kv_health.Feeds``):
which ranks it answers for, and when their publisher counts as read. The end-to-end outage and return over real
NATS and ZMQ is ``test_event_plane_liveness.py``."""

from __future__ import annotations

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_liveness import KV_EVENTS_STOPPED
from kvrouter.actors.core.kv_modes import KvMode
from kvrouter.actors.fleet.dynamo_layout import DiscoveredWorker, Layout
from kvrouter.actors.fleet.event_ingest import EventPlaneIngest
from kvrouter.actors.kv_health import Feeds, KvHealth
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from tests.support.dynamo_keys import NS, worker_keys, zmq_channel_value

ON_NATS, ON_ZMQ = 0x7200000000000001, 0x7200000000000002
SECOND = 1_000_000_000
SUBJECT = f"namespace.{NS}.component.backend.endpoint.generate.kv-events"


def discovered() -> dict[int, DiscoveredWorker]:
    layout = Layout()
    keys = {
        **worker_keys(ON_NATS, 0xA1),
        **worker_keys(ON_ZMQ, 0xA2, channel=zmq_channel_value(0xA2, "tcp://127.0.0.1:39111")),
    }
    for key, value in keys.items():
        layout.put(key, value)
    workers, skipped = layout.workers(kv_events_endpoint=None)
    assert skipped == {} and set(workers) == {ON_NATS, ON_ZMQ}
    return workers


def plane(read: set[str]) -> EventPlaneIngest:
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    ingest = EventPlaneIngest(system, "nats")
    ingest.reading = read.__contains__
    ingest.follow(discovered())
    return ingest


async def test_a_discovered_publishers_ranks_are_fed_while_the_plane_reads_its_subject() -> None:
    read: set[str] = {SUBJECT}
    ingest = plane(read)
    assert ingest.connected(ON_NATS, 0) is True
    assert ingest.connected(ON_NATS, 1) is None  # a rank the worker does not have
    assert ingest.connected(0x99, 0) is None  # a worker discovery does not show: not the plane's
    assert sorted(ingest.listening()) == [(ON_NATS, 0), (ON_ZMQ, 0)]
    read.clear()  # the NATS connection is down
    assert ingest.connected(ON_NATS, 0) is False


async def test_a_publisher_on_the_other_planes_channel_is_never_read() -> None:
    ingest = plane({SUBJECT, "tcp://127.0.0.1:39111"})
    assert ingest.connected(ON_ZMQ, 0) is False  # kvrouter reads --event-plane nats: its events never come
    assert ingest.all_connected() is False


async def test_feeds_answer_for_a_rank_with_the_first_feed_that_knows_it() -> None:
    ingest = plane({SUBJECT})
    other = plane(set())  # knows the same ranks, never read: not asked once the first answers
    feeds = Feeds(ingest)
    feeds.add(other)
    assert feeds.connected(ON_NATS, 0) is True
    assert feeds.connected(0x99, 0) is None
    assert feeds.all_connected() is False
    assert sorted(feeds.listening()) == sorted([*ingest.listening(), *other.listening()])
    ingest.follow({})  # discovery no longer shows them
    assert ingest.connected(ON_NATS, 0) is None and feeds.connected(ON_NATS, 0) is False


async def test_an_event_plane_rank_is_scored_on_its_bookings_and_taken_out_by_the_listeners_rule() -> None:
    """Through ``KvHealth`` with the plane added as a feed: a booking its events leave unanswered makes the rank
    predicted after the stale time, then out after the timeout; a rank of no feed is neither."""
    workers = discovered()
    ingest = plane({SUBJECT})
    listeners = plane(set())
    listeners.follow({})  # the first feed (the KV listeners, in a service) knows none of these ranks
    health = KvHealth(listeners, stale_after_secs=1.0, out_after_secs=2.0)
    health.add_feed(ingest)
    record = workers[ON_NATS].record
    scope, rank = record.scope, WorkerRank(ON_NATS, 0)
    health.liveness.booked(scope, rank, 0)
    health.liveness.booked(scope, WorkerRank(0x99, 0), 0)  # no feed knows it
    assert health.modes(scope, record, SECOND // 2)[rank].mode is KvMode.EXACT
    assert health.modes(scope, record, SECOND)[rank].mode is KvMode.PREDICTED
    (change,) = health.check(2 * SECOND)
    assert (change.rank, change.out, change.cause) == (rank, True, KV_EVENTS_STOPPED)
    assert health.outages(scope, record, 2 * SECOND)["0"]["reason"] == KV_EVENTS_STOPPED
