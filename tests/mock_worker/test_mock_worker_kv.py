"""The mock worker's KV events reach a real selection service (in-process, real ZMQ on 127.0.0.1): it indexes
them and routes a repeated prompt to the worker that cached it; a late listener catches up by replay; the
replay buffer is bounded; registration and its failures."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
import zmq

from kvrouter.actors.core.kv_wire import BlockStored, decode_batch
from kvrouter.actors.transport.zmq_socket import open_socket
from kvrouter.api.mock_worker.registration import Registration, RegistrationFailed, register
from tests.conftest import start_select_service
from tests.support.kv_publisher import free_tcp_port
from tests.support.mock_workers import BLOCK, start_mock_worker

PROMPT = list(range(1000, 1017))  # 4 full blocks of 4 and one token
END = b"\xff" * 8


async def wait_for_blocks(http: httpx.AsyncClient, prompt: list[int], worker_id: int, blocks: int) -> None:
    with trio.fail_after(10):
        while True:
            rows = (await http.post("/overlap_scores", json={"model_name": "mock", "token_ids": prompt})).json()
            if any(r["worker_id"] == worker_id and r["device_blocks"] == blocks for r in rows["workers"]):
                return
            await trio.sleep(0.02)


async def test_the_selection_service_routes_a_repeated_prompt_to_the_worker_that_cached_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    service = await start_select_service(nursery, tmp_path / "data")
    url = service.urls[0]
    async with trio.open_nursery() as workers:
        first = await start_mock_worker(workers, register_url=url, worker_id=1)
        second = await start_mock_worker(workers, register_url=url, worker_id=2)
        async with httpx.AsyncClient(base_url=url, timeout=10) as router:
            rows = {row["worker_id"]: row for row in (await router.get("/workers")).json()}
            assert sorted(rows) == [1, 2] and {r["lifecycle"] for r in rows.values()} == {"schedulable"}
            assert rows[2]["kv_events_endpoint"] == second.kv_events_endpoint
            assert rows[2]["replay_endpoint"] == second.replay_endpoint
            assert rows[2]["total_kv_blocks"] == 64 and rows[2]["block_size"] == BLOCK
            async with httpx.AsyncClient(base_url=second.url, timeout=10) as worker:
                answer = await worker.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
                assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_for_blocks(router, PROMPT, 2, 4)
            for _ in range(5):
                choice = (await router.post("/select", json={"model_name": "mock", "token_ids": PROMPT})).json()
                assert choice["worker_id"] == 2 and choice["overlap"]["longest_matched"] == 16
            # What the router predicted is what the worker finds.
            async with httpx.AsyncClient(base_url=second.url, timeout=10) as worker:
                again = await worker.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
            assert first.app.stats()["kv_batches_published"] == 0
            second.stop()  # unregisters, then stops
            with trio.fail_after(10):
                while [row["worker_id"] for row in (await router.get("/workers")).json()] != [1]:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            first.stop()
    # The nursery ended once both workers had stopped: both unregistered.
    async with httpx.AsyncClient(base_url=url, timeout=10) as router:
        assert (await router.get("/workers")).json() == []
    service.stop()


async def test_a_listener_that_joins_late_gets_the_missed_batches_by_replay(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    worker = await start_mock_worker(nursery)
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        for start in (0, 100, 200):  # three prompts, published while nobody listens
            await http.post("/v1/completions", json={"prompt": [p + start for p in PROMPT], "max_tokens": 1})
    published = worker.publisher.next_seq
    assert published >= 3
    service = await start_select_service(nursery, tmp_path / "data")
    record = {
        "worker_id": 7,
        "model_name": "mock",
        "endpoint": worker.url,
        "block_size": BLOCK,
        "kv_events_endpoint": worker.kv_events_endpoint,
        "replay_endpoint": worker.replay_endpoint,
    }
    async with httpx.AsyncClient(base_url=service.urls[0], timeout=10) as router:
        assert (await router.post("/workers", json=record)).status_code == 201
        for start in (0, 100, 200):
            await wait_for_blocks(router, [p + start for p in PROMPT], 7, 4)
        listener = (await router.get("/workers")).json()[0]["kv_listeners"]["0"]
        assert listener["replayed_batches"] == published and listener["last_seq"] == published - 1
        assert listener["lost_batches"] == 0
    service.stop()


async def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay endpoint from ``start``, as the selection service's listener does."""
    with open_socket(zmq.DEALER, sndhwm=10, rcvhwm=1000) as dealer:
        dealer.socket.connect(endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        with trio.fail_after(10):
            while True:
                empty, seq, payload = await dealer.recv_multipart()
                assert empty == b""
                if seq == END:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))


async def test_the_replay_buffer_keeps_the_newest_batches_in_vllms_format(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery, replay_buffer_batches=2)
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        for start in (0, 100, 200, 300):
            await http.post("/v1/completions", json={"prompt": [p + start for p in PROMPT], "max_tokens": 1})
    assert worker.publisher.next_seq == 4  # one batch per request: its prompt's 4 blocks
    assert worker.replay_endpoint is not None
    kept = await replay(worker.replay_endpoint, 0)
    assert [seq for seq, _ in kept] == [2, 3]  # the oldest two were dropped
    assert [seq for seq, _ in await replay(worker.replay_endpoint, 3)] == [3]
    assert await replay(worker.replay_endpoint, 9) == []
    batch = decode_batch(kept[1][1])
    assert batch.dp_rank == 0
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert tuple(stored.token_ids) == tuple(p + 300 for p in PROMPT[:16]) and stored.block_size == BLOCK
    assert len(stored.block_hashes) == 4 and stored.parent_hash is None


async def test_registration_gives_up_after_its_attempts_or_at_once_when_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    record = {"worker_id": 1, "model_name": "mock"}
    nobody = f"http://127.0.0.1:{free_tcp_port()}"
    with pytest.raises(RegistrationFailed) as unreachable:
        await register(Registration(nobody, record, attempts=2, first_delay=0.01))
    assert not unreachable.value.refused
    assert str(unreachable.value).startswith(f"cannot register with the selection service at {nobody} after 2 attempts")
    service = await start_select_service(nursery, tmp_path / "data")
    with pytest.raises(RegistrationFailed) as refused:
        await register(Registration(service.urls[0] + "/nowhere", record, attempts=5, first_delay=10))
    assert refused.value.refused
    assert "refused to register worker 1: 404 route not found" in str(refused.value)
    service.stop()
