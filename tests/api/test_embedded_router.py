"""The in-process router from trio: the selection service's calls as methods, the HTTP API's errors as
``RouterError``, journaled bookings across a restart, and the same answers as the HTTP service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from kvrouter import (
    IN_PROCESS_KV_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Router,
    RouterConfig,
    RouterError,
)
from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.selection import NO_SCHEDULABLE_WORKERS_ANYWHERE
from kvrouter.actors.snapshotter import SnapshotMethod
from kvrouter.api.process import data_dir as data_dirs
from kvrouter.journal.store import DataDirectoryInUse
from tests.conftest import start_select_service
from tests.support.kv_publisher import open_kv_publisher

BLOCK = 4
PROMPT = list(range(1, 17))  # 4 blocks of 4


def in_process_worker(worker_id: int, **extra: Any) -> dict[str, Any]:
    return {
        "endpoint": f"http://w{worker_id}",
        "block_size": BLOCK,
        "kv_events_endpoint": IN_PROCESS_KV_EVENTS,
        **extra,
    }


def cached(tokens: list[int], first_hash: int, parent: int | None = None) -> BlockStored:
    """``tokens`` (whole blocks) stored on a worker under engine hashes first_hash, first_hash + 1, ..."""
    hashes = tuple(range(first_hash, first_hash + len(tokens) // BLOCK))
    return BlockStored(hashes, parent, tuple(tokens), BLOCK)


async def test_the_request_lifecycle_moves_the_loads_as_the_service_does() -> None:
    async with Router.open("llama", seed=1) as router:
        for worker_id in (1, 2):
            shown = await router.register_worker(worker_id, **in_process_worker(worker_id))
            assert shown["lifecycle"] == "schedulable" and "kv_listeners" not in shown  # nothing listens
        # Worker 2 holds the first three blocks (a raw engine payload here, objects below).
        await router.apply_kv_events(2, encode_batch([cached(PROMPT[:12], 100)]), seq=0)
        assert await router.best_worker(PROMPT) == (2, 0, 3)
        assert [row["active_requests"] for row in await router.get_potential_loads(PROMPT)] == [0, 0]

        assert await router.best_worker(PROMPT, request_id="r1") == (2, 0, 3)
        booked = {row["worker_id"]: row for row in await router.get_potential_loads(PROMPT)}
        assert booked[2]["active_requests"] == 1
        assert booked[2]["potential_prefill_tokens"] == 4 + 4  # r1's uncached block + this prompt's
        await router.mark_prefill_complete("r1")
        assert {row["worker_id"]: row for row in await router.get_potential_loads(PROMPT)}[2][
            "potential_prefill_tokens"
        ] == 4
        await router.free("r1")
        assert [row["active_requests"] for row in await router.get_potential_loads(PROMPT)] == [0, 0]

        # Removing the blocks (objects this time) sends the prompt back to a load-only choice.
        await router.apply_kv_events(2, [BlockRemoved((100, 101, 102))])
        assert (await router.best_worker(PROMPT))[2] == 0
        await router.apply_kv_events(1, [cached(PROMPT, 200)])
        assert await router.best_worker(PROMPT) == (1, 0, 4)
        await router.apply_kv_events(1, [AllBlocksCleared()])
        assert (await router.best_worker(PROMPT))[2] == 0
        assert blocks_in(orjson.loads(await router.dump_events())) == 0


async def test_refusals_carry_the_http_status_and_text() -> None:
    async with Router.open("llama", seed=1) as router:
        with pytest.raises(RouterError) as none:
            await router.best_worker(PROMPT)
        assert (none.value.status, str(none.value)) == (503, NO_SCHEDULABLE_WORKERS_ANYWHERE)
        await router.register_worker(1, **in_process_worker(1))

        with pytest.raises(RouterError) as bad_token:
            await router.best_worker([1, -1])
        assert bad_token.value.status == 422
        assert bad_token.value.message.endswith("token_ids[1]: invalid value: integer `-1`, expected u32")
        with pytest.raises(RouterError) as bad_override:
            await router.best_worker(PROMPT, {"router_temperature": -1.0})
        assert bad_override.value.status == 422 and "router_temperature" in bad_override.value.message

        await router.best_worker(PROMPT, request_id="r1")
        with pytest.raises(RouterError) as twice:
            await router.best_worker(PROMPT, request_id="r1")
        assert twice.value.status == 409
        await router.free("r1")
        with pytest.raises(RouterError) as gone:
            await router.free("r1")
        assert (gone.value.status, gone.value.message) == (404, "reservation r1 not found")
        with pytest.raises(RouterError) as unknown:
            await router.mark_prefill_complete("nope")
        assert (unknown.value.status, unknown.value.message) == (404, "reservation nope not found")

        with pytest.raises(RouterError) as no_worker:
            await router.apply_kv_events(7, [cached(PROMPT, 1)])
        assert (no_worker.value.status, no_worker.value.message) == (404, "worker 7 not found")
        with pytest.raises(RouterError) as no_rank:
            await router.apply_kv_events(1, [cached(PROMPT, 1)], dp_rank=3)
        assert no_rank.value.status == 404 and "dp_rank 3" in no_rank.value.message
        with pytest.raises(RouterError) as garbage:
            await router.apply_kv_events(1, b"\xc1 not msgpack")
        assert garbage.value.status == 400 and garbage.value.message.startswith("not a KV-event batch: ")

        with pytest.raises(RouterError) as bad_worker:
            await router.register_worker(2, block_size=-4)
        assert bad_worker.value.status == 422 and "block_size" in bad_worker.value.message
        with pytest.raises(TypeError, match="model_name is set by the router"):
            await router.register_worker(2, model_name="other")
        assert (await router.unregister_worker(1))["lifecycle"] == "unschedulable"
        with pytest.raises(RouterError) as twice_removed:
            await router.unregister_worker(1)
        assert (twice_removed.value.status, twice_removed.value.message) == (404, "worker 1 not found")


async def test_an_error_of_the_callers_block_comes_out_as_itself() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with Router.open():
            raise KeyError("mine")


async def test_a_journaled_router_keeps_bookings_and_the_index_across_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "router"
    async with Router.open("llama", data_dir=data, seed=1) as router:
        await router.register_worker(1, **in_process_worker(1))
        await router.register_worker(2, **in_process_worker(2))
        await router.apply_kv_events(1, [cached(PROMPT, 300)])
        assert await router.best_worker(PROMPT, request_id="kept") == (1, 0, 4)
        # Snapshots never fork (the host process has other threads); a restart reads snapshot + tail.
        assert (await router.service.system.snapshot()).method is SnapshotMethod.THREAD
        second, _, _ = await router.best_worker(PROMPT, request_id="after-snapshot")
        with pytest.raises(DataDirectoryInUse):
            async with Router.open("llama", data_dir=data):
                pass
    async with Router.open("llama", data_dir=data, seed=1) as restarted:
        assert [w["worker_id"] for w in await restarted.workers()] == [1, 2]
        rows = {row["worker_id"]: row["active_requests"] for row in await restarted.get_potential_loads(PROMPT)}
        assert rows == {1: 1 + (second == 1), 2: int(second == 2)}
        assert await restarted.best_worker(PROMPT, {"overlap_score_weight": 5.0}) == (1, 0, 4)  # the index too
        await restarted.mark_prefill_complete("kept")
        await restarted.free("kept")
        await restarted.free("after-snapshot")
    async with Router.open("llama", data_dir=data, fresh=True) as fresh:
        assert await fresh.workers() == []
    # The directory is a selection service's (the service could take it over); a slot tracker's is refused.
    assert data_dirs.owner(data) == data_dirs.SELECTION_SERVICE
    slot_tracker = tmp_path / "slot-tracker"
    slot_tracker.mkdir()
    data_dirs.claim(slot_tracker, data_dirs.SLOT_TRACKER, ())
    with pytest.raises(data_dirs.DataDirectoryOwned, match="belongs to the slot tracker"):
        async with Router.open("llama", data_dir=slot_tracker):
            pass


async def test_an_in_memory_router_starts_empty_every_time() -> None:
    async with Router.open("llama") as router:
        await router.register_worker(1, **in_process_worker(1))
    async with Router.open("llama") as router:
        assert await router.workers() == []


# -- the same answers as the HTTP service ------------------------------------------------------------------


async def wait_until(condition: Any) -> None:
    with trio.fail_after(10):
        while not await condition():  # noqa: ASYNC110 - both routers index in other tasks
            await trio.sleep(0.02)


def blocks_in(dump: dict[str, Any]) -> int:
    return sum(len(event["event"]["data"]["stored"]["blocks"]) for scope in dump.values() for event in scope["events"])


async def test_answers_equal_the_http_services_for_the_same_state(nursery: trio.Nursery, tmp_path: Path) -> None:
    """One selection service over HTTP and one embedded router, same seed, both subscribed to the same
    engines' ZMQ KV-event streams: every selection, potential load, booking and dump is the same."""
    config = RouterConfig()
    handle = await start_select_service(nursery, tmp_path / "http", config, seed=11)
    a, b = list(range(100, 116)), list(range(200, 216))
    async with (
        httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http,
        Router.open("m", config=config, seed=11) as router,
        open_kv_publisher() as one,
        open_kv_publisher() as two,
        open_kv_publisher() as three,
    ):
        for worker_id, publisher in ((1, one), (2, two), (3, three)):
            fields = {
                "endpoint": f"http://w{worker_id}",
                "block_size": BLOCK,
                "kv_events_endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
            }
            assert (await http.post("/workers", json={"worker_id": worker_id, "model_name": "m", **fields})).is_success
            assert (await router.register_worker(worker_id, **fields))["lifecycle"] == "schedulable"
        one.publish(encode_batch([cached(a[:12], 10)]))
        two.publish(encode_batch([cached(a[:4], 20), cached(b[:8], 30)]))
        three.publish(encode_batch([cached(b[:4], 40)]))

        async def all_indexed() -> bool:
            over_http = (await http.get("/dump")).json()
            embedded = orjson.loads(await router.dump_events())
            return blocks_in(over_http) == blocks_in(embedded) == 3 + 1 + 2 + 1

        await wait_until(all_indexed)
        assert orjson.loads(await router.dump_events()) == (await http.get("/dump")).json()

        prompts = [a, b, a[:8], b[:4] + a[4:], list(range(900, 913))]
        overrides = [None, {"router_temperature": 0.7}, {"overlap_score_weight": 0.0}]
        for round_ in range(3):
            for prompt in prompts:
                for override in overrides:
                    body: dict[str, Any] = {"model_name": "m", "token_ids": prompt}
                    if override is not None:
                        body["router_config_override"] = override
                    chosen = (await http.post("/select", json=body)).json()
                    blocks = chosen["overlap"]["dp"][str(chosen["dp_rank"])] // chosen["block_size"]
                    assert await router.best_worker(prompt, override) == (
                        chosen["worker_id"],
                        chosen["dp_rank"],
                        blocks,
                    )
                    loads = (await http.post("/potential_loads", json=body)).json()
                    assert await router.get_potential_loads(prompt, override) == loads
            # Book the same requests on both: the loads they then report stay equal.
            request_id = f"r{round_}"
            booked = (await http.post("/select_and_reserve", json={**body, "reservation_id": request_id})).json()
            blocks = booked["overlap"]["dp"][str(booked["dp_rank"])] // booked["block_size"]
            assert await router.best_worker(prompt, override, request_id) == (
                booked["worker_id"],
                booked["dp_rank"],
                blocks,
            )
        await http.post("/reservations/r0/prefill_complete")
        await router.mark_prefill_complete("r0")
        await http.delete("/reservations/r1")
        await router.free("r1")
        for prompt in prompts:
            body = {"model_name": "m", "token_ids": prompt}
            assert await router.get_potential_loads(prompt) == (await http.post("/potential_loads", json=body)).json()
        # The embedded router's listeners are the service's own (state, sequence watermark, counters).
        listeners = {w["worker_id"]: w["kv_listeners"]["0"] for w in await router.workers()}
        assert {w: (s["state"], s["last_seq"]) for w, s in listeners.items()} == {w: ("active", 0) for w in (1, 2, 3)}
    handle.stop()


