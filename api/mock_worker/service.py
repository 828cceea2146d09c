"""Composition of the mock worker: KV publisher, engine loop, HTTP server, registration.

Start: bind the KV sockets (so a registered listener finds them), start the engine and the replay server,
open the HTTP port, then register. Stop (``MockWorkerHandle.stop``, SIGINT/SIGTERM): unregister first (the
router stops sending here), then drain HTTP (in-flight requests are answered), then stop the engine and
close the sockets.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from functools import partial

import attrs
import trio

from kvrouter.actors.core.worker_endpoints import default_worker_id
from kvrouter.api.http.server import HttpSettings, hypercorn_config, serve_http
from kvrouter.api.mock_worker.engine_loop import EngineLoop
from kvrouter.api.mock_worker.kv_publisher import DEFAULT_BUFFER_BATCHES, DEFAULT_BUFFER_BYTES, KvEventPublisher
from kvrouter.api.mock_worker.openai_app import AppLimits, MockWorkerApp
from kvrouter.api.mock_worker.registration import Registration, register, unregister
from kvrouter.simulations.timing import EngineParams

log = logging.getLogger("kvrouter.mock_worker")


@attrs.frozen
class MockWorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (the handle says which)
    kv_events_port: int = 0
    replay_port: int | None = None  # None: no replay endpoint (vLLM's default)
    engine: EngineParams = attrs.Factory(EngineParams)
    speedup: float = 1.0
    model_name: str = "mock"
    limits: AppLimits = attrs.Factory(AppLimits)
    replay_buffer_batches: int = DEFAULT_BUFFER_BATCHES
    replay_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    register_url: str | None = None
    register_attempts: int = 10
    register_token: str | None = attrs.field(default=None, repr=False)  # the service's bearer token, if it has one
    worker_id: int | None = None  # None: derived from the advertised HTTP endpoint
    advertise_host: str | None = None  # the host others reach us at (default: host)
    http: HttpSettings = attrs.Factory(HttpSettings)


@attrs.frozen
class MockWorkerHandle:
    url: str
    kv_events_endpoint: str
    replay_endpoint: str | None
    worker_id: int
    app: MockWorkerApp
    loop: EngineLoop
    publisher: KvEventPublisher
    stop: Callable[[], None]


async def run_mock_worker(
    options: MockWorkerOptions, *, task_status: trio.TaskStatus[MockWorkerHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    publisher = KvEventPublisher(buffer_batches=options.replay_buffer_batches, buffer_bytes=options.replay_buffer_bytes)
    publisher.bind(options.host, options.kv_events_port, options.replay_port)
    try:
        loop = EngineLoop(options.engine, publisher.publish, speedup=options.speedup)
        app = MockWorkerApp(loop, publisher, options.model_name, options.limits)
        stop_requested = trio.Event()
        http_stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop.run)
            nursery.start_soon(publisher.serve_replay)
            config = hypercorn_config(options.host, options.port, options.http)
            # Streams stay open while tokens are generated and the client sends nothing: hypercorn's read
            # timeout would cut them. The body deadline is the app's (AppLimits.body_timeout).
            config.read_timeout = None
            http_done = trio.Event()

            async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await serve_http(
                        app,
                        config,
                        http_stop.wait,
                        max_connections=options.http.max_connections,
                        task_status=task_status,
                    )
                finally:
                    http_done.set()

            urls = await nursery.start(http)
            port = int(urls[0].rsplit(":", 1)[1])
            advertised = options.advertise_host or options.host
            url = f"http://{_url_host(advertised)}:{port}"
            kv_endpoint = f"tcp://{_url_host(advertised)}:{publisher.port}"
            replay_endpoint = (
                None if publisher.replay_port is None else f"tcp://{_url_host(advertised)}:{publisher.replay_port}"
            )
            worker_id = options.worker_id if options.worker_id is not None else default_worker_id(url)
            registration = _registration(options, worker_id, url, kv_endpoint, replay_endpoint)
            if registration is not None:
                await register(registration)
            log.info(
                "kvrouter mock worker listening on %s (model %s, worker id %d, KV events %s, replay %s, "
                "%d blocks of %d tokens, speedup %g)",
                url,
                options.model_name,
                worker_id,
                kv_endpoint,
                replay_endpoint or "off",
                options.engine.num_blocks,
                options.engine.block_size,
                options.speedup,
            )
            task_status.started(
                MockWorkerHandle(url, kv_endpoint, replay_endpoint, worker_id, app, loop, publisher, stop_requested.set)
            )
            await stop_requested.wait()
            if registration is not None:
                with trio.CancelScope(shield=True):
                    await unregister(registration)
            http_stop.set()
            await http_done.wait()
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()


def _registration(
    options: MockWorkerOptions, worker_id: int, url: str, kv_endpoint: str, replay_endpoint: str | None
) -> Registration | None:
    """How the worker registers itself with ``--register`` (None without it): its catalog record."""
    if options.register_url is None:
        return None
    record = {
        "worker_id": worker_id,
        "model_name": options.model_name,
        "endpoint": url,
        "block_size": options.engine.block_size,
        "kv_events_endpoint": kv_endpoint,
        "replay_endpoint": replay_endpoint,
        "total_kv_blocks": options.engine.num_blocks,
        "max_num_batched_tokens": options.engine.max_batched_tokens,
        "data_parallel_size": 1,
    }
    return Registration(options.register_url, record, attempts=options.register_attempts, token=options.register_token)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def run_until_signal(options: MockWorkerOptions) -> None:
    """Serve until SIGINT/SIGTERM. A signal while starting (registration may be retrying) stops at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            handles: list[MockWorkerHandle] = []

            async def on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if handles:
                        log.info("received %s: shutting down", name)
                        handles[0].stop()
                    else:
                        log.info("received %s while starting: stopping", name)
                        nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
            handles.append(await nursery.start(partial(run_mock_worker, options)))
