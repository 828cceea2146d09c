"""Two frontends (``kvrouter frontend --selection-url``) in front of a cluster of three selection-service replicas
(``select-service --cluster``) on a real etcd and nats-server, with two ``kvrouter mock-worker`` processes, all on
free loopback ports and stopped by PID: a completion through frontend A, then the same prompt through frontend B,
is routed to the worker that cached it; the replica owning the scope killed with kill -9, both frontends serve
again once a survivor took the scope over, still routing the prompt to that worker; frontend A killed with kill -9,
B serves on. Flags that configure the selection are refused with ``--selection-url`` in one line (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.api.frontend.remote_routing import REFRESH_SECONDS
from tests.support.cluster import scope_row, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.processes import KvrouterProcess, free_port
from tests.support.replicas import AUTH, TOKEN, SelectReplica, select_replicas

pytestmark = pytest.mark.slow
__all__ = ["etcd_and_nats", "select_replicas", "servers"]  # fixtures (tests/support)

MODEL = "mock"
PROMPT = list(range(1, 65))  # 4 blocks of 16 tokens, the mock worker's block size
CLI = [sys.executable, "-m", "kvrouter.api.cli.main"]


def token_file(directory: Path) -> Path:
    path = directory / "frontend-token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


def frontend(directory: Path, name: str, replicas: list[SelectReplica]) -> KvrouterProcess:
    port = free_port()
    urls = ",".join(replica.url for replica in replicas)
    argv = [*CLI, "frontend", "--port", str(port), "--selection-url", urls,
            "--auth-token-file", str(token_file(directory)), "--log-level", "info"]  # fmt: skip
    return KvrouterProcess(directory, name, argv, port)


def mock_worker(directory: Path, worker_id: int, register: SelectReplica) -> KvrouterProcess:
    port = free_port()
    argv = [*CLI, "mock-worker", "--port", str(port), "--kv-events-port", str(free_port()),
            "--replay-port", str(free_port()), "--speedup", "10", "--model-name", MODEL,
            "--register", register.url, "--register-token-file", str(token_file(directory)),
            "--worker-id", str(worker_id)]  # fmt: skip
    return KvrouterProcess(directory, f"worker-{worker_id}", argv, port)


@pytest.fixture
async def started(tmp_path: Path, select_replicas: list[SelectReplica]) -> AsyncIterator[list[KvrouterProcess]]:
    """Two mock workers registered through the first replica, then frontends A and B."""
    processes = [mock_worker(tmp_path, 1, select_replicas[0]), mock_worker(tmp_path, 2, select_replicas[0])]
    processes += [frontend(tmp_path, "frontend-a", select_replicas), frontend(tmp_path, "frontend-b", select_replicas)]
    try:
        async with httpx.AsyncClient(base_url=select_replicas[0].url, trust_env=False, headers=AUTH) as http:
            await wait_for_members(http, 3)
            for process in processes[:2]:
                await process.start()
            await schedulable_workers(http, 2)
        for process in processes[2:]:
            await process.start()
        yield processes
    finally:
        for process in processes:
            await process.kill9()


async def schedulable_workers(http: httpx.AsyncClient, count: int) -> None:
    """Until ``count`` workers are schedulable with their KV listeners active on the scope's owner."""
    with trio.fail_after(20):
        while True:
            answer = await http.get("/workers")
            if answer.status_code == 200:
                rows = answer.json()
                active = [row for row in rows if row["lifecycle"] == "schedulable" and row.get("kv_listeners")
                          and all(s.get("state") == "active" for s in row["kv_listeners"].values())]  # fmt: skip
                if len(active) == count:
                    return
            await trio.sleep(0.05)


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})


