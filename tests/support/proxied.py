"""A service in the ``--fronts`` layout inside one test process: the actor side (journal, actors,
dispatcher) and one front (hypercorn, the same routes over proxies) talk over real ZMQ ipc sockets, so
every route test can run through the proxy and the wire without the cost of starting processes (the
real multi-process service is tested in tests/api/test_fronts_processes.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import trio

from kvrouter.api.http import Route
from kvrouter.api.http.app import make_app
from kvrouter.api.http.server import hypercorn_config, serve_http
from kvrouter.api.process.fronts import open_dispatcher, open_front_link, remote_objects
from kvrouter.api.process.main import ObjectsBuilder, ServiceHandle, ServiceObjects, ServiceOptions, recovered_runtime


async def run_proxied_service(
    name: str,
    options: ServiceOptions,
    build_objects: ObjectsBuilder,
    routes_of: Callable[[ServiceObjects], list[Route]],
    service_class: type,
    *,
    task_status: trio.TaskStatus[ServiceHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    with tempfile.TemporaryDirectory(prefix="kvr-") as runtime_dir:
        async with recovered_runtime(name, options) as (runtime, _):
            objects = await build_objects(options, runtime.system, runtime.nursery)
            await runtime.nursery.start(open_dispatcher(objects, Path(runtime_dir)).run)
            link = open_front_link(Path(runtime_dir), 0, options)
            await runtime.nursery.start(link.run)
            routes = routes_of(remote_objects(link, service_class))
            app = make_app(
                routes, body_limit=options.body_limit, body_timeout=options.http.body_timeout, auth=options.auth
            )

            async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                config = hypercorn_config(options.host, options.port, options.http)
                await serve_http(app, config, runtime.stopping.wait, task_status=task_status)
                runtime.nursery.cancel_scope.cancel()

            urls = await runtime.nursery.start(http)
            task_status.started(ServiceHandle(urls, runtime.system, runtime.stopping.set))
