"""Composition of ``kvrouter frontend``: journal, actors and the selection service's core, the HTTP client to the
workers, the ASGI app on hypercorn, the ``--workers`` registered at startup.

Start: open (or recover) the journal, start the actors and the selection service (its KV listeners subscribe to
the registered workers), register ``--workers``, open the port. Stop (``FrontendHandle.stop``, SIGINT/SIGTERM):
drain HTTP (in-flight requests finish within the shutdown grace; each frees its booking), then stop the actors
and close the journal.
"""

from __future__ import annotations

import logging
import secrets
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import attrs
import httpx
import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.worker_endpoints import default_worker_id
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.fleet.tokenizer_check import local_checksum
from kvrouter.actors.fleet.worker_file import FileParser
from kvrouter.actors.kv_ingest import IN_PROCESS_KV_EVENTS
from kvrouter.actors.runtime import running_actors, start_select_service
from kvrouter.actors.select_service import SelectService
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import WorkerBody
from kvrouter.api.cli.fleet_flags import worker_file_parser
from kvrouter.api.embedded import _opened_journal, as_router_errors
from kvrouter.api.frontend.app import FrontendApp
from kvrouter.api.frontend.model_dir import load_model_dir
from kvrouter.api.frontend.options import FrontendOptions, WorkerSpec
from kvrouter.api.frontend.proxy import Proxy
from kvrouter.api.frontend.routing import TENANT, Routing
from kvrouter.api.frontend.tokenizers import Tokenize, load_tokenizer
from kvrouter.api.http import Route
from kvrouter.api.http.app import make_app
from kvrouter.api.http.server import hypercorn_config, serve_http
from kvrouter.api.process.main import REPLY_DEADLINE_SECONDS
from kvrouter.api.routes.commands import with_command_routes
from kvrouter.api.routes.metrics import FrontMetrics, MetricsEndpoint
from kvrouter.api.routes.operations import route as operation_route
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT, select_service_routes
from kvrouter.client.table import FRONTEND

log = logging.getLogger("kvrouter.frontend")
KEEPALIVE_EXPIRY_SECONDS = 2.0


@attrs.frozen
class FrontendHandle:
    url: str
    routing: Routing
    proxy: Proxy
    stop: Callable[[], None]


def http_client(options: FrontendOptions) -> httpx.AsyncClient:
    """The client to the workers: bounded connections, no proxy from the environment (workers are direct)."""
    limits = options.limits
    timeout = httpx.Timeout(
        connect=limits.connect_timeout, read=limits.read_timeout, write=limits.read_timeout, pool=limits.connect_timeout
    )
    # Idle connections are dropped before a worker's own idle timeout (hypercorn's 5 s) could close them under
    # a request being sent.
    pool = httpx.Limits(
        max_connections=limits.max_in_flight,
        max_keepalive_connections=min(256, limits.max_in_flight),
        keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
    )
    return httpx.AsyncClient(timeout=timeout, limits=pool, trust_env=False, follow_redirects=False)


async def register_workers(routing: Routing, options: FrontendOptions) -> None:
    """Put each ``--workers`` entry in the catalog (its id the hash a self-registering mock worker uses)."""
    for spec in options.workers:
        await routing.service.put_worker(worker_record(spec, options))
        log.info("worker %s registered (KV events %s)", spec.endpoint, spec.kv_events_endpoint or "off: predicted")


def worker_record(spec: WorkerSpec, options: FrontendOptions) -> WorkerRecord:
    body = {
        "worker_id": default_worker_id(spec.endpoint.rstrip("/")),
        "model_name": options.model_name,
        "tenant_id": TENANT,
        "endpoint": spec.endpoint.rstrip("/"),
        "block_size": options.block_size,
        # Without one, an endpoint nothing publishes on: the rank is schedulable, scored on its predicted cache.
        "kv_events_endpoint": spec.kv_events_endpoint or IN_PROCESS_KV_EVENTS,
    }
    with as_router_errors():
        return parse(WorkerBody, body).to_record()


def file_workers(model_name: str, block_size: int) -> FileParser:
    """A ``--discovery-file``'s entries read as ``--workers`` are: the frontend's model and block size unless an
    entry names its own, and without a KV-events endpoint a worker is scored on its predicted cache."""
    return worker_file_parser(
        {
            "model_name": model_name,
            "tenant_id": TENANT,
            "block_size": block_size,
            "kv_events_endpoint": IN_PROCESS_KV_EVENTS,
        }
    )


