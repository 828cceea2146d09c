"""The journal outlives the machine, in its first form: ``kvrouter select-service --journal jetstream`` killed with
kill -9, then started again on an EMPTY data directory (another machine's) against the same JetStream stream, has
every acknowledged write. And a replica that cannot reach NATS at start exits 2 with one line naming it.
Real nats-server (JetStream, free port, stopped by PID); skips when it is absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.fleet_servers import NatsServer, nats_server
from tests.support.kv_publisher import open_kv_publisher
from tests.support.processes import free_port
from tests.test_crash_recovery import Service

pytestmark = pytest.mark.slow

__all__ = ["nats_server"]  # the fixture (tests/support)


def selector(data_dir: Path, nats_url: str) -> Service:
    args = ("--journal", "jetstream", "--nats-server", nats_url, "--jetstream-stream", "MACHINE_TEST")
    return Service(data_dir, "always", module="kvrouter.api.select_service", extra_args=args)


async def book_until_killed(
    service: Service, worker: dict[str, object], acknowledged: list[str]
) -> list[dict[str, object]]:
    """Register the worker, book reservations from 4 clients, kill -9 the service mid-flight; the workers seen."""
    query = {"model_name": "m", "token_ids": list(range(64))}
    async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
        assert (await http.post("/workers", json=worker)).status_code == 201
        workers: list[dict[str, object]] = (await http.get("/workers")).json()

        async def reserve(client_id: int) -> None:
            for n in range(10_000):
                body = {**query, "reservation_id": f"c{client_id}-{n}"}
                try:
                    response = await http.post("/select_and_reserve", json=body)
                except httpx.TransportError:
                    return
                if response.status_code == 200:
                    acknowledged.append(body["reservation_id"])  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            for client_id in range(4):
                nursery.start_soon(reserve, client_id)
            await trio.sleep(0.5)
            await service.kill9()
    return workers


async def test_every_acknowledged_write_is_recovered_on_an_empty_data_dir(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    first = selector(tmp_path / "machine-a", nats_server.url)
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
        await first.start()
        try:
            workers_before = await book_until_killed(first, worker, acknowledged)
        finally:
            if first.process and first.process.poll() is None:
                await first.kill9()
        assert len(acknowledged) > 10
        second = selector(tmp_path / "machine-b", nats_server.url)  # nothing in it: all comes from the stream
        await second.start()
        await check_recovered(second, workers_before, acknowledged)
    assert not any((tmp_path / "machine-b").glob("journal-*")), "the journal is not on this machine"


async def check_recovered(second: Service, workers_before: list[dict[str, object]], acknowledged: list[str]) -> None:
    try:
        async with httpx.AsyncClient(base_url=second.url, timeout=10) as http:
            workers_after = (await http.get("/workers")).json()
            for row in workers_before + workers_after:
                row.pop("kv_listeners", None)
            assert workers_after == workers_before
            for reservation_id in acknowledged:
                assert (await http.delete(f"/reservations/{reservation_id}")).status_code == 200
    finally:
        await second.kill9()


def test_a_replica_that_cannot_reach_nats_exits_2_naming_it(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", "0"]
    argv += ["--data-dir", str(tmp_path / "data"), "--journal", "jetstream", "--nats-server", url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach NATS at {url}" in lines[0], result.stderr


async def test_a_second_service_on_the_stream_is_fenced_and_stops_in_one_line(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    """Two replicas pointed at one stream by mistake: the one whose append comes second is refused by JetStream,
    answers 503 (not acknowledged), and stops with one line naming the cause; the log holds only the first's."""
    args = ("--journal", "jetstream", "--nats-server", nats_server.url, "--jetstream-stream", "TWO_WRITERS")
    for machine in ("a", "b"):
        (tmp_path / machine).mkdir()
    first = Service(tmp_path / "a" / "data", "always", extra_args=args)
    second = Service(tmp_path / "b" / "data", "always", extra_args=args)  # (each logs in its own directory)
    register = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    await first.start()
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as http:
            assert (await http.post("/register", json=register)).status_code == 201
            await second.start()  # recovers the first's record, then both believe they write the stream
            assert (await http.post("/register", json={**register, "worker_id": 2})).status_code == 201
        async with httpx.AsyncClient(base_url=second.url, timeout=10) as http:
            refused = await http.post("/register", json={**register, "worker_id": 3})
        assert refused.status_code == 503 and "error" in refused.json()
        assert second.process is not None
        with trio.fail_after(30):
            assert await second.process.wait() == 1
        errors = [line for line in second.log.read_text().splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "another writer appended" in errors[0], errors
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as http:
            loads = (await http.get("/loads", params={"model_name": "m"})).json()
        assert sorted(row["worker_id"] for row in loads) == [1, 2]
    finally:
        for service in (first, second):
            if service.process is not None and service.process.poll() is None:
                await service.kill9()
