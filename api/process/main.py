"""Composition root: open the journal, recover, start the writer, the actors and hypercorn.

Shutdown order (SIGINT/SIGTERM or ``ServiceHandle.stop``): hypercorn stops accepting and drains
in-flight requests, then the actors are cancelled, then the journal writer flushes and closes.
A crash anywhere is fail-stop: the process exits and the journal is the recovery path.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import secrets
import signal
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio

from kvrouter.actors.core.commands import RecoveredRun
from kvrouter.actors.core.dump import DumpError, parse_dump
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE
from kvrouter.actors.core.pending import DEFAULT_MAX_BYTES as DEFAULT_SELECTION_CACHE_MAX_BYTES
from kvrouter.actors.core.pending import SelectionCacheBudget
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.actors.peers.replicator import ReplicaSecurity, random_router_id
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.runtime import ActorRuntime, running_actors, start_select_service
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.api.cli.fleet_flags import worker_file_parser
from kvrouter.api.http import Route
from kvrouter.api.http.app import make_app
from kvrouter.api.http.auth import BearerToken
from kvrouter.api.http.server import HttpSettings, hypercorn_config, serve_http
from kvrouter.api.process import data_dir
from kvrouter.api.process.cluster_options import ClusterOptions
from kvrouter.api.process.journal_backend import JetStreamJournalOptions, open_journal
from kvrouter.api.routes.commands import with_command_routes
from kvrouter.api.routes.metrics import FrontMetrics, metrics_route
from kvrouter.api.routes.replica import replica_routes, start_replication
from kvrouter.api.routes.selection import select_service_routes
from kvrouter.api.routes.slot_tracker import slot_tracker_routes
from kvrouter.api.streams.decisions import decisions_route
from kvrouter.api.streams.live import DEFAULT_STREAMS, StreamMetrics, StreamSettings
from kvrouter.api.streams.loads import partition_loads_route, slot_loads_route
from kvrouter.client.table import SELECT_SERVICE, SLOT_TRACKER
from kvrouter.journal.store import DataDirectoryInUse, Durability

log = logging.getLogger("kvrouter")
KVROUTER_VERSION = version("kvrouter")

GC_GEN0_THRESHOLD = 20_000  # CPython's default is 700
SLOT_TRACKER_BODY_LIMIT = 2 * 1024 * 1024  # axum's default, as the reference slot tracker
REPLY_DEADLINE_SECONDS = 10.0  # a command without a durable decision by then answers 504
PEER_TIMEOUT_SECONDS = 10.0  # one --indexer-peers /dump fetch


@attrs.frozen
class ServiceOptions:
    host: str = "127.0.0.1"
    port: int = 8091
    data_dir: Path = Path("kvrouter-data")
    durability: Durability = Durability.ALWAYS
    jetstream_journal: JetStreamJournalOptions | None = None  # None: the file journal in data_dir
    cluster: ClusterOptions | None = None  # a replica of a cluster (api/process/cluster.py); None: single node
    fresh: bool = False
    body_limit: int = SLOT_TRACKER_BODY_LIMIT
    seed: int | None = None  # root of the scopes' random sources; None = fresh per process
    selection_cache_ttl_secs: float = 120.0
    selection_cache_max_entries: int = 4096
    selection_cache_max_bytes: int = DEFAULT_SELECTION_CACHE_MAX_BYTES
    max_index_blocks_per_scope: int = MAX_INDEX_BLOCKS_PER_SCOPE  # the KV-event index cap (index_bounds.py)
    replica_sync_port: int | None = None  # None: replica sync disabled
    replica_sync_peers: tuple[str, ...] = ()
    reply_deadline: float = REPLY_DEADLINE_SECONDS
    replica_security: ReplicaSecurity | None = None  # None: no CURVE, default peer limits
    http: HttpSettings = attrs.Factory(HttpSettings)  # client timeouts, connection cap, shutdown grace
    auth: BearerToken | None = None  # every route but GET /health requires it
    streams: StreamSettings = attrs.Factory(StreamSettings)  # bounds of GET /ws/loads and /ws/decisions


# Builds a service's routes once the actor system runs; may start more components in the nursery.
RouteBuilder = Callable[[ServiceOptions, ActorSystem, trio.Nursery], Awaitable[list[Route]]]


@attrs.frozen
class ServiceObjects:
    """What a service's routes call (plain data in and out, so a front process's proxy can stand in):
    the service object and the replica peer service."""

    service: Any  # SlotService or SelectService
    peers: PeerService
    front: FrontMetrics = attrs.Factory(FrontMetrics)  # this process's HTTP figures (GET /metrics)


# Starts a service's objects once the actor system runs; may start more components in the nursery.
ObjectsBuilder = Callable[[ServiceOptions, ActorSystem, trio.Nursery], Awaitable[ServiceObjects]]


async def start_peer_service(
    options: ServiceOptions,
    system: ActorSystem,
    nursery: trio.Nursery,
    *,
    router_id: int | None = None,
    session_ttl_ns: int = 0,
) -> PeerService:
    replicator = await start_replication(
        system,
        nursery,
        host=options.host,
        port=options.replica_sync_port,
        peers=options.replica_sync_peers,
        security=options.replica_security,
        router_id=router_id,
        session_ttl_ns=session_ttl_ns,
    )
    return PeerService(replicator)


async def slot_tracker_objects(options: ServiceOptions, system: ActorSystem, nursery: trio.Nursery) -> ServiceObjects:
    return ServiceObjects(SlotService(system), await start_peer_service(options, system, nursery))


def slot_tracker_routes_of(
    objects: ServiceObjects,
    streams: StreamSettings = DEFAULT_STREAMS,
    change: Callable[[list[Route]], list[Route]] = list,
) -> list[Route]:
    """The slot tracker's routes; ``change`` (a cluster replica's ``clustered``) turns the operations' routes into
    those served, before ``POST /batch`` and the command stream take them as their table of commands."""
    live = [slot_loads_route(objects.service, streams, StreamMetrics.of(objects.front))[1]]
    return with_command_routes(
        change([*slot_tracker_routes(objects.service), *replica_routes(objects.peers), *live, metrics_route(objects)]),
        SLOT_TRACKER,
        "kvrouter slot tracker",
        KVROUTER_VERSION,
        budgets=streams.answers,
        front=objects.front,
    )


async def slot_tracker_app(options: ServiceOptions, system: ActorSystem, nursery: trio.Nursery) -> list[Route]:
    return slot_tracker_routes_of(await slot_tracker_objects(options, system, nursery), options.streams)


# -- the selection service -------------------------------------------------------------------------------


def fetch_dump(url: str) -> Any:
    with urllib.request.urlopen(url.rstrip("/") + "/dump", timeout=PEER_TIMEOUT_SECONDS) as response:
        return orjson.loads(response.read())


async def recover_from_peers(service: SelectService, peers: Sequence[str]) -> str | None:
    """Seed the index from the first peer whose ``/dump`` answers (a kvrouter or reference selector
    or indexer); returns that peer's URL. Runs before the HTTP listener opens."""
    for url in peers:
        try:
            document = await trio.to_thread.run_sync(fetch_dump, url)
            scopes: dict[ScopeKey, tuple[int | None, list[RecoveredRun]]] = parse_dump(document)
        except (OSError, ValueError, DumpError) as exc:
            log.warning("indexer peer %s unusable: %s", url, exc)
            continue
        blocks = 0
        for scope, (_, runs) in sorted(scopes.items()):
            if runs:
                await service.recover_index(scope, tuple(runs))
                blocks += sum(len(run.blocks) for run in runs)
        log.info("recovered %d blocks in %d scopes from indexer peer %s", blocks, len(scopes), url)
        return url
    if peers:
        log.warning("no indexer peer answered; starting with the local index only")
    return None


