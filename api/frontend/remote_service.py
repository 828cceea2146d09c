"""Composition of ``kvrouter frontend --selection-url URL[,URL...]``: the frontend with no routing state of its own,
its selection made by a selection service (a single one, or the replicas of a ``select-service --cluster``) over
HTTP (``remote_routing.py``). The OpenAI routes are the frontend's, served by the same ``Proxy``; the service's
own routes (``POST /workers``, ``/loads``, ...) are the service's: workers register with it, not here. This port
answers ``GET /health`` and ``GET /metrics`` besides (its HTTP requests, its calls to the service, the catalog's age,
the workers' breakers).

Start: read the service's catalog once (a failure is logged and the catalog read again every half second), start
the workers' breakers, open the port. Stop (SIGINT/SIGTERM): drain HTTP (in-flight requests finish within the
shutdown grace; each frees its booking at the service). A frontend killed with its requests in flight leaves their
bookings to the service's stale-request expiry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from kvrouter.actors.metric_families import Family
from kvrouter.api.frontend.app import FrontendApp
from kvrouter.api.frontend.options import FrontendOptions
from kvrouter.api.frontend.proxy import Proxy
from kvrouter.api.frontend.remote_routing import RemoteRouting, selection_client
from kvrouter.api.frontend.service import frontend_tokenizer, http_client, serve_frontend
from kvrouter.api.http import Request, Response, json_response
from kvrouter.api.http.app import make_app
from kvrouter.api.routes.metrics import FrontMetrics, MetricsEndpoint
from kvrouter.api.routes.operations import route as operation_route
from kvrouter.api.routes.selection import OK_STATUS

log = logging.getLogger("kvrouter.frontend")
OTHER_ROUTES_BODY_LIMIT = 64 * 1024  # this port's own routes take no body


@attrs.frozen
class RemoteFrontendHandle:
    url: str
    routing: RemoteRouting
    proxy: Proxy
    stop: Callable[[], None]


@attrs.frozen
class _Families:
    """A synchronous figures source as a ``MetricsEndpoint`` source."""

    families: Callable[[], list[Family]]

    async def metrics(self) -> list[Family]:
        return self.families()


async def health(request: Request) -> Response:
    return json_response(200, OK_STATUS)


async def run_remote_frontend(
    options: FrontendOptions, *, task_status: trio.TaskStatus[RemoteFrontendHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    tokenize, tokenizer_name = frontend_tokenizer(options)
    stopping, stopped = trio.Event(), trio.Event()
    async with (
        http_client(options) as client,
        selection_client(options.limits.max_in_flight) as selection,
        trio.open_nursery() as nursery,
    ):
        routing = RemoteRouting(options.selection_urls, selection, options.auth, options.router.worker_endpoint_allow)
        await nursery.start(routing.follow_catalog)
        proxy = Proxy(routing, client, tokenize, options.limits)
        await nursery.start(proxy.liveness.run)  # the probes of workers out of selection
        metrics = MetricsEndpoint(FrontMetrics(), (routing, _Families(proxy.liveness.families)))
        own_routes = make_app(
            [operation_route("health", health), operation_route("metrics", metrics)],
            body_limit=OTHER_ROUTES_BODY_LIMIT,
            body_timeout=options.http.body_timeout,
            auth=options.auth,
            stopping=stopping,
        )
        app = FrontendApp(proxy, own_routes, options.auth)
        urls = await nursery.start(serve_frontend, app, options, stopping, stopped)
        log.info(
            "kvrouter frontend listening on %s (selection by %s, tokenizer %s, %d workers)",
            " ".join(urls),
            ", ".join(routing.urls),
            tokenizer_name,
            len(routing.catalog_workers()),
        )
        task_status.started(RemoteFrontendHandle(urls[0], routing, proxy, stopping.set))
        await stopped.wait()
        nursery.cancel_scope.cancel()
