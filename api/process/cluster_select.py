"""A selection-service replica's composition (``kvrouter select-service --cluster NAME``): the cluster kind
``run_cluster_replica`` runs, with the selection service over each owned scope and its routes clustered."""

from __future__ import annotations

from kvrouter.actors.cluster.select_service import ClusterSelectService, select_scope_service
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.actors.peers.replicator import random_router_id
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.api.http import Route
from kvrouter.api.process.cluster import ClusterKind
from kvrouter.api.process.main import KVROUTER_VERSION, ServiceObjects, ServiceOptions
from kvrouter.api.routes.cluster import clustered
from kvrouter.api.routes.cluster_select import SELECT_ROUTING, not_in_a_cluster
from kvrouter.api.routes.commands import with_command_routes
from kvrouter.api.routes.metrics import metrics_route
from kvrouter.api.routes.replica import replica_routes
from kvrouter.api.routes.selection import select_service_routes
from kvrouter.api.streams.live import StreamMetrics
from kvrouter.api.streams.loads import partition_loads_route
from kvrouter.client.table import SELECT_SERVICE


def select_service_kind(config: RouterConfig, listener_slots: ListenerSlots | None = None) -> ClusterKind:
    """Every owned scope's selection service shares this process's listener slots and one writer id."""
    slots = listener_slots or ListenerSlots.for_this_process()
    return ClusterKind(
        "select-service", select_scope_service(config, slots, random_router_id()), ClusterSelectService, select_routes
    )


def select_routes(options: ServiceOptions, service: ClusterSelectService) -> list[Route]:
    """The selection service's routes, clustered before the command routes are added, so that a command of
    ``POST /batch`` or the command stream goes where its scope is served, as on its own route."""
    objects = ServiceObjects(service, PeerService(None))
    own = [*select_service_routes(service), *replica_routes(objects.peers), metrics_route(objects)]  # type: ignore[arg-type]
    live = [partition_loads_route(service, options.streams, StreamMetrics.of(objects.front))[1]]
    live.append(not_in_a_cluster("watch_decisions"))
    return with_command_routes(
        [*clustered(own, service, SELECT_ROUTING), *live],
        SELECT_SERVICE,
        "kvrouter selection service",
        KVROUTER_VERSION,
        budgets=options.streams.answers,
        front=objects.front,
    )
