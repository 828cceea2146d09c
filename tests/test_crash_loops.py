"""No crash loops: input that once crashed the real service, then crashed it again at every start (it was
journaled), is refused with a 4xx and changes nothing; a journal that already holds such a record still
starts; a poison record stops startup with one line naming its repair, and that repair works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import PrefillCompleted, WorkerRegistered, WorkerUpserted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.persistence.codec import encode_record
from tests.support.journal_files import append_records
from tests.support.processes import free_port

pytestmark = pytest.mark.slow

KVROUTER = [sys.executable, "-m", "kvrouter.api.cli.main"]


class Service:
    """The real ``kvrouter`` process on a data directory; ``start`` returns once /health answers."""

    def __init__(self, service: str, data_dir: Path) -> None:
        self.service = service
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / f"{service}.log"
        self.process: trio.Process | None = None

    def argv(self) -> list[str]:
        return [*KVROUTER, self.service, "--port", str(self.port), "--data-dir", str(self.data_dir)]

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(self.argv(), stdout=subprocess.DEVNULL, stderr=log)
        async with httpx.AsyncClient(base_url=self.url) as http:
            with trio.fail_after(20):
                while True:
                    if self.process.poll() is not None:
                        raise AssertionError(f"exited with {self.process.returncode}: {self.log.read_text()}")
                    try:
                        if (await http.get("/health")).status_code == 200:
                            return
                    except httpx.TransportError:
                        await trio.sleep(0.05)

    async def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        await self.process.wait()

    async def stop(self) -> None:
        assert self.process is not None
        self.process.terminate()
        with trio.fail_after(20):
            assert await self.process.wait() == 0

    async def start_fails(self) -> subprocess.CompletedProcess[bytes]:
        with trio.fail_after(20):
            return await trio.run_process(self.argv(), capture_stdout=True, capture_stderr=True, check=False)


async def selection_state(http: httpx.AsyncClient) -> tuple[object, ...]:
    workers = (await http.get("/workers")).json()
    for row in workers:
        row.pop("kv_listeners", None)
    return workers, (await http.get("/loads")).json(), (await http.get("/dump")).json()


WORKER = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4, "kv_events_endpoint": ""}
POISON_REQUESTS = [
    # Each of these answered 500 (or hung) and the first three were journaled: every restart then exited 1.
    ("POST", "/workers", {**WORKER, "worker_id": 2, "data_parallel_size": 2, "replay_endpoint": "tcp://h:²"}),
    ("POST", "/workers", {**WORKER, "worker_id": 3, "kv_events_endpoints": {"²": "tcp://h:1"}}),
    ("POST", "/workers", {**WORKER, "worker_id": 4, "data_parallel_size": 4_000_000_000}),
    ("POST", "/reservations", {"model_name": "nobody", "selection_id": "q"}),
    ("PATCH", "/workers/%C2%B2", {"block_size": 8}),
    ("DELETE", "/workers/%C2%B2", None),
]


async def test_poison_requests_are_refused_and_the_service_restarts(tmp_path: Path) -> None:
    service = Service("select-service", tmp_path / "data")
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            assert (await http.post("/workers", json=WORKER)).status_code == 201
            before = await selection_state(http)
            for method, path, body in POISON_REQUESTS:
                response = await http.request(method, path, json=body)
                assert 400 <= response.status_code < 500, (path, body, response.text)
                assert list(response.json()) == ["error"]
            assert await selection_state(http) == before
    finally:
        await service.kill9()
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            assert await selection_state(http) == before
    finally:
        await service.kill9()


async def test_a_record_journaled_before_validation_does_not_stop_startup(tmp_path: Path) -> None:
    """What the 500 left behind: the record is in the journal, and every start computed int("²")."""
    data_dir = tmp_path / "data"
    scope = ScopeKey("m", "default")
    record = WorkerRecord(
        2,
        "m",
        "default",
        endpoint="http://w2",
        block_size=4,
        kv_events_endpoints=((0, "tcp://127.0.0.1:9"), (1, "tcp://127.0.0.1:9")),
        replay_endpoint="tcp://h:²",
        data_parallel_size=2,
    )
    await append_records(data_dir, [encode_record(scope, (WorkerUpserted(record, 4),))])
    service = Service("select-service", data_dir)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            (row,) = (await http.get("/workers")).json()
            assert (row["worker_id"], row["replay_endpoint"]) == (2, "tcp://h:²")
            # The operator can now fix it through the API.
            fixed = await http.patch("/workers/2", json={"replay_endpoint": "tcp://127.0.0.1:10"})
            assert fixed.status_code == 200, fixed.text
    finally:
        await service.stop()


async def journal(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(30):
        return await trio.run_process(
            [*KVROUTER, "journal", *args], capture_stdout=True, capture_stderr=True, check=False
        )


async def test_a_poison_record_names_its_repair_and_the_repair_works(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    service = Service("slot-tracker", data_dir)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            register = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 2}
            assert (await http.post("/register", json=register)).status_code == 201
            add = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 1, "sequence_hashes": [1, 2]}
            assert (await http.post("/add", json={**add, "new_isl_tokens": 8})).status_code == 201
            before = (await http.get("/workers")).json(), (await http.get("/loads")).json()
    finally:
        await service.stop()
    # A record that decodes but cannot apply (a prefill completion of a request never added), then a good one.
    scope = ScopeKey("m", "default")
    await append_records(
        data_dir,
        [
            encode_record(scope, (PrefillCompleted("never-added"),)),
            encode_record(ScopeKey("n", "default"), (WorkerRegistered(7, 4, 0, 1),)),
        ],
    )
    segments = sorted(data_dir.glob("journal-*.log"))
    poison_lsn = 3  # register, add, then the poison

    refused = await service.start_fails()
    lines = refused.stderr.decode().strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    repair = f"kvrouter journal truncate-after --data-dir {data_dir} --lsn {poison_lsn - 1} --yes"
    assert f"journal record at lsn {poison_lsn} cannot be applied" in lines[0] and repair in lines[0]

    inspected = await journal("inspect", "--data-dir", str(data_dir))
    listing = inspected.stdout.decode()
    assert inspected.returncode == 1, listing
    assert f"lsn {poison_lsn}  " in listing and "model=m tenant_id=default: prefill_completed" in listing
    assert "model=n tenant_id=default: worker_registered" in listing
    assert f"recovery: STOPS at lsn {poison_lsn}: record {poison_lsn} cannot be used" in listing
    assert repair.removeprefix("kvrouter ") in listing

    kept_poison = await journal("truncate-after", "--data-dir", str(data_dir), "--lsn", str(poison_lsn), "--yes")
    assert kept_poison.returncode == 2
    assert f"record {poison_lsn} cannot be used" in kept_poison.stderr.decode()
    files = {path.name: path.read_bytes() for path in segments}

    dry = await journal("truncate-after", "--data-dir", str(data_dir), "--lsn", str(poison_lsn - 1))
    assert dry.returncode == 0 and b"remove 2 records" in dry.stdout and b"nothing changed" in dry.stdout
    assert {path.name: path.read_bytes() for path in segments} == files

    done = await journal("truncate-after", "--data-dir", str(data_dir), "--lsn", str(poison_lsn - 1), "--yes")
    assert done.returncode == 0, done.stderr
    assert b"recovery: ok" in done.stdout

    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            assert ((await http.get("/workers")).json(), (await http.get("/loads")).json()) == before
    finally:
        await service.stop()


async def test_the_journal_of_a_running_service_is_not_truncated(tmp_path: Path) -> None:
    service = Service("slot-tracker", tmp_path / "data")
    await service.start()
    try:
        refused = await journal("truncate-after", "--data-dir", str(service.data_dir), "--lsn", "0", "--yes")
        assert refused.returncode == 2
        assert b"is in use by a running kvrouter; stop it first" in refused.stderr
    finally:
        await service.stop()
