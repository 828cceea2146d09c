"""Answer budgets (api/streams/answer_budget.py): a POST /batch answer is bounded in bytes, and a command stream whose
client does not read stops reading its commands once its unsent answers reach the connection's budget."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
import trio.testing

from kvrouter.api.http import Request, Response, Route, json_response
from kvrouter.api.streams.answer_budget import AnswerBudgets, AnswerMetrics, StreamOutput, Unsent
from kvrouter.api.streams.command_runner import CommandRunner
from kvrouter.api.streams.command_stream import CommandStream
from kvrouter.api.streams.live import StreamSettings
from tests.api.test_batch import add, cmd
from tests.support.services import running

RANKS = 500  # a GET /loads of the worker answers ~60 KB
CAP = 100_000


def budgets(**caps: int) -> StreamSettings:
    return StreamSettings(answers=AnswerBudgets(**caps))


async def test_a_batch_answer_stops_at_its_cap_and_commands_past_it_are_not_run(tmp_path: Path) -> None:
    """Before: 1,000 such reads built a 60 MB answer (a 4,096-rank worker: 609 MB). Now the first read fits, the
    second would pass the cap and answers 413 (it changed nothing), and nothing after it runs, writes included."""
    async with (
        running("slot tracker", tmp_path, streams=budgets(batch_answer_bytes=CAP)) as service,
        httpx.AsyncClient(base_url=service.urls[0]) as client,
    ):
        body = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": RANKS}
        assert (await client.post("/register", json=body)).status_code == 201
        loads = cmd("GET", "/loads?model_name=m")
        commands = [add("before"), loads, loads, add("after"), *[loads] * 100]
        answer = await client.post("/batch", json=commands)
        assert answer.status_code == 200 and len(answer.content) < CAP + 110 * 300
        results = answer.json()
        assert [r["status"] for r in results[:3]] == [201, 200, 413]
        assert len(results[1]["body"]) == RANKS
        assert all(r["status"] == 413 and "--max-batch-answer-bytes" in r["body"]["error"] for r in results[2:])
        rows = (await client.get("/loads", params={"model_name": "m"})).json()
        assert sum(row["active_prefill_tokens"] for row in rows) == 48  # "before" applied, "after" not run
        metrics = (await client.get("/metrics")).text
        assert "kvrouter_batch_commands_not_run_total 102.0" in metrics


async def test_the_default_cap_bounds_a_batch_of_large_reads(tmp_path: Path) -> None:
    """With the defaults: 1,000 reads of ~75 KB answered 75 MB before; now the answer stays near 16 MiB."""
    async with (
        running("slot tracker", tmp_path) as service,
        httpx.AsyncClient(base_url=service.urls[0], timeout=60) as client,
    ):
        body = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": RANKS}
        assert (await client.post("/register", json=body)).status_code == 201
        answer = await client.post("/batch", json=[cmd("GET", "/loads?model_name=m")] * 1000)
        assert answer.status_code == 200 and len(answer.content) <= 17 * 1024 * 1024
        assert answer.json()[-1]["status"] == 413


async def test_a_batch_under_its_cap_is_answered_in_full(tmp_path: Path) -> None:
    async with (
        running("slot tracker", tmp_path, streams=budgets(batch_answer_bytes=CAP)) as service,
        httpx.AsyncClient(base_url=service.urls[0]) as client,
    ):
        commands = [add(f"r{i}", first_hash=10 * i) for i in range(200)] + [cmd("GET", "/loads")]
        results = (await client.post("/batch", json=commands)).json()
        assert [r["status"] for r in results] == [404] * 200 + [200]  # (no worker registered: the route's 404)


def large_reads() -> tuple[CommandRunner, list[int]]:
    """A runner whose GET /large answers ~300 KB after a checkpoint (as a read waits for its barrier)."""
    big = json_response(200, {"pad": "x" * 300_000})
    started = [0]

    async def large(request: Request) -> Response:
        started[0] += 1
        await trio.lowlevel.checkpoint()
        return big

    runner = CommandRunner()
    runner.serve([Route("GET", "/large", large)])
    return runner, started


async def test_a_stream_that_is_not_read_stops_reading_at_its_budget() -> None:
    """In process: a client that takes the first results message and then nothing (its socket full). Before, the
    stream read all 40 messages and ran all 400 reads (120 MB held for a client that takes nothing; 1.4 GB in the
    attack); now it holds at most its budget of unsent answers (the default, 4 MiB: what
    ``kvrouter_command_stream_unsent_peak_bytes`` shows) and leaves the rest of the messages unread."""
    runner, started = large_reads()
    inbox_send, inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
    for i in range(40):
        message = {"commands": [{"id": 10 * i + j, "method": "GET", "path": "/large"} for j in range(10)]}
        inbox_send.send_nowait({"type": "websocket.receive", "text": orjson.dumps({**message, "ordered": False})})
    sent: list[dict[str, Any]] = []
    never = trio.Event()

    async def send_out(message: dict[str, Any]) -> None:
        if sent:
            await never.wait()  # the client's socket takes nothing more
        sent.append(message)

    stream = CommandStream(runner, send_out)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, inbox.receive)
        await trio.testing.wait_all_tasks_blocked()
        assert started[0] < 40 and inbox.statistics().current_buffer_used >= 30  # the rest is left unread
        budget = stream.output.limit
        assert stream.output.everywhere.peak <= budget and stream.output.unsent <= budget
        assert started[0] <= 1 + budget // 300_000 + 3  # the first message's results, then up to the budget
        never.set()  # the client reads again: everything is answered
        await trio.testing.wait_all_tasks_blocked()
        assert started[0] == 400 and inbox.statistics().current_buffer_used == 0
        assert stream.output.unsent == 0 and stream.output.everywhere.used == 0
        nursery.cancel_scope.cancel()


async def test_a_connection_waits_for_the_service_wide_budget_unless_it_holds_nothing() -> None:
    """Two connections over a service-wide budget of 1 MiB: the one holding unsent answers has no room, the one
    holding nothing still reads (one thing at a time), so clients that read their answers keep going."""
    everywhere = Unsent(1 << 20, AnswerMetrics(None))
    stuck, reading = StreamOutput(4 << 20, everywhere), StreamOutput(4 << 20, everywhere)
    stuck.add(1 << 20)
    assert not stuck.has_room(1) and reading.has_room(1) and reading.has_room(3 << 20)
    reading.add(10)
    assert not reading.has_room(1)
    stuck.close()
    assert everywhere.used == 10 and reading.has_room(1)
