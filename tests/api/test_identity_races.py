"""Service-wide identity in the selection service: worker ids and reservation ids have one owner.

The interleavings are forced, not hoped for: the app is called in process under trio's MockClock, and
the scope actors are held (the journal says it has no room, so each actor stops after its current turn)
while the requests under test are started one at a time and run until they block. Only then are the
actors let go, so both requests have made whatever checks they make before either command is applied.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from kvrouter.actors.core.commands import ExpireStale
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.system import ActorSystem
from kvrouter.api.process.main import select_service_builder
from tests.support.asgi import ASGIApp, Reply, call, service_app
from tests.support.journals import RoomJournal

A = {"model_name": "m", "tenant_id": "a"}
B = {"model_name": "m", "tenant_id": "b"}
PROMPT = {"token_ids": [1, 2, 3, 4, 5]}


def worker(worker_id: int, scope: dict[str, str]) -> dict[str, Any]:
    return {"worker_id": worker_id, **scope, "endpoint": f"http://w{worker_id}", "block_size": 4}


@pytest.fixture
async def selector(mock_clock: trio.abc.Clock, nursery: trio.Nursery) -> tuple[ASGIApp, ActorSystem, RoomJournal]:
    """A selection service without KV events (no listeners), with workers 10 in scope A and 11 in B."""
    journal = RoomJournal()
    app, system = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)), journal)
    for worker_id, scope in ((10, A), (11, B)):
        assert (await call(app, "POST", "/workers", worker(worker_id, scope))).status == 201
    return app, system, journal


async def hold_actors(system: ActorSystem, journal: RoomJournal) -> None:
    """Let every actor take one (empty) turn and then wait for room: what is sent from now on stays queued."""
    journal.close_room()
    for scope in system.scopes():
        await system.submit(scope, ExpireStale(1, at=0))
    await trio.testing.wait_all_tasks_blocked()


async def interleaved(app: ASGIApp, system: ActorSystem, journal: RoomJournal, *requests: tuple) -> list[Reply]:
    """Start each request in turn and run it until it blocks (actors held); then let the actors go."""
    replies: list[Reply | None] = [None] * len(requests)

    async def send(index: int, method: str, path: str, body: Any) -> None:
        replies[index] = await call(app, method, path, body)

    await hold_actors(system, journal)
    async with trio.open_nursery() as clients:
        for index, (method, path, body) in enumerate(requests):
            clients.start_soon(send, index, method, path, body)
            await trio.testing.wait_all_tasks_blocked()
        journal.open_room()
    assert all(reply is not None for reply in replies)
    return replies  # type: ignore[return-value]


async def workers_named(app: ASGIApp, worker_id: int) -> list[str]:
    rows = (await call(app, "GET", "/workers")).body
    return [row["tenant_id"] for row in rows if row["worker_id"] == worker_id]


async def test_two_registrations_of_one_worker_in_two_scopes_leave_it_in_one(selector) -> None:
    app, system, journal = selector
    first, second = await interleaved(
        app, system, journal, ("POST", "/workers", worker(7, A)), ("POST", "/workers", worker(7, B))
    )
    assert (first.status, second.status) == (201, 201)
    assert await workers_named(app, 7) == ["b"]  # the later write moved it; it is never in both
    assert (await call(app, "DELETE", "/workers/7")).status == 200
    assert await workers_named(app, 7) == []


async def test_a_move_and_a_delete_racing_leave_the_worker_nowhere(selector) -> None:
    app, system, journal = selector
    await call(app, "POST", "/workers", worker(7, A))
    moved, deleted = await interleaved(
        app, system, journal, ("POST", "/workers", worker(7, B)), ("DELETE", "/workers/7", None)
    )
    assert (moved.status, deleted.status) == (201, 200)
    assert deleted.body["tenant_id"] == "b"  # the delete came second and removed the moved record
    assert await workers_named(app, 7) == []


async def test_one_reservation_id_booked_in_two_scopes_at_once_is_booked_once(selector) -> None:
    app, system, journal = selector
    first, second = await interleaved(
        app,
        system,
        journal,
        ("POST", "/select_and_reserve", {**A, **PROMPT, "reservation_id": "R"}),
        ("POST", "/select_and_reserve", {**B, **PROMPT, "reservation_id": "R"}),
    )
    assert (first.status, first.body["reservation_id"], first.body["tenant_id"]) == (200, "R", "a")
    assert (second.status, second.body) == (409, {"error": "selection R is already reserved or being reserved"})
    assert (await call(app, "DELETE", "/reservations/R")).status == 200
    assert (await call(app, "DELETE", "/reservations/R")).body == {"error": "reservation R not found"}
    loads = (await call(app, "GET", "/loads")).body
    assert [row["active_requests"] for partition in loads for row in partition["loads"]] == [0, 0]


async def test_an_explicit_reservation_and_a_selection_race_for_one_id(selector) -> None:
    app, system, journal = selector
    explicit = {**B, "reservation_id": "R", "worker_id": 11, "dp_rank": 0, "sequence_hashes": [5], "isl_tokens": 4}
    booked, refused = await interleaved(
        app,
        system,
        journal,
        ("POST", "/reservations", explicit),
        ("POST", "/select_and_reserve", {**A, **PROMPT, "selection_id": "R"}),
    )
    assert (booked.status, refused.status) == (201, 409)


async def test_a_reservation_id_is_unique_across_scopes(selector) -> None:
    app, _, _ = selector
    assert (await call(app, "POST", "/select_and_reserve", {**A, **PROMPT, "reservation_id": "R"})).status == 200
    again = await call(app, "POST", "/select_and_reserve", {**B, **PROMPT, "reservation_id": "R"})
    assert (again.status, again.body) == (409, {"error": "selection R is already reserved or being reserved"})
    explicit = {**B, "reservation_id": "R", "worker_id": 11, "dp_rank": 0, "sequence_hashes": [5], "isl_tokens": 4}
    assert (await call(app, "POST", "/reservations", explicit)).status == 409
    assert (await call(app, "POST", "/reservations/R/prefill_complete")).status == 200
    assert (await call(app, "DELETE", "/reservations/R")).status == 200
    assert (await call(app, "POST", "/reservations", explicit)).status == 201  # free again, anywhere
    loads = (await call(app, "GET", "/loads", query=b"tenant_id=b")).body
    assert loads[0]["loads"][0]["active_requests"] == 1


async def test_a_refused_booking_gives_its_claim_back(selector) -> None:
    app, _, _ = selector
    unknown_rank = {**A, "reservation_id": "R", "worker_id": 10, "dp_rank": 5, "sequence_hashes": [5], "isl_tokens": 4}
    assert (await call(app, "POST", "/reservations", unknown_rank)).status == 404
    assert (await call(app, "POST", "/select_and_reserve", {**B, **PROMPT, "reservation_id": "R"})).status == 200


async def test_reservations_dropped_with_their_worker_free_their_ids(selector) -> None:
    app, _, _ = selector
    assert (await call(app, "POST", "/select_and_reserve", {**A, **PROMPT, "reservation_id": "R"})).status == 200
    assert (await call(app, "DELETE", "/workers/10")).status == 200  # its ranks, and their bookings, go
    assert (await call(app, "DELETE", "/reservations/R")).status == 404
    assert (await call(app, "POST", "/select_and_reserve", {**B, **PROMPT, "reservation_id": "R"})).status == 200


async def test_lifecycle_calls_reach_the_scope_holding_the_reservation(selector) -> None:
    app, system, _ = selector
    assert (await call(app, "POST", "/select_and_reserve", {**B, **PROMPT, "reservation_id": "R"})).status == 200
    assert (await call(app, "POST", "/reservations/R/output_block", {})).status == 200
    state = system.state(ScopeKey("m", "b"))
    assert state is not None and state.slots.ranks[(11, 0)].outputs["R"] == (0, 1.0, 1)
