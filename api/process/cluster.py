"""Composition root of a cluster replica (``kvrouter slot-tracker --cluster NAME``, ``kvrouter select-service
--cluster NAME``): one code path for both, parametrized by the service kind (``ClusterKind``: what runs over each
owned scope, the replica's service object over them, and its routes).

Start-up, in order: lock the data directory (one process per directory, as a single node), check that the
cluster's JetStream stream is reachable (``JournalUnreachable``: exit 2), join the cluster in etcd (a lease, the
member key, the first list of the cluster's keys; ``ClusterUnreachable``: exit 2), then serve: the membership
(lease renewals, the watch), the placement loop, the scopes this replica owns (each an actor system over its own
journal), and the kind's routes through ``api/routes/cluster.py``.

Shutdown (SIGINT/SIGTERM): HTTP stops accepting and drains, the scopes stop (each journal publishes what it
holds and closes), then the lease is revoked so the other replicas claim this one's scopes at once instead of
after the TTL.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from kvrouter.actors.cluster.forwarder import Forwarder
from kvrouter.actors.cluster.kind_check import check_kind
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.scopes import OwnedScopes, ScopeJournals, ServiceBuilder, slot_service_of
from kvrouter.actors.cluster.service import ClusterService, ClusterSlotService
from kvrouter.actors.fleet.etcd import EtcdClient
from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.api.http import Route
from kvrouter.api.http.app import make_app
from kvrouter.api.http.server import hypercorn_config, serve_http
from kvrouter.api.process import data_dir
from kvrouter.api.process.main import (
    ServiceObjects,
    ServiceOptions,
    actor_system_options,
    lock_data_dir,
    slot_tracker_routes_of,
)
from kvrouter.api.routes.cluster import clustered
from kvrouter.journal.jetstream import JetStreamJournal

log = logging.getLogger("kvrouter")

FORWARD_MARGIN_SECONDS = 2.0  # past the owner's reply deadline, a forwarded command's answer is given up on


@attrs.frozen
class ClusterKind:
    """What differs between the service kinds of a cluster replica."""

    name: str  # "slot-tracker", "select-service": the member key says it, and a replica of another kind is refused
    build_scope: ServiceBuilder[Any]  # the service over one owned scope's actor system
    service: Callable[[Membership, OwnedScopes[Any], Forwarder], ClusterService[Any]]
    routes: Callable[[ServiceOptions, Any], list[Route]]  # the replica's routes, clustered, over ``service``


def slot_tracker_routes(options: ServiceOptions, service: ClusterSlotService) -> list[Route]:
    return clustered(slot_tracker_routes_of(ServiceObjects(service, PeerService(None)), options.streams), service)


SLOT_TRACKER_KIND = ClusterKind("slot-tracker", slot_service_of, ClusterSlotService, slot_tracker_routes)


async def run_cluster_replica(
    name: str,
    options: ServiceOptions,
    stopping: trio.Event,
    kind: ClusterKind = SLOT_TRACKER_KIND,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One replica until ``stopping`` is set; ``task_status`` gets its URLs once it listens."""
    cluster = options.cluster
    assert cluster is not None, "run_cluster_replica needs ServiceOptions.cluster"
    with lock_data_dir(options.data_dir):
        data_dir.check_owner(options.data_dir, name)
        await trio.to_thread.run_sync(
            JetStreamJournal.check, cluster.nats_servers, cluster.name, cluster.jetstream_replicas
        )
        data_dir.claim(options.data_dir, name, ())
        async with httpx.AsyncClient(trust_env=False) as etcd_http:
            etcd = EtcdClient(list(cluster.etcd_endpoints), etcd_http)
            membership = Membership(etcd, cluster.name, cluster.advertise_url, cluster.lease_ttl_seconds)
            await check_kind(etcd, cluster.name, membership.prefix, kind.name)  # before it is a member
            await membership.join()
            authorization = options.auth.authorization() if options.auth is not None else None
            forwarder = Forwarder(options.reply_deadline + FORWARD_MARGIN_SECONDS, authorization)
            journals = ScopeJournals(cluster.nats_servers, cluster.name, options.durability)
            owned = OwnedScopes[Any](membership, journals, actor_system_options(options), kind.build_scope)
            service = kind.service(membership, owned, forwarder)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(owned.run)
                    nursery.start_soon(membership.run, owned.drop_all)
                    nursery.start_soon(service.keep_placed)
                    routes = kind.routes(options, service)
                    urls = await nursery.start(serve_replica, options, routes, stopping, nursery.cancel_scope)
                    log.info("kvrouter %s listening on %s, %s", name, " ".join(urls), cluster.describe())
                    task_status.started(urls)
            finally:
                with trio.CancelScope(shield=True):  # the scopes have stopped: now let the others claim them
                    await membership.leave()
                    await forwarder.aclose()


async def serve_replica(
    options: ServiceOptions,
    routes: list[Route],
    stopping: trio.Event,
    replica: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The replica's routes until ``stopping``; then, HTTP drained, stop the ``replica``."""
    app = make_app(
        routes, body_limit=options.body_limit, body_timeout=options.http.body_timeout, auth=options.auth,
        stopping=stopping,
    )  # fmt: skip
    await serve_http(
        app,
        hypercorn_config(options.host, options.port, options.http),
        stopping.wait,
        max_connections=options.http.max_connections,
        write_timeout=options.http.write_timeout,
        task_status=task_status,
    )
    replica.cancel()


async def run_cluster_until_signal(name: str, options: ServiceOptions, kind: ClusterKind = SLOT_TRACKER_KIND) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        stopping = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(run_cluster_replica, name, options, stopping, kind)
            async for signum in signals:
                log.info("received %s: shutting down", signal.Signals(signum).name)
                stopping.set()
                break
