"""Overload, queueing, approximate mode, per-rank fallback and session affinity end to end: real hypercorn on
127.0.0.1 (and a real ZMQ publisher for the fallback)."""

from __future__ import annotations

import httpx
import pytest
import trio

import kvrouter.actors.core.waiting_room as waiting_room
from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from tests.conftest import start_select_service
from tests.support.kv_publisher import open_kv_publisher

APPROX = {"use_kv_events": False}


async def wait_for(predicate) -> None:
    with trio.fail_after(5):
        while not await predicate():  # noqa: ASYNC110 - polling over HTTP, no event to wait on
            await trio.sleep(0.02)


def worker(worker_id: int, **extra: object) -> dict:
    return {"worker_id": worker_id, "model_name": "m", "endpoint": f"http://w{worker_id}", "block_size": 4, **extra}


def prompt(first: int, tokens: int, **extra: object) -> dict:
    return {"model_name": "m", "token_ids": list(range(first, first + tokens)), **extra}


async def pending(http: httpx.AsyncClient) -> tuple[int, int]:
    (partition,) = (await http.get("/loads", params={"model_name": "m"})).json()
    return partition["pending_count"], partition["pending_isl_tokens"]


async def test_every_worker_busy_is_429_with_retry_after(nursery: trio.Nursery, tmp_path) -> None:
    config = RouterConfig(use_kv_events=False, active_prefill_tokens_threshold=10)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        for worker_id in (1, 2):
            await http.post("/workers", json=worker(worker_id))
        for n, name in enumerate(("a", "b")):
            assert (
                await http.post("/select_and_reserve", json=prompt(100 * n, 12, reservation_id=name))
            ).status_code == 200
        refused = await http.post("/select_and_reserve", json=prompt(900, 4, reservation_id="c"))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json() == {"error": "all 2 eligible workers are overloaded"}
        assert (await http.post("/select", json=prompt(900, 4))).status_code == 429
        await http.post("/reservations/a/prefill_complete")
        assert (await http.post("/select_and_reserve", json=prompt(900, 4, reservation_id="c"))).status_code == 200
    handle.stop()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["b", "c", "d"]), ("lcfs", ["d", "c", "b"]), ("wspt", ["c", "d", "b"])],
)
async def test_waiting_requests_are_admitted_in_policy_order(
    nursery: trio.Nursery, tmp_path, policy: str, expected: list[str]
) -> None:
    """One worker with a 10-token batch and queue threshold 1.0: every prompt here is over 10 tokens, so
    one request at a time runs its prefill and the others wait (1.6.1 shows the same pending counts)."""
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0, router_queue_policy=policy)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        incomplete = (await http.post("/workers", json=worker(1))).json()
        assert incomplete["not_schedulable_reasons"] == ["max_num_batched_tokens is required while queueing is enabled"]
        await http.post("/workers", json=worker(1, max_num_batched_tokens=10))
        assert (await http.post("/select_and_reserve", json=prompt(0, 12, reservation_id="a"))).status_code == 200
        admitted: list[str] = []

        async def book(name: str, first: int, tokens: int) -> None:
            response = await http.post("/select_and_reserve", json=prompt(first, tokens, reservation_id=name))
            assert response.status_code == 200, response.text
            admitted.append(name)

        sizes = {"b": 20, "c": 12, "d": 16}  # arrival order b, c, d; shortest first is c, d, b
        for count, name in enumerate(sizes, start=1):
            nursery.start_soon(book, name, 1000 * count, sizes[name])

            async def queued(count: int = count) -> bool:
                return (await pending(http))[0] == count

            await wait_for(queued)
        assert await pending(http) == (3, 48)
        running = "a"
        for step in range(3):
            await http.post(f"/reservations/{running}/prefill_complete")

            async def one_more(step: int = step) -> bool:
                return len(admitted) == step + 1

            await wait_for(one_more)
            running = admitted[-1]
            assert (await pending(http))[0] == 2 - step
        assert admitted == expected
        assert await pending(http) == (0, 0)
    handle.stop()


