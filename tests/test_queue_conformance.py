"""Queueing against the Dynamo 1.6.1 reference selection service (optional: skipped unless the reference is
installed), both started with ``DYN_ROUTER_QUEUE_THRESHOLD``: a worker without ``max_num_batched_tokens`` is
incomplete with the same reason, selections wait while every worker is over the threshold, ``/loads`` shows
them pending, and a prefill completion lets them through to the same workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.processes import free_port, require_reference, start_process
from tests.test_select_conformance import normalise, ours, theirs

pytestmark = pytest.mark.conformance
require_reference()

M = {"model_name": "m"}
ENV = {"DYN_ROUTER_QUEUE_THRESHOLD": "1.0", "DYN_ROUTER_QUEUE_POLICY": "wspt"}


def worker(worker_id: int, **fields: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, **M, "endpoint": f"http://w{worker_id}", "block_size": 4, **fields}


async def play(url: str) -> list[Any]:
    """What a user sees, in order (the waiting selections' answers when they come)."""
    seen: list[Any] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:

        async def call(method: str, path: str, body: Any = None) -> Any:
            response = await http.request(method, path, json=body)
            answer = (response.status_code, normalise(response.json()) if response.content else None)
            seen.append((method, path, answer))
            return answer

        async def pending() -> int:
            count: int = (await http.get("/loads")).json()[0]["pending_count"]
            return count

        await call("POST", "/workers", worker(1, max_num_batched_tokens=10))
        await call("POST", "/workers", worker(2, max_num_batched_tokens=10))
        await call("POST", "/workers", worker(3))  # incomplete while queueing is on
        await call("GET", "/workers")
        for name, rank in (("a", 1), ("b", 2)):  # 12 prefill tokens each: both over 1.0 x 10
            body = {
                **M,
                "selection_id": name,
                "token_ids": list(range(1, 13)),
                "pinned_worker": {"worker_id": rank, "dp_rank": 0},
            }
            await call("POST", "/select_and_reserve", body)
        answers: dict[str, Any] = {}

        async def waiting(name: str, tokens: list[int]) -> None:
            response = await http.post("/select_and_reserve", json={**M, "selection_id": name, "token_ids": tokens})
            answers[name] = (response.status_code, response.json()["worker_id"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting, "long", list(range(100, 120)))
            with trio.fail_after(10):
                while await pending() < 1:  # noqa: ASYNC110 - polling another process over HTTP
                    await trio.sleep(0.02)
            nursery.start_soon(waiting, "short", [50, 51, 52, 53])
            with trio.fail_after(10):
                while await pending() < 2:  # noqa: ASYNC110 - polling another process over HTTP
                    await trio.sleep(0.02)
            await call("GET", "/loads")  # both pending, with their prompt tokens
            await call("POST", "/reservations/a/prefill_complete")
        seen.append(("answers", sorted(answers.items())))
        await call("GET", "/loads")
    return seen


async def test_queueing_gives_the_same_answers(tmp_path: Path) -> None:
    mine_port, ref_port = free_port(), free_port()
    processes = [
        await start_process(ours(mine_port, tmp_path / "data"), mine_port, tmp_path / "ours.log", ENV),
        await start_process(theirs(ref_port), ref_port, tmp_path / "ref.log", {"DYN_USE_KV_EVENTS": "false", **ENV}),
    ]
    try:
        mine = await play(f"http://127.0.0.1:{mine_port}")
        reference = await play(f"http://127.0.0.1:{ref_port}")
    finally:
        for process in processes:
            process.kill()
            await process.wait()
    for a, b in zip(mine, reference, strict=True):
        assert a == b, f"\nkvrouter:  {a}\nreference: {b}"
    assert ("answers", [("long", (200, 1)), ("short", (200, 1))]) in mine  # both waited for worker 1