async def cached_on(http: httpx.AsyncClient, worker_id: int) -> None:
    """Until the scope's owner shows ``PROMPT``'s 4 blocks cached on ``worker_id`` (its KV events arrived)."""
    with trio.fail_after(20):
        while True:
            answer = await http.post("/overlap_scores", json={"model_name": MODEL, "token_ids": PROMPT})
            if answer.status_code == 200:
                rows = {row["worker_id"]: row["device_blocks"] for row in answer.json()["workers"]}
                if rows.get(worker_id) == 4:
                    return
            await trio.sleep(0.05)


async def served_again(http: httpx.AsyncClient) -> httpx.Response:
    """The first 200 of the same prompt, retried while the scope has no owner (503, with an ``{"error"}``; 504 for a
    booking that was with the owner as it died: its outcome is unknown, and the service's expiry frees it)."""
    with trio.fail_after(30):
        while True:
            answer = await complete(http, PROMPT)
            if answer.status_code == 200:
                return answer
            assert answer.status_code in (503, 504) and "error" in answer.json(), answer.text
            await trio.sleep(0.1)


async def test_two_frontends_share_routing_and_survive_the_owner_and_a_frontend_killed(
    select_replicas: list[SelectReplica], started: list[KvrouterProcess]
) -> None:
    front_a, front_b = started[2], started[3]
    replicas = {replica.url: replica for replica in select_replicas}
    async with (
        httpx.AsyncClient(base_url=front_a.url, trust_env=False, headers=AUTH, timeout=30) as through_a,
        httpx.AsyncClient(base_url=front_b.url, trust_env=False, headers=AUTH, timeout=30) as through_b,
        httpx.AsyncClient(base_url=select_replicas[0].url, trust_env=False, headers=AUTH, timeout=15) as service,
    ):
        assert (await through_a.get("/v1/models")).json()["data"][0]["id"] == MODEL
        first = await complete(through_a, PROMPT)
        assert first.status_code == 200, first.text
        holder = int(first.headers["x-kvrouter-worker-id"])
        await cached_on(service, holder)
        again = await complete(through_b, PROMPT)  # the other frontend, the same prompt
        assert again.status_code == 200, again.text
        assert int(again.headers["x-kvrouter-worker-id"]) == holder
        assert again.headers["x-kvrouter-overlap-blocks"] == "4"

        owner = (await scope_row(service, MODEL))["owner"]
        await trio.sleep(1)  # the KV events' records are published with the next group (nobody waits for them)
        await replicas[owner].kill9()
        killed = trio.current_time()
        for name, through in (("A", through_a), ("B", through_b)):
            after = await served_again(through)
            print(f"frontend {name} served again {trio.current_time() - killed:.2f} s after the owner's kill -9")
            assert int(after.headers["x-kvrouter-worker-id"]) == holder  # the KV index came back with the scope
            assert after.headers["x-kvrouter-overlap-blocks"] == "4"
        for n in range(10):
            answer = await complete([through_a, through_b][n % 2], PROMPT[: 16 * (n % 4 + 1)])
            assert answer.status_code == 200, answer.text

        await front_a.kill9()
        await trio.sleep(REFRESH_SECONDS)
        for n in range(5):
            answer = await complete(through_b, [100 + n, *PROMPT])
            assert answer.status_code == 200, answer.text
        stats = (await through_b.get("/frontend/stats")).json()
        assert stats["requests"] >= 7, stats


@pytest.mark.parametrize(
    "flag",
    [
        ["--data-dir", "x"],
        ["--workers", "http://127.0.0.1:8101"],
        ["--router-mode", "kv"],
        ["--seed", "3"],
        ["--discovery-backend", "file", "--discovery-file", "workers.json"],
        ["--model-name", "llama"],  # the --workers' model and block size: the service's catalog names them
        ["--block-size", "32"],
    ],
)
def test_selection_flags_are_refused_with_selection_url(flag: list[str], tmp_path: Path) -> None:
    argv = [*CLI, "frontend", "--selection-url", "http://127.0.0.1:8092", *flag]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--selection-url does not take" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
