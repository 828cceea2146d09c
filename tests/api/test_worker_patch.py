"""PATCH /workers/{id} carries a plain-data patch (``WorkerPatch``) that the catalog writer applies to the
record as it is then: the merged record is checked again (a combination no single field shows is a 400 and
changes nothing), ``routing_group`` is ``tenant_id``'s alias, and untouched fields stay."""

from __future__ import annotations

import httpx

from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord
from kvrouter.actors.core.limits import MAX_RANKS_PER_WORKER


async def test_a_patch_whose_merged_record_is_invalid_is_refused_and_changes_nothing(
    selector: httpx.AsyncClient,
) -> None:
    created = await selector.post(
        "/workers",
        json={"worker_id": 3, "model_name": "m", "endpoint": "http://w3", "replay_endpoint": "tcp://127.0.0.1:65535"},
    )
    assert created.status_code == 201
    # data_parallel_size 2 alone is fine; with this record's replay port, rank 1 would replay on port 65536.
    refused = await selector.patch("/workers/3", json={"data_parallel_size": 2})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": "replay_endpoint: port 65535 + 1 is beyond 65535; "
        "rank r replays on the given port + (r - data_parallel_start_rank)"
    }
    [shown] = (await selector.get("/workers")).json()
    assert shown["data_parallel_size"] is None and shown["replay_endpoint"] == "tcp://127.0.0.1:65535"


async def test_a_patch_replaces_only_the_fields_it_gives(selector: httpx.AsyncClient) -> None:
    await selector.post("/workers", json={"worker_id": 4, "model_name": "m", "endpoint": "http://w4", "taints": ["a"]})
    patched = await selector.patch("/workers/4", json={"routing_group": "g", "taints": [], "endpoint": None})
    assert patched.status_code == 200
    shown = patched.json()
    assert (shown["model_name"], shown["tenant_id"], shown["endpoint"], shown["taints"]) == ("m", "g", "http://w4", [])
    [listed] = (await selector.get("/workers", params={"tenant_id": "g"})).json()
    assert listed["worker_id"] == 4


def test_worker_patch_is_plain_data_applied_to_the_current_record() -> None:
    current = WorkerRecord(4, "m", "t", endpoint="http://w4", taints=("a",), block_size=16)
    patch = WorkerPatch(tenant_id="u", taints=())
    assert patch.apply(current) == WorkerRecord(4, "m", "u", endpoint="http://w4", taints=(), block_size=16)
    too_many = MAX_RANKS_PER_WORKER + 1
    assert WorkerPatch(data_parallel_size=too_many).apply(current) == (
        f"data_parallel_size {too_many} exceeds the maximum of {MAX_RANKS_PER_WORKER} ranks per worker"
    )
