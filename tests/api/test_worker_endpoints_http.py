"""Worker endpoints at every surface of the selection service, on real hypercorn on 127.0.0.1: a bad endpoint or a
host outside ``--worker-endpoint-allow`` is a 400 ``{"error"}`` before anything is journaled (POST and PATCH
/workers, ``POST /batch``, the command stream, the embedded router); re-pointing a worker is logged, and with a
token configured needs it; a record journaled before the check still starts the service."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from trio_websocket import HandshakeError

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import WorkerUpserted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.worker_endpoints import parse_allow_list
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.api.embedded import Router, RouterError
from kvrouter.api.process.main import ServiceHandle
from kvrouter.client.stream import open_websocket
from tests.conftest import start_select_service
from tests.support.journal_files import append_records
from tests.support.services import running

BAD_ENDPOINTS = [
    "http://127.0.0.1:19000/secret/internal#",
    "http://127.0.0.1:19000/secret?x=",
    "http://user:pw@127.0.0.1:19000",
    "ftp://127.0.0.1/x",
    "file:///etc/passwd",
    "javascript:alert(1)",
    "http://",
    "http://" + "a" * 3000,
    "http://é.example",
    "http://2130706433:19000",
]
WORKER = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000", "block_size": 4, "kv_events_endpoint": ""}
TOKEN = "s3cret-endpoints"


@contextlib.asynccontextmanager
async def serving(data_dir: Path, **options: Any) -> AsyncIterator[tuple[ServiceHandle, httpx.AsyncClient]]:
    async with (
        running("selection service", data_dir, **options) as service,
        httpx.AsyncClient(base_url=service.urls[0], timeout=10) as http,
    ):
        yield service, http


def ws_url(http_url: str) -> str:
    return "ws" + http_url[4:] + "/ws/commands"


async def catalog(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    rows = (await http.get("/workers")).json()
    for row in rows:
        row.pop("kv_listeners", None)
    return list(rows)


async def test_a_bad_endpoint_is_refused_at_every_http_surface_and_nothing_is_journaled(tmp_path: Path) -> None:
    async with running("selection service", tmp_path / "data") as service:
        async with httpx.AsyncClient(base_url=service.urls[0], timeout=10) as http:
            assert (await http.post("/workers", json=WORKER)).status_code == 201
            before = await catalog(http)
            for endpoint in BAD_ENDPOINTS:
                created = await http.post("/workers", json={**WORKER, "worker_id": 2, "endpoint": endpoint})
                repointed = await http.post("/workers", json={**WORKER, "endpoint": endpoint})
                patched = await http.patch("/workers/1", json={"endpoint": endpoint})
                commands = [
                    {"method": "POST", "path": "/workers", "body": {**WORKER, "worker_id": 3, "endpoint": endpoint}},
                    {"method": "PATCH", "path": "/workers/1", "body": {"endpoint": endpoint}},
                ]
                batch = (await http.post("/batch", json=commands)).json()
                for answer in (created, repointed, patched):
                    assert answer.status_code == 400, (endpoint, answer.text)
                    assert list(answer.json()) == ["error"]
                assert [result["status"] for result in batch] == [400, 400], (endpoint, batch)
            async with open_websocket(ws_url(service.urls[0])) as ws:
                message = {"commands": [{"id": 1, **commands[0]}, {"id": 2, **commands[1]}], "ordered": True}
                await ws.send_message(orjson.dumps(message).decode())
                streamed: list[dict[str, Any]] = []
                while len(streamed) < 2:  # results may come in more than one message
                    streamed += orjson.loads(await ws.get_message())["results"]
            assert sorted(result["status"] for result in streamed) == [400, 400]
            assert await catalog(http) == before
        last_lsn = service.system.journal.last_lsn
    async with running("selection service", tmp_path / "data") as service:
        assert service.system.journal.last_lsn == last_lsn  # nothing refused reached the journal
        async with httpx.AsyncClient(base_url=service.urls[0], timeout=10) as http:
            assert await catalog(http) == before


async def test_the_embedded_router_refuses_a_bad_endpoint() -> None:
    async with Router.open("m") as router:
        with pytest.raises(RouterError) as refused:
            await router.register_worker(1, endpoint="http://127.0.0.1:19000/secret/internal#", block_size=4)
        assert refused.value.status == 400 and "fragment" in refused.value.message
        assert await router.workers() == []


async def test_a_host_outside_the_allow_list_is_refused_everywhere(tmp_path: Path) -> None:
    config = RouterConfig(worker_endpoint_allow=parse_allow_list(["10.0.0.0/8,w1"]))
    async with serving(tmp_path / "data", config=config) as (_, http):
        assert (await http.post("/workers", json=WORKER)).status_code == 201
        inside = await http.post("/workers", json={**WORKER, "worker_id": 2, "endpoint": "http://10.9.8.7:8000"})
        assert inside.status_code == 201, inside.text
        before = await catalog(http)
        for body in (
            {**WORKER, "worker_id": 3, "endpoint": "http://127.0.0.1:19000"},
            {**WORKER, "endpoint": "http://169.254.169.254"},  # re-pointing an allowed worker
            {**WORKER, "worker_id": 3, "model_name": "n", "endpoint": "http://w2:8000"},
            {**WORKER, "worker_id": 3, "kv_events_endpoint": "tcp://192.168.0.1:5557"},
        ):
            refused = await http.post("/workers", json=body)
            assert refused.status_code == 400, refused.text
            assert "not in the operator's allow-list" in refused.json()["error"]
        patched = await http.patch("/workers/2", json={"endpoint": "http://127.0.0.1:8000"})
        assert patched.status_code == 400 and "--worker-endpoint-allow 10.0.0.0/8, w1" in patched.json()["error"]
        batch = await http.post(
            "/batch", json=[{"method": "PATCH", "path": "/workers/1", "body": {"endpoint": "http://x"}}]
        )
        assert batch.json()[0]["status"] == 400
        assert await catalog(http) == before


async def test_re_pointing_a_worker_is_logged_with_old_and_new(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter")
    async with serving(tmp_path / "data") as (_, http):
        assert (await http.post("/workers", json=WORKER)).status_code == 201
        assert (await http.post("/workers", json=WORKER)).status_code == 201  # the same endpoint: no line
        assert not [r for r in caplog.records if "re-pointed" in r.getMessage()]
        assert (await http.post("/workers", json={**WORKER, "endpoint": "http://attacker:8000"})).status_code == 201
        assert (await http.patch("/workers/1", json={"endpoint": "http://w1b:8000"})).status_code == 200
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "re-pointed" in r.getMessage()]
    assert lines == [
        (
            logging.WARNING,
            "worker 1 (model=m tenant_id=default): endpoint re-pointed http://w1:8000 -> http://attacker:8000",
        ),
        (
            logging.WARNING,
            "worker 1 (model=m tenant_id=default): endpoint re-pointed http://attacker:8000 -> http://w1b:8000",
        ),
    ]


async def test_with_a_token_re_pointing_a_worker_needs_it(tmp_path: Path) -> None:
    """Every catalog write needs the token when one is set (``api/http/auth.py``): a re-registration that would send
    the model's prompts elsewhere is a 401 without it, on every surface, and changes nothing."""
    good = {"authorization": f"Bearer {TOKEN}"}
    async with serving(tmp_path / "data", token=TOKEN) as (service, http):
        assert (await http.post("/workers", json=WORKER, headers=good)).status_code == 201
        before = (await http.get("/workers", headers=good)).json()
        moved = {**WORKER, "endpoint": "http://attacker:8000"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            assert (await http.post("/workers", json=moved, headers=headers)).status_code == 401
            assert (
                await http.patch("/workers/1", json={"endpoint": moved["endpoint"]}, headers=headers)
            ).status_code == 401
            batch = [{"method": "POST", "path": "/workers", "body": moved}]
            assert (await http.post("/batch", json=batch, headers=headers)).status_code == 401
        with pytest.raises(HandshakeError):
            async with open_websocket(ws_url(service.urls[0])):
                pass
        assert (await http.get("/workers", headers=good)).json() == before
        assert (await http.post("/workers", json=moved, headers=good)).status_code == 201


async def test_a_record_journaled_before_the_check_starts_the_service_and_can_be_fixed(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    legacy = WorkerRecord(1, "m", endpoint="http://127.0.0.1:19000/secret/internal#", block_size=4)
    await append_records(data_dir, [encode_record(ScopeKey("m", "default"), (WorkerUpserted(legacy, 4),))])
    async with serving(data_dir) as (_, http):
        (row,) = await catalog(http)
        assert row["endpoint"] == legacy.endpoint
        # Any other change must fix the endpoint too: the patched record is checked whole.
        refused = await http.patch("/workers/1", json={"block_size": 8})
        assert refused.status_code == 400 and refused.json()["error"].startswith("endpoint: ")
        fixed = await http.patch("/workers/1", json={"endpoint": "http://127.0.0.1:19000"})
        assert fixed.status_code == 200, fixed.text


@pytest.mark.parametrize("proxied", [False, True])
async def test_both_process_layouts_refuse_bad_endpoints_and_hosts_outside_the_allow_list(
    nursery: trio.Nursery, tmp_path: Path, proxied: bool
) -> None:
    """``proxied``: the routes run in a front and the catalog in the actor process, as with ``--fronts``."""
    config = RouterConfig(worker_endpoint_allow=parse_allow_list(["w1"]))
    handle = await start_select_service(nursery, tmp_path / "data", config, proxied=proxied)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        for endpoint in [*BAD_ENDPOINTS, "http://w2:8000"]:
            refused = await http.post("/workers", json={**WORKER, "endpoint": endpoint})
            assert refused.status_code == 400 and list(refused.json()) == ["error"], (endpoint, refused.text)
        assert (await http.post("/workers", json=WORKER)).status_code == 201
        assert [row["endpoint"] for row in await catalog(http)] == ["http://w1:8000"]
    handle.stop()
