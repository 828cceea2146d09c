"""Property-based fuzzing of every route of the mock worker (``MOCK_WORKER_ROUTES``), against real hypercorn:
never a 5xx, every error an ``{"error"}``, and a rejected request changes nothing (``/stats``: the engine's
cache, its requests and its KV-event stream)."""

from __future__ import annotations

import attrs
import trio

from kvrouter.api.mock_worker.openai_app import DEFAULT_BODY_LIMIT
from tests.fuzz.harness import Fuzzer, RunningService, ServiceUnderTest, run_examples
from tests.fuzz.requests import SPOILS, known_request
from tests.fuzz.routes import MOCK_WORKER_KNOWN, MOCK_WORKER_ROUTES
from tests.support.mock_workers import start_mock_worker

MOCK_WORKER = ServiceUnderTest(
    "mock worker",
    lambda: None,  # type: ignore[arg-type,return-value]  # started below, not through run_service
    DEFAULT_BODY_LIMIT,
    MOCK_WORKER_ROUTES,
    MOCK_WORKER_KNOWN,
    state_paths=("/stats", "/v1/models"),
    restart_paths=(),
)


async def test_mock_worker_routes_survive_generated_requests() -> None:
    async with trio.open_nursery() as nursery:
        worker = await start_mock_worker(nursery)
        served = {(method, path) for path, methods in worker.app.routes.items() for method in methods}
        table = {(row.method, row.path) for row in MOCK_WORKER.rows}
        assert served == table, f"routes without a fuzz row: {served - table}; rows of no route: {table - served}"
        port = int(worker.url.rsplit(":", 1)[1])
        fuzzer = Fuzzer(MOCK_WORKER, RunningService(None, port, []))  # type: ignore[arg-type]
        for method, target, body in MOCK_WORKER.known:
            await fuzzer.exercise(known_request(MOCK_WORKER.rows, method, target, body))
        await trio.to_thread.run_sync(run_examples, fuzzer, MOCK_WORKER.rows, SPOILS)
        worker.stop()
    assert fuzzer.sent > 0 and any(200 <= status < 300 for status in fuzzer.statuses)
    accepted = {path for (_, path, status), count in fuzzer.by_route.items() if 200 <= status < 300 and count}
    assert {"/v1/completions", "/v1/chat/completions"} <= accepted
    assert attrs.fields(ServiceUnderTest)  # the table type is the shared one
