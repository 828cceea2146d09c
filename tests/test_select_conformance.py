"""Conformance with the Dynamo 1.6.1 reference selection service (optional: skipped unless the
reference is installed, see tests/test_conformance.py). Both run without KV events
(DYN_USE_KV_EVENTS=false / --no-use-kv-events) so the catalog needs no ZMQ publishers; the same
requests must give the same statuses and bodies, modulo the documented differences: kvrouter's
records and rows also carry ``tenant_id``, its error texts say ``tenant_id=``, and 1.6.1 appends
serde positions. Then each recovers its index from the other's /dump (--indexer-peers)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.processes import free_port, require_reference, start_process

pytestmark = pytest.mark.conformance
REFERENCE = require_reference()


@attrs.frozen
class Raw:
    """A body sent as these bytes with this content type (None: no such header)."""

    content: bytes = b""
    content_type: str | None = None


JSON = "application/json"
TOKENS = list(range(1, 41))
M = {"model_name": "m"}
SCENARIO: list[tuple[str, str, Any]] = [
    ("GET", "/ready", None),
    ("POST", "/select", {**M, "token_ids": TOKENS}),
    ("POST", "/workers", {"worker_id": 1, "model_name": "m"}),
    ("POST", "/workers", {"worker_id": 2, "model_name": "m", "endpoint": "http://w2", "block_size": 4}),
    ("PATCH", "/workers/1", {"endpoint": "http://w1", "block_size": 4}),
    ("PATCH", "/workers/9", {"endpoint": "http://x"}),  # an unknown worker: 404 (kvrouter refuses "x" with 400)
    ("PATCH", "/workers/2", {"endpoint": None, "block_size": None, "taints": None}),  # null keeps the field
    ("GET", "/workers", None),
    ("GET", "/ready", None),
    ("POST", "/select", {**M, "token_ids": TOKENS, "pinned_worker": {"worker_id": 1, "dp_rank": 0}}),
    ("POST", "/select", {**M, "sequence_hashes": [1], "isl_tokens": 4}),
    ("POST", "/select", {**M, "block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 4}),
    ("POST", "/select", {**M, "block_hashes": [1], "sequence_hashes": [1], "isl_tokens": 0}),
    ("POST", "/select", {**M, "token_ids": TOKENS, "allowed_worker_ids": [99]}),
    ("POST", "/select", {**M, "token_ids": TOKENS, "routing_constraints": {"required_taints": ["x"]}}),
    (
        "POST",
        "/select_and_reserve",
        {**M, "token_ids": TOKENS, "selection_id": "r1", "pinned_worker": {"worker_id": 1, "dp_rank": 0}},
    ),
    (
        "POST",
        "/select_and_reserve",
        {**M, "token_ids": TOKENS, "selection_id": "r1", "pinned_worker": {"worker_id": 1, "dp_rank": 0}},
    ),
    ("GET", "/loads", None),
    ("POST", "/potential_loads", {**M, "token_ids": TOKENS[:24] + [999] * 8}),
    ("POST", "/overlap_scores", {**M, "token_ids": TOKENS[:24] + [999] * 8}),
    ("POST", "/select", {**M, "token_ids": TOKENS, "selection_id": "s2", "pinned_worker": {"worker_id": 2}}),
    (
        "POST",
        "/select",
        {**M, "token_ids": TOKENS, "selection_id": "s2", "pinned_worker": {"worker_id": 2, "dp_rank": 0}},
    ),
    ("POST", "/reservations", {**M, "selection_id": "s2"}),
    ("POST", "/reservations", {**M, "selection_id": "s2"}),
    # output_block needs a JSON body: the content type is checked before the reservation is looked up.
    ("POST", "/reservations/nope/output_block", Raw()),
    ("POST", "/reservations/nope/output_block", Raw(b"", "application/json")),
    ("POST", "/reservations/nope/output_block", {}),
    ("POST", "/reservations/r1/output_block", Raw(b"{}", "text/plain")),
    ("POST", "/reservations/r1/output_block", {}),
    ("POST", "/reservations/r1/output_block", {"decay_fraction": 1.5}),
    ("POST", "/reservations/r1/output_block", {"decay_fraction": 0.5}),
    ("POST", "/reservations/r1/prefill_complete", {}),
    ("POST", "/reservations/s2/prefill_complete", Raw(b"hello", "text/plain")),  # routes without a body ignore one
    # Both ids given: each is echoed (kvrouter books under reservation_id; 1.6.1 knows only selection_id).
    (
        "POST",
        "/select_and_reserve",
        {
            **M,
            "token_ids": TOKENS[:12],
            "selection_id": "s3",
            "reservation_id": "q3",
            "pinned_worker": {"worker_id": 2},
        },
    ),
    ("GET", "/loads", None),
    ("DELETE", "/reservations/r1", None),
    ("DELETE", "/reservations/r1", None),
    ("DELETE", "/reservations/s2", Raw(b"not json", "application/json")),
    ("DELETE", "/workers/1", Raw(b"x", "text/plain")),
    ("DELETE", "/workers/1", None),
    ("GET", "/health", None),
    # A key written twice: a field of a struct is refused at any depth; a map's key, an unknown field: the last wins.
    ("POST", "/select", Raw(b'{"model_name":"m","token_ids":[1,2,3,4],"model_name":"m"}', JSON)),
    ("POST", "/select", Raw(b'{"model_name":"m","token_ids":[1,2,3,4],"token_ids":[5]}', JSON)),
    (
        "POST",
        "/select",
        Raw(
            b'{"model_name":"m","token_ids":[1],"router_config_override":{"router_temperature":0,"router_temperature":1}}',
            JSON,
        ),
    ),
    (
        "POST",
        "/select",
        Raw(b'{"model_name":"m","token_ids":[1],"session_context":{"session_id":"a","session_id":"b"}}', JSON),
    ),
    (
        "POST",
        "/select",
        Raw(b'{"model_name":"m","token_ids":[1,2,3,4],"router_config_override":{"zz":0,"zz":1}}', JSON),
    ),
    ("POST", "/select", Raw(b'{"model_name":"m","token_ids":[1,2,3,4],"extra":{"a":1,"a":2},"extra":3}', JSON)),
    ("POST", "/workers", Raw(b'{"worker_id":3,"model_name":"m","endpoint":"http://w3","endpoint":"http://w4"}', JSON)),
    (
        "POST",
        "/workers",
        Raw(b'{"worker_id":3,"model_name":"m","endpoint":"http://w3","topology_domains":{"r":"a","r":"b"}}', JSON),
    ),
    ("PATCH", "/workers/3", Raw(b'{"block_size":4,"block_size":8}', JSON)),
    ("PATCH", "/workers/3", Raw(b'{"block_size":4,"zz":1,"zz":2}', JSON)),
    ("POST", "/reservations", Raw(b'{"model_name":"m","selection_id":"q","selection_id":"q"}', JSON)),
    ("POST", "/overlap_scores", Raw(b'{"model_name":"m","token_ids":[1,2,3,4],"token_ids":[1,2,3,4]}', JSON)),
    ("GET", "/workers", None),
]


# Fields only kvrouter's answers carry: the seed's scope name, its KV listeners and per-rank KV modes, and the
# seed's reservation_id beside 1.6.1's selection_id.
KVROUTER_ONLY_FIELDS = ("tenant_id", "kv_listeners", "kv_modes", "reservation_id")


def normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items() if k not in KVROUTER_ONLY_FIELDS}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        value = re.sub(r" at line \d+ column \d+", "", value).replace("routing_group=", "tenant_id=")
        # kvrouter names the required taints no worker carries; 1.6.1 stops at "no endpoints available ...".
        return re.sub(r"(no endpoints available to route work): no eligible worker carries .*", r"\1", value)
    return value


async def play(url: str) -> list[tuple[int, Any]]:
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for method, path, body in SCENARIO:
            if isinstance(body, Raw):
                headers = {"content-type": body.content_type} if body.content_type else {}
                response = await http.request(method, path, content=body.content, headers=headers)
            else:
                response = await http.request(method, path, json=body)
            results.append((response.status_code, normalise(response.json()) if response.content else None))
    return results


def ours(port: int, data: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvrouter.api.select_service",
        "--port",
        str(port),
        "--data-dir",
        str(data),
        "--no-use-kv-events",
        "--log-level",
        "warning",
        *extra,
    ]


def theirs(port: int, *extra: str) -> list[str]:
    return [REFERENCE or "", "-m", "dynamo.select_service", "--port", str(port), *extra]


@pytest.mark.parametrize("fronts", [0, 2])  # one process, and two HTTP front processes (README, Process layout)
async def test_same_requests_same_answers(tmp_path: Path, fronts: int) -> None:
    mine_port, ref_port = free_port(), free_port()
    mine_argv = ours(mine_port, tmp_path / "data", "--fronts", str(fronts))
    processes = [
        await start_process(mine_argv, mine_port, tmp_path / "ours.log"),
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


async def test_index_recovery_both_ways(tmp_path: Path) -> None:
    """A reference replica recovers kvrouter's approximate-mode index from /dump, and back."""
    first, second, third = free_port(), free_port(), free_port()
    worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
    processes = [await start_process(ours(first, tmp_path / "a"), first, tmp_path / "a.log")]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{first}", timeout=10) as http:
            await http.post("/workers", json=worker)
            await http.post("/select_and_reserve", json={**M, "token_ids": TOKENS})
            dump = (await http.get("/dump")).json()
        assert len(dump["m:default"]["events"]) == 1
        processes.append(
            await start_process(
                theirs(second, "--indexer-peers", f"http://127.0.0.1:{first}"),
                second,
                tmp_path / "b.log",
                {"DYN_USE_KV_EVENTS": "false"},
            )
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{second}", timeout=10) as http:
            await http.post("/workers", json=worker)
            with trio.fail_after(10):
                while True:
                    scores = (await http.post("/overlap_scores", json={**M, "token_ids": TOKENS})).json()
                    if scores["workers"][0]["device_blocks"] == 10:
                        break
                    await trio.sleep(0.1)
        processes.append(
            await start_process(
                ours(third, tmp_path / "c", "--indexer-peers", f"http://127.0.0.1:{second}"), third, tmp_path / "c.log"
            )
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{third}", timeout=10) as http:
            await http.post("/workers", json=worker)
            scores = (await http.post("/overlap_scores", json={**M, "token_ids": TOKENS})).json()
            assert scores["workers"][0]["device_blocks"] == 10
    finally:
        for process in processes:
            process.kill()
            await process.wait()


async def test_replica_sync_with_the_reference_selection_service(tmp_path: Path) -> None:
    """Bookings on a 1.6.1 selector show up in a kvrouter selector's loads and back."""
    ours_http, ours_sync, ref_http, ref_sync = free_port(), free_port(), free_port(), free_port()
    processes = [
        await start_process(
            ours(
                ours_http,
                tmp_path / "a",
                "--replica-sync-port",
                str(ours_sync),
                "--replica-sync-peers",
                f"tcp://127.0.0.1:{ref_sync}",
            ),
            ours_http,
            tmp_path / "a.log",
        ),
        await start_process(
            theirs(
                ref_http, "--replica-sync-port", str(ref_sync), "--replica-sync-peers", f"tcp://127.0.0.1:{ours_sync}"
            ),
            ref_http,
            tmp_path / "ref.log",
            {"DYN_USE_KV_EVENTS": "false"},
        ),
    ]
    worker = {"worker_id": 7, "model_name": "m", "endpoint": "http://w7", "block_size": 4}
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{ours_http}", timeout=10) as mine,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{ref_http}", timeout=10) as ref,
        ):
            for http in (mine, ref):
                assert (await http.post("/workers", json=worker)).status_code == 201

            async def active(http: httpx.AsyncClient) -> int:
                return (await http.get("/loads")).json()[0]["loads"][0]["active_requests"]

            for source, target, tag in ((ref, mine, "from-ref"), (mine, ref, "from-kvrouter")):
                # Repeat until the peer's subscription has joined (ZMQ's slow joiner), then clean up.
                booked = []
                with trio.fail_after(20):
                    while await active(target) == 0:
                        booking = f"{tag}-{len(booked)}"
                        booked.append(booking)
                        body = {**M, "token_ids": TOKENS, "selection_id": booking, "reservation_id": booking}
                        assert (await source.post("/select_and_reserve", json=body)).status_code == 200
                        await trio.sleep(0.2)
                    for booking in booked:
                        assert (await source.delete(f"/reservations/{booking}")).status_code == 200
                    while await active(target) != 0:  # noqa: ASYNC110 - polled over HTTP
                        await trio.sleep(0.05)
    finally:
        for process in processes:
            process.kill()
            await process.wait()