async def test_overload_is_429_with_retry_after_and_the_selection_fields_pass_through() -> None:
    config = RouterConfig(use_kv_events=False, active_prefill_tokens_threshold=10)
    async with Router.open("llama", config=config, seed=1) as router:
        await router.register_worker(1, endpoint="http://w1", block_size=BLOCK, taints=["gpu=a100"])
        await router.register_worker(2, endpoint="http://w2", block_size=BLOCK)
        # The fields of a /select body beyond the prompt: constraints, allowed workers, routing mode.
        assert (await router.best_worker(PROMPT, routing_constraints={"required_taints": ["gpu=a100"]}))[0] == 1
        assert (await router.best_worker(PROMPT, allowed_worker_ids=[2]))[0] == 2
        with pytest.raises(RouterError) as unknown_mode:
            await router.best_worker(PROMPT, router_mode="fastest")
        assert unknown_mode.value.status == 422 and "router_mode" in unknown_mode.value.message
        with pytest.raises(TypeError, match="reservation_id"):
            await router.best_worker(PROMPT, reservation_id="r")

        await router.best_worker(list(range(100, 112)), request_id="a")
        await router.best_worker(list(range(200, 212)), request_id="b")
        with pytest.raises(RouterError) as busy:
            await router.best_worker(PROMPT[:4], request_id="c")
        assert (busy.value.status, busy.value.message) == (429, "all 2 eligible workers are overloaded")
        assert busy.value.retry_after == 1.0
        await router.mark_prefill_complete("a")
        await router.best_worker(PROMPT[:4], request_id="c")
