"""A worker killed with ``kill -9`` under steady load: the frontend's circuit breaker takes it out of selection at
the first failure, so one request pays a retry for it, not every other one; a worker restarted on the same
endpoint is chosen again once its probe passes (``docs/frontend.md#dead-workers``).

Real processes: two ``kvrouter mock-worker`` processes on 127.0.0.1 that register themselves with a frontend
(in-process, real hypercorn, round-robin so that without the breaker every other request would go to the dead
worker first). Short cool-downs keep the test quick; nothing asserts on elapsed time.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from kvrouter import IN_PROCESS_KV_EVENTS
from kvrouter.api.frontend.service import FrontendHandle
from tests.frontend.test_frontend_proxy import closed_port
from tests.support.frontends import small_limits, start_frontend, wait_idle, wait_listeners
from tests.support.mock_workers import start_mock_worker
from tests.support.processes import free_port, start_process

PROMPT = list(range(100, 117))
REQUESTS = 40
COOL_DOWN = 0.2  # --worker-cool-down-secs of the test's frontend
MAX_COOL_DOWN = 0.4


class WorkerProcess:
    """One ``kvrouter mock-worker`` process on fixed ports (so that a restart serves the same endpoint)."""

    def __init__(self, worker_id: int, frontend: FrontendHandle, log_dir: Path) -> None:
        self.worker_id = worker_id
        self.port, self.kv_port = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.frontend = frontend
        self.log_dir = log_dir
        self.starts = 0
        self.process: trio.Process | None = None

    async def start(self) -> None:
        self.starts += 1
        argv = [sys.executable, "-m", "kvrouter.api.cli.main", "mock-worker", "--port", str(self.port)]
        argv += ["--kv-events-port", str(self.kv_port), "--block-size", "4", "--blocks", "256", "--speedup", "1000"]
        argv += ["--worker-id", str(self.worker_id), "--register", self.frontend.url]
        log = self.log_dir / f"worker-{self.worker_id}-{self.starts}.log"
        self.process = await start_process(argv, self.port, log)

    async def kill(self) -> None:
        """``kill -9``: no unregistration, no goodbye."""
        assert self.process is not None
        self.process.kill()
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def complete(http: httpx.AsyncClient, index: int) -> httpx.Response:
    return await http.post("/v1/completions", json={"prompt": [*PROMPT, index], "max_tokens": 2})


def row_of(stats: dict[str, Any], worker_id: int) -> dict[str, Any]:
    (row,) = [row for row in stats["workers"] if row["worker_id"] == worker_id]
    return row


async def wait_row(http: httpx.AsyncClient, worker_id: int, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Until the worker's ``/frontend/stats`` row passes ``check``; the row then."""
    with trio.fail_after(30):
        while True:
            row = row_of((await http.get("/frontend/stats")).json(), worker_id)
            if check(row):
                return row
            await trio.sleep(0.02)


