"""Routing constraints and worker topology over HTTP, on a real server: the catalog's topology fields and
worker role (validated before journaling, shown in /workers, changed by PATCH, kept across a restart), and
routing_constraints on a selection body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from kvrouter.actors.core.router_config import RouterConfig
from tests.conftest import start_select_service

BLOCK = 4
TOKENS = list(range(100, 132))
NO_KV_EVENTS = RouterConfig(use_kv_events=False)


def worker(worker_id: int, **fields: Any) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": "m",
        "endpoint": f"http://w{worker_id}",
        "block_size": BLOCK,
        **fields,
    }


async def chosen(http: httpx.AsyncClient, **body: Any) -> int:
    response = await http.post("/select", json={"model_name": "m", "token_ids": TOKENS, **body})
    assert response.status_code == 200, response.text
    return int(response.json()["worker_id"])


async def test_topology_fields_are_validated_stored_patched_and_kept_across_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    topology = {
        "taints": ["gpu-h100"],
        "topology_domains": {"zone": "a", "rack": "r7"},
        "kv_transfer_domain": "zone",
        "kv_transfer_enforcement": "preferred",
        "kv_transfer_preferred_weight": 0.5,
        "worker_role": "prefill",
    }
    async with trio.open_nursery() as nursery:
        handle = await start_select_service(nursery, data, NO_KV_EVENTS)
        http = httpx.AsyncClient(base_url=handle.urls[0], timeout=10)
        created = await http.post("/workers", json=worker(1, **topology))
        assert created.status_code == 201
        shown = created.json()
        assert {key: shown[key] for key in topology} == topology

        refusals = [
            (
                {"kv_transfer_enforcement": "prefer"},
                422,
                "Failed to deserialize the JSON body into the target type: kv_transfer_enforcement: unknown variant "
                "`prefer`, expected `required` or `preferred`",  # 1.6.1's text
            ),
            (
                {"kv_transfer_preferred_weight": 1.5},
                400,
                "kv_transfer_preferred_weight must be between 0 and 1, got 1.5",
            ),
            ({"taints": ["dynamo.topology/zone=b"]}, 400, "taint 'dynamo.topology/zone=b' uses the reserved prefix"),
            ({"topology_domains": {"zone": ""}}, 400, "topology domain 'zone' must have a non-empty value"),
            ({"worker_role": "encoder"}, 400, "worker_role must be one of prefill, decode, both, got 'encoder'"),
        ]
        for change, status, message in refusals:
            for response in (
                await http.post("/workers", json=worker(1, **{**topology, **change})),
                await http.patch("/workers/1", json=change),
            ):
                assert response.status_code == status, (change, response.text)
                assert response.json()["error"].startswith(message)
        (unchanged,) = (await http.get("/workers")).json()
        assert unchanged == shown  # a refused write changes nothing

        patched = await http.patch(
            "/workers/1",
            json={"kv_transfer_enforcement": "required", "topology_domains": {"zone": "b"}, "worker_role": "both"},
        )
        assert patched.status_code == 200
        after = patched.json()
        assert (after["kv_transfer_enforcement"], after["topology_domains"], after["worker_role"]) == (
            "required",
            {"zone": "b"},  # maps are replaced wholesale
            "both",
        )
        await http.aclose()
        handle.stop()

    async with trio.open_nursery() as nursery:
        restarted = await start_select_service(nursery, data, NO_KV_EVENTS)
        async with httpx.AsyncClient(base_url=restarted.urls[0], timeout=10) as http:
            assert (await http.get("/workers")).json() == [after]
        restarted.stop()


async def test_routing_constraints_on_a_selection(nursery: trio.Nursery, tmp_path: Path) -> None:
    handle = await start_select_service(nursery, tmp_path / "data", NO_KV_EVENTS)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await http.post("/workers", json=worker(1, topology_domains={"zone": "a"}))
        await http.post("/workers", json=worker(2, taints=["spot"], topology_domains={"zone": "b"}))
        for _ in range(8):  # the two idle workers tie: without the constraints the pick is a coin flip
            required = {"routing_constraints": {"required_taints": ["dynamo.topology/zone=b"]}}
            assert await chosen(http, **required) == 2
            assert await chosen(http, routing_constraints={"preferred_taints": {"dynamo.topology/zone=a": 0.5}}) == 1
            assert await chosen(http, routing_constraints={"preferred_taints": {"spot": -1.0}}) == 1
        missing = await http.post(
            "/select",
            json={"model_name": "m", "token_ids": TOKENS, "routing_constraints": {"required_taints": ["spot", "gpu"]}},
        )
        assert missing.status_code == 503
        assert missing.json() == {
            "error": "no endpoints available to route work: no eligible worker carries every required taint of "
            "routing_constraints [gpu, spot]"
        }
    handle.stop()
