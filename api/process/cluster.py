"""Composition root of a cluster replica (``kvrouter slot-tracker --cluster NAME``, ``kvrouter select-service
--cluster NAME``): one code path for both, parametrized by the service kind (``ClusterKind``: what runs over each
owned scope, the replica's service object over them, and its routes).

Start-up, in order: lock the data directory (one process per directory, as a single node), check that the
cluster's JetStream stream is reachable (``JournalUnreachable``: exit 2), join the cluster in etcd (a lease, the
member key, the first list of the cluster's keys; ``ClusterUnreachable``: exit 2), then serve: the membership
(lease renewals, the watch), the placement loop, the scopes this replica owns (each an actor system over its own
journal), and the kind's routes through ``api/routes/cluster.py``.

Shutdown (SIGINT/SIGTERM) hands the scopes over before HTTP stops (``hand_over_and_stop``): the member key is
marked leaving (the lease is kept), so placement everywhere prefers the others; each scope served here is handed
over as on a join (no new commands, those in flight answered, the journal closed, the claim released), while HTTP
keeps listening: a command arriving meanwhile is held, then forwarded to the new owner. Once no scope is held here
(at most ``HAND_OVER_SECONDS``), and ``FORWARD_GRACE_SECONDS`` later (commands routed here by a view a moment
behind are still forwarded), HTTP stops accepting and drains, the scopes left stop, and the lease is revoked.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from kvrouter.actors.cluster.follower_reads import FollowerReads, served_predicate
from kvrouter.actors.cluster.followers import Followers
from kvrouter.actors.cluster.forwarder import Forwarder
from kvrouter.actors.cluster.kind_check import check_kind
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.scopes import OwnedScopes, ScopeJournals, ServiceBuilder, slot_service_of
from kvrouter.actors.cluster.service import ClusterService, ClusterSlotService
from kvrouter.actors.fleet.etcd import EtcdClient, EtcdUnavailable
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
from kvrouter.api.routes.forwarded import checking_forwarded
from kvrouter.journal.jetstream import JetStreamJournal

log = logging.getLogger("kvrouter")

FORWARD_MARGIN_SECONDS = 2.0  # past the owner's reply deadline, a forwarded command's answer is given up on
# Stopping: how long the scopes may take to be handed over (each drains for at most ``DRAIN_SECONDS`` and closes its
# journal within the journal's flush bound; they are handed over in parallel); past it, those left stop the short
# way (their claims go with the lease).
HAND_OVER_SECONDS = 20.0
FORWARD_GRACE_SECONDS = 0.5  # after the hand-over, before HTTP stops: the other replicas' views catch up


@attrs.frozen
class ClusterKind:
    """What differs between the service kinds of a cluster replica."""

    name: str  # "slot-tracker", "select-service": the member key says it, and a replica of another kind is refused
    build_scope: ServiceBuilder[Any]  # the service over one owned scope's actor system
    service: Callable[[Membership, OwnedScopes[Any], Forwarder], ClusterService[Any]]
    routes: Callable[[ServiceOptions, Any], list[Route]]  # the replica's routes, clustered, over ``service``


def slot_tracker_routes(options: ServiceOptions, service: ClusterSlotService) -> list[Route]:
    # clustered before the command table is made: a command of the stream or of a batch is routed as its route is
    return slot_tracker_routes_of(
        ServiceObjects(service, PeerService(None)), options.streams, lambda served: clustered(served, service)
    )


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
            forwarder = Forwarder(options.reply_deadline + FORWARD_MARGIN_SECONDS, membership.me, authorization)
            journals = ScopeJournals(cluster.nats_servers, cluster.name, options.durability)
            owned = OwnedScopes[Any](membership, journals, actor_system_options(options), kind.build_scope)
            service = kind.service(membership, owned, forwarder)
            followers = follow_reads(service, journals)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(owned.run)
                    await nursery.start(service.batches.run)
                    if followers is not None:
                        await nursery.start(followers.run)
                    nursery.start_soon(membership.run, owned.drop_all)
                    nursery.start_soon(service.keep_placed)
                    http_stopping = trio.Event()
                    nursery.start_soon(hand_over_and_stop, service, stopping, http_stopping)
                    routes = kind.routes(options, service)
                    urls = await nursery.start(
                        serve_replica,
                        options,
                        checking_forwarded(routes, membership),
                        stopping,
                        http_stopping,
                        nursery.cancel_scope,
                    )
                    log.info("kvrouter %s listening on %s, %s", name, " ".join(urls), cluster.describe())
                    task_status.started(urls)
            finally:
                with trio.CancelScope(shield=True):  # the scopes have stopped: now let the others claim them
                    await membership.leave()
                    await forwarder.aclose()


def follow_reads(service: ClusterService[Any], journals: ScopeJournals) -> Followers | None:
    """The slot tracker's follower copies (its reads of scopes owned elsewhere answered here), hooked into
    ``service``; None for another kind (its reads are gathered from the owners)."""
    if not isinstance(service, ClusterSlotService):
        return None
    followers = Followers(journals, served_predicate(service.owned))
    service.follower_reads = FollowerReads(followers, service.membership, service.owned, service.written)
    service.metric_sources.append(service.follower_reads.metrics)
    return followers


async def hand_over_and_stop(service: ClusterService[Any], stopping: trio.Event, http_stopping: trio.Event) -> None:
    """Once ``stopping`` is set: leave placement, wait (bounded) until every scope held here is handed over, then
    set ``http_stopping``."""
    await stopping.wait()
    membership = service.membership
    started = trio.current_time()
    with trio.move_on_after(HAND_OVER_SECONDS) as bounded:
        try:
            await membership.leave_placement()
        except EtcdUnavailable as exc:
            log.warning("cluster: could not mark this member leaving in etcd (%s); handing over all the same", exc)
        log.info("cluster: stopping; handing over %d scope(s) before HTTP stops", len(service.owned.owned()))
        await service.owned.all_released()
    if bounded.cancelled_caught:
        log.warning(
            "cluster: %d scope(s) still held after %g s of hand-over; they stop with the lease",
            len(service.owned.owned()),
            HAND_OVER_SECONDS,
        )
    else:
        took = trio.current_time() - started
        log.info("cluster: scopes handed over in %.2f s; HTTP stops in %g s", took, FORWARD_GRACE_SECONDS)
        await trio.sleep(FORWARD_GRACE_SECONDS)
    http_stopping.set()


async def serve_replica(
    options: ServiceOptions,
    routes: list[Route],
    stopping: trio.Event,
    http_stopping: trio.Event,
    replica: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The replica's routes until ``http_stopping`` (``stopping`` ends the streams); then, HTTP drained, stop the
    ``replica``."""
    app = make_app(
        routes, body_limit=options.body_limit, body_timeout=options.http.body_timeout,
        auth=options.auth, stopping=stopping,
    )  # fmt: skip
    await serve_http(
        app,
        hypercorn_config(options.host, options.port, options.http),
        http_stopping.wait,
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