async def test_a_full_queue_refuses_with_429(nursery: trio.Nursery, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(waiting_room, "MAX_WAITING", 1)
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await http.post("/workers", json=worker(1, max_num_batched_tokens=10))
        await http.post("/select_and_reserve", json=prompt(0, 12, reservation_id="a"))

        async def book_b() -> None:
            await http.post("/select_and_reserve", json=prompt(100, 12, reservation_id="b"))

        nursery.start_soon(book_b)

        async def queued() -> bool:
            return (await pending(http))[0] == 1

        await wait_for(queued)
        refused = await http.post("/select", json=prompt(200, 12))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"].startswith("the request queue is full (1 requests")
        await http.delete("/reservations/a")

        async def drained() -> bool:
            return (await pending(http))[0] == 0

        await wait_for(drained)
        assert (await http.get("/loads")).json()[0]["loads"][0]["active_requests"] == 1  # b was admitted
    handle.stop()


async def test_session_affinity_pins_a_session_to_its_worker(nursery: trio.Nursery, tmp_path) -> None:
    config = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=60.0)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        for worker_id in (1, 2, 3, 4):
            await http.post("/workers", json=worker(worker_id))
        booked = (
            await http.post("/select_and_reserve", json=prompt(0, 8, session_id="chat", reservation_id="r"))
        ).json()
        chosen = {
            (await http.post("/select", json=prompt(100 * i, 8, session_id="chat"))).json()["worker_id"]
            for i in range(1, 13)
        }
        assert chosen == {booked["worker_id"]}
        context = {"session_context": {"session_id": "chat"}}
        assert (await http.post("/select", json=prompt(5000, 8, **context))).json()["worker_id"] == booked["worker_id"]
        others = {(await http.post("/select", json=prompt(100 * i, 8))).json()["worker_id"] for i in range(1, 13)}
        assert others - {booked["worker_id"]}  # without the session, the busy worker is avoided
        bad = await http.post("/select", json={**prompt(0, 4), "session_context": {}})
        assert bad.status_code == 422
    handle.stop()


async def test_workers_show_each_ranks_kv_mode_and_a_silent_stream_falls_back(nursery: trio.Nursery, tmp_path) -> None:
    """KV events on, stale after 0.3 s: a booking the worker does not answer with events makes its rank
    predicted (its bookings then count as cached); the next batch makes it exact again."""
    config = RouterConfig(kv_events_stale_secs=0.3)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http, open_kv_publisher() as publisher:
        body = worker(1, kv_events_endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        await http.post("/workers", json=body)

        async def mode() -> dict:
            (row,) = (await http.get("/workers")).json()
            return row["kv_modes"]["0"]

        async def exact() -> bool:
            (row,) = (await http.get("/workers")).json()
            return row["kv_listeners"]["0"]["state"] == "active" and (await mode())["mode"] == "exact"

        await wait_for(exact)
        await http.post("/select_and_reserve", json=prompt(0, 8, reservation_id="a"))

        async def predicted() -> bool:
            return (await mode())["mode"] == "predicted"

        await wait_for(predicted)
        assert (await mode())["reason"].startswith("no KV events for ")
        await http.post("/select_and_reserve", json=prompt(0, 8, reservation_id="b"))  # now a prediction
        scores = (await http.post("/overlap_scores", json=prompt(0, 12))).json()
        assert scores["workers"][0]["device_blocks"] == 2
        publisher.publish(encode_batch([["BlockStored", [7], None, [100, 101, 102, 103], 4, None, None]]))
        await wait_for(exact)
        scores = (await http.post("/overlap_scores", json=prompt(0, 12))).json()
        assert scores["workers"][0]["device_blocks"] == 0  # exact again: the events never stored that prompt
    handle.stop()


async def test_approximate_mode_shows_every_rank_predicted(nursery: trio.Nursery, tmp_path) -> None:
    handle = await start_select_service(nursery, tmp_path / "data", RouterConfig(**APPROX))
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await http.post("/workers", json=worker(1, data_parallel_size=2))
        (row,) = (await http.get("/workers")).json()
        assert row["kv_modes"] == {
            "0": {"mode": "predicted", "reason": "approximate mode"},
            "1": {"mode": "predicted", "reason": "approximate mode"},
        }
    handle.stop()
