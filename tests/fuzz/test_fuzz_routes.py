"""Property-based fuzzing of every route of both services (``tests/fuzz/routes.py``), against real hypercorn:
never a 5xx, a rejected request changes nothing, and the service restarts from its journal afterwards."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.worker_endpoints import parse_allow_list
from kvrouter.api.process.main import SLOT_TRACKER_BODY_LIMIT, RouteBuilder, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from tests.fuzz.harness import ServiceUnderTest, fuzz_service, selection_service, slot_tracker
from tests.fuzz.routes import SELECTION_KNOWN, SELECTION_ROUTES, SLOT_TRACKER_KNOWN, SLOT_TRACKER_ROUTES

SLOT_TRACKER = ServiceUnderTest(
    "slot tracker",
    slot_tracker,
    SLOT_TRACKER_BODY_LIMIT,
    SLOT_TRACKER_ROUTES,
    SLOT_TRACKER_KNOWN,
    state_paths=("/workers", "/loads", "/replica_sync/peers"),
    restart_paths=("/workers", "/loads"),
)
SELECTION = ServiceUnderTest(
    "selection service",
    selection_service,
    SELECTION_BODY_LIMIT,
    SELECTION_ROUTES,
    SELECTION_KNOWN,
    state_paths=("/workers", "/loads", "/dump", "/replica_sync/peers"),
    restart_paths=("/workers", "/loads", "/dump"),
)


async def test_slot_tracker_routes_survive_generated_requests(tmp_path: Path) -> None:
    fuzzer = await fuzz_service(SLOT_TRACKER, tmp_path / "data")
    assert fuzzer.sent > 0 and any(200 <= status < 300 for status in fuzzer.statuses)


async def test_selection_routes_survive_generated_requests(tmp_path: Path) -> None:
    fuzzer = await fuzz_service(SELECTION, tmp_path / "data")
    assert fuzzer.sent > 0 and any(200 <= status < 300 for status in fuzzer.statuses)
    assert fuzzer.by_route.get(("POST", "/workers", 400), 0) > 0  # bad endpoints among them


def allow_listed() -> RouteBuilder:
    """A selection service whose workers may live on ``w`` and 10.0.0.0/8 only (``--worker-endpoint-allow``)."""
    return select_service_builder(RouterConfig(worker_endpoint_allow=parse_allow_list(["w,10.0.0.0/8"])))


async def test_a_service_with_an_allow_list_survives_generated_requests(tmp_path: Path) -> None:
    """The same rows against ``--worker-endpoint-allow``: a registration naming another host (``[::1]``, the
    attack URLs' hosts) is a 400 that changes nothing, and the journal restarts to the same state."""
    fuzzer = await fuzz_service(attrs.evolve(SELECTION, builder=allow_listed), tmp_path / "data")
    assert fuzzer.by_route.get(("POST", "/workers", 201), 0) > 0
    assert fuzzer.by_route.get(("POST", "/workers", 400), 0) > 0


async def test_a_service_with_a_token_refuses_every_request_without_it(tmp_path: Path) -> None:
    """The same rows with a bearer token configured: a request without it (or with a wrong one) is a 401 and
    changes nothing; with it, everything above holds."""
    fuzzer = await fuzz_service(attrs.evolve(SELECTION, token="s3cret-fuzz-token"), tmp_path / "data")
    assert fuzzer.statuses.get(401, 0) > 0 and any(200 <= status < 300 for status in fuzzer.statuses)
