"""Property-based fuzzing of the frontend's own routes (``FRONTEND_ROUTES``) in front of a real mock worker:
never a 5xx, every error an ``{"error"}``, and a rejected request changes nothing (``/loads``: no booking is
left behind, whether the frontend or the worker refused it)."""

from __future__ import annotations

from pathlib import Path

import trio

from kvrouter.api.frontend.app import OWN_ROUTES
from kvrouter.api.frontend.options import FrontendLimits
from kvrouter.api.frontend.remote_service import RemoteFrontendHandle, run_remote_frontend
from tests.fuzz.harness import Fuzzer, RunningService, ServiceUnderTest, run_examples
from tests.fuzz.requests import SPOILS, known_request
from tests.fuzz.routes import FRONTEND_KNOWN, FRONTEND_ROUTES, REMOTE_FRONTEND_ROUTES
from tests.support.frontends import frontend_options, start_frontend, start_workers
from tests.support.mock_workers import start_mock_worker
from tests.support.services import running

FRONTEND = ServiceUnderTest(
    "frontend",
    lambda: None,  # type: ignore[arg-type,return-value]  # started below, not through run_service
    FrontendLimits().body_limit,
    FRONTEND_ROUTES,
    FRONTEND_KNOWN,
    state_paths=("/loads", "/v1/models"),
    restart_paths=(),
)


async def test_frontend_routes_survive_generated_requests() -> None:
    async with trio.open_nursery() as nursery:
        frontend = await start_frontend(nursery)
        await start_workers(nursery, frontend, 1)
        served = set(OWN_ROUTES.items())
        table = {(row.path, row.method) for row in FRONTEND.rows}
        assert served == table, f"routes without a fuzz row: {served - table}; rows of no route: {table - served}"
        port = int(frontend.url.rsplit(":", 1)[1])
        fuzzer = Fuzzer(FRONTEND, RunningService(None, port, []))  # type: ignore[arg-type]
        for method, target, body in FRONTEND.known:
            await fuzzer.exercise(known_request(FRONTEND.rows, method, target, body))
        # Fewer examples than the services: each accepted one is a whole proxied generation.
        await trio.to_thread.run_sync(run_examples, fuzzer, FRONTEND.rows, SPOILS, 100)
        nursery.cancel_scope.cancel()
    assert fuzzer.sent > 0
    accepted = {path for (_, path, status), count in fuzzer.by_route.items() if 200 <= status < 300 and count}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/frontend/stats"} <= accepted


REMOTE_FRONTEND = ServiceUnderTest(
    "frontend --selection-url",
    lambda: None,  # type: ignore[arg-type,return-value]  # started below, not through run_service
    FrontendLimits().body_limit,
    REMOTE_FRONTEND_ROUTES,
    FRONTEND_KNOWN,
    state_paths=("/v1/models",),
    restart_paths=(),
)


async def test_remote_frontend_routes_survive_generated_requests(tmp_path: Path) -> None:
    """The frontend in front of a selection service: its port's routes under generated requests."""
    async with running("selection service", tmp_path / "service") as service, trio.open_nursery() as nursery:
        await start_mock_worker(nursery, register_url=service.urls[0], worker_id=1)
        front: RemoteFrontendHandle = await nursery.start(
            run_remote_frontend, frontend_options(selection_urls=(service.urls[0],), seed=None)
        )
        with trio.fail_after(10):
            while True:  # the catalog read at start may precede the worker's registration
                if front.routing.catalog_workers():
                    break
                await trio.sleep(0.05)
        port = int(front.url.rsplit(":", 1)[1])
        fuzzer = Fuzzer(REMOTE_FRONTEND, RunningService(None, port, []))  # type: ignore[arg-type]
        for method, target, body in REMOTE_FRONTEND.known:
            await fuzzer.exercise(known_request(REMOTE_FRONTEND.rows, method, target, body))
        await trio.to_thread.run_sync(run_examples, fuzzer, REMOTE_FRONTEND.rows, SPOILS, 60)
        front.stop()
        nursery.cancel_scope.cancel()
    assert fuzzer.sent > 0
    accepted = {path for (_, path, status), count in fuzzer.by_route.items() if 200 <= status < 300 and count}
    assert {"/v1/completions", "/v1/models", "/health", "/metrics"} <= accepted