async def select_service_objects(
    config: RouterConfig,
    peers: Sequence[str],
    listener_slots: ListenerSlots | None,
    fleet: FleetOptions | None,
    options: ServiceOptions,
    system: ActorSystem,
    nursery: trio.Nursery,
) -> ServiceObjects:
    # One id for this process: replica sync's router id is also the writer of the session bindings it makes.
    router_id = random_router_id()
    service = await start_select_service(
        system,
        config,
        nursery,
        listener_slots,
        before_listeners=partial(recover_from_peers, peers=peers),
        writer_id=router_id,
        fleet=fleet,
        parse_worker_file=worker_file_parser(),
    )
    peer_service = await start_peer_service(
        options, system, nursery, router_id=router_id, session_ttl_ns=config.affinity_ttl_ns
    )
    return ServiceObjects(service, peer_service)


def select_service_routes_of(objects: ServiceObjects, streams: StreamSettings = DEFAULT_STREAMS) -> list[Route]:
    metrics = StreamMetrics.of(objects.front)
    live = [
        partition_loads_route(objects.service, streams, metrics)[1],
        decisions_route(objects.service, streams, metrics)[1],
    ]
    return with_command_routes(
        [*select_service_routes(objects.service), *replica_routes(objects.peers), *live, metrics_route(objects)],
        SELECT_SERVICE,
        "kvrouter selection service",
        KVROUTER_VERSION,
        budgets=streams.answers,
        front=objects.front,
    )


def select_objects_builder(
    config: RouterConfig,
    indexer_peers: Sequence[str] = (),
    listener_slots: ListenerSlots | None = None,
    *,
    fleet: FleetOptions | None = None,
) -> ObjectsBuilder:
    return partial(select_service_objects, config, tuple(indexer_peers), listener_slots, fleet)


