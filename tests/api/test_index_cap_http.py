"""--max-index-blocks-per-scope end to end: real ZMQ publishers, real hypercorn, a restart from the journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.kv_publisher import open_kv_publisher

BLOCK = 4
CAP = 40


def prompt(first_hash: int, blocks: int) -> bytes:
    """One batch storing a chain of ``blocks`` blocks whose tokens are unlike any other prompt's."""
    tokens = list(range(first_hash * BLOCK, (first_hash + blocks) * BLOCK))
    event = ["BlockStored", list(range(first_hash, first_hash + blocks)), None, tokens, BLOCK, None, None]
    return encode_batch([event])


def dumped_blocks(dump: dict[str, Any]) -> dict[int, int]:
    """Blocks per worker in a /dump."""
    out: dict[int, int] = {}
    for scope in dump.values():
        for row in scope["events"]:
            blocks = len(row["event"]["data"]["stored"]["blocks"])
            out[row["worker_id"]] = out.get(row["worker_id"], 0) + blocks
    return out


async def start(nursery: trio.Nursery, data: Path, cap: int | None) -> str:
    extra = {} if cap is None else {"max_index_blocks_per_scope": cap}
    options = ServiceOptions(
        port=0, data_dir=data, durability=Durability.ALWAYS, seed=3, body_limit=SELECTION_BODY_LIMIT, **extra
    )
    handle = await nursery.start(run_service, "selection service", options, select_service_builder(RouterConfig()))
    return str(handle.urls[0])


async def test_a_flooding_worker_is_trimmed_counted_in_workers_and_the_index_replays_identically(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    async with open_kv_publisher() as flooder, open_kv_publisher() as honest:
        async with trio.open_nursery() as nursery:
            url = await start(nursery, data, CAP)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                for worker_id, publisher in ((1, flooder), (2, honest)):
                    body = {
                        "worker_id": worker_id,
                        "model_name": "m",
                        "endpoint": f"http://w{worker_id}",
                        "block_size": BLOCK,
                        "kv_events_endpoint": publisher.endpoint,
                        "replay_endpoint": publisher.replay_endpoint,
                    }
                    assert (await http.post("/workers", json=body)).status_code == 201
                honest.publish(prompt(50_000, 6))
                for batch in range(30):  # 300 blocks offered, never removed
                    flooder.publish(prompt(1_000 * (batch + 1), 10))

                async def status() -> dict[int, dict[str, Any]]:
                    return {row["worker_id"]: row for row in (await http.get("/workers")).json()}

                async def flooder_accounted() -> bool:
                    """Its 300 blocks are applied: held or counted as evicted (the listener takes a batch before the
                    actor applies it, and ingest goes after requests, so its last_seq alone is not enough)."""
                    evicted = (await status())[1].get("kv_index", {}).get("evicted_blocks", 0)
                    return dumped_blocks((await http.get("/dump")).json()).get(1, 0) + evicted == 300

                with trio.fail_after(10):
                    while (await status())[1]["kv_listeners"]["0"].get("last_seq") != 29:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                    while dumped_blocks((await http.get("/dump")).json()).get(2) != 6:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                    while not await flooder_accounted():  # noqa: ASYNC110
                        await trio.sleep(0.02)
                workers = await status()
                dump = (await http.get("/dump")).json()
            nursery.cancel_scope.cancel()
        held = dumped_blocks(dump)
        assert sum(held.values()) <= CAP and held[2] == 6  # the honest worker kept all it stored
        evicted = workers[1]["kv_index"]["evicted_blocks"]
        assert workers[1]["kv_index"] == {"evicted_blocks": evicted, "refused_blocks": 0}
        assert held[1] + evicted == 300  # every block the flooder stored is held or counted as evicted
        assert "kv_index" not in workers[2]
        # The trims are journaled: a start with another cap (the default) replays to the same index.
        async with trio.open_nursery() as nursery:
            url = await start(nursery, data, None)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                assert (await http.get("/dump")).json() == dump
                assert "kv_index" not in (await http.get("/workers")).json()[0]  # process counters start at zero
            nursery.cancel_scope.cancel()
