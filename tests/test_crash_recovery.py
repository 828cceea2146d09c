"""kill -9 the real service (a subprocess) and restart it on the same data dir: nothing
acknowledged is lost, and the read endpoints answer exactly as before the crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.kv_wire import encode_batch
from tests.support.kv_publisher import open_kv_publisher
from tests.support.processes import free_port

pytestmark = pytest.mark.slow


class Service:
    def __init__(
        self,
        data_dir: Path,
        durability: str,
        module: str = "kvrouter.api.slot_tracker",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.module = module
        self.extra_args = extra_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / f"service-{durability}.log"
        self.process: trio.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    self.module,
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(self.data_dir),
                    "--durability",
                    self.durability,
                    "--log-level",
                    "warning",
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        async with httpx.AsyncClient(base_url=self.url) as http:
            with trio.fail_after(20):
                while True:
                    if self.process.poll() is not None:
                        raise AssertionError(self.log.read_text())
                    try:
                        if (await http.get("/health")).status_code == 200:
                            return
                    except httpx.TransportError:
                        await trio.sleep(0.05)

    async def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        await self.process.wait()


async def snapshot_reads(http: httpx.AsyncClient) -> tuple:
    potential = (
        await http.post(
            "/potential_loads",
            json={
                "model_name": "m",
                "sequence_hashes": [1, 2, 3, 4, 5],
                "new_isl_tokens": 9,
            },
        )
    ).json()
    key = lambda r: (r["worker_id"], r["dp_rank"])  # noqa: E731 - order is unspecified, compare sorted
    return (await http.get("/workers")).json(), (await http.get("/loads")).json(), sorted(potential, key=key)


# httpx leaves a response-stream generator unfinalised when the server dies mid-response; that is
# the client library reacting to the crash we cause on purpose, not a fault of the service.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("durability", ["always", "batch", "off"])
async def test_every_acknowledged_write_survives_kill_9(tmp_path: Path, durability: str) -> None:
    service = Service(tmp_path / "data", durability)
    await service.start()
    acknowledged: dict[str, list[int]] = {}
    attempted: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            for worker in (1, 2):
                body = {"worker_id": worker, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2}
                assert (await http.post("/register", json=body)).status_code == 201
            for i in range(40):
                hashes = [1, 2, 3, 100 + i][: 1 + i % 4]
                body = {
                    "model_name": "m",
                    "request_id": f"q{i}",
                    "worker_id": 1 + i % 2,
                    "dp_rank": i % 2,
                    "sequence_hashes": hashes,
                    "new_isl_tokens": 10 * i,
                }
                assert (await http.post("/add", json=body)).status_code == 201
            for i in range(0, 40, 3):
                await http.post("/prefill_complete", json={"model_name": "m", "request_id": f"q{i}"})
            for i in range(0, 40, 5):
                await http.post("/free", json={"model_name": "m", "request_id": f"q{i}"})
            before = await snapshot_reads(http)

            # Now crash in the middle of concurrent writes, remembering what was acknowledged.
            async def writer(client_id: int) -> None:
                for n in range(10_000):
                    request_id = f"c{client_id}-{n}"
                    attempted.append(request_id)
                    body = {
                        "model_name": "m",
                        "request_id": request_id,
                        "worker_id": 1,
                        "dp_rank": 0,
                        "sequence_hashes": [client_id, n],
                        "new_isl_tokens": 1,
                    }
                    try:
                        response = await http.post("/add", json=body)
                    except httpx.TransportError:
                        return
                    if response.status_code == 201:
                        acknowledged[request_id] = [client_id, n]

            async with trio.open_nursery() as nursery:
                for client_id in range(4):
                    nursery.start_soon(writer, client_id)
                await trio.sleep(0.5)
                await service.kill9()
    finally:
        if service.process and service.process.poll() is None:
            await service.kill9()

    assert len(acknowledged) > 10, "the crash came before any concurrent write was acknowledged"
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            workers, _, _ = await snapshot_reads(http)
            assert workers == before[0]
            for request_id, hashes in acknowledged.items():
                body = {
                    "model_name": "m",
                    "request_id": request_id,
                    "worker_id": 1,
                    "dp_rank": 0,
                    "sequence_hashes": hashes,
                }
                response = await http.post("/add", json=body)
                assert response.status_code == 409, f"acknowledged {request_id} was lost"
            # Free everything attempted during the crash (acknowledged or not: a write may be
            # durable without its reply having reached us); then the reads equal the pre-crash ones.
            for request_id in attempted:
                await http.post("/free", json={"model_name": "m", "request_id": request_id})
            assert await snapshot_reads(http) == before
    finally:
        await service.kill9()


async def test_restart_without_crash_keeps_state(tmp_path: Path) -> None:
    service = Service(tmp_path / "data", "always")
    await service.start()
    async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
        body = {"worker_id": 3, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
        await http.post("/register", json=body)
        add = {
            "model_name": "m",
            "request_id": "a",
            "worker_id": 3,
            "dp_rank": 0,
            "sequence_hashes": [1, 2],
            "new_isl_tokens": 5,
        }
        await http.post("/add", json=add)
        before = await snapshot_reads(http)
    assert service.process is not None
    service.process.send_signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await service.process.wait() == 0
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            assert await snapshot_reads(http) == before
    finally:
        await service.kill9()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_selection_service_survives_kill_9(tmp_path: Path) -> None:
    """Catalog, KV index and every acknowledged reservation are back after kill -9."""
    service = Service(tmp_path / "data", "always", module="kvrouter.api.select_service")
    tokens = list(range(64))
    acknowledged: list[str] = []
    async with open_kv_publisher() as publisher:
        worker = {
            "worker_id": 3,
            "model_name": "m",
            "endpoint": "http://w3",
            "block_size": 4,
            "kv_events_endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
        }
        await service.start()
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
                assert (await http.post("/workers", json=worker)).status_code == 201
                publisher.publish(encode_batch([["BlockStored", [1, 2, 3, 4], None, tokens[:16], 4, None, None]]))
                query = {"model_name": "m", "token_ids": tokens}
                with trio.fail_after(10):
                    scores = "/overlap_scores"
                    while (await http.post(scores, json=query)).json()["workers"][0]["device_blocks"] < 4:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                workers_before = (await http.get("/workers")).json()

                async def reserve(client_id: int) -> None:
                    for n in range(10_000):
                        body = {**query, "reservation_id": f"c{client_id}-{n}"}
                        try:
                            response = await http.post("/select_and_reserve", json=body)
                        except httpx.TransportError:
                            return
                        if response.status_code == 200:
                            acknowledged.append(body["reservation_id"])

                async with trio.open_nursery() as nursery:
                    for client_id in range(4):
                        nursery.start_soon(reserve, client_id)
                    await trio.sleep(0.5)
                    await service.kill9()
        finally:
            if service.process and service.process.poll() is None:
                await service.kill9()
        assert len(acknowledged) > 10
        await service.start()
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
                workers_after = (await http.get("/workers")).json()
                for row in workers_before + workers_after:
                    row.pop("kv_listeners", None)
                assert workers_after == workers_before
                scores = (await http.post("/overlap_scores", json={"model_name": "m", "token_ids": tokens})).json()
                assert scores["workers"][0]["device_blocks"] == 4
                for reservation_id in acknowledged:
                    assert (await http.delete(f"/reservations/{reservation_id}")).status_code == 200
        finally:
            await service.kill9()


async def test_a_second_process_on_the_same_data_dir_refuses_to_start(tmp_path: Path) -> None:
    first = Service(tmp_path / "data", "always")
    await first.start()
    try:
        second = await trio.run_process(
            [
                sys.executable,
                "-m",
                "kvrouter.api.slot_tracker",
                "--port",
                str(free_port()),
                "--data-dir",
                str(tmp_path / "data"),
            ],
            capture_stderr=True,
            check=False,
        )
        assert second.returncode == 2
        assert b"is in use by another kvrouter process" in second.stderr
    finally:
        await first.kill9()
    await first.start()  # the lock died with the first process
    await first.kill9()
