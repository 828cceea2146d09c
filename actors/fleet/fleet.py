"""The fleet side of a selection service (``kvrouter select-service`` and ``kvrouter frontend`` alike): a discovery
source and, with etcd, Dynamo's event plane, started next to the service and plugged into its status, ``/ready``,
``/workers`` and ``/metrics``.

Start order: the event plane's readers first (they connect in the background), then discovery, whose first list
is applied before ``start_fleet`` returns (so the service opens with the discovered catalog; an unreachable source
does not hold the start: the service opens with the recovered catalog and says so). Every catalog change discovery
applies then re-routes the event plane: which publisher speaks for which rank, which subjects and endpoints to read.
The event plane is one more KV feed of the service's liveness watch (``KvHealth.add_feed``): its ranks go out of
selection when their events stop while they have traffic, as the KV listeners' do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx
import trio

from kvrouter.actors.fleet.discovery import (
    CatalogSync,
    DiscoveryStatus,
    EtcdDiscovery,
    FileDiscovery,
    since_seconds,
    up,
)
from kvrouter.actors.fleet.dynamo_layout import (
    KV_EVENTS_TOPIC,
    DiscoveredWorker,
    NatsChannel,
    ZmqChannel,
)
from kvrouter.actors.fleet.etcd import EtcdClient
from kvrouter.actors.fleet.event_ingest import EventPlaneIngest
from kvrouter.actors.fleet.nats_plane import NatsPlane
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.fleet.tokenizer_check import TokenizerCheck
from kvrouter.actors.fleet.worker_file import FileParser
from kvrouter.actors.fleet.zmq_plane import ZmqPlane
from kvrouter.actors.kv_ingest import IN_PROCESS_KV_EVENTS
from kvrouter.actors.metric_families import Family, Labels, counter, gauge
from kvrouter.actors.select_service import SelectService

log = logging.getLogger("kvrouter.fleet")


class Fleet:
    def __init__(self, service: SelectService, options: FleetOptions, parse_file: FileParser | None = None) -> None:
        self._service = service
        self._options = options
        self._parse_file = parse_file
        self.ingest: EventPlaneIngest | None = None
        self.nats: NatsPlane | None = None
        self.zmq: ZmqPlane | None = None
        self.discovery: EtcdDiscovery | FileDiscovery | None = None
        local = options.tokenizer_checksum
        self.tokenizers = TokenizerCheck(local) if local is not None else None
        self._flush = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[Fleet] = trio.TASK_STATUS_IGNORED) -> None:
        options = self._options
        async with trio.open_nursery() as nursery:
            if options.discovery_backend == "etcd":
                await self._start_event_plane(nursery)
                async with httpx.AsyncClient(trust_env=False) as client:
                    await self._start_etcd(nursery, client)
                    self._plug_in()
                    task_status.started(self)
                    await trio.sleep_forever()
            elif options.discovery_backend == "file":
                assert options.discovery_file is not None and self._parse_file is not None
                status = DiscoveryStatus("file", str(options.discovery_file))
                sync = CatalogSync(self._service, "file", status, _ignore)
                self.discovery = await nursery.start(
                    FileDiscovery(options.discovery_file, self._parse_file, sync, status).run
                )
                self._plug_in()
                task_status.started(self)

    async def _start_event_plane(self, nursery: trio.Nursery) -> None:
        plane = self._options.event_plane
        if plane is None:
            return
        system = self._service.system
        self.ingest = EventPlaneIngest(system, plane)
        if plane == "nats":
            self.nats = NatsPlane(
                self.ingest,
                list(self._options.nats_servers),
                self._options.namespace,
                self._options.jetstream,
                wait_durable=system.wait_durable,
                reset_consumer=not any(
                    record.discovered_by == "etcd"
                    for state in system.states()
                    for record in state.selection.catalog.values()
                ),
            )
            self.ingest.reading = self.nats.reading
            await nursery.start(self.nats.run)
        else:
            self.zmq = ZmqPlane(self.ingest)
            self.ingest.reading = self.zmq.reading
            await nursery.start(self.zmq.run)
        if self._service.health is not None:
            self._service.health.add_feed(self.ingest)  # its ranks are watched as the KV listeners' are
        nursery.start_soon(self._flush_held)

    async def _start_etcd(self, nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
        options = self._options
        status = DiscoveryStatus("etcd", ",".join(options.etcd_endpoints), options.namespace)
        sync = CatalogSync(self._service, "etcd", status, self._route)
        marker = IN_PROCESS_KV_EVENTS if self.ingest is not None else None
        etcd = EtcdClient(list(options.etcd_endpoints), client)
        self.discovery = await nursery.start(EtcdDiscovery(etcd, options.namespace, sync, status, marker).run)

    def _route(self, workers: Mapping[int, DiscoveredWorker]) -> None:
        """A catalog change was applied: compare the cards' tokenizers, re-route the event plane."""
        if self.tokenizers is not None:
            self.tokenizers.follow(workers)
        if self.ingest is None:
            return
        self.ingest.follow(workers)
        publishers = [p for worker in workers.values() for p in worker.publishers]
        if self.nats is not None:
            self.nats.follow(
                {p.transport.subject(KV_EVENTS_TOPIC) for p in publishers if isinstance(p.transport, NatsChannel)}
            )
        if self.zmq is not None:
            self.zmq.follow({p.transport.endpoint for p in publishers if isinstance(p.transport, ZmqChannel)})
        if self.ingest.needs_flush():
            self._flush.set()

    async def _flush_held(self) -> None:
        """Apply held envelopes whose publisher discovery has just shown (nothing may come after them)."""
        while True:
            await self._flush.wait()
            self._flush = trio.Event()
            if self.ingest is not None:
                await self.ingest.ingest([])

    # -- status ------------------------------------------------------------------------------------------------

    def _plug_in(self) -> None:
        service = self._service
        service.readiness_sources.append(self.readiness)
        service.metric_sources.append(self.families)
        if self.ingest is not None:
            service.kv_status_sources.append(self.ingest.status)
        if self.tokenizers is not None:
            service.tokenizer_status = self.tokenizers.status
            service.metric_sources.append(self.tokenizers.families)

    def readiness(self) -> dict[str, Any]:
        """``/ready``'s ``discovery`` and ``event_plane`` fields."""
        found: dict[str, Any] = {}
        if self.discovery is not None:
            found["discovery"] = self.discovery.status.view()
        if self.nats is not None:
            status = self.nats.status
            found["event_plane"] = {
                "plane": "nats",
                "servers": status.servers,
                "state": status.state,
                "jetstream": status.jetstream,
                "subjects": list(status.subjects),
                **({"stream": status.stream, "consumer": status.consumer} if status.jetstream else {}),
                "last_error": status.last_error,
            }
        elif self.zmq is not None:
            found["event_plane"] = {"plane": "zmq", "unresolved": dict(self.zmq.problems)}
        return found

    def families(self) -> list[Family]:
        families = []
        if self.discovery is not None:
            status = self.discovery.status
            source: Labels = (status.backend,)
            families += [
                gauge(
                    "kvrouter_discovery_up",
                    "1 while the discovery source is in sync, 0 otherwise",
                    ("backend",),
                    {source: up(status)},
                ),
                gauge(
                    "kvrouter_discovery_state_seconds",
                    "Seconds since the discovery state last changed",
                    ("backend",),
                    {source: since_seconds(status)},
                ),
                gauge(
                    "kvrouter_discovery_workers",
                    "Discovered workers in the catalog",
                    ("backend",),
                    {source: float(status.workers)},
                ),
                counter(
                    "kvrouter_discovery_outages",
                    "Times the source became unreachable or unreadable",
                    ("backend",),
                    {source: float(status.outages)},
                ),
                counter(
                    "kvrouter_discovery_refused",
                    "Discovered workers the catalog refused",
                    ("backend",),
                    {source: float(status.refused)},
                ),
            ]
        if self.ingest is not None:
            families += self._plane_families(self.ingest)
        return families

    def _plane_families(self, ingest: EventPlaneIngest) -> list[Family]:
        rank = ("worker_id", "dp_rank")
        batches: dict[Labels, float] = {}
        gaps: dict[Labels, float] = {}
        lost: dict[Labels, float] = {}
        dropped: dict[Labels, float] = {}
        for route in ingest.routes.values():
            labels = (str(route.publisher.worker_id), str(route.publisher.stream_rank))
            status = route.status
            batches[labels] = float(status.batches)
            gaps[labels] = float(status.gaps)
            lost[labels] = float(status.lost_batches)
            dropped[(*labels, "stale")] = float(status.stale_dropped)
            dropped[(*labels, "malformed")] = float(status.malformed)
            dropped[(*labels, "foreign")] = float(status.foreign_events)
        plane: Labels = (ingest.plane_name,)
        families = [
            counter(
                "kvrouter_event_plane_envelopes", "Event-plane envelopes applied per publisher's rank", rank, batches
            ),
            counter(
                "kvrouter_event_plane_gaps",
                "Times a publisher's sequence skipped ahead (nothing can fill it)",
                rank,
                gaps,
            ),
            counter(
                "kvrouter_event_plane_lost",
                "Envelopes never applied: gaps, and those before kvrouter heard the publisher",
                rank,
                lost,
            ),
            counter(
                "kvrouter_event_plane_dropped",
                "Envelopes (stale, malformed) or router events (foreign) dropped",
                (*rank, "reason"),
                dropped,
            ),
            counter(
                "kvrouter_event_plane_unreadable",
                "Messages that were not event-plane envelopes",
                ("plane",),
                {plane: float(ingest.unreadable)},
            ),
            counter(
                "kvrouter_event_plane_held_dropped",
                "Envelopes of undiscovered publishers dropped from the hold",
                ("plane",),
                {plane: float(ingest.held_dropped)},
            ),
        ]
        if self.nats is not None:
            nats = self.nats.status
            families += [
                gauge(
                    "kvrouter_event_plane_connected",
                    "1 while connected to the NATS server",
                    ("plane",),
                    {plane: 1.0 if nats.state == "connected" else 0.0},
                ),
                counter(
                    "kvrouter_event_plane_disconnects",
                    "NATS connections lost",
                    ("plane",),
                    {plane: float(nats.disconnects)},
                ),
                counter(
                    "kvrouter_event_plane_inbox_dropped",
                    "Core NATS messages dropped: the inbox was full",
                    ("plane",),
                    {plane: float(nats.inbox_dropped)},
                ),
            ]
        return families


def _ignore(workers: Mapping[int, DiscoveredWorker]) -> None:
    return None
