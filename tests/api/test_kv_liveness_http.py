"""A worker whose KV-event stream stops while it has traffic leaves selection and comes back when its events resume:
real hypercorn on 127.0.0.1 and real ZMQ publishers (``actors/core/kv_liveness.py``)."""

from __future__ import annotations

import httpx
import trio

from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from tests.conftest import start_select_service
from tests.support.kv_publisher import free_tcp_port, open_kv_publisher

TIMEOUT_SECS = 0.5


async def wait_for(predicate) -> None:
    with trio.fail_after(20):  # a bound on a hang, not a figure under test
        while not await predicate():  # noqa: ASYNC110 - polling over HTTP, no event to wait on
            await trio.sleep(0.05)


def worker(worker_id: int, publisher) -> dict:
    return {
        "worker_id": worker_id,
        "model_name": "m",
        "endpoint": f"http://w{worker_id}",
        "block_size": 4,
        "kv_events_endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
    }


def prompt(first: int, **extra: object) -> dict:
    return {"model_name": "m", "token_ids": list(range(first, first + 8)), **extra}


async def rows(http: httpx.AsyncClient) -> dict[int, dict]:
    return {row["worker_id"]: row for row in (await http.get("/workers")).json()}


async def metric(http: httpx.AsyncClient, line_start: str) -> float:
    text = (await http.get("/metrics")).text
    (line,) = [line for line in text.splitlines() if line.startswith(line_start)]
    return float(line.rsplit(" ", 1)[1])


async def test_a_worker_whose_kv_events_stop_under_traffic_leaves_selection_and_comes_back(
    nursery: trio.Nursery, tmp_path
) -> None:
    config = RouterConfig(kv_events_timeout_secs=TIMEOUT_SECS)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    port, replay_port = free_tcp_port(), free_tcp_port()
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http, open_kv_publisher() as healthy:
        async with open_kv_publisher(port=port, replay_port=replay_port) as dying:
            await http.post("/workers", json=worker(1, dying))
            await http.post("/workers", json=worker(2, healthy))

            async def connected() -> bool:
                found = await rows(http)
                return all(found[w]["kv_listeners"]["0"]["state"] == "active" for w in (1, 2))

            await wait_for(connected)
            booked = {"model_name": "m", "reservation_id": "a", "worker_id": 1, "sequence_hashes": [1], "isl_tokens": 4}
            assert (await http.post("/reservations", json=booked)).status_code == 201
            assert "out_of_selection" not in (await rows(http))[1]
        # Worker 1's publisher is gone (a process exit) while its booking is unanswered.

        async def out() -> bool:
            return "out_of_selection" in (await rows(http))[1]

        await wait_for(out)
        shown = (await rows(http))[1]["out_of_selection"]["0"]
        assert shown["reason"] == "kv_events_stopped"
        assert shown["detail"].startswith("no KV events for ")
        assert shown["out_since"] >= shown["silent_since"]
        assert "out_of_selection" not in (await rows(http))[2]
        # Its booking was freed (a journaled release), and selections leave it out.
        assert (await http.delete("/reservations/a")).status_code == 404
        for first in range(0, 80, 8):
            chosen = (await http.post("/select", json=prompt(first))).json()
            assert chosen["worker_id"] == 2
        assert await metric(http, 'kvrouter_kv_stream_outages_total{reason="kv_events_stopped"}') == 1
        assert await metric(http, "kvrouter_ranks_out_of_selection") == 1

        # Its publisher is back on the same endpoint and publishes: worker 1 comes back.
        async with open_kv_publisher(port=port, replay_port=replay_port) as back:
            await back.wait_for_subscribers()
            back.publish(encode_batch([["BlockStored", [7], None, [100, 101, 102, 103], 4, None, None]]))

            async def returned() -> bool:
                return "out_of_selection" not in (await rows(http))[1]

            await wait_for(returned)
            chosen = {
                (await http.post("/select", json=prompt(first))).json()["worker_id"] for first in range(0, 400, 8)
            }
            assert chosen == {1, 2}
            assert await metric(http, "kvrouter_ranks_out_of_selection") == 0
            returns = await metric(http, 'kvrouter_kv_stream_returns_total{cause="kv_events_resumed"}')
            returns += await metric(http, 'kvrouter_kv_stream_returns_total{cause="kv_stream_reconnected"}')
            assert returns == 1
    handle.stop()


async def test_a_worker_without_a_kv_listener_is_never_taken_out(nursery: trio.Nursery, tmp_path) -> None:
    """Approximate mode (no KV listener attached): bookings nothing answers leave every worker in selection, as in
    1.6.1."""
    config = RouterConfig(use_kv_events=False, kv_events_timeout_secs=0.05)
    handle = await start_select_service(nursery, tmp_path / "data", config)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await http.post("/workers", json={"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4})
        booked = {"model_name": "m", "reservation_id": "a", "worker_id": 1, "sequence_hashes": [1], "isl_tokens": 4}
        assert (await http.post("/reservations", json=booked)).status_code == 201
        await trio.sleep(0.3)  # six timeouts: long enough for a check to have run, were there one
        assert "out_of_selection" not in (await rows(http))[1]
        assert (await http.delete("/reservations/a")).status_code == 200
    handle.stop()
