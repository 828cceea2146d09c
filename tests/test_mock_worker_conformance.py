"""The Dynamo 1.6.1 reference selection service accepts the mock worker's KV events (optional: skipped unless
the reference is installed, see tests/support/processes.py): two mock workers register with it, one serves a
prompt, and the reference's /select routes that prompt back to it with the overlap its events describe."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.api.mock_worker.registration import Registration, register
from tests.support.mock_workers import BLOCK, start_mock_worker
from tests.support.processes import free_port, require_reference, start_process

pytestmark = pytest.mark.conformance
REFERENCE = require_reference()


def record(worker_id: int, url: str, kv: str, replay: str | None) -> dict[str, object]:
    return {
        "worker_id": worker_id,
        "model_name": "mock",
        "endpoint": url,
        "block_size": BLOCK,
        "kv_events_endpoint": kv,
        "replay_endpoint": replay,
        "total_kv_blocks": 64,
        "data_parallel_size": 1,
    }


async def test_the_reference_indexes_the_mock_workers_events(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    reference = await start_process(
        [REFERENCE, "-m", "dynamo.select_service", "--port", str(port)], port, tmp_path / "reference.log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        workers = [await start_mock_worker(nursery) for _ in range(2)]
        for worker_id, worker in enumerate(workers, 1):
            body = record(worker_id, worker.url, worker.kv_events_endpoint, worker.replay_endpoint)
            await register(Registration(url, body))
        async with (
            httpx.AsyncClient(base_url=url, timeout=10) as router,
            httpx.AsyncClient(base_url=workers[1].url, timeout=10) as worker,
        ):
            # Until the reference's SUB has joined, a batch may pass unheard (and a first one cannot show a
            # gap): serve fresh prompts until one is indexed.
            with trio.fail_after(30):
                for attempt in range(1000):
                    prompt = [attempt * 100 + k for k in range(1, 18)]  # 4 full blocks and one token
                    await worker.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                    scores = await router.post("/overlap_scores", json={"model_name": "mock", "token_ids": prompt})
                    rows = {row["worker_id"]: row["device_blocks"] for row in scores.json()["workers"]}
                    if rows.get(2) == 4:
                        break
                    await trio.sleep(0.1)
            choice = (await router.post("/select", json={"model_name": "mock", "token_ids": prompt})).json()
            assert choice["worker_id"] == 2 and choice["overlap"]["longest_matched"] == 16, choice
    finally:
        reference.kill()
        await reference.wait()
