"""How a write ends when it cannot be acknowledged: 504 with a request id when its durable reply is late;
503 when the journal can no longer be written (a full disk), after which the service stops with one line
and a restart finds every write it acknowledged."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.exit_reasons import STOPPED, ServiceContext, explain
from kvrouter.api.process.main import (
    ServiceHandle,
    ServiceOptions,
    run_service,
    select_service_builder,
    slot_tracker_app,
)
from kvrouter.journal import segment_writer
from kvrouter.journal.store import Durability
from tests.support.asgi import call, service_app
from tests.support.journals import GatedJournal

REGISTER = {"model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 1}


async def test_a_write_without_a_durable_reply_in_time_answers_504_with_a_request_id(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()  # the disk never confirms
    app, _ = await service_app(nursery, slot_tracker_app, journal, reply_deadline=2.0)
    started = trio.current_time()
    late = await call(app, "POST", "/register", {"worker_id": 1, **REGISTER})
    assert trio.current_time() - started == pytest.approx(2.0)
    assert late.status == 504 and set(late.body) == {"error", "request_id"}
    assert late.body["error"].startswith("no reply within 2 s; the command may still be applied")
    assert late.body["request_id"] in late.body["error"]
    journal.release()
    workers = await call(app, "GET", "/workers")
    assert [row["worker_id"] for row in workers.body] == [1]  # it was applied: only the answer was late


async def test_a_late_catalog_write_answers_504_and_the_next_one_still_sees_it(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    build = select_service_builder(RouterConfig(use_kv_events=False))
    app, _ = await service_app(nursery, build, journal, reply_deadline=2.0)
    worker = {"worker_id": 7, "model_name": "m", "endpoint": "http://w", "block_size": 4}
    assert (await call(app, "POST", "/workers", worker)).status == 504
    assert (await call(app, "POST", "/workers", {**worker, "model_name": "other"})).status == 504
    journal.release()
    rows = (await call(app, "GET", "/workers")).body
    assert [(row["worker_id"], row["model_name"]) for row in rows] == [(7, "other")]  # moved, not duplicated


# -- a full disk -------------------------------------------------------------------------------------------


class FullDisk:
    """Stands in for the journal's pwrite: fails with ENOSPC while ``full``, as a full filesystem does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self._write = segment_writer.write_all_at
        monkeypatch.setattr(segment_writer, "write_all_at", self.write)

    def write(self, fd: int, data: Any, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._write(fd, data, offset)


async def test_a_full_disk_answers_504_or_503_stops_with_one_line_and_loses_nothing_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = FullDisk(monkeypatch)
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    stopped: list[BaseException] = []
    finished = trio.Event()

    async def serve(*, task_status: trio.TaskStatus[ServiceHandle]) -> None:
        try:
            await run_service("slot tracker", options, slot_tracker_app, task_status=task_status)
        except BaseException as exc:
            stopped.append(exc)
        finally:
            finished.set()

    statuses: dict[int, tuple[int | None, Any]] = {}
    async with trio.open_nursery() as nursery:
        handle: ServiceHandle = await nursery.start(serve)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            for worker_id in range(3):
                assert (await http.post("/register", json={"worker_id": worker_id, **REGISTER})).status_code == 201
            caplog.clear()
            caplog.set_level(logging.INFO)
            disk.full = True

            async def register(worker_id: int) -> None:
                try:
                    response = await http.post("/register", json={"worker_id": worker_id, **REGISTER})
                except (httpx.RemoteProtocolError, httpx.ConnectError):
                    # Sent while the service was already stopping: on a connection it had not read from yet, it
                    # closed the connection unanswered (HTTP lets a server close an idle connection), or the
                    # client's new connection came after the listener had closed. Either way the client sees the
                    # write as not acknowledged, as a 503 would say. Seen under load.
                    statuses[worker_id] = (None, None)
                    return
                statuses[worker_id] = (response.status_code, response.json())

            async with trio.open_nursery() as clients:
                for worker_id in range(3, 8):
                    clients.start_soon(register, worker_id)
        with trio.fail_after(10):
            await finished.wait()
    assert sorted(statuses) == list(range(3, 8))
    answered = [(status, body) for status, body in statuses.values() if status is not None]
    assert answered  # the first failed write is answered, before the service stops
    assert any(status == 504 for status, _ in answered)  # the write the disk refused had been appended
    for status, body in answered:
        assert "No space left on device" in body["error"]
        if status == 504:  # appended before the write failed: whether it survives is unknown (a look is needed)
            assert body["error"].startswith("the journal failed (") and "may or may not" in body["error"]
        else:  # refused before reaching the journal: not applied, safe to send again
            assert status == 503
            assert body["error"].startswith("the journal cannot be written (") and "not applied" in body["error"]
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []  # the one line is the command line's, from the error the service stopped with:
    reason = explain(stopped[0], ServiceContext("127.0.0.1", 0, options.data_dir), journal_open=True)
    assert reason.status == STOPPED and "\n" not in reason.message
    assert reason.message.startswith(f"stopped: writing the journal in {options.data_dir} failed (No space left")
    assert "free space on its filesystem and restart" in reason.message

    disk.full = False  # space freed: a restart has every acknowledged write
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            workers = [row["worker_id"] for row in (await http.get("/workers")).json()]
            assert workers[:3] == [0, 1, 2] and set(workers) <= set(range(8))
            assert (await http.post("/register", json={"worker_id": 9, **REGISTER})).status_code == 201
        handle.stop()
