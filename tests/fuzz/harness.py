"""Run a real service in-process, drive it with generated requests, and check what every answer must be.

Per request: never a 5xx (a row's ``unavailable_ok`` allows the 503 1.6.1 gives when no worker is
eligible, never with Retry-After); an error is ``{"error": "..."}`` (or the plain text of a query-string
rejection); and a rejected request leaves the state exactly as it was. After the run, the service
restarts from its journal to the same state.

Memory: the examples run in three batches, a warm-up then two of the same size, and the process's resident
memory (the service runs in it) may grow by at most ``MAX_BATCH_GROWTH`` over the second of them: a service
whose state, caches or buffers grow with the requests it is sent (the pending-selection cache once took
943 MiB for 60 selections) fails it, while a bounded one only grows while it warms up.

Hypothesis runs in a worker thread (it calls the test function synchronously); each request is sent
on the trio loop that also runs the service, through ``trio.from_thread.run``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.http import Route
from kvrouter.api.http.auth import BearerToken
from kvrouter.api.process.main import RouteBuilder, ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.process.main import slot_tracker_app as slot_tracker_builder
from kvrouter.journal.store import Durability
from tests.fuzz.requests import (
    SPOILS,
    VALID_TOKEN,
    FuzzRequest,
    RawResponse,
    draw_request,
    known_request,
    raw_request,
    send,
)
from tests.fuzz.routes import FuzzRoute

# Examples per service (each a few requests); KVROUTER_FUZZ_EXAMPLES raises it for a longer hunt, and
# KVROUTER_FUZZ_RANDOM=1 explores new inputs instead of the fixed, reproducible sequence CI runs.
EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "250"))
DERANDOMIZE = os.environ.get("KVROUTER_FUZZ_RANDOM", "") != "1"
REQUESTS_PER_EXAMPLE = 8
# Resident memory the second of two equal batches (after a warm-up) may add; measured: under 1 MiB. A batch
# is ~100 examples, ~2,000 HTTP requests with the state reads between them: a leak of 256 KiB per request
# injected into the app grew it by 542 MiB, and one of 32 KiB per request would already fail it.
MAX_BATCH_GROWTH = 64 * 1024 * 1024


@attrs.frozen
class ServiceUnderTest:
    name: str
    builder: Callable[[], RouteBuilder]
    body_limit: int
    rows: list[FuzzRoute]
    known: list[tuple[str, str, Any]]  # fixed requests sent first (past crashes)
    state_paths: tuple[str, ...]  # GETs whose answers together are the service's observable state
    restart_paths: tuple[str, ...]  # the part of it kept across a restart (peers added at run time are not)
    token: str | None = None  # bearer token the service requires (--auth-token-file), if any


def slot_tracker() -> RouteBuilder:
    return slot_tracker_builder


def selection_service() -> RouteBuilder:
    return select_service_builder(RouterConfig())


@attrs.define
class RunningService:
    """A service on an ephemeral port, its route table as served, and its nursery (stopping waits for it)."""

    handle: ServiceHandle
    port: int
    routes: list[Route]


async def start(nursery: trio.Nursery, service: ServiceUnderTest, data_dir: Path) -> RunningService:
    served: list[Route] = []
    build = service.builder()

    async def capture(options: ServiceOptions, system: Any, inner: trio.Nursery) -> list[Route]:
        routes = await build(options, system, inner)
        served.extend(routes)
        return routes

    options = ServiceOptions(
        port=0,
        data_dir=data_dir,
        durability=Durability.ALWAYS,
        seed=7,
        body_limit=service.body_limit,
        replica_sync_port=0,
        auth=None if service.token is None else BearerToken(service.token.encode()),
    )
    handle: ServiceHandle = await nursery.start(run_service, service.name, options, capture)
    return RunningService(handle, int(handle.urls[0].rsplit(":", 1)[1]), served)


async def observe(port: int, paths: tuple[str, ...], token: str | None) -> tuple[Any, ...]:
    """The answers to the state GETs (KV listener status, the per-rank KV modes it drives, and the ranks out of
    selection because their KV events stopped are live health, which changes with time, not state: left out)."""
    seen = []
    for path in paths:
        headers = (("authorization", f"Bearer {token}"),) if token is not None else ()
        response = await raw_request(port, "GET", path, headers)
        assert response.status == 200, (path, response.status, response.body[:300])
        value = response.json()
        if path.startswith("/workers"):
            for row in value:
                row.pop("kv_listeners", None)
                row.pop("kv_modes", None)
                row.pop("out_of_selection", None)
        seen.append(value)
    return tuple(seen)


def check_answer(request: FuzzRequest, response: RawResponse, token: str | None = None) -> None:
    where = f"{request.describe()} -> {response.status} {response.body[:300]!r}"
    if token is not None and request.authorization != VALID_TOKEN and request.route.path != "/health":
        assert response.status in (401, 404, 405), f"served without its token: {where}"
    if response.status >= 500:
        allowed = response.status == 503 and request.route.unavailable_ok and "retry-after" not in response.headers
        assert allowed, f"a 5xx: {where}"
    if response.status >= 400 and request.method != "HEAD":
        if response.headers.get("content-type", "").startswith("text/plain"):
            assert response.status == 400 and response.body, where  # axum's query-string rejection, in 1.6.1 too
        elif request.route.path != "/ready":
            body = response.json()
            assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], where
    if request.route.path == "/batch" and response.status == 200:
        for result in response.json():  # each command answered as its route: never a 500, errors are {error}
            assert result["status"] != 500, where
            if result["status"] >= 400 and isinstance(result["body"], dict) and "ready" not in result["body"]:
                assert isinstance(result["body"].get("error"), str) and result["body"]["error"], where


class Fuzzer:
    """Sends generated requests to one running service; remembers the state between requests."""

    def __init__(self, service: ServiceUnderTest, running: RunningService) -> None:
        self.service = service
        self.port = running.port
        self.state: tuple[Any, ...] | None = None
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.by_route: dict[tuple[str, str, int], int] = {}  # (method, path template, status) -> count
        self.resident: list[int] = []  # bytes after each batch: warm-up, first, second
        self.body_types = {(route.method, route.path): route.body_type for route in running.routes}

    async def exercise(self, request: FuzzRequest) -> None:
        if self.state is None:
            self.state = await observe(self.port, self.service.state_paths, self.service.token)
        response = await send(self.port, request, self.service.token)
        self.sent += 1
        self.statuses[response.status] = self.statuses.get(response.status, 0) + 1
        key = (request.route.method, request.route.path, response.status)
        self.by_route[key] = self.by_route.get(key, 0) + 1
        check_answer(request, response, self.service.token)
        if response.status >= 400:
            after = await observe(self.port, self.service.state_paths, self.service.token)
            changed = [
                f"{path}: {before!r:.600} -> {now!r:.600}"
                for path, before, now in zip(self.service.state_paths, self.state, after, strict=True)
                if before != now
            ]
            assert not changed, f"a rejected request changed the state: {request.describe()}: {changed}"
        elif request.method not in ("GET", "HEAD"):
            self.state = None  # accepted: the state may have changed
        body_type = self.body_types.get((request.route.method, request.route.path))
        if request.repeated is not None and body_type is not None and request.repeated in attrs.fields_dict(body_type):
            # As 1.6.1: a repeated field is refused (it was served with the last value before).
            assert response.status >= 400, f"a repeated field was accepted: {request.describe()}"


def run_examples(
    fuzzer: Fuzzer, rows: list[FuzzRoute], spoils: list[str], examples: int = EXAMPLES, batch: int = 0
) -> None:
    """Hypothesis's search, in this worker thread; each request goes to the trio loop. Each batch draws other
    inputs (seeded by its number, so CI's run is reproducible, unless KVROUTER_FUZZ_RANDOM=1)."""

    weighted = [row for row in rows for _ in range(row.weight)]

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def example(data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, REQUESTS_PER_EXAMPLE), label="requests")):
            row = data.draw(st.sampled_from(weighted), label="route")
            trio.from_thread.run(fuzzer.exercise, draw_request(row, data, spoils))

    (seed(batch)(example) if DERANDOMIZE else example)()


