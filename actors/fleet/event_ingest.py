"""EventPlaneIngest: Dynamo event-plane envelopes in, ``IngestKvBatch`` commands to the scope actors out.

Every reader of the event plane (the NATS subscription, the JetStream consumer, each ZMQ channel) hands its
envelopes here in batches, in the order it read them. Each envelope is routed by its publisher to the worker rank
that publisher speaks for (``follow``: what discovery last found), checked against its sequence
(``publishers.sequence_verdict``), decoded, and its router events checked against the live catalog: an event naming
another worker than its publisher's, or a dp rank the worker does not have, is dropped and counted (Dynamo's router
drops them too). Consecutive envelopes of one publisher become one command (one decision, one journal record),
bounded in blocks as the ZMQ listeners' runs are, and the journaled watermark of the publisher's stream rank is the
last sequence applied, so a restart resumes after it.

Envelopes of a publisher discovery has not shown yet are held (bytes-bounded, the oldest dropped first) and applied
once it has: a worker publishes from its first step, and its discovery keys may reach kvrouter's watch a moment
after its first envelopes.

One batch is applied at a time between all the readers (a FIFO lock), each run after the loop has gone idle
(``loop_idle``), so requests go first and one publisher's envelopes keep their order whichever reader brought them.
A reader waits until its batch is applied (policy: block; the reader's own buffer and the transport then hold the
backlog) and learns the journal position of the last command, which the JetStream consumer waits to be durable
before it acknowledges the messages.

It is also a KV feed of the service's liveness watch (``actors/kv_health.py``), as the ZMQ listeners are: every rank
of a discovered worker with a publisher is watched, and its publisher counts as connected while the plane reads its
source (``reading``: the NATS connection is up; the ZMQ channel's endpoint is resolved and read) and its channel is
of the plane's kind. A rank whose events stop while it has traffic is then taken out of selection by the same rule
and the same journaled command as a listener's (``core/kv_liveness.py``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import trio

from kvrouter.actors.core.commands import IngestKvBatch
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.index_bounds import run_block_limit
from kvrouter.actors.core.kv_wire import KvBatch, named_blocks, stored_upper_bound
from kvrouter.actors.fleet.dynamo_events import Envelope, EnvelopeError, rank_batches
from kvrouter.actors.fleet.dynamo_layout import DiscoveredWorker, NatsChannel, Publisher, ZmqChannel
from kvrouter.actors.fleet.publishers import UNKNOWN_PUBLISHER_BYTES, PublisherStatus, Route, sequence_verdict
from kvrouter.actors.kv_ingest import INGEST_RUN_BLOCKS, INGEST_WAITS_AT_MOST
from kvrouter.actors.loop_idle import when_loop_idle
from kvrouter.actors.mailbox import Overloaded
from kvrouter.actors.system import ActorSystem

log = logging.getLogger("kvrouter.event_plane")

# A mailbox that stays full makes ``ActorSystem.apply`` give up (Overloaded); the run is offered again after this.
RETRY_FULL_MAILBOX_SECONDS: Final = 0.05


class EventPlaneIngest:
    def __init__(self, system: ActorSystem, plane: str) -> None:
        self._system = system
        self.plane = plane  # "nats" or "zmq": the channels of the other kind are not read
        self.routes: dict[int, Route] = {}  # by publisher id
        self._lock = trio.Lock()  # one batch applied at a time between the readers (FIFO)
        self._held: deque[Envelope] = deque()  # of publishers not discovered yet
        self._held_bytes = 0
        self.held_dropped = 0  # envelopes dropped from the hold (full, or their publisher never appeared)
        self.unreadable = 0  # messages that were not envelopes at all (no publisher to count them on)
        self.jetstream = False  # the NATS plane reads through kvrouter's JetStream stream
        # Whether the plane reads a publisher's source (subject or endpoint) now; the plane sets it once started.
        self.reading: Callable[[str], bool] = _never
        self._by_rank: dict[tuple[int, int], tuple[Route, ...]] = {}  # (worker id, dp rank) -> its publishers

    # -- following discovery -----------------------------------------------------------------------------------

    def follow(self, workers: Mapping[int, DiscoveredWorker]) -> None:
        """Route each discovered worker's publishers (its record is in the catalog by now); forget the others.
        Synchronous, so atomic. A publisher seen before keeps its status; a new one starts after its rank's
        journaled watermark."""
        routes: dict[int, Route] = {}
        for worker in workers.values():
            record = worker.record
            ranks = frozenset(rank.dp_rank for rank in record.ranks)
            for publisher in worker.publishers:
                known = self.routes.get(publisher.publisher_id)
                if known is not None and known.publisher == publisher and known.scope == record.scope:
                    known.dp_ranks = ranks
                    routes[publisher.publisher_id] = known
                    continue
                status = self._new_status(publisher, record.scope)
                routes[publisher.publisher_id] = Route(publisher, record.scope, ranks, status)
        self.routes = routes
        by_rank: dict[tuple[int, int], tuple[Route, ...]] = {}
        for route in routes.values():
            for dp_rank in sorted(route.dp_ranks):
                key = (route.publisher.worker_id, dp_rank)
                by_rank[key] = (*by_rank.get(key, ()), route)
        self._by_rank = by_rank

    def _new_status(self, publisher: Publisher, scope: ScopeKey) -> PublisherStatus:
        transport = publisher.transport
        state = self._system.state(scope)
        watermark = None
        if state is not None:
            watermark = state.selection.kv_watermarks.get(WorkerRank(publisher.worker_id, publisher.stream_rank))
        status = PublisherStatus(self.plane_name, _source(transport), f"{publisher.publisher_id:x}", last_seq=watermark)
        wanted = ZmqChannel if self.plane == "zmq" else NatsChannel
        if not isinstance(transport, wanted):
            kind = "an unknown transport" if transport is None else type(transport).__name__.removesuffix("Channel")
            status.state = "failed"
            status.last_error = f"the publisher's channel is {kind}; kvrouter reads --event-plane {self.plane}"
        return status

    @property
    def plane_name(self) -> str:
        return "jetstream" if self.jetstream else self.plane

    def status(self, worker_id: int) -> dict[str, dict[str, object]]:
        """Per stream rank of ``worker_id``, its publisher's status (``GET /workers``'s ``kv_listeners``)."""
        found: dict[str, dict[str, object]] = {}
        for route in sorted(self.routes.values(), key=lambda r: r.publisher.publisher_id):
            if route.publisher.worker_id == worker_id:
                route.status.plane = self.plane_name  # JetStream is known only once the plane has connected
                found.setdefault(str(route.publisher.stream_rank), _view(route.status))
        return found

    # -- a KV feed of the liveness watch (``kv_health.Listeners``) -------------------------------------------

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        """Whether a publisher of the rank is read now; None when discovery names none for it."""
        routes = self._by_rank.get((worker_id, dp_rank))
        if routes is None:
            return None
        return any(self._read(route) for route in routes)

    def all_connected(self) -> bool:
        for route in self.routes.values():  # noqa: SIM110 - a plain loop: every selection asks
            if not self._read(route):
                return False
        return True

    def listening(self) -> list[tuple[int, int]]:
        return list(self._by_rank)

    def _read(self, route: Route) -> bool:
        status = route.status
        return status.state != "failed" and self.reading(status.source)

    def needs_flush(self) -> bool:
        """Whether held envelopes now have a route (the plane's runner then calls ``ingest([])``)."""
        return any(envelope.publisher_id in self.routes for envelope in self._held)

    # -- ingest ------------------------------------------------------------------------------------------------

    async def ingest(self, envelopes: Sequence[Envelope]) -> int:
        """Apply ``envelopes`` (with any held ones whose publisher is known now, first); returns the journal position
        of the last command applied (0: none). Returns once every run is applied (not yet durable)."""
        async with self._lock:
            runs = self._runs(self._release_held() + list(envelopes))
            lsn = 0
            for route, items in runs:
                lsn = max(lsn, await self._apply(route, items))
            return lsn

    def _release_held(self) -> list[Envelope]:
        if not self._held or not self.needs_flush():
            return []
        ready = [envelope for envelope in self._held if envelope.publisher_id in self.routes]
        self._held = deque(envelope for envelope in self._held if envelope.publisher_id not in self.routes)
        self._held_bytes = sum(len(envelope.payload) for envelope in self._held)
        return ready

    def _hold(self, envelope: Envelope) -> None:
        self._held.append(envelope)
        self._held_bytes += len(envelope.payload)
        while self._held_bytes > UNKNOWN_PUBLISHER_BYTES:
            dropped = self._held.popleft()
            self._held_bytes -= len(dropped.payload)
            self.held_dropped += 1

    def _runs(self, envelopes: list[Envelope]) -> list[tuple[Route, list[tuple[int, KvBatch]]]]:
        """Consecutive envelopes of one publisher as runs of ``(seq, batch)``, bounded in blocks."""
        cap = self._system.max_index_blocks_per_scope
        stored_limit = run_block_limit(cap)
        runs: list[tuple[Route, list[tuple[int, KvBatch]]]] = []
        named = stored = 0
        for envelope in envelopes:
            route = self.routes.get(envelope.publisher_id)
            if route is None:
                self._hold(envelope)
                continue
            status = route.status
            if status.state == "failed" or sequence_verdict(status, envelope.sequence) == "stale":
                continue
            items = self._checked(route, envelope)
            status.last_seq = envelope.sequence
            status.batches += 1
            status.state = "active"
            more_named = sum(named_blocks(batch) for _, batch in items)
            more_stored = sum(stored_upper_bound(batch) for _, batch in items)
            last = runs[-1] if runs else None
            if (
                last is not None
                and last[0] is route
                and named + more_named <= INGEST_RUN_BLOCKS
                and stored + more_stored <= stored_limit
            ):
                last[1].extend(items)
                named += more_named
                stored += more_stored
            else:
                runs.append((route, items))
                named, stored = more_named, more_stored
        return runs

    def _checked(self, route: Route, envelope: Envelope) -> list[tuple[int, KvBatch]]:
        """The envelope's batches the publisher's worker may apply; at least one (maybe empty) batch, so the
        watermark moves past an envelope even when nothing in it is applied."""
        status = route.status
        seq = envelope.sequence
        kept: list[tuple[int, KvBatch]] = []
        try:
            batches = rank_batches(envelope.payload, envelope.published_at)
        except EnvelopeError as exc:
            status.malformed += 1
            status.last_error = f"envelope {seq} skipped: {exc}"
            log.warning("publisher %x: %s", route.publisher.publisher_id, status.last_error)
            batches = []
        for rank_batch in batches:
            if rank_batch.worker_id != route.publisher.worker_id or rank_batch.dp_rank not in route.dp_ranks:
                status.foreign_events += max(1, len(rank_batch.batch.events))
                continue
            if rank_batch.batch.dropped:
                log.debug("publisher %x envelope %d: %s", route.publisher.publisher_id, seq, rank_batch.batch.dropped)
            kept.append((seq, rank_batch.batch))
        return kept or [(seq, KvBatch(envelope.published_at / 1000.0, ()))]

    async def _apply(self, route: Route, items: list[tuple[int, KvBatch]]) -> int:
        (seq, batch), *following = items
        publisher = route.publisher
        system = self._system
        while True:
            await when_loop_idle(INGEST_WAITS_AT_MOST)  # requests first
            command = IngestKvBatch(
                publisher.worker_id,
                publisher.stream_rank,
                seq,
                batch,
                at=system.clock.now_ns(),
                max_index_blocks=system.max_index_blocks_per_scope,
                following=tuple(following),
            )
            try:
                _, lsn = await system.apply(route.scope, command)
            except Overloaded:
                await trio.sleep(RETRY_FULL_MAILBOX_SECONDS)  # policy: block the readers until the actor takes it
                continue
            return lsn


def _never(source: str) -> bool:
    return False


def _source(transport: NatsChannel | ZmqChannel | None) -> str:
    if isinstance(transport, NatsChannel):
        return transport.subject("kv-events")
    if isinstance(transport, ZmqChannel):
        return transport.endpoint
    return ""


def _view(status: PublisherStatus) -> dict[str, object]:
    return {
        "plane": status.plane,
        "endpoint": status.source,
        "publisher_id": status.publisher_id,
        "state": status.state,
        "last_seq": status.last_seq,
        "last_error": status.last_error,
        "batches": status.batches,
        "gaps": status.gaps,
        "lost_batches": status.lost_batches,
        "stale_dropped": status.stale_dropped,
        "malformed": status.malformed,
        "foreign_events": status.foreign_events,
    }