def frontend_service_routes(service: SelectService, front: FrontMetrics) -> list[Route]:
    """The selection service's operations the frontend serves on its port; ``GET /metrics`` with the service's
    figures (the breakers' among them, ``liveness.py``) and the front's HTTP requests."""
    metrics = operation_route("metrics", MetricsEndpoint(front, (service,)))
    return with_command_routes([*select_service_routes(service), metrics], FRONTEND, front=front)


def fleet_with_tokenizer(options: FrontendOptions) -> FleetOptions:
    """The fleet options, with ``--model-path``'s tokenizer checksum when discovery could compare cards with it."""
    fleet = options.fleet
    if options.model_path is None or not fleet.enabled:
        return fleet
    return attrs.evolve(fleet, tokenizer_checksum=local_checksum(options.model_path / "tokenizer.json"))


def frontend_tokenizer(options: FrontendOptions) -> tuple[Tokenize, str]:
    """``--model-path``'s tokenizer and chat template, else ``--tokenizer``'s file, else the built-in tokenizer."""
    if options.model_path is not None:
        model = load_model_dir(options.model_path)
        return model, model.name
    return load_tokenizer(options.tokenizer)


async def run_frontend(
    options: FrontendOptions, *, task_status: trio.TaskStatus[FrontendHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    tokenize, tokenizer_name = frontend_tokenizer(options)
    seed = secrets.randbits(64) if options.seed is None else options.seed
    journal_opened = _opened_journal(options.data_dir, options.durability, options.fresh)
    async with (
        journal_opened as (journal, states),
        running_actors(journal, states, seed=seed, reply_deadline=REPLY_DEADLINE_SECONDS) as runtime,
    ):
        service = await start_select_service(
            runtime.system,
            options.router,
            runtime.nursery,
            fleet=fleet_with_tokenizer(options),
            parse_worker_file=file_workers(options.model_name, options.block_size),
        )
        routing = Routing(service)
        # Before any traffic: the bookings of requests that were in flight when this frontend last stopped
        # (killed, crashed) would otherwise count as load until the stale-request expiry.
        freed = await routing.free_orphans()
        if freed:
            log.info("freed %d bookings of requests in flight when the frontend last stopped", freed)
        await register_workers(routing, options)
        async with http_client(options) as client:
            proxy = Proxy(routing, client, tokenize, options.limits)
            await runtime.nursery.start(proxy.liveness.run)  # the probes of workers out of selection
            service.metric_sources.append(proxy.liveness.families)
            service_app = make_app(
                frontend_service_routes(service, FrontMetrics()),
                body_limit=SELECTION_BODY_LIMIT,
                body_timeout=options.http.body_timeout,
                auth=options.auth,
                stopping=runtime.stopping,
            )
            app = FrontendApp(proxy, service_app, options.auth)
            stopped = trio.Event()
            urls = await runtime.nursery.start(serve_frontend, app, options, runtime.stopping, stopped)
            log.info(
                "kvrouter frontend listening on %s (router mode %s, tokenizer %s, journal %s, %d workers)",
                " ".join(urls),
                options.router.router_mode,
                tokenizer_name,
                options.data_dir or "in memory",
                len(await service.workers()),
            )
            task_status.started(FrontendHandle(urls[0], routing, proxy, runtime.stopping.set))
            await stopped.wait()
        runtime.nursery.cancel_scope.cancel()


async def serve_frontend(
    app: FrontendApp,
    options: FrontendOptions,
    stopping: trio.Event,
    stopped: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the frontend's port until ``stopping``, then drain; ``stopped`` set once it is done."""
    config = hypercorn_config(options.host, options.port, options.http)
    # A stream stays open while tokens come and the client sends nothing: hypercorn's read timeout
    # would cut it. Bodies have their own deadline (--http-body-timeout-secs).
    config.read_timeout = None
    await serve_http(
        app,
        config,
        stopping.wait,
        max_connections=options.http.max_connections,
        write_timeout=options.http.write_timeout,
        task_status=task_status,
    )
    stopped.set()


class Stoppable(Protocol):
    @property
    def stop(self) -> Callable[[], None]: ...


async def run_until_signal(options: FrontendOptions, runner: Callable[..., Awaitable[None]] = run_frontend) -> None:
    """Run the frontend (``runner``: in-process selection, or ``run_remote_frontend``) until SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            handle: Stoppable = await nursery.start(partial(runner, options))
            async for signum in signals:
                log.info("received %s: shutting down", signal.Signals(signum).name)
                handle.stop()
                break
