"""``kvrouter watch`` as a user runs it (a subprocess) against a live service: ``--json`` lines follow the
loads and the decisions, and every failure is one line with exit 2 (bad URL or token file) or 1 (refused
connection, refused upgrade), never a traceback. Also the table and the decision log as rendered."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from rich.console import Console

from kvrouter.api.cli.watch import LoadTable, decision_line, main
from tests.support.services import running

WATCH = [sys.executable, "-m", "kvrouter.api.cli.main", "watch"]


class Lines:
    """A child's stdout, line by line."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdout is not None
        self.stream = process.stdout
        self.buffer = b""

    async def next(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            assert chunk, "the watcher exited"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        parsed: dict[str, Any] = orjson.loads(line)
        return parsed

    async def next_of(self, kind: str) -> dict[str, Any]:
        while True:
            found = await self.next()
            if found["type"] == kind:
                return found


async def test_watch_json_follows_loads_and_decisions_of_a_live_service(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path / "slots") as slots, httpx.AsyncClient(base_url=slots.urls[0]) as http:
        process = await trio.lowlevel.open_process([*WATCH, slots.urls[0], "--json"], stdout=subprocess.PIPE)
        try:
            lines = Lines(process)
            assert await lines.next() == {"type": "snapshot", "scopes": []}
            body = {"worker_id": 3, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}
            assert (await http.post("/register", json=body)).status_code == 201
            update = await lines.next_of("update")
            assert update["loads"] == (await http.get("/loads")).json()
        finally:
            process.terminate()
            await process.wait()
    async with (
        running("selection service", tmp_path / "select") as selector,
        httpx.AsyncClient(base_url=selector.urls[0]) as http,
    ):
        worker = {
            "worker_id": 1,
            "model_name": "m",
            "block_size": 4,
            "endpoint": "http://w1",
            "kv_events_endpoint": "tcp://127.0.0.1:1",
        }
        assert (await http.post("/workers", json=worker)).status_code == 201
        command = [*WATCH, selector.urls[0], "--json", "--decisions", "--model-name", "m"]
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
        try:
            lines = Lines(process)
            assert (await lines.next())["type"] == "ready"
            reply = (await http.post("/select", json={"model_name": "m", "token_ids": list(range(8))})).json()
            seen = await lines.next_of("decision")
            assert (seen["worker_id"], seen["overlap"]) == (reply["worker_id"], reply["overlap"])
            assert seen["explain"]["reason"] == "constraint"  # one worker: the only eligible rank
        finally:
            process.terminate()
            await process.wait()


def run_watch(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WATCH, *arguments], capture_output=True, text=True, timeout=60)


def test_a_bad_url_or_token_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for arguments in (
        ["ftp://127.0.0.1:1"],
        ["http://127.0.0.1:99999"],
        ["http://127.0.0.1:1/loads"],
        ["http://127.0.0.1:1", "--token-file", str(tmp_path / "missing")],
        [],
        ["http://127.0.0.1:1", "--bogus"],
    ):
        done = run_watch(*arguments)
        assert done.returncode == 2, (arguments, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("kvrouter watch: "), done.stderr
        assert "Traceback" not in done.stderr


def test_a_refused_connection_is_one_line_and_exit_1() -> None:
    done = run_watch("http://127.0.0.1:1")
    assert done.returncode == 1
    assert done.stderr.startswith("kvrouter watch: cannot connect to ws://127.0.0.1:1/ws/loads")
    assert done.stderr.count("\n") == 1


async def test_a_refused_upgrade_says_why(tmp_path: Path) -> None:
    """401 without the token (it passes with --token-file), 404 for --decisions on the slot tracker."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    async with running("slot tracker", tmp_path / "data", token="s3cret") as service:
        url = service.urls[0]
        no_token = await trio.to_thread.run_sync(run_watch, url, "--json")
        assert no_token.returncode == 1
        assert "401" in no_token.stderr and "--token-file" in no_token.stderr
        assert no_token.stderr.count("\n") == 1
        decisions = await trio.to_thread.run_sync(run_watch, url, "--decisions", "--token-file", str(token_file))
        assert decisions.returncode == 1 and "404" in decisions.stderr and "--decisions" in decisions.stderr
        command = [*WATCH, url, "--json", "--token-file", str(token_file)]
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
        try:
            assert (await Lines(process).next())["type"] == "snapshot"
        finally:
            process.terminate()
            await process.wait()


def test_the_table_and_the_decision_log_as_rendered() -> None:
    table = LoadTable()
    row = {"model_name": "m", "tenant_id": "t", "routing_group": "t", "worker_id": 4, "dp_rank": 1}
    table.apply({"type": "snapshot", "scopes": [{**row, "loads": [{**row, "active_prefill_tokens": 5}], "seq": 1}]})
    table.apply({"type": "update", **row, "loads": [{**row, "active_prefill_tokens": 9}], "seq": 4})
    assert table.missed == 2  # seq 2 and 3 were conflated
    out = io.StringIO()
    Console(file=out, width=120).print(table.render("ws://x/ws/loads"))
    text = out.getvalue()
    assert "prefill tokens" in text and " 9 " in text and "2 states conflated" in text
    line = decision_line(
        {
            "seq": 7,
            "at_ns": 0,
            "model_name": "m",
            "tenant_id": "t",
            "reserved": True,
            "worker_id": 2,
            "dp_rank": 0,
            "explain": {
                "reason": "cache",
                "rule": None,
                "isl_tokens": 64,
                "candidates": [
                    {"worker_id": 2, "dp_rank": 0, "cost": 1.5, "cached_tokens": 48},
                    {"worker_id": 3, "dp_rank": 0, "cost": 4.0, "cached_tokens": 0},
                ],
            },
        }
    )
    assert "worker 2 rank 0: cache, cost 1.50, cached 48 of 64 tokens, 2 candidates" in line
    assert main(["not a url at all:::"], io.StringIO()) == 2


async def _finish(process: trio.Process) -> tuple[int, str]:
    """Wait for the watcher to exit; its status and stderr."""
    assert process.stderr is not None
    chunks = []
    while chunk := await process.stderr.receive_some(65536):
        chunks.append(chunk)
    return await process.wait(), b"".join(chunks).decode()


async def test_a_stream_the_service_closes_is_one_line_and_exit_1(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path / "data") as service:
        command = [*WATCH, service.urls[0], "--json"]
        process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert (await Lines(process).next())["type"] == "snapshot"
    # leaving `running` stopped the service, which closes every stream with 1001
    with trio.fail_after(60):
        status, stderr = await _finish(process)
    assert status == 1, stderr
    assert stderr.startswith("kvrouter watch: the service closed the stream (1001"), stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr


def _ctrl_c_as_in_a_terminal() -> None:
    """In the watcher, before it runs: SIGINT's default disposition, as a terminal's Ctrl-C finds it. A test run
    started in the background (``&`` in a script) ignores SIGINT, and its children inherit that: Python then
    installs no KeyboardInterrupt handler and the watcher sits out the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_ctrl_c_exits_0_without_a_traceback(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path / "data") as service:
        command = [*WATCH, service.urls[0], "--json"]
        process = await trio.lowlevel.open_process(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_ctrl_c_as_in_a_terminal
        )
        with trio.fail_after(60):
            assert (await Lines(process).next())["type"] == "snapshot"  # following the stream
            process.send_signal(signal.SIGINT)
            status, stderr = await _finish(process)
        assert (status, stderr) == (0, "")
