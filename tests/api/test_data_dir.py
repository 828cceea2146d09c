"""A data directory belongs to the service that first used it; the other service refuses it before reading it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import orjson
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.data_dir import MARKER, DataDirectoryOwned
from kvrouter.api.process.main import (
    ServiceHandle,
    ServiceOptions,
    run_service,
    select_service_builder,
    slot_tracker_app,
)
from tests.api.test_select_http import worker

REGISTER = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}


async def slot_tracker(nursery: trio.Nursery, data_dir: Path) -> ServiceHandle:
    handle: ServiceHandle = await nursery.start(
        run_service, "slot tracker", ServiceOptions(port=0, data_dir=data_dir), slot_tracker_app
    )
    return handle


async def selection_service(nursery: trio.Nursery, data_dir: Path) -> ServiceHandle:
    build = select_service_builder(RouterConfig())
    handle: ServiceHandle = await nursery.start(
        run_service, "selection service", ServiceOptions(port=0, data_dir=data_dir), build
    )
    return handle


async def refusal(start: Callable[[trio.Nursery, Path], Awaitable[ServiceHandle]], data_dir: Path) -> str:
    """The one line a service start on ``data_dir`` is refused with (fails if it starts)."""
    try:
        async with trio.open_nursery() as nursery:
            (await start(nursery, data_dir)).stop()
    except BaseExceptionGroup as group:
        matched, _ = group.split(DataDirectoryOwned)
        assert matched is not None, group
        while isinstance(matched, BaseExceptionGroup):
            matched = matched.exceptions[0]
        assert "\n" not in str(matched)
        return str(matched)
    raise AssertionError(f"started on {data_dir}")


async def used_by_slot_tracker(data_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        handle = await slot_tracker(nursery, data_dir)
        async with httpx.AsyncClient(base_url=handle.urls[0]) as http:
            assert (await http.post("/register", json=REGISTER)).status_code == 201
        handle.stop()


async def used_by_selection_service(data_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        handle = await selection_service(nursery, data_dir)
        async with httpx.AsyncClient(base_url=handle.urls[0]) as http:
            assert (await http.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))).status_code == 201
        handle.stop()


async def test_each_service_refuses_the_others_directory(tmp_path: Path) -> None:
    tracker_dir, selector_dir = tmp_path / "tracker", tmp_path / "selector"
    await used_by_slot_tracker(tracker_dir)
    await used_by_selection_service(selector_dir)
    assert orjson.loads((tracker_dir / MARKER).read_bytes())["service"] == "slot tracker"
    line = await refusal(selection_service, tracker_dir)
    assert f"the data directory {tracker_dir} belongs to the slot tracker" in line
    assert "give this selection service its own --data-dir" in line
    assert "belongs to the selection service" in await refusal(slot_tracker, selector_dir)
    await used_by_slot_tracker_again(tracker_dir)  # its own service still opens it, state intact


async def used_by_slot_tracker_again(data_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        handle = await slot_tracker(nursery, data_dir)
        async with httpx.AsyncClient(base_url=handle.urls[0]) as http:
            assert [row["worker_id"] for row in (await http.get("/workers")).json()] == [1]
        handle.stop()


async def test_a_directory_from_before_markers_goes_to_the_service_its_journal_came_from(tmp_path: Path) -> None:
    old = tmp_path / "old"
    await used_by_slot_tracker(old)
    (old / MARKER).unlink()  # as an earlier kvrouter left it: a journal, no marker
    assert "holds a slot tracker's journal" in await refusal(selection_service, old)
    assert not (old / MARKER).exists()
    await used_by_slot_tracker_again(old)  # adopted, and now marked
    assert orjson.loads((old / MARKER).read_bytes())["service"] == "slot tracker"


async def test_a_directory_whose_state_says_nothing_is_adopted(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    async with trio.open_nursery() as nursery:
        (await slot_tracker(nursery, empty)).stop()
    (empty / MARKER).unlink()
    await used_by_selection_service(empty)
    assert orjson.loads((empty / MARKER).read_bytes())["service"] == "selection service"


@pytest.mark.parametrize("content", [b"not json", b"{}", b'{"service": ""}'])
async def test_an_unreadable_marker_is_refused_with_advice(tmp_path: Path, content: bytes) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / MARKER).write_bytes(content)
    assert "fix it or delete it" in await refusal(slot_tracker, data_dir)