async def test_a_killed_worker_costs_one_retry_and_comes_back_when_restarted(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    limits = small_limits(connect_timeout=2.0, breaker_cool_down=COOL_DOWN, breaker_max_cool_down=MAX_COOL_DOWN)
    frontend = await start_frontend(nursery, "round_robin", limits=limits)
    workers = [WorkerProcess(worker_id, frontend, tmp_path) for worker_id in (1, 2)]
    try:
        for worker in workers:
            await worker.start()
        await wait_listeners(frontend, 2)
        await under_load_then_killed(frontend, workers)
        await restarted(frontend, workers[0])
    finally:
        for worker in workers:
            await worker.stop()


async def under_load_then_killed(frontend: FrontendHandle, workers: list[WorkerProcess]) -> None:
    dead = workers[0]
    served: Counter[int] = Counter()
    async with httpx.AsyncClient(base_url=frontend.url, timeout=30) as http:
        killed_at = 0.0
        for index in range(REQUESTS):
            if index == REQUESTS // 2:
                await dead.kill()
                killed_at = trio.current_time()
            answer = await complete(http, index)
            assert answer.status_code == 200, answer.text  # every request succeeds
            served[int(answer.headers["x-kvrouter-worker-id"])] += 1
        finished_at = trio.current_time()
        stats = (await http.get("/frontend/stats")).json()
        # Sequential requests: the first one booked on the dead worker after the kill pays the one retry; the
        # breaker is open from then on, so none of the 19 after it is sent there (round robin alone sends about
        # half of them, each paying a retry: the same test without the breaker counts ~10).
        assert stats["retried"] == 1, stats
        assert served[dead.worker_id] == REQUESTS // 2 // 2 and served[2] == REQUESTS - served[dead.worker_id]
        row = row_of(stats, dead.worker_id)
        assert row["breaker"] in ("open", "half_open") and row["cause"] == "refused", row
        assert str(dead.port) in row["last_error"]  # refused at first, then the failed probes say so
        metrics = (await http.get("/metrics")).text
        assert 'kvrouter_frontend_breaker_openings_total{cause="refused"} 1.0' in metrics
        assert "kvrouter_frontend_dead_worker_retries_total 1.0" in metrics
        assert "kvrouter_frontend_workers_out 1.0" in metrics
        await wait_idle(http)  # the failed attempt's booking was freed too
        out_after = (finished_at - killed_at) - row["out_for_secs"]
        print(f"\nretries paid: {stats['retried']} of {REQUESTS - REQUESTS // 2} requests after the kill")
        print(f"out of selection {max(0.0, out_after) * 1000:.0f} ms after the kill (at the first request sent there)")


async def restarted(frontend: FrontendHandle, worker: WorkerProcess) -> None:
    async with httpx.AsyncClient(base_url=frontend.url, timeout=30) as http:
        # While it is dead its probes fail: it stays out (and the failed trials back off).
        await wait_row(http, worker.worker_id, lambda row: row.get("failed_trials", 0) >= 1)
        await worker.start()  # the same port: the same endpoint
        started = trio.current_time()
        await wait_row(http, worker.worker_id, lambda row: row["breaker"] == "closed")
        print(f"back in selection {(trio.current_time() - started) * 1000:.0f} ms after the restart's port opened")
        served: Counter[int] = Counter()
        for index in range(4):
            answer = await complete(http, 1000 + index)
            assert answer.status_code == 200, answer.text
            served[int(answer.headers["x-kvrouter-worker-id"])] += 1
        assert served == {1: 2, 2: 2}  # round robin over both again
        stats = (await http.get("/frontend/stats")).json()
        assert stats["retried"] == 1
        assert 'kvrouter_frontend_breaker_trials_total{outcome="passed"} 1.0' in (await http.get("/metrics")).text


async def answering_worker(status: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A worker that answers every request (its ``/health`` probes too) with ``status``, and counts them."""
    seen = answering_worker_requests.setdefault(status, [])

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            seen.append(data.split(b"\r\n", 1)[0].decode())
            body = b'{"error":"the engine died"}'
            head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            await stream.send_all(head.encode() + b"connection: close\r\n\r\n" + body)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(serve, listeners)


answering_worker_requests: dict[int, list[str]] = {}


async def register(http: httpx.AsyncClient, worker_id: int, port: int) -> None:
    worker = {"worker_id": worker_id, "model_name": "mock", "endpoint": f"http://127.0.0.1:{port}", "block_size": 4}
    worker["kv_events_endpoint"] = IN_PROCESS_KV_EVENTS
    assert (await http.post("/workers", json=worker)).status_code in (200, 201)


async def test_a_worker_answering_500_is_taken_out_and_its_request_served_elsewhere(nursery: trio.Nursery) -> None:
    answering_worker_requests.clear()
    limits = small_limits(breaker_cool_down=0.05, breaker_max_cool_down=0.1)
    frontend = await start_frontend(nursery, "round_robin", limits=limits)
    port = await nursery.start(answering_worker, 500)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        await register(http, 1, port)
        await start_mock_worker(nursery, register_url=frontend.url, worker_id=2)
        for index in range(6):
            answer = await complete(http, index)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvrouter-worker-id"] == "2"
        stats = (await http.get("/frontend/stats")).json()
        assert stats["retried"] == 1 and stats["worker_errors"] == 1
        row = row_of(stats, 1)
        assert row["cause"] == "server_error"  # its last error may be a probe's already
        # Its probes answer 500 too: it stays out, and only probes reach it after the first request.
        row = await wait_row(http, 1, lambda row: row.get("failed_trials", 0) >= 2)
        assert row["last_error"] == "probe answered 500"
        completions = [line for line in answering_worker_requests[500] if line.startswith("POST")]
        assert len(completions) == 1 and all("/health" in line for line in answering_worker_requests[500][1:])
        await wait_idle(http)


async def test_a_worker_shedding_load_with_503_stays_in_selection(nursery: trio.Nursery) -> None:
    """503 is a live worker saying it is full: passed on with Retry-After, as before; no breaker opens."""
    frontend = await start_frontend(nursery, "round_robin")
    port = await nursery.start(answering_worker, 503)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        await register(http, 1, port)
        for index in range(2):
            answer = await complete(http, index)
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        stats = (await http.get("/frontend/stats")).json()
        assert row_of(stats, 1)["breaker"] == "closed" and stats["retried"] == 0
        await wait_idle(http)


async def test_concurrent_requests_pay_at_most_one_retry_each_for_a_dead_worker(nursery: trio.Nursery) -> None:
    """With C requests in flight, those booked on the dead worker before the first failure opened its breaker
    each pay one retry (at most C); every later request avoids it."""
    concurrency = 4
    limits = small_limits(breaker_cool_down=30.0, breaker_max_cool_down=30.0)
    frontend = await start_frontend(nursery, "round_robin", limits=limits)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        await register(http, 1, closed_port())
        await start_mock_worker(nursery, register_url=frontend.url, worker_id=2)
        statuses: list[int] = []

        async def client(offset: int) -> None:
            for index in range(5):
                statuses.append((await complete(http, offset * 100 + index)).status_code)

        async with trio.open_nursery() as clients:
            for offset in range(concurrency):
                clients.start_soon(client, offset)
        assert statuses == [200] * concurrency * 5
        retried = (await http.get("/frontend/stats")).json()["retried"]
        assert 1 <= retried <= concurrency
        await wait_idle(http)