def select_service_builder(
    config: RouterConfig,
    indexer_peers: Sequence[str] = (),
    listener_slots: ListenerSlots | None = None,
    *,
    fleet: FleetOptions | None = None,
) -> RouteBuilder:
    """The selection service's composition; ``listener_slots`` defaults to what this process affords; ``fleet``:
    discovery and Dynamo's event plane (``actors/fleet``), none by default."""
    build = select_objects_builder(config, indexer_peers, listener_slots, fleet=fleet)

    async def select_service_app(options: ServiceOptions, system: ActorSystem, nursery: trio.Nursery) -> list[Route]:
        return select_service_routes_of(await build(options, system, nursery), options.streams)

    return select_service_app


@attrs.frozen
class ServiceHandle:
    urls: list[str]
    system: ActorSystem
    stop: Callable[[], None]


async def run_service(
    name: str,
    options: ServiceOptions,
    build_routes: RouteBuilder,
    *,
    task_status: trio.TaskStatus[ServiceHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One process: the actors, the journal and hypercorn (``--fronts 0``)."""
    async with recovered_runtime(name, options) as (runtime, scopes):
        system, inner, stopping = runtime.system, runtime.nursery, runtime.stopping
        routes = await build_routes(options, system, inner)
        app = make_app(
            routes,
            body_limit=options.body_limit,
            body_timeout=options.http.body_timeout,
            auth=options.auth,
            stopping=stopping,
        )

        async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            config = hypercorn_config(options.host, options.port, options.http)
            await serve_http(
                app,
                config,
                stopping.wait,
                max_connections=options.http.max_connections,
                write_timeout=options.http.write_timeout,
                task_status=task_status,
            )
            inner.cancel_scope.cancel()  # HTTP drained: now stop the actors

        urls = await inner.start(http)
        log.info(
            "kvrouter %s listening on %s (data dir %s%s, durability %s, %s recovered)",
            name,
            " ".join(urls),
            options.data_dir,
            f", journal on {options.jetstream_journal.describe()}" if options.jetstream_journal else "",
            options.durability.value,
            counted(scopes, "scope"),
        )
        task_status.started(ServiceHandle(urls, system, stopping.set))


def counted(count: int, noun: str) -> str:
    """``1 scope``, ``2 scopes``: the startup line is read by people."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@contextlib.contextmanager
def lock_data_dir(path: Path) -> Iterator[None]:
    """One process per data directory: two writers would interleave journal frames and corrupt
    it. An exclusive flock, dropped by the kernel when the process exits (even by kill -9)."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirectoryInUse(
                f"the data directory {path} is in use by another kvrouter process; "
                "stop it or give this one another --data-dir"
            ) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def actor_system_options(options: ServiceOptions) -> dict[str, Any]:
    """What ``ActorSystem`` takes from the service's options (a cluster replica gives each scope's system the same)."""
    return {
        "seed": secrets.randbits(64) if options.seed is None else options.seed,
        "pending_options": {
            "ttl_seconds": options.selection_cache_ttl_secs,
            "max_entries": options.selection_cache_max_entries,
            "budget": SelectionCacheBudget(options.selection_cache_max_bytes),  # one, shared by every scope
        },
        "reply_deadline": options.reply_deadline,
        "max_index_blocks_per_scope": options.max_index_blocks_per_scope,
    }


@contextlib.asynccontextmanager
async def recovered_runtime(name: str, options: ServiceOptions) -> AsyncIterator[tuple[ActorRuntime, int]]:
    """The data directory locked and claimed, the journal recovered, the actors running over it: the
    runtime and how many scopes were recovered. The journal closes (and says so) when the block ends."""
    with lock_data_dir(options.data_dir):
        data_dir.check_owner(options.data_dir, name)
        journal = await trio.to_thread.run_sync(
            partial(open_journal, options.data_dir, options.durability, options.jetstream_journal, fresh=options.fresh)
        )
        recovered = await trio.to_thread.run_sync(recover, journal)
        data_dir.claim(options.data_dir, name, recovered.states.values())
        # Recovered state is long-lived: move it out of the cyclic GC's sight, and collect young
        # objects less often (request handling allocates many short-lived containers).
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
        # A failed journal write (a full disk) stops the service, but only after the requests in flight have
        # been told (503: not acknowledged); the failure then ends the block (one line, exit 1).
        async with running_actors(journal, recovered.states, **actor_system_options(options)) as runtime:
            yield runtime, len(recovered.states)
        log.info("journal closed: %s", journal.statistics())  # (a failed journal raised instead)


async def run_until_signal(name: str, options: ServiceOptions, build_routes: RouteBuilder) -> None:
    # The receiver opens first: a signal that arrives while the service starts (or just after it says it
    # listens) waits for the start to finish and then stops it gracefully, instead of killing the process.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            handle: ServiceHandle = await nursery.start(run_service, name, options, build_routes)
            async for signum in signals:
                log.info("received %s: shutting down", signal.Signals(signum).name)
                handle.stop()
                break
