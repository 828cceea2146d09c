"""ClusterSelectService: the selection service's methods on a cluster replica (``select-service --cluster``).

Each scope this replica serves runs its own ``SelectService`` over the scope's actor system and journal
(``select_scope_service``): its catalog, its KV index (KV-event records journaled to the scope's subject like any
other record, so a new owner restores the index from the snapshot and the tail), its reservations, and the
KV-event listeners of its workers, which run on the scope's owner alone (they follow the scope's catalog).

A method naming a scope (a selection, a booking, a worker's record) runs on that scope's service; the routes
(``api/routes/cluster.py``) have already sent it to the owner. A method naming a reservation or a worker id runs
on the served scope that holds it, and answers 404 when none does (the routes then ask the other members). Reads
of many scopes answer for the scopes served here; the routes gather the other members'. ``GET /ws/loads`` on a
replica follows the scopes it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from kvrouter.actors.catalog_writer import worker_not_found
from kvrouter.actors.cluster.forwarder import Forwarder
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.scopes import OwnedScopes
from kvrouter.actors.cluster.service import ClusterService, ServedStates
from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord
from kvrouter.actors.core.commands import Prompt
from kvrouter.actors.core.disaggregation import DisaggregatedSelection
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import PotentialLoad
from kvrouter.actors.core.router_config import RouterConfig, RouterConfigOverride
from kvrouter.actors.core.selection_queries import partition_loads
from kvrouter.actors.core.selection_rules import Selection, reservation_not_found
from kvrouter.actors.load_feed import LoadChange, LoadChanges, LoadFeed, read_changes
from kvrouter.actors.runtime import start_select_service
from kvrouter.actors.select_service import (
    Booking,
    OverlapScores,
    PartitionLoads,
    SelectionRequest,
    SelectService,
    WorkerStatus,
)
from kvrouter.actors.service_support import EVERY_SCOPE, Refused, ScopeFilter
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerSlots


def select_scope_service(
    config: RouterConfig, listener_slots: ListenerSlots, writer_id: int
) -> Callable[[ActorSystem, trio.Nursery], Any]:
    """What runs over one owned scope: a selection service with its KV ingest (the listeners of the scope's
    workers); every scope of the replica shares the process's listener slots."""

    async def build(system: ActorSystem, nursery: trio.Nursery) -> SelectService:
        return await start_select_service(system, config, nursery, listener_slots, writer_id=writer_id)

    return build


class ClusterSelectService(ClusterService[SelectService]):
    FORWARDED_IN_ORDER = False  # each forwarded command is one client's request: none waits for another's

    def __init__(self, membership: Membership, owned: OwnedScopes[SelectService], forwarder: Forwarder) -> None:
        super().__init__(membership, owned, forwarder)
        self.load_feed = LoadFeed()  # the scopes served here (GET /ws/loads)
        owned.on_service = self._hook

    def _hook(self, service: SelectService) -> None:
        service.system.observers.append(self.load_feed.observe)
        service.system.queue_observers.append(self.load_feed.bump)  # pending counts move without events

    # -- the catalog ------------------------------------------------------------------------------------

    async def put_worker(self, record: WorkerRecord) -> WorkerStatus:
        with self._local(record.scope) as service:
            return await service.put_worker(record)

    async def patch_worker(self, worker_id: int, patch: WorkerPatch) -> WorkerStatus:
        with self._local(await self._worker_scope(worker_id)) as service:
            return await service.patch_worker(worker_id, patch)

    async def remove_worker(self, worker_id: int, discovered_by: str | None = None) -> WorkerRecord:
        with self._local(await self._worker_scope(worker_id)) as service:
            return await service.remove_worker(worker_id, discovered_by)

    async def readiness(self) -> dict[str, Any]:
        return {}  # discovery and the event plane do not run on a cluster replica

    async def workers(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[WorkerStatus]:
        await self.owned.settled()
        rows = []
        for service in self.owned.services():
            rows.extend(await service.workers(wanted))
        return sorted(rows, key=lambda row: (row.record.scope, row.record.worker_id))

    async def _worker_scope(self, worker_id: int) -> ScopeKey:
        await self.owned.settled()
        for service in self.owned.services():
            scope = service.directory.worker_scope(worker_id)
            if scope is not None:
                return scope
        raise worker_not_found(worker_id)

    # -- selection and reservations -----------------------------------------------------------------------

    async def select(self, request: SelectionRequest) -> Selection:
        with self._local(request.scope) as service:
            return await service.select(request)

    async def select_and_reserve(self, request: SelectionRequest) -> Selection:
        with self._local(request.scope) as service:
            return await service.select_and_reserve(request)

    async def select_disaggregated(self, request: SelectionRequest) -> DisaggregatedSelection:
        with self._local(request.scope) as service:
            return await service.select_disaggregated(request)

    async def reserve(self, scope: ScopeKey, *arguments: Any) -> Booking:
        with self._local(scope) as service:
            return await service.reserve(scope, *arguments)

    async def reserve_selection(self, scope: ScopeKey, selection_id: str) -> Booking:
        with self._local(scope) as service:
            return await service.reserve_selection(scope, selection_id)

    async def complete_prefill(self, reservation_id: str, cached_tokens: int | None = None) -> None:
        with self._local(await self._reservation_scope(reservation_id)) as service:
            await service.complete_prefill(reservation_id, cached_tokens)

    async def add_output_block(self, reservation_id: str, decay_fraction: float | None = None) -> None:
        with self._local(await self._reservation_scope(reservation_id)) as service:
            await service.add_output_block(reservation_id, decay_fraction)

    async def release(self, reservation_id: str) -> None:
        with self._local(await self._reservation_scope(reservation_id)) as service:
            await service.release(reservation_id)

    async def _reservation_scope(self, reservation_id: str) -> ScopeKey:
        await self.owned.settled()
        for service in self.owned.services():
            scope = service.directory.reservation_scope(reservation_id)
            if scope is not None:
                return scope
        raise Refused.because(reservation_not_found(reservation_id))

    # -- inspection -----------------------------------------------------------------------------------

    async def loads(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[PartitionLoads]:
        await self.owned.settled()
        partitions = []
        for service in self.owned.services():
            partitions.extend(await service.loads(wanted))
        return sorted(partitions, key=lambda partition: partition.scope)

    async def potential_loads(
        self, scope: ScopeKey, prompt: Prompt, override: RouterConfigOverride | None = None
    ) -> list[PotentialLoad]:
        with self._local(scope) as service:
            return await service.potential_loads(scope, prompt, override)

    async def overlap_scores(self, scope: ScopeKey, prompt: Prompt) -> OverlapScores:
        with self._local(scope) as service:
            return await service.overlap_scores(scope, prompt)

    async def load_changes(self, epoch: str, cursor: int, wait_seconds: float) -> LoadChanges:
        """As ``SelectService.load_changes``, over the scopes served here."""

        def measure(scope: ScopeKey, version: int) -> LoadChange:
            service = self.owned.serving(scope)
            state = service.system.state(scope) if service is not None else None
            if service is None or state is None:
                return LoadChange(scope, version, None)
            config = service.config
            rows = partition_loads(state, config.use_kv_events, queueing=config.queueing)
            return LoadChange(scope, version, rows, *service.system.pending_loads(scope))

        return await read_changes(self.load_feed, ServedStates(self.owned), epoch, cursor, wait_seconds, measure)

    async def dump(self) -> dict[str, Any]:
        await self.owned.settled()
        document: dict[str, Any] = {}
        for service in self.owned.services():
            document.update(await service.dump())
        return document
