"""Operators see workers arrive and leave, and expiries, at info; only live decisions are logged."""

from __future__ import annotations

import logging

import pytest
import trio

from kvrouter.actors.core.commands import AddRequest, ExpireStale, RegisterWorker, UnregisterWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "t")


def catalog_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvrouter.catalog" and r.levelno == logging.INFO]


async def test_arrivals_departures_and_expiries_are_logged_once_at_info(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.catalog")
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    await nursery.start(system.run)
    await system.ask(SCOPE, RegisterWorker(7, 16, 0, 2))
    for i in range(7):
        await system.ask(SCOPE, AddRequest(f"r{i}", 7, 1, (), 10, at=i))
    await system.ask(SCOPE, ExpireStale(max_age_ns=1, at=100))
    await system.ask(SCOPE, AddRequest("busy", 7, 0, (), 10, at=200))  # a request alone logs nothing
    await system.ask(SCOPE, UnregisterWorker(7))
    assert catalog_lines(caplog) == [
        "worker 7 registered (model=m tenant_id=t, block_size 16, dp ranks 0..1)",
        "7 requests expired (model=m tenant_id=t): r0, r1, r2, r3, r4 and 2 more",
        "worker 7 removed (model=m tenant_id=t)",
    ]
