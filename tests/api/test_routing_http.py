"""Routing modes, their knobs and disaggregated prefill/decode over HTTP, on a real server (approximate mode:
no ZMQ publishers; a booking makes its blocks a predicted cache hit on its rank)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from tests.conftest import start_select_service

BLOCK = 4
PROMPT = list(range(100, 132))  # 8 blocks
OTHER = list(range(500, 516))  # 4 blocks sharing nothing with PROMPT
APPROX = RouterConfig(use_kv_events=False)


def worker(worker_id: int, **fields: Any) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": "m",
        "endpoint": f"http://w{worker_id}",
        "block_size": BLOCK,
        **fields,
    }


def body(tokens: list[int] = PROMPT, **fields: Any) -> dict[str, Any]:
    return {"model_name": "m", "token_ids": tokens, **fields}


@pytest.fixture
async def http(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    handle = await start_select_service(nursery, tmp_path / "data", APPROX)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as client:
        yield client
    handle.stop()


async def workers(http: httpx.AsyncClient, *records: dict[str, Any]) -> None:
    for record in records:
        assert (await http.post("/workers", json=record)).status_code == 201


async def pick(http: httpx.AsyncClient, route: str = "/select", **fields: Any) -> int:
    response = await http.post(route, json=body(**fields))
    assert response.status_code == 200, response.text
    return int(response.json()["worker_id"])


async def loads(http: httpx.AsyncClient) -> dict[int, tuple[int, int, int]]:
    (partition,) = (await http.get("/loads")).json()
    return {
        row["worker_id"]: (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"])
        for row in partition["loads"]
    }


async def test_round_robin_and_random_per_request(http: httpx.AsyncClient) -> None:
    await workers(http, worker(1), worker(2), worker(3))
    cycle = [await pick(http, router_mode="round_robin") for _ in range(6)]
    assert cycle == [1, 2, 3, 1, 2, 3]
    # bookings in round-robin mode (written with Dynamo's dash) continue the same cycle, whatever the cache says
    booked = [await pick(http, "/select_and_reserve", router_mode="round-robin") for _ in range(4)]
    assert booked == [1, 2, 3, 1]
    assert {await pick(http, router_mode="random") for _ in range(30)} == {1, 2, 3}  # seeded, every one reached
    assert {w: row[2] for w, row in (await loads(http)).items()} == {1: 2, 2: 1, 3: 1}  # active requests


async def test_a_service_wide_router_mode(nursery: trio.Nursery, tmp_path: Path) -> None:
    handle = await start_select_service(
        nursery, tmp_path / "data", RouterConfig(use_kv_events=False, router_mode="round_robin")
    )
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await workers(http, worker(1), worker(2))
        assert [await pick(http) for _ in range(4)] == [1, 2, 1, 2]
        # a request's own mode wins over the service's: kv, and both workers are idle and cold (a draw)
        assert await pick(http, router_mode="direct", pinned_worker={"worker_id": 2, "dp_rank": 0}) == 2
    handle.stop()


async def test_least_loaded_takes_the_worker_with_fewest_requests(http: httpx.AsyncClient) -> None:
    await workers(http, worker(1), worker(2))
    for reservation_id in ("a", "b"):
        pinned = {"pinned_worker": {"worker_id": 1, "dp_rank": 0}}
        assert (
            await http.post("/select_and_reserve", json=body(OTHER, reservation_id=reservation_id, **pinned))
        ).json()
    assert {await pick(http, router_mode="least_loaded") for _ in range(8)} == {2}
    # kv would take worker 1 for OTHER (its 4 blocks are cached there): the modes really differ
    assert {await pick(http, tokens=OTHER, router_mode="kv") for _ in range(4)} == {1}


async def test_direct_mode_needs_an_eligible_pin(http: httpx.AsyncClient) -> None:
    await workers(http, worker(1, taints=["gpu"]), worker(2))
    refused = await http.post("/select", json=body(router_mode="direct"))
    assert (refused.status_code, refused.json()) == (
        400,
        {"error": "router_mode direct needs pinned_worker {worker_id, dp_rank}"},
    )
    assert await pick(http, router_mode="direct", pinned_worker={"worker_id": 2, "dp_rank": 0}) == 2
    constrained = await http.post(
        "/select",
        json=body(
            router_mode="direct",
            pinned_worker={"worker_id": 2, "dp_rank": 0},
            routing_constraints={"required_taints": ["gpu"]},
        ),
    )
    assert constrained.status_code == 503 and "[gpu]" in constrained.json()["error"]
    unknown = await http.post("/select", json=body(router_mode="fastest"))
    assert unknown.status_code == 422
    assert "router_mode: unknown variant `fastest`" in unknown.json()["error"]


async def test_overlap_score_weight_zero_balances_load_only(http: httpx.AsyncClient) -> None:
    """Worker 1 has PROMPT cached (a finished booking) and 4 active blocks of another prompt; worker 2 is idle
    and cold. kv: 1 costs 32/4 - 8 + 4 + 8 = 12 against 16; weight 0: 12 against 8."""
    await workers(http, worker(1), worker(2))
    on_1 = {"pinned_worker": {"worker_id": 1, "dp_rank": 0}}
    await http.post("/select_and_reserve", json=body(reservation_id="warm", **on_1))
    await http.delete("/reservations/warm")
    await http.post("/select_and_reserve", json=body(OTHER, reservation_id="busy", **on_1))
    await http.post("/reservations/busy/prefill_complete")
    assert await pick(http) == 1
    assert await pick(http, router_config_override={"overlap_score_weight": 0}) == 2


async def test_active_block_tracking_off_books_prefill_only(http: httpx.AsyncClient) -> None:
    await workers(http, worker(1))
    override = {"track_active_blocks": False}
    response = await http.post("/select_and_reserve", json=body(reservation_id="p", router_config_override=override))
    assert response.json()["potential_decode_blocks"] == 0
    assert (await loads(http))[1] == (32, 0, 1)  # prefill tokens, no decode blocks
    both = await http.post(
        "/select", json=body(router_config_override={"track_active_blocks": False, "track_output_blocks": True})
    )
    assert (both.status_code, both.json()) == (
        400,
        {"error": "router_config_override: output-block tracking requires active-block tracking"},
    )


async def test_output_block_tracking_decays_by_the_expected_output(nursery: trio.Nursery, tmp_path: Path) -> None:
    handle = await start_select_service(nursery, tmp_path / "data", RouterConfig(use_kv_events=False))
    tracked = await start_select_service(
        nursery, tmp_path / "tracked", RouterConfig(use_kv_events=False, router_track_output_blocks=True)
    )
    seen = []
    for service in (handle, tracked):
        async with httpx.AsyncClient(base_url=service.urls[0], timeout=10) as http:
            await workers(http, worker(1))
            booked = body(PROMPT[:8], reservation_id="r", expected_output_tokens=8)
            assert (await http.post("/select_and_reserve", json=booked)).status_code == 200
            for _ in range(3):
                assert (await http.post("/reservations/r/output_block", json={})).status_code == 200
            seen.append((await loads(http))[1][1])
        service.stop()
    # untracked: 2 prompt blocks + 3 output blocks; tracked: the third block starts at token 9 of 8 expected,
    # so every block of the request (the prompt's own tail too) weighs max(0, 1 - 9/8) = 0
    assert seen == [5, 0]


# -- disaggregated prefill/decode -----------------------------------------------------------------------


def cluster(policy: str = "required", **extra: Any) -> list[dict[str, Any]]:
    transfer = {"kv_transfer_domain": "zone", "kv_transfer_enforcement": policy, **extra}
    return [
        worker(1, worker_role="prefill", topology_domains={"zone": "a"}, **transfer),
        worker(2, worker_role="prefill", topology_domains={"zone": "b"}, **transfer),
        worker(3, worker_role="decode", topology_domains={"zone": "a"}),
        worker(4, worker_role="decode", topology_domains={"zone": "b"}),
    ]


async def test_disaggregated_selection_books_both_parts_with_their_own_lifecycle(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    async with trio.open_nursery() as inner:
        handle = await start_select_service(inner, data, APPROX)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            await workers(http, *cluster())
            response = await http.post("/select_disaggregated", json=body(reservation_id="r", expected_output_tokens=4))
            assert response.status_code == 200, response.text
            chosen = response.json()
            prefill, decode = chosen["prefill"], chosen["decode"]
            assert chosen["mode"] == "disaggregated" and chosen["reservation_id"] == "r"
            assert (prefill["reservation_id"], decode["reservation_id"]) == ("r:prefill", "r:decode")
            zone = {1: "a", 2: "b"}[prefill["worker_id"]]
            assert decode["worker_id"] == {"a": 3, "b": 4}[zone]  # required: the prefill worker's zone
            assert chosen["decode_constraints"] == {
                "required_taints": [f"dynamo.topology/zone={zone}"],
                "preferred_taints": {},
            }
            assert (prefill["effective_prefill_tokens"], decode["effective_prefill_tokens"]) == (32, 0)
            assert (prefill["potential_decode_blocks"], decode["potential_decode_blocks"]) == (0, 8)
            booked = await loads(http)
            assert booked[prefill["worker_id"]] == (32, 0, 1)  # prefill tokens, no decode blocks
            assert booked[decode["worker_id"]] == (0, 8, 1)  # decode blocks, no prefill tokens
            again = await http.post("/select_disaggregated", json=body(reservation_id="r"))
            assert (again.status_code, again.json()) == (
                409,
                {"error": "selection r:prefill is already reserved or being reserved"},
            )
        handle.stop()

    async with trio.open_nursery() as inner:  # both parts were journaled together and come back together
        handle = await start_select_service(inner, data, APPROX)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            assert await loads(http) == booked
            assert (await http.post("/reservations/r:prefill/prefill_complete")).status_code == 200
            assert (await http.delete("/reservations/r:prefill")).status_code == 200
            assert (await http.post("/reservations/r:decode/output_block", json={})).status_code == 200
            after = await loads(http)
            assert after[prefill["worker_id"]] == (0, 0, 0)
            assert after[decode["worker_id"]] == (0, 9, 1)
            assert (await http.delete("/reservations/r:decode")).status_code == 200
            assert (await http.delete("/reservations/r:decode")).status_code == 404
        handle.stop()


async def test_required_transfer_domain_fails_closed_before_booking(http: httpx.AsyncClient) -> None:
    records = cluster()
    records[2] = worker(3, worker_role="decode", topology_domains={"zone": "c"})
    records[3] = worker(4, worker_role="decode", topology_domains={"zone": "c"})
    await workers(http, *records)
    response = await http.post("/select_disaggregated", json=body(reservation_id="r"))
    assert response.status_code == 503
    assert "no eligible decode worker carries [dynamo.topology/zone=" in response.json()["error"]
    assert set((await loads(http)).values()) == {(0, 0, 0)}  # nothing booked, not even the prefill part
    assert (await http.delete("/reservations/r:prefill")).status_code == 404


async def test_preferred_transfer_domain_and_decode_only_fallback(http: httpx.AsyncClient) -> None:
    await workers(http, *cluster("preferred", kv_transfer_preferred_weight=1.0))
    response = (await http.post("/select_disaggregated", json=body(reservation_id="p"))).json()
    zone = {1: "a", 2: "b"}[response["prefill"]["worker_id"]]
    assert response["decode_constraints"] == {
        "required_taints": [],
        "preferred_taints": {f"dynamo.topology/zone={zone}": 1.0},
    }
    assert response["decode"]["worker_id"] == {"a": 3, "b": 4}[zone]  # idle decode workers: the preference decides
    # no prefill worker left: decode only, one booking that prefills on the decode worker
    for worker_id in (1, 2):
        await http.delete(f"/workers/{worker_id}")
    fallback = await http.post("/select_disaggregated", json=body(OTHER, reservation_id="f"))
    chosen = fallback.json()
    assert (fallback.status_code, chosen["mode"], chosen["prefill"]) == (200, "decode_only", None)
    assert chosen["fallback_reason"] == "no schedulable worker can prefill (worker_role prefill or both)"
    assert (await loads(http))[chosen["decode"]["worker_id"]][0] == 16  # its prefill tokens are on the decode worker
    pinned = await http.post("/select_disaggregated", json=body(pinned_worker={"worker_id": 3, "dp_rank": 0}))
    assert pinned.status_code == 400


async def test_aggregated_selections_never_take_a_prefill_only_worker(http: httpx.AsyncClient) -> None:
    await workers(http, *cluster())
    assert {await pick(http, router_mode="random") for _ in range(20)} == {3, 4}
