"""Reads never show a write a crash could take back, and wait for nothing else: a read of one scope waits
for that scope's last write to be durable, not for every write in the service. In process, under trio's
MockClock, with a journal whose durability the test releases by hand."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.main import select_service_builder, slot_tracker_app
from tests.support.asgi import ASGIApp, Reply, call, service_app
from tests.support.journals import GatedJournal

A = {"model_name": "m", "tenant_id": "a"}
B = {"model_name": "m", "tenant_id": "b"}


async def durable_call(app: ASGIApp, journal: GatedJournal, method: str, path: str, body: Any) -> Reply:
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


async def test_a_slot_tracker_read_waits_only_for_its_own_scope(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, slot_tracker_app, journal)
    register = {"worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert (await durable_call(app, journal, "POST", "/register", {**A, **register})).status == 201
    add_b = await pending(app, nursery, "POST", "/register", {**B, **register})  # journaled, not yet durable
    assert add_b == []
    with trio.fail_after(1):  # virtual time: it must answer without waiting for scope B
        read_a = await call(app, "POST", "/potential_loads", {**A, "sequence_hashes": [1, 2]})
    assert read_a.status == 200 and read_a.body[0]["potential_decode_blocks"] == 2
    read_all = await pending(app, nursery, "GET", "/loads")  # sees scope B: waits for its write
    assert read_all == []
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert add_b[0].status == 201 and [row["tenant_id"] for row in read_all[0].body] == ["a", "b"]


async def test_a_selection_waits_only_for_its_own_scope(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)), journal)
    for worker_id, scope in ((1, A), (2, B)):
        body = {"worker_id": worker_id, **scope, "endpoint": "http://w", "block_size": 4}
        assert (await durable_call(app, journal, "POST", "/workers", body)).status == 201
    prompt = {"token_ids": [1, 2, 3, 4, 5]}
    booking = await pending(app, nursery, "POST", "/select_and_reserve", {**B, **prompt, "reservation_id": "r"})
    assert booking == []
    with trio.fail_after(1):
        selected = await call(app, "POST", "/select", {**A, **prompt})
        scores = await call(app, "POST", "/overlap_scores", {**A, **prompt})
    assert (selected.status, selected.body["worker_id"], scores.status) == (200, 1, 200)
    in_b = await pending(app, nursery, "POST", "/select", {**B, **prompt})
    assert in_b == []  # scope B's booking is not durable yet
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert booking[0].status == 200 and in_b[0].status == 200
