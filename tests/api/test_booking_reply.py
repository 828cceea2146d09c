"""A booking answers where it went from its own decision, not from a read of the scope afterwards: the state
may have moved on by the time the booking is durable (here, the reservation is released, or its worker removed,
meanwhile)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import select_service_builder
from tests.support.asgi import ASGIApp, Reply, call, service_app
from tests.support.journals import GatedJournal

A = {"model_name": "m", "tenant_id": "a"}
PROMPT = list(range(8))


async def durable_call(app: ASGIApp, journal: GatedJournal, method: str, path: str, body: Any = None) -> Reply:
    async with trio.open_nursery() as nursery:
        replies = []

        async def send() -> None:
            replies.append(await call(app, method, path, body))

        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        journal.release()
    return replies[0]


async def pending(app: ASGIApp, nursery: trio.Nursery, method: str, path: str, body: Any = None) -> list[Reply]:
    """Start a request and run it until it blocks; its reply lands in the returned list."""
    replies: list[Reply] = []

    async def send() -> None:
        replies.append(await call(app, method, path, body))

    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked()
    return replies


async def booked_then_undone(nursery: trio.Nursery, body: dict[str, Any], undo: str) -> Reply:
    """Book with ``body`` (journaled, not yet durable), ``DELETE undo`` before that is durable, answer both."""
    journal = GatedJournal()
    app, _ = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)), journal)
    worker = {"worker_id": 7, **A, "endpoint": "http://w7", "block_size": 4}
    assert (await durable_call(app, journal, "POST", "/workers", worker)).status == 201
    selected = await durable_call(app, journal, "POST", "/select", {**A, "token_ids": PROMPT, "selection_id": "s"})
    assert selected.status == 200
    booked = await pending(app, nursery, "POST", "/reservations", {**A, **body})
    assert booked == []  # applied, waiting for its record to be durable
    undone = await pending(app, nursery, "DELETE", undo)
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert undone[0].status == 200
    return booked[0]


async def test_a_replayed_selection_says_where_it_was_booked_though_released_before_the_answer(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    booked = await booked_then_undone(nursery, {"selection_id": "s"}, "/reservations/s")
    assert booked.status == 201
    assert (booked.body["worker_id"], booked.body["dp_rank"], booked.body["endpoint"]) == (7, 0, "http://w7")


async def test_an_explicit_booking_says_its_endpoint_though_its_worker_left_before_the_answer(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    body = {"reservation_id": "s", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [1, 2], "isl_tokens": 8}
    booked = await booked_then_undone(nursery, body, "/workers/7")
    assert booked.status == 201
    assert (booked.body["worker_id"], booked.body["dp_rank"], booked.body["endpoint"]) == (7, 0, "http://w7")