def resident_bytes() -> int:
    """This process's resident memory (the service runs in it), after a full collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def fuzz_service(service: ServiceUnderTest, data_dir: Path, spoils: list[str] = SPOILS) -> Fuzzer:
    """Fuzz ``service`` on a fresh data directory, then restart it from its journal and compare."""
    async with trio.open_nursery() as nursery:
        running = await start(nursery, service, data_dir)
        served = {(route.method, route.path) for route in running.routes}
        table = {(row.method, row.path) for row in service.rows}
        assert served == table, f"routes without a fuzz row: {served - table}; rows of no route: {table - served}"
        fuzzer = Fuzzer(service, running)
        for method, target, body in service.known:
            await fuzzer.exercise(known_request(service.rows, method, target, body))
        warm_up = max(1, EXAMPLES // 5)
        for batch, examples in enumerate((warm_up, (EXAMPLES - warm_up) // 2, (EXAMPLES - warm_up) // 2)):
            await trio.to_thread.run_sync(run_examples, fuzzer, service.rows, spoils, max(1, examples), batch)
            fuzzer.resident.append(resident_bytes())
        growth = fuzzer.resident[2] - fuzzer.resident[1]
        print(
            f"{service.name}: {fuzzer.sent} requests; resident after warm-up, first and second batch "
            f"{', '.join(f'{r / 2**20:.1f}' for r in fuzzer.resident)} MiB (second batch: {growth / 2**20:+.1f} MiB)"
        )
        assert growth <= MAX_BATCH_GROWTH, (
            f"{service.name}: resident memory grew {growth / 2**20:.1f} MiB over a batch after warm-up "
            f"(limit {MAX_BATCH_GROWTH / 2**20:.0f} MiB): something grows with every request"
        )
        before = await observe(running.port, service.restart_paths, service.token)
        running.handle.stop()
    async with trio.open_nursery() as nursery:
        restarted = await start(nursery, service, data_dir)
        assert await observe(restarted.port, service.restart_paths, service.token) == before
        restarted.handle.stop()
    return fuzzer
