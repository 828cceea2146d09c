"""Conformance with the Dynamo 1.6.1 reference slot tracker: the same requests give the same
statuses and bodies. Optional: runs only when the reference is installed, in a Python named by
KVROUTER_REFERENCE_PYTHON (or in this one). Normalisation: the reference's ``routing_group`` is
kvrouter's ``tenant_id``; the reference appends serde's "at line L column C" to body errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import free_port, require_reference, start_process

pytestmark = pytest.mark.conformance


REFERENCE = require_reference()

R = {"model_name": "m", "routing_group": "g"}
SCENARIO: list[tuple[str, str, Any]] = [
    ("GET", "/workers", None),
    ("POST", "/register", {**R, "worker_id": 7, "block_size": 16, "dp_start": 0, "dp_size": 2}),
    ("POST", "/register", {**R, "worker_id": 7, "block_size": 16, "dp_start": 0, "dp_size": 2}),
    ("POST", "/register", {**R, "worker_id": 8, "block_size": 32, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {**R, "worker_id": 8, "block_size": 0, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {**R, "worker_id": 8, "block_size": 16, "dp_start": 0, "dp_size": 0}),
    ("POST", "/register", {**R, "worker_id": 8, "block_size": 16, "dp_start": 0, "dp_size": 4097}),
    ("POST", "/register", {**R, "worker_id": 8, "block_size": 16, "dp_start": 4294967295, "dp_size": 1}),
    ("POST", "/register", {**R, "worker_id": 3, "block_size": 16, "dp_start": 2, "dp_size": 2}),
    ("POST", "/register", {"model_name": "a", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("GET", "/workers", None),
    ("GET", "/workers?model_name=m", None),
    ("GET", "/loads", None),
    (
        "POST",
        "/add",
        {**R, "request_id": "a", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [1, 2, 3, 4], "new_isl_tokens": 12},
    ),
    ("POST", "/add", {**R, "request_id": "b", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [1, 2, 5]}),
    (
        "POST",
        "/add",
        {**R, "request_id": "c", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [9, 2, 3], "new_isl_tokens": 4},
    ),
    ("POST", "/add", {**R, "request_id": "d", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [1, 1, 1]}),
    ("POST", "/add", {**R, "request_id": "e", "worker_id": 7, "dp_rank": 1, "sequence_hashes": [-1]}),
    ("POST", "/add", {**R, "request_id": "e", "worker_id": 3, "dp_rank": 2, "sequence_hashes": []}),
    ("POST", "/add", {**R, "request_id": "f", "worker_id": 3, "dp_rank": 9, "sequence_hashes": []}),
    ("POST", "/add", {**R, "request_id": "f", "worker_id": 3, "dp_rank": 3, "sequence_hashes": [2**63]}),
    ("POST", "/add", {"model_name": "nope", "request_id": "f", "worker_id": 3, "dp_rank": 3, "sequence_hashes": []}),
    ("POST", "/add", {**R, "request_id": "f", "worker_id": 3, "dp_rank": 3}),
    ("GET", "/loads", None),
    ("POST", "/potential_loads", {**R, "sequence_hashes": [1, 2, 3, 4, 6], "new_isl_tokens": 5}),
    ("POST", "/potential_loads", {**R, "sequence_hashes": [-1]}),
    ("POST", "/prefill_complete", {**R, "request_id": "a"}),
    ("POST", "/prefill_complete", {**R, "request_id": "a"}),
    ("POST", "/prefill_complete", {**R, "request_id": "zzz"}),
    ("GET", "/loads", None),
    ("POST", "/free", {**R, "request_id": "a"}),
    ("POST", "/free", {**R, "request_id": "a"}),
    ("POST", "/free", {**R, "request_id": "never"}),
    ("POST", "/free", {"model_name": "nope", "request_id": "x"}),
    ("GET", "/loads?model_name=m", None),
    ("POST", "/unregister", {**R, "worker_id": 99}),
    ("POST", "/unregister", {**R, "worker_id": 7}),
    ("POST", "/unregister", {**R, "worker_id": 3}),
    ("GET", "/loads", None),
    ("POST", "/potential_loads", {**R, "sequence_hashes": []}),
    ("POST", "/register", {"worker_id": "7", "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {"worker_id": -1, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {"worker_id": 1.5, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {"worker_id": True, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {"worker_id": 1, "model_name": None, "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {"worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}),
    ("GET", "/nowhere", None),
    ("GET", "/register", None),
    ("POST", "/health", {}),
    ("GET", "/health", None),
    # A key written twice (bytes: a dict cannot hold it): a repeated field is refused, an unknown one ignored.
    ("POST", "/register", b'{"model_name":"m","worker_id":11,"block_size":16,"dp_start":0,"dp_size":1,"worker_id":12}'),
    (
        "POST",
        "/register",
        b'{"model_name":"m","model\\u005fname":"n","worker_id":11,"block_size":16,"dp_start":0,"dp_size":1}',
    ),
    (
        "POST",
        "/register",
        b'{"model_name":"m","worker_id":13,"block_size":16,"dp_start":0,"dp_size":1,"zz":1,"zz":{"a":1,"a":2}}',
    ),
    (
        "POST",
        "/add",
        b'{"model_name":"m","request_id":"x","worker_id":13,"dp_rank":0,"sequence_hashes":[1],"request_id":"y"}',
    ),
    ("POST", "/potential_loads", b'{"model_name":"m","sequence_hashes":[1],"sequence_hashes":[2]}'),
    ("POST", "/free", b'{"model_name" : "m", "request_id" : "x", "request_id" : "x"}'),
    ("GET", "/workers", None),
    ("GET", "/loads", None),
]


def normalise(body: bytes) -> Any:
    if not body:
        return None
    text = re.sub(r" at line \d+ column \d+", "", body.decode())
    text = text.replace("routing_group=", "tenant_id=")
    value = httpx.Response(200, content=text.encode()).json()
    rows = value if isinstance(value, list) else None
    if rows and isinstance(rows[0], dict):
        rows = [{("tenant_id" if k == "routing_group" else k): v for k, v in row.items()} for row in rows]
        if "potential_prefill_tokens" in rows[0]:  # order unspecified by both
            rows.sort(key=lambda r: (r["worker_id"], r["dp_rank"]))
        return rows
    return value


async def play(url: str) -> list[tuple[int, Any]]:
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for method, path, body in SCENARIO:
            if isinstance(body, bytes):
                response = await http.request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                response = await http.request(method, path, json=body)
            results.append((response.status_code, normalise(response.content)))
    return results


@pytest.mark.parametrize("fronts", [0, 2])  # one process, and two HTTP front processes (README, Process layout)
async def test_same_requests_same_answers(tmp_path: Path, fronts: int) -> None:
    ours_port, ref_port = free_port(), free_port()
    ours = await start_process(
        [
            sys.executable,
            "-m",
            "kvrouter.api.slot_tracker",
            "--port",
            str(ours_port),
            "--data-dir",
            str(tmp_path / "data"),
            "--log-level",
            "warning",
            "--fronts",
            str(fronts),
        ],
        ours_port,
        tmp_path / "ours.log",
    )
    reference = await start_process(
        [REFERENCE, "-m", "dynamo.slot_tracker", "--port", str(ref_port)],  # type: ignore[list-item]
        ref_port,
        tmp_path / "reference.log",
    )
    try:
        ours_results = await play(f"http://127.0.0.1:{ours_port}")
        ref_results = await play(f"http://127.0.0.1:{ref_port}")
    finally:
        for process in (ours, reference):
            process.kill()
            await process.wait()
    for (method, path, body), mine, theirs in zip(SCENARIO, ours_results, ref_results, strict=True):
        if isinstance(mine[1], list) and mine[1] and isinstance(mine[1][0], dict):
            mine = (mine[0], [{k: v for k, v in row.items() if k != "routing_group"} for row in mine[1]])
        assert mine == theirs, f"{method} {path} {body}"
