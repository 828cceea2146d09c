"""A write that changes nothing (a repeated free, a booking that "already exists") is answered from the scope's
state, which may hold a write not yet durable: it waits for that write, as a read does, so it never acknowledges
what a failed journal would take back. (Found by the fault runs on real processes: a free whose append hung was
retried, the retry was answered 200 at once from the state holding the first free, and the first append then
failed: an acknowledged free lost.) In process, under trio's MockClock, with a journal whose durability the test
releases by hand."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import select_service_builder, slot_tracker_app
from tests.support.asgi import ASGIApp, Reply, call, service_app
from tests.support.journals import GatedJournal

SCOPE = {"model_name": "m"}
REGISTER = {**SCOPE, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}


def add(request_id: str) -> dict[str, Any]:
    return {**SCOPE, "request_id": request_id, "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2]} | {
        "new_isl_tokens": 32
    }


async def pending(app: ASGIApp, nursery: trio.Nursery, method: str, path: str, body: Any = None) -> list[Reply]:
    """Start a request and run it until it blocks; its reply lands in the returned list."""
    replies: list[Reply] = []

    async def send() -> None:
        replies.append(await call(app, method, path, body))

    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked()
    return replies


async def durable(app: ASGIApp, nursery: trio.Nursery, journal: GatedJournal, path: str, body: Any) -> int:
    reply = await pending(app, nursery, "POST", path, body)
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    return reply[0].status


async def test_a_repeated_free_and_a_repeated_booking_wait_for_the_first_to_be_durable(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, slot_tracker_app, journal)
    assert await durable(app, nursery, journal, "/register", REGISTER) == 201
    assert await durable(app, nursery, journal, "/add", add("r1")) == 201
    first_free = await pending(app, nursery, "POST", "/free", {**SCOPE, "request_id": "r1"})
    first_add = await pending(app, nursery, "POST", "/add", add("r2"))
    assert first_free == [] and first_add == []  # journaled, not yet durable
    free_again = await pending(app, nursery, "POST", "/free", {**SCOPE, "request_id": "r1"})
    add_again = await pending(app, nursery, "POST", "/add", add("r2"))
    assert free_again == [] and add_again == []  # they saw r1 freed and r2 booked: neither is durable yet
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert [first_free[0].status, first_add[0].status, free_again[0].status] == [200, 201, 200]
    assert add_again[0].status == 409 and "already" in str(add_again[0].body)


async def test_a_repeated_free_of_a_durable_free_is_answered_at_once(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, slot_tracker_app, journal)
    assert await durable(app, nursery, journal, "/register", REGISTER) == 201
    assert await durable(app, nursery, journal, "/add", add("r1")) == 201
    assert await durable(app, nursery, journal, "/free", {**SCOPE, "request_id": "r1"}) == 200
    with trio.fail_after(1):  # virtual time: nothing to wait for
        again = await call(app, "POST", "/free", {**SCOPE, "request_id": "r1"})
    assert again.status == 200


async def test_a_catalog_refusal_waits_for_the_removal_it_saw_to_be_durable(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    """The selection service's catalog: a PATCH answered 404 because of a removal still on its way to the journal
    waits for that removal, as a write that changes nothing does."""
    journal = GatedJournal()
    app, _ = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)), journal)
    worker = {"worker_id": 5, "model_name": "m", "endpoint": "http://w5", "block_size": 16}
    assert await durable(app, nursery, journal, "/workers", worker) == 201
    removal = await pending(app, nursery, "DELETE", "/workers/5")
    patch = await pending(app, nursery, "PATCH", "/workers/5", {"endpoint": "http://w6"})
    assert removal == [] and patch == []  # the 404 is not given before the removal is durable
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert (removal[0].status, patch[0].status) == (200, 404)
