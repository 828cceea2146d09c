"""The routing policies through the in-process router (issue 9: each capability through the HTTP API and the
in-process API): disaggregated prefill/decode, session affinity, routing modes and queueing."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvrouter import BlockingRouter, Router, RouterConfig, RouterError

PROMPT = list(range(1, 18))  # 17 tokens: 5 blocks of 4
APPROXIMATE = RouterConfig(use_kv_events=False)


async def register_zones(router: Router) -> None:
    for worker_id, role, zone in ((1, "prefill", "a"), (2, "prefill", "b"), (3, "decode", "a"), (4, "decode", "b")):
        await router.register_worker(
            worker_id,
            endpoint=f"http://w{worker_id}",
            block_size=4,
            worker_role=role,
            topology_domains={"zone": zone},
            kv_transfer_domain="zone",
            kv_transfer_enforcement="required",
        )


async def active(router: Router) -> dict[int, int]:
    return {row["worker_id"]: row["active_requests"] for row in await router.get_potential_loads(PROMPT)}


async def test_disaggregated_selection_books_both_parts_in_one_zone() -> None:
    async with Router.open("llama", config=APPROXIMATE, seed=3) as router:
        await register_zones(router)
        answer = await router.select_disaggregated(PROMPT, "req-1")
        assert answer["mode"] == "disaggregated"
        prefill, decode = answer["prefill"], answer["decode"]
        assert (prefill["reservation_id"], decode["reservation_id"]) == ("req-1:prefill", "req-1:decode")
        zone = "a" if prefill["worker_id"] == 1 else "b"
        assert decode["worker_id"] == (3 if zone == "a" else 4)  # the required transfer domain
        assert answer["decode_constraints"]["required_taints"] == [f"dynamo.topology/zone={zone}"]
        assert await active(router) == {1: 0, 2: 0, 3: 0, 4: 0} | {prefill["worker_id"]: 1, decode["worker_id"]: 1}
        await router.mark_prefill_complete("req-1:prefill")
        await router.free("req-1:prefill")
        await router.free("req-1:decode")
        assert set((await active(router)).values()) == {0}

        with pytest.raises(RouterError) as pinned:
            await router.select_disaggregated(PROMPT, "req-2", pinned_worker={"worker_id": 3, "dp_rank": 0})
        assert pinned.value.status == 400 and "pinned_worker" in pinned.value.message
        with pytest.raises(TypeError, match="reservation_id"):
            await router.select_disaggregated(PROMPT, "req-2", reservation_id="other")

        await router.unregister_worker(1)
        await router.unregister_worker(2)
        fallback = await router.select_disaggregated(PROMPT, "req-3")  # no prefill worker: decode only
        assert (fallback["mode"], fallback["prefill"]) == ("decode_only", None)
        assert fallback["decode"]["reservation_id"] == "req-3:decode"


def test_disaggregated_selection_from_a_thread() -> None:
    with BlockingRouter("llama", config=APPROXIMATE, seed=3) as router:
        for worker_id, role in ((1, "prefill"), (2, "decode")):
            router.register_worker(worker_id, endpoint=f"http://w{worker_id}", block_size=4, worker_role=role)
        answer = router.select_disaggregated(PROMPT, "r")
        assert (answer["prefill"]["worker_id"], answer["decode"]["worker_id"]) == (1, 2)


async def test_session_affinity_pins_a_session_to_its_worker() -> None:
    config = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=600)
    async with Router.open("llama", config=config, seed=3) as router:
        for worker_id in (1, 2, 3):
            await router.register_worker(worker_id, endpoint=f"http://w{worker_id}", block_size=4)
        pinned, _, _ = await router.best_worker(PROMPT, request_id="t1", session_id="chat")
        for _ in range(3):  # the pinned worker is now the busiest: only the pin sends the session there
            assert (await router.best_worker([9, 9, 9, 9], session_id="chat"))[0] == pinned
            assert (await router.best_worker([9, 9, 9, 9], session_id="other"))[0] != pinned


async def test_routing_modes_per_request() -> None:
    async with Router.open("llama", config=APPROXIMATE, seed=3) as router:
        for worker_id in (1, 2, 3):
            await router.register_worker(worker_id, endpoint=f"http://w{worker_id}", block_size=4)
        cycle = [(await router.best_worker(PROMPT, router_mode="round_robin"))[0] for _ in range(6)]
        assert sorted(cycle[:3]) == [1, 2, 3] and cycle[3:] == cycle[:3]
        direct = await router.best_worker(PROMPT, router_mode="direct", pinned_worker={"worker_id": 2, "dp_rank": 0})
        assert direct[0] == 2
        with pytest.raises(RouterError) as unpinned:
            await router.best_worker(PROMPT, router_mode="direct")
        assert unpinned.value.status == 400
        await router.best_worker(PROMPT, request_id="busy-1", pinned_worker={"worker_id": 1, "dp_rank": 0})
        await router.best_worker(PROMPT, request_id="busy-3", pinned_worker={"worker_id": 3, "dp_rank": 0})
        assert (await router.best_worker(PROMPT, router_mode="least_loaded"))[0] == 2


async def test_a_booking_waits_in_the_queue_until_a_prefill_completes() -> None:
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0)
    async with Router.open("llama", config=config, seed=3) as router, trio.open_nursery() as nursery:
        await router.register_worker(1, endpoint="http://w1", block_size=4, max_num_batched_tokens=10)
        await router.best_worker(list(range(1, 13)), request_id="a")  # 12 prefill tokens > 1.0 x 10
        booked: list[tuple[int, int, int]] = []

        async def waiting() -> None:
            booked.append(await router.best_worker([50, 51, 52, 53], request_id="b"))

        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        assert booked == []  # queued, not refused
        await router.mark_prefill_complete("a")
        with trio.fail_after(10):
            while not booked:  # noqa: ASYNC110 - the router's own tasks answer it
                await trio.sleep(0.01)
        assert booked[0][0] == 1
