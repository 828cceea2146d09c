"""``--fronts 2`` as an operator runs it: a supervisor, the actor process and two front processes, real
processes on 127.0.0.1. The same requests get the same answers as in one process; a front killed with -9
loses nothing acknowledged and comes back; the actor process killed with -9 stops the service in one line
and a restart recovers every acknowledged write; SIGTERM stops every process gracefully; startup errors
stay one line with exit status 2.

A thread reads the supervisor's stderr, which every child inherits: it closes only once every process of
the service has exited, so a test that sees it closed knows no child was left behind.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

CLI = [sys.executable, "-m", "kvrouter.api.cli.main"]
TIMEOUT = 90
LISTENING = re.compile(r" listening on http://127\.0\.0\.1:(\d+) \(")
M = {"model_name": "m", "tenant_id": "t"}


class FrontedService:
    """``kvrouter <argv> --fronts N`` on a port of its own choosing (see tests/api/test_cli.py's Service)."""

    def __init__(self, argv: list[str], tmp_path: Path, port: int = 0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        self.process = subprocess.Popen(
            [*CLI, *argv, "--port", str(port)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
        )
        self._lines: list[str] = []
        self._events: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        line = self.wait_for(LISTENING)
        assert line is not None, f"exited with {self.process.wait(TIMEOUT)}: {self.stderr()}"
        self.listening = line
        found = LISTENING.search(line)
        assert found is not None
        self.port = int(found[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self._lines.append(line)
                self._events.put(line)
        self._events.put(None)  # every process of the service has exited

    def wait_for(self, pattern: re.Pattern[str]) -> str | None:
        """The next stderr line matching ``pattern``; None if stderr closed first."""
        while True:
            line = self._events.get(timeout=TIMEOUT)  # a hang guard only
            if line is None:
                return None
            if pattern.search(line):
                return line

    def children(self, role: str) -> list[int]:
        """The pids of the supervisor's children in ``role`` (actor, front)."""
        pid = self.process.pid
        found = []
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if any(part.startswith(f"{role},".encode()) for part in command):
                found.append(int(child))
        return found

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(TIMEOUT)

    def stderr(self) -> str:
        """Everything the service wrote; asserts that every one of its processes has exited."""
        self._reader.join(TIMEOUT)
        assert not self._reader.is_alive(), "a process of the service is still running"
        return "".join(self._lines)


@pytest.fixture
def started() -> Any:
    services: list[FrontedService] = []

    def start(argv: list[str], tmp_path: Path, port: int = 0) -> FrontedService:
        service = FrontedService(argv, tmp_path, port)
        services.append(service)
        return service

    yield start
    for service in services:
        if service.process.poll() is None:
            service.process.kill()
            service.process.wait(TIMEOUT)


def slot_tracker(data_dir: Path, fronts: int = 2) -> list[str]:
    return ["slot-tracker", "--fronts", str(fronts), "--data-dir", str(data_dir), "--log-level", "info"]


def add(http: httpx.Client, request_id: str) -> int:
    body = {**M, "request_id": request_id, "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2], "new_isl_tokens": 9}
    return http.post("/add", json=body).status_code


def active_prefill_tokens(http: httpx.Client) -> int:
    return sum(row["active_prefill_tokens"] for row in http.get("/loads").json())


# -- the same answers as one process -----------------------------------------------------------------------

SLOT_SCENARIO: list[tuple[str, str, Any]] = [
    ("POST", "/register", {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 2}),
    ("POST", "/register", {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 2}),
    ("POST", "/register", {**M, "worker_id": 2, "block_size": 8, "dp_start": 0, "dp_size": 1}),
    ("POST", "/register", {**M, "worker_id": "x"}),
    (
        "POST",
        "/add",
        {**M, "request_id": "a", "worker_id": 1, "dp_rank": 1, "sequence_hashes": [5, 6], "new_isl_tokens": 7},
    ),
    ("POST", "/add", {**M, "request_id": "b", "worker_id": 9, "dp_rank": 0, "sequence_hashes": []}),
    ("POST", "/add", {"model_name": "none", "request_id": "c", "worker_id": 1, "dp_rank": 0, "sequence_hashes": []}),
    ("GET", "/loads", None),
    ("GET", "/workers?model_name=m", None),
    ("POST", "/potential_loads", {**M, "sequence_hashes": [5, 6, 7], "new_isl_tokens": 11}),
    ("POST", "/potential_loads", {"model_name": "none", "sequence_hashes": []}),
    ("POST", "/prefill_complete", {**M, "request_id": "a"}),
    ("POST", "/free", {**M, "request_id": "a"}),
    ("POST", "/free", {**M, "request_id": "a"}),
    ("POST", "/unregister", {**M, "worker_id": 2}),
    ("GET", "/replica_sync/peers", None),
    ("POST", "/replica_sync/register_peer", {"endpoint": "tcp://127.0.0.1:1"}),
    ("POST", "/register", b"{not json"),
    ("GET", "/nowhere", None),
    ("GET", "/health", None),
]

W = {"model_name": "m", "endpoint": "http://w", "block_size": 4, "kv_events_endpoint": "tcp://127.0.0.1:1"}
SELECT_SCENARIO: list[tuple[str, str, Any]] = [
    ("GET", "/ready", None),
    ("POST", "/select", {"model_name": "m", "token_ids": [1, 2, 3, 4]}),
    ("POST", "/workers", {**W, "worker_id": 1}),
    ("POST", "/workers", {**W, "worker_id": 2, "data_parallel_size": 2, "taints": ["gpu"]}),
    ("PATCH", "/workers/2", {"total_kv_blocks": 100, "replay_endpoint": "tcp://127.0.0.1:65535"}),
    ("PATCH", "/workers/9", {}),
    ("GET", "/workers", None),
    ("POST", "/select", {"model_name": "m", "token_ids": list(range(12)), "allowed_worker_ids": [1]}),
    ("POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(9)), "reservation_id": "r1"}),
    ("POST", "/select_and_reserve", {"model_name": "m", "token_ids": [1], "reservation_id": "r1"}),
    (
        "POST",
        "/reservations",
        {
            "model_name": "m",
            "reservation_id": "r2",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": [3, 4],
            "isl_tokens": 8,
        },
    ),
    ("POST", "/reservations/r1/prefill_complete", None),
    ("POST", "/reservations/r1/output_block", {"decay_fraction": 0.5}),
    ("POST", "/reservations/r1/output_block", {"decay_fraction": 2.0}),
    ("GET", "/loads", None),
    ("POST", "/potential_loads", {"model_name": "m", "token_ids": [1, 2, 3, 4, 5]}),
    ("POST", "/overlap_scores", {"model_name": "m", "token_ids": [1, 2, 3, 4, 5]}),
    ("DELETE", "/reservations/r1", None),
    ("DELETE", "/reservations/r1", None),
    ("POST", "/select_disaggregated", {"model_name": "m", "token_ids": [1, 2, 3], "reservation_id": "d"}),
    ("GET", "/dump", None),
    ("DELETE", "/workers/1", None),
    ("DELETE", "/workers/1", None),
    ("POST", "/replica_sync/deregister_peer", {"endpoint": "nonsense"}),
]


def play(url: str, scenario: list[tuple[str, str, Any]]) -> list[tuple[int, str]]:
    answers = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, body in scenario:
            if isinstance(body, bytes):
                response = http.request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.request(method, path, json=body)
            answers.append((response.status_code, response.text))
    return answers


@pytest.mark.parametrize(
    ("service", "scenario", "extra"),
    [
        ("slot-tracker", SLOT_SCENARIO, []),
        ("select-service", SELECT_SCENARIO, ["--seed", "5", "--no-use-kv-events"]),
    ],
)
def test_the_same_requests_get_the_same_answers_as_in_one_process(
    service: str, scenario: list[tuple[str, str, Any]], extra: list[str], tmp_path: Path, started: Any
) -> None:
    answers = {}
    for fronts in (0, 2):
        argv = [service, "--fronts", str(fronts), "--data-dir", str(tmp_path / f"data{fronts}"), *extra]
        running = started(argv, tmp_path)
        answers[fronts] = play(running.url, scenario)
        assert running.stop() == 0
    for (method, path, body), single, fronted in zip(scenario, answers[0], answers[2], strict=True):
        assert fronted == single, f"{method} {path} {body}"


# -- crashes and stops -------------------------------------------------------------------------------------


def test_a_front_killed_with_sigkill_loses_nothing_acknowledged_and_comes_back(tmp_path: Path, started: Any) -> None:
    service = started(slot_tracker(tmp_path / "data"), tmp_path)
    fronts = service.children("front")
    assert len(fronts) == 2
    with httpx.Client(base_url=service.url, timeout=30) as http:
        body = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert http.post("/register", json=body).status_code == 201
        assert [add(http, f"r{i}") for i in range(40)] == [201] * 40
    os.kill(fronts[0], signal.SIGKILL)
    assert service.wait_for(re.compile(r"front process \d is serving again")) is not None
    assert len(service.children("front")) == 2 and fronts[0] not in service.children("front")
    with httpx.Client(base_url=service.url, timeout=30) as http:  # new connections: either front may answer
        assert active_prefill_tokens(http) == 40 * 9
        assert [add(http, f"s{i}") for i in range(20)] == [201] * 20
        assert active_prefill_tokens(http) == 60 * 9
    assert service.stop() == 0


def test_the_actor_process_killed_with_sigkill_stops_the_service_and_a_restart_recovers(
    tmp_path: Path, started: Any
) -> None:
    service = started(slot_tracker(tmp_path / "data"), tmp_path)
    with httpx.Client(base_url=service.url, timeout=30) as http:
        body = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert http.post("/register", json=body).status_code == 201
        assert [add(http, f"r{i}") for i in range(30)] == [201] * 30
    [actor] = service.children("actor")
    os.kill(actor, signal.SIGKILL)
    assert service.process.wait(TIMEOUT) == 1
    errors = [line for line in service.stderr().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "the actor process exited (status -9)" in errors[0], errors
    again = started(slot_tracker(tmp_path / "data"), tmp_path)
    assert "1 scope recovered" in again.listening
    with httpx.Client(base_url=again.url, timeout=30) as http:
        assert active_prefill_tokens(http) == 30 * 9
    assert again.stop() == 0


def test_sigterm_stops_every_process_gracefully(tmp_path: Path, started: Any) -> None:
    service = started(slot_tracker(tmp_path / "data"), tmp_path)
    with httpx.Client(base_url=service.url, timeout=30) as http:
        body = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert http.post("/register", json=body).status_code == 201
        assert add(http, "r") == 201
    assert service.stop() == 0
    log = service.stderr()  # (returns only once every child has exited)
    assert " ERROR " not in log and "Traceback" not in log
    assert "journal closed" in log and "kvrouter slot tracker stopped" in log
    again = started(slot_tracker(tmp_path / "data"), tmp_path)
    assert "(2 fronts, data dir" in again.listening and "1 scope recovered" in again.listening
    with httpx.Client(base_url=again.url, timeout=30) as http:
        assert active_prefill_tokens(http) == 9
    assert again.stop() == 0


def test_a_port_in_use_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*CLI, *slot_tracker(tmp_path / "data"), "--port", str(port)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"port {port} is already in use" in errors[0], result.stderr


def test_a_data_dir_in_use_is_one_line_and_exit_status_2(tmp_path: Path, started: Any) -> None:
    first = started(slot_tracker(tmp_path / "data"), tmp_path)
    result = subprocess.run(
        [*CLI, *slot_tracker(tmp_path / "data"), "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "is in use by another kvrouter process" in errors[0], result.stderr
    assert first.stop() == 0


def test_the_supervisor_killed_with_sigkill_stops_its_children_gracefully_and_leaves_nothing(
    tmp_path: Path, started: Any
) -> None:
    service = started(slot_tracker(tmp_path / "data"), tmp_path)
    [actor] = service.children("actor")
    role = next(part for part in Path(f"/proc/{actor}/cmdline").read_bytes().split(b"\0") if part.startswith(b"actor,"))
    runtime_dir = Path(role.decode().split(",")[1])
    assert (runtime_dir / "actor").exists()
    with httpx.Client(base_url=service.url, timeout=30) as http:
        body = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert http.post("/register", json=body).status_code == 201
        assert add(http, "r") == 201
    service.process.kill()
    log = service.stderr()  # returns once every child has exited (they get SIGTERM when the supervisor dies)
    assert "journal closed" in log and "Traceback" not in log
    assert not runtime_dir.exists()
    again = started(slot_tracker(tmp_path / "data"), tmp_path)
    with httpx.Client(base_url=again.url, timeout=30) as http:
        assert active_prefill_tokens(http) == 9
    assert again.stop() == 0
