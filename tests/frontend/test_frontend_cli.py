"""``kvrouter frontend`` as an operator runs it: flags refused in one line with exit 2, and real processes (a
frontend with a bearer token, a mock worker registering itself with that token, SIGTERM for both)."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.api.frontend.cli import main
from tests.support.frontends import loads
from tests.support.processes import free_port, start_process

CLI = [sys.executable, "-m", "kvrouter.api.cli.main"]


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (
            ["--router-mode", "fastest"],
            "--router-mode='fastest' is not a router mode (use kv, round-robin, random, kv-ttft)",
        ),
        (["--router-mode", "direct"], "--router-mode='direct' is not a router mode"),
        (["--kv-overlap-score-weight", "-1"], "--kv-overlap-score-weight='-1' must be >= 0"),
        (["--router-temperature", "hot"], "--router-temperature='hot' is not a number"),
        (["--busy-threshold", "1.5"], "--busy-threshold='1.5' must be between 0 and 1"),
        (["--port", "70000"], "--port='70000' must be between 0 and 65535"),
        (["--workers", "127.0.0.1:8101"], "--workers: `127.0.0.1:8101` is not an http:// or https:// URL"),
        (["--workers", "http://a:1=http://b"], "KV-events endpoint 'http://b' of http://a:1 must be tcp://"),
        (["--max-in-flight", "0"], "--max-in-flight='0' must be between 1 and"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer /nonexistent/tokenizer.json"),
        (["--shards", "2"], "unrecognized arguments: --shards"),
        (["--worker-cool-down-secs", "0"], "--worker-cool-down-secs='0' must be between 0.001 and"),
        (
            ["--worker-cool-down-secs", "5", "--worker-max-cool-down-secs", "2"],
            "--worker-max-cool-down-secs=2 is shorter than --worker-cool-down-secs=5",
        ),
        (["--selection-url", ""], "--selection-url is empty"),
        (["--selection-url", " , "], "--selection-url is empty"),
        (["--selection-url", "127.0.0.1:8092"], "--selection-url: `127.0.0.1:8092` is not an http:// or https://"),
        (["--selection-url", "http://127.0.0.1:8092/select"], "`http://127.0.0.1:8092/select` has a path (/select)"),
        (["--selection-url", "http://127.0.0.1:8092?x=1"], "`http://127.0.0.1:8092?x=1` has a query"),
        (["--selection-url", "http://127.0.0.1:http"], "`http://127.0.0.1:http` has an invalid port `http`"),
        (
            ["--selection-url", "http://127.0.0.1:8092,,http://127.0.0.1:8093"],
            "--selection-url='http://127.0.0.1:8092,,http://127.0.0.1:8093' has an empty item",
        ),
        (["--selection-url", "http://127.0.0.1:8092,"], "--selection-url='http://127.0.0.1:8092,' has an empty item"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, flags: list[str], text: str
) -> None:
    try:
        status = main(flags)
    except SystemExit as exited:
        status = exited.code  # type: ignore[assignment]
    assert status == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    lines += [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1 and text in lines[0], lines


async def test_a_mock_worker_registers_with_a_token_protected_frontend(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*CLI, "frontend", "--port", str(port), "--auth-token-file", str(token), "--data-dir", str(tmp_path / "j")]
    frontend = await start_process(argv, port, tmp_path / "frontend.log")
    worker_argv = [*CLI, "mock-worker", "--port", "0", "--kv-events-port", "0", "--speedup", "100"]
    worker_argv += ["--register", url, "--register-token-file", str(token), "--worker-id", "5"]
    worker = await trio.lowlevel.open_process(worker_argv, stderr=subprocess.PIPE)
    try:
        auth = {"authorization": "Bearer s3cret-token"}
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            with trio.fail_after(30):
                while not (await http.get("/v1/models", headers=auth)).json()["data"]:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            refused = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert refused.status_code == 401 and "bearer token" in refused.json()["error"]
            answer = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=auth)
            assert answer.status_code == 200 and answer.headers["x-kvrouter-worker-id"] == "5"
            worker.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await worker.wait()
            # It unregistered on the way out, with the token.
            assert (await http.get("/workers", headers=auth)).json() == []
    finally:
        for process in (worker, frontend):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await process.wait()
    assert worker.returncode == 0 and frontend.returncode == 0
    log = (tmp_path / "frontend.log").read_text()
    assert re.search(r"kvrouter frontend listening on http://127\.0\.0\.1:\d+ \(router mode kv", log), log
    assert " ERROR " not in log and "Traceback" not in log


async def test_a_frontend_killed_mid_request_frees_its_bookings_when_it_restarts(tmp_path: Path) -> None:
    """Before: the 30 bookings of a frontend killed with -9 came back as active requests and lingered until the
    stale-request expiry (minutes), skewing routing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*CLI, "frontend", "--port", str(port), "--data-dir", str(tmp_path / "j")]
    frontend = await start_process(argv, port, tmp_path / "frontend.log")
    # Slow workers: each answer takes seconds, so the requests are still in flight at the kill.
    worker_argv = [*CLI, "mock-worker", "--port", "0", "--kv-events-port", "0", "--speedup", "0.2"]
    workers = [
        await trio.lowlevel.open_process(
            [*worker_argv, "--register", url, "--worker-id", str(i)], stderr=subprocess.DEVNULL
        )
        for i in (1, 2)
    ]
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(30):
                while len((await http.get("/workers")).json()) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.05)

            async def request() -> None:
                with contextlib.suppress(httpx.HTTPError):  # the frontend is killed under it
                    await http.post("/v1/completions", json={"prompt": "tell me a story", "max_tokens": 500})

            async with trio.open_nursery() as clients:
                for _ in range(10):
                    clients.start_soon(request)
                with trio.fail_after(30):
                    while sum(row["active_requests"] for row in (await loads(http)).values()) < 10:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                frontend.kill()
                await frontend.wait()
            frontend = await start_process(argv, port, tmp_path / "frontend-again.log")
            rows = await loads(http)
            assert len(rows) == 2 and all(row["active_requests"] == 0 for row in rows.values()), rows
        log = (tmp_path / "frontend-again.log").read_text()
        assert "freed 10 bookings of requests in flight when the frontend last stopped" in log, log
    finally:
        for process in (*workers, frontend):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await process.wait()


def test_a_selection_url_nobody_listens_on_is_one_line_and_exit_2(tmp_path: Path) -> None:
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    argv = [*CLI, "frontend", "--port", str(free_port()), "--selection-url", ",".join(nowhere)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--selection-url: nothing answered for 5 s" in lines[0], lines
    assert all(url in lines[0] for url in nowhere) and "start the selection service first" in lines[0], lines
