"""Property-based fuzzing of the frontend's own routes (``FRONTEND_ROUTES``) in front of a real mock worker:
never a 5xx, every error an ``{"error"}``, and a rejected request changes nothing (``/loads``: no booking is
left behind, whether the frontend or the worker refused it)."""

from __future__ import annotations

import trio

from kvrouter.api.frontend.app import OWN_ROUTES
from kvrouter.api.frontend.options import FrontendLimits
from tests.fuzz.harness import Fuzzer, RunningService, ServiceUnderTest, run_examples
from tests.fuzz.requests import SPOILS, known_request
from tests.fuzz.routes import FRONTEND_KNOWN, FRONTEND_ROUTES
from tests.support.frontends import start_frontend, start_workers

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
