"""Route-level behaviour of the selection service that 1.6.1 pins down (checked against a live 1.6.1 by
tests/test_select_conformance.py when the reference is installed; these run everywhere, in process)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import select_service_builder
from tests.support.asgi import ASGIApp, call, service_app

M = {"model_name": "m"}
PROMPT = {**M, "token_ids": [1, 2, 3, 4, 5]}
UNSUPPORTED = {"error": "Expected request with `Content-Type: application/json`"}


@pytest.fixture
async def app(nursery: trio.Nursery) -> ASGIApp:
    app, _ = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)))
    worker = {"worker_id": 1, **M, "endpoint": "http://w1", "block_size": 4, "taints": ["gpu"]}
    assert (await call(app, "POST", "/workers", worker)).status == 201
    return app


async def booked(app: ASGIApp, **ids: str) -> dict[str, Any]:
    reply = await call(app, "POST", "/select_and_reserve", {**PROMPT, **ids})
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_output_block_requires_a_json_body_before_looking_the_reservation_up(app: ASGIApp) -> None:
    await booked(app, reservation_id="r")
    for reservation in ("r", "unknown"):
        path = f"/reservations/{reservation}/output_block"
        assert (await call(app, "POST", path)).body == UNSUPPORTED
        assert (await call(app, "POST", path, raw=b"{}", content_type=b"text/plain")).status == 415
        empty = await call(app, "POST", path, raw=b"", content_type=b"application/json")
        assert (empty.status, empty.body) == (
            400,
            {"error": "Failed to parse the request body as JSON: EOF while parsing a value"},
        )
    assert (await call(app, "POST", "/reservations/r/output_block", {})).status == 200
    assert (await call(app, "POST", "/reservations/unknown/output_block", {})).status == 404


async def test_routes_without_a_body_ignore_one_of_any_content_type(app: ASGIApp) -> None:
    await booked(app, reservation_id="r")
    complete = await call(app, "POST", "/reservations/r/prefill_complete", raw=b"hello", content_type=b"text/plain")
    assert (complete.status, complete.body) == (200, {"status": "ok"})
    released = await call(app, "DELETE", "/reservations/r", raw=b"not json", content_type=b"application/json")
    assert released.status == 200
    removed = await call(app, "DELETE", "/workers/1", raw=b"x", content_type=b"application/octet-stream")
    assert (removed.status, removed.body["worker_id"]) == (200, 1)


async def test_select_and_reserve_echoes_each_id_it_was_given(app: ASGIApp) -> None:
    both = await booked(app, selection_id="S", reservation_id="R")
    assert (both["selection_id"], both["reservation_id"]) == ("S", "R")
    only_reservation = await booked(app, reservation_id="R2")
    assert "selection_id" not in only_reservation and only_reservation["reservation_id"] == "R2"
    only_selection = await booked(app, selection_id="S3")
    assert (only_selection["selection_id"], only_selection["reservation_id"]) == ("S3", "S3")
    generated = await booked(app)
    assert generated["selection_id"] == generated["reservation_id"] and len(generated["reservation_id"]) == 36
    assert (await call(app, "DELETE", "/reservations/R")).status == 200  # booked under reservation_id
    assert (await call(app, "DELETE", "/reservations/S")).status == 404
    plain = (await call(app, "POST", "/select", {**PROMPT, "selection_id": "S4", "reservation_id": "ignored"})).body
    assert plain["selection_id"] == "S4" and "reservation_id" not in plain


async def test_patch_with_null_keeps_the_field(app: ASGIApp) -> None:
    patched = await call(app, "PATCH", "/workers/1", {"endpoint": None, "block_size": None, "taints": None})
    assert patched.status == 200
    assert (patched.body["endpoint"], patched.body["block_size"], patched.body["taints"]) == ("http://w1", 4, ["gpu"])
    assert patched.body["lifecycle"] == "schedulable"
    cleared = await call(app, "PATCH", "/workers/1", {"taints": []})
    assert cleared.body["taints"] == []


async def test_patch_body_is_checked_before_the_worker_is_looked_up(app: ASGIApp) -> None:
    for worker_id in (1, 9):
        wrong = await call(app, "PATCH", f"/workers/{worker_id}", {"block_size": "four"})
        assert wrong.status == 422 and "block_size" in wrong.body["error"]
        assert (
            await call(app, "PATCH", f"/workers/{worker_id}", raw=b"null", content_type=b"application/json")
        ).status == 422
    assert (await call(app, "PATCH", "/workers/9", {"block_size": 8})).body == {"error": "worker 9 not found"}
