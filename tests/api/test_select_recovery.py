"""The selection service keeps catalog, index and reservations across restarts, resumes each KV
stream after its journaled watermark (filling the gap by replay), and can seed its index from a
peer's /dump."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service
from kvrouter.api.process.main import select_service_builder as builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.conftest import start_select_service
from tests.support.kv_publisher import open_kv_publisher

BLOCK = 4
TOKENS = list(range(100, 132))  # 8 blocks


def store(hashes: list[int], tokens: list[int], parent: int | None = None) -> bytes:
    return encode_batch([["BlockStored", hashes, parent, tokens, BLOCK, None, None]])


async def observed(url: str) -> tuple:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        workers = (await http.get("/workers")).json()
        for row in workers:
            row.pop("kv_listeners", None)
        loads = (await http.get("/loads")).json()
        scores = (await http.post("/overlap_scores", json={"model_name": "m", "token_ids": TOKENS})).json()
        return workers, loads, scores


async def device_blocks(url: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        scores = (await http.post("/overlap_scores", json={"model_name": "m", "token_ids": TOKENS})).json()
        return max((w["device_blocks"] for w in scores["workers"]), default=0)


async def wait_blocks(url: str, expected: int) -> None:
    with trio.fail_after(10):
        while await device_blocks(url) != expected:  # noqa: ASYNC110 - polled over HTTP
            await trio.sleep(0.02)


async def test_restart_recovers_state_and_fills_the_stream_gap(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_kv_publisher() as publisher:
        worker = {
            "worker_id": 5,
            "model_name": "m",
            "endpoint": "http://w5",
            "block_size": BLOCK,
            "kv_events_endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
        }
        async with trio.open_nursery() as nursery:
            handle = await start_select_service(nursery, data)
            url = handle.urls[0]
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                assert (await http.post("/workers", json=worker)).status_code == 201
                publisher.publish(store([1, 2, 3], TOKENS[:12]))
                await wait_blocks(url, 3)
                reserve = {"model_name": "m", "token_ids": TOKENS, "reservation_id": "keep"}
                assert (await http.post("/select_and_reserve", json=reserve)).status_code == 200
            before = await observed(url)
            handle.stop()
        # While the service is down the worker caches one more block; nobody hears it live.
        publisher.publish(store([4], TOKENS[12:16], parent=3))
        async with trio.open_nursery() as nursery:
            handle = await start_select_service(nursery, data)
            url = handle.urls[0]
            workers, loads, scores = await observed(url)
            assert (workers, loads) == before[:2]
            # The index came back from the journal, and on connecting the listener caught up on
            # what the worker published while the service was down (seq 1, replayed).
            assert max(w["device_blocks"] for w in scores["workers"]) in (3, 4)
            await wait_blocks(url, 4)
            publisher.publish(store([5], TOKENS[16:20], parent=4))
            await wait_blocks(url, 5)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                assert (await http.delete("/reservations/keep")).status_code == 200
                status = (await http.get("/workers")).json()[0]["kv_listeners"]["0"]
                assert status["last_seq"] == 2 and status["replayed_batches"] >= 1
            handle.stop()


async def test_indexer_peer_dump_seeds_a_new_replica(tmp_path: Path) -> None:
    async with open_kv_publisher() as publisher, trio.open_nursery() as nursery:
        first = await start_select_service(nursery, tmp_path / "a")
        # With a replay endpoint, a batch published before the listener connects is caught up.
        worker = {
            "worker_id": 5,
            "model_name": "m",
            "endpoint": "http://w5",
            "block_size": BLOCK,
            "kv_events_endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
        }
        async with httpx.AsyncClient(base_url=first.urls[0], timeout=10) as http:
            await http.post("/workers", json=worker)
            publisher.publish(store([1, 2, 3, 4], TOKENS[:16]))
            await wait_blocks(first.urls[0], 4)
            dump = (await http.get("/dump")).json()
        assert dump["m:default"]["block_size"] == BLOCK and len(dump["m:default"]["events"]) == 1

        options = ServiceOptions(
            port=0, data_dir=tmp_path / "b", durability=Durability.ALWAYS, seed=1, body_limit=SELECTION_BODY_LIMIT
        )
        build = builder(RouterConfig(), [first.urls[0]])
        second: ServiceHandle = await nursery.start(run_service, "selection service", options, build)
        async with httpx.AsyncClient(base_url=second.urls[0], timeout=10) as http:
            # Same blocks; the block size is fixed later, by the partition's first schedulable worker.
            assert (await http.get("/dump")).json()["m:default"]["events"] == dump["m:default"]["events"]
            # Once the worker joins the new replica's catalog, selection sees the recovered blocks.
            await http.post(
                "/workers", json={**worker, "kv_events_endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None}
            )
            assert await device_blocks(second.urls[0]) == 4
        first.stop()
        second.stop()
