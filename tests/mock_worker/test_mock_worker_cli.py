"""``kvrouter mock-worker`` as an operator runs it: a real process, its listening line, SIGTERM (which also
unregisters it), and one-line failures with exit 2 for bad configuration."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from kvrouter.api.mock_worker.cli import main
from tests.conftest import start_select_service
from tests.support.kv_publisher import free_tcp_port

CLI = [sys.executable, "-m", "kvrouter.api.cli.main", "mock-worker"]
TIMEOUT = 60
LISTENING = re.compile(r" listening on http://127\.0\.0\.1:(\d+) \(model \S+, worker id (\d+), KV events (\S+),")


class Worker:
    """A mock worker process on free ports; ``port`` and ``worker_id`` come from its own listening line."""

    def __init__(self, *flags: str, tmp_path: Path, wait_for: re.Pattern[str] = LISTENING) -> None:
        self._pattern = wait_for
        argv = [*CLI, "--port", "0", "--kv-events-port", "0", "--speedup", "100", *flags]
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        self.process = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._found: queue.Queue[re.Match[str] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self.lines.append(line)
                if found := self._pattern.search(line):
                    self._found.put(found)
        self._found.put(None)

    def wait_listening(self) -> re.Match[str]:
        found = self._found.get(timeout=TIMEOUT)
        assert found is not None, self.stderr()
        return found

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(TIMEOUT)

    def stderr(self) -> str:
        self._reader.join(TIMEOUT)
        return "".join(self.lines)


def test_a_signal_while_registration_retries_stops_at_once(tmp_path: Path) -> None:
    """Before: SIGTERM waited for every registration attempt (here ~10 minutes) before stopping."""
    nobody = f"http://127.0.0.1:{free_tcp_port()}"
    retrying = re.compile(r"registration attempt 1/1000 failed")
    worker = Worker("--register", nobody, "--register-attempts", "1000", tmp_path=tmp_path, wait_for=retrying)
    worker.wait_listening()
    assert worker.stop() == 0
    assert "received SIGTERM while starting: stopping" in worker.stderr()


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, stderr
    return errors[0]


def test_serves_completions_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    worker = Worker("--replay-port", "0", tmp_path=tmp_path)
    try:
        port = int(worker.wait_listening()[1])
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=orjson.dumps({"prompt": "hello there", "max_tokens": 2}),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            assert orjson.loads(response.read())["usage"]["completion_tokens"] == 2
    finally:
        status = worker.stop()
    assert status == 0
    assert " ERROR " not in worker.stderr() and "received SIGTERM: shutting down" in worker.stderr()


async def test_registers_at_start_and_unregisters_on_sigterm(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start_select_service(nursery, tmp_path / "data")
    url = service.urls[0]
    worker = Worker("--register", url, "--model-name", "m", "--replay-port", "0", tmp_path=tmp_path)
    try:
        found = await trio.to_thread.run_sync(worker.wait_listening)
        async with httpx.AsyncClient(base_url=url, timeout=10) as router:
            (row,) = (await router.get("/workers")).json()
            assert row["worker_id"] == int(found[2]) and row["kv_events_endpoint"] == found[3]
            assert row["model_name"] == "m" and row["block_size"] == 16 and row["endpoint"].endswith(f":{found[1]}")
            assert await trio.to_thread.run_sync(worker.stop) == 0
            assert (await router.get("/workers")).json() == []
    finally:
        worker.stop()
    assert f"unregistered worker {found[2]}" in worker.stderr()
    service.stop()


def bad_starts(tmp_path: Path, *argvs: list[str]) -> list[tuple[int, str]]:
    """Start the processes at once (each pays an interpreter start-up), then collect status and stderr."""
    processes = [
        subprocess.Popen([*CLI, *flags], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for flags in argvs
    ]
    return [(p.wait(TIMEOUT), p.communicate(timeout=TIMEOUT)[1]) for p in processes]


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--port", "70000"], "argument --port: '70000' is not a port number (0-65535)"),
        (["--speedup", "0"], "argument --speedup: '0' is not a positive number"),
        (["--blocks", "nan"], "argument --blocks: 'nan' is not a positive number"),
        (["--worker-id", "-1"], "argument --worker-id: '-1' is not a worker id"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str], flags: list[str], text: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(flags)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and text in err
    assert err.count("\n") == 1 and err.startswith("kvrouter mock-worker: "), err  # one line, not the usage block


def test_startup_failures_are_one_line(tmp_path: Path) -> None:
    nobody = f"http://127.0.0.1:{free_tcp_port()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        http_taken, kv_taken, unreachable, same = bad_starts(
            tmp_path,
            ["--port", port, "--kv-events-port", "0"],
            ["--port", "0", "--kv-events-port", port],
            ["--port", "0", "--kv-events-port", "0", "--register", nobody, "--register-attempts", "1"],
            ["--port", "9001", "--kv-events-port", "9001"],
        )
    assert http_taken[0] == 2
    assert f"cannot start: cannot listen on 127.0.0.1 port {port}" in error_line(http_taken[1])
    assert kv_taken[0] == 2
    assert f"cannot start: a KV-events port (--kv-events-port {port}" in error_line(kv_taken[1])
    assert unreachable[0] == 1
    expected = f"cannot start: cannot register with the selection service at {nobody} after 1 attempts"
    assert expected in error_line(unreachable[1])
    assert same[0] == 2 and "must differ" in error_line(same[1])
