"""Routing constraints against the Dynamo 1.6.1 reference selection service (optional: skipped unless the
reference is installed): catalog topology fields as stored and shown, the enforcement's 422, required taints
(exact match) and preferred taints (exp(-tanh) of the matched weights, negative weights repel) in selections.

Where kvrouter deliberately differs it is left out here and tested on its own: 1.6.1 derives no
``dynamo.topology/<domain>=<value>`` taint from ``topology_domains`` in its selection service, accepts weights
outside [0, 1], and its 503 for unmatched required taints does not name them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import free_port, require_reference, start_process
from tests.test_select_conformance import normalise, ours, theirs

pytestmark = pytest.mark.conformance
require_reference()

TOKENS = list(range(1, 41))
M = {"model_name": "m"}


def worker(worker_id: int, **fields: Any) -> dict[str, Any]:
    return {"worker_id": worker_id, **M, "endpoint": f"http://w{worker_id}", "block_size": 4, **fields}


def select(**body: Any) -> tuple[str, str, Any]:
    return ("POST", "/select", {**M, "token_ids": TOKENS, **body})


# Workers 1 and 2 are idle and cold, so they tie on cost: each selection below is decided by its constraints
# alone (and is repeated, so a coin flip could not pass by luck). Worker 3 is busier.
SCENARIO: list[tuple[str, str, Any]] = [
    (
        "POST",
        "/workers",
        worker(
            1,
            taints=["gpu-h100"],
            topology_domains={"zone": "a"},
            kv_transfer_domain="zone",
            kv_transfer_enforcement="required",
        ),
    ),
    (
        "POST",
        "/workers",
        worker(
            2,
            taints=["spot", "gpu-h100"],
            kv_transfer_domain="zone",
            kv_transfer_enforcement="preferred",
            kv_transfer_preferred_weight=0.25,
        ),
    ),
    ("POST", "/workers", worker(3, kv_transfer_enforcement="prefer")),  # unknown variant: 422
    ("POST", "/workers", worker(3)),
    (
        "POST",
        "/select_and_reserve",
        {**M, "token_ids": TOKENS[:8], "selection_id": "b", "pinned_worker": {"worker_id": 3, "dp_rank": 0}},
    ),
    ("GET", "/workers", None),
    *[select(routing_constraints={"required_taints": ["spot"]})] * 4,
    *[select(routing_constraints={"required_taints": ["gpu-h100", "spot"]})] * 4,
    select(routing_constraints={"required_taints": ["GPU-H100"]}),  # exact strings only
    *[select(routing_constraints={"preferred_taints": {"spot": -0.5}, "required_taints": ["gpu-h100"]})] * 4,
    *[select(routing_constraints={"preferred_taints": {"spot": 2.0}})] * 4,
    # negative weights repel: 1 and 2 (cost 20 each) cost 20 x e^tanh(1) = 42.9, so the busier 3 (20) wins
    *[select(routing_constraints={"preferred_taints": {"gpu-h100": -1.0}})] * 4,
    ("PATCH", "/workers/2", {"taints": ["spot"]}),  # a PATCH replaces the taints
    *[select(routing_constraints={"required_taints": ["gpu-h100"]})] * 2,
    *[select(routing_constraints={"preferred_taints": {"spot": 0.5, "gpu-h100": 0.1}})] * 2,
]


async def play(url: str) -> list[tuple[int, Any]]:
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for method, path, body in SCENARIO:
            response = await http.request(method, path, json=body)
            results.append(
                (response.status_code, sorted_taints(normalise(response.json())) if response.content else None)
            )
    return results


def sorted_taints(value: Any) -> Any:
    """1.6.1 lists a worker's taints (a set) in hash order, which changes from process to process."""
    if isinstance(value, list):
        return [sorted_taints(v) for v in value]
    if isinstance(value, dict) and isinstance(value.get("taints"), list):
        return {**value, "taints": sorted(value["taints"])}
    return value


async def test_constraints_give_the_same_answers(tmp_path: Path) -> None:
    mine_port, ref_port = free_port(), free_port()
    processes = [
        await start_process(ours(mine_port, tmp_path / "data"), mine_port, tmp_path / "ours.log"),
        await start_process(theirs(ref_port), ref_port, tmp_path / "ref.log", {"DYN_USE_KV_EVENTS": "false"}),
    ]
    try:
        mine = await play(f"http://127.0.0.1:{mine_port}")
        reference = await play(f"http://127.0.0.1:{ref_port}")
    finally:
        for process in processes:
            process.kill()
            await process.wait()
    for (method, path, body), a, b in zip(SCENARIO, mine, reference, strict=True):
        assert a == b, f"{method} {path} {body}\nkvrouter:  {a}\nreference: {b}"
    chosen = [answer["worker_id"] for status, answer in mine if status == 200 and "worker_id" in answer]
    assert len(chosen) > 20  # the selections were answered, not refused
