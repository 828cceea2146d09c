"""Automatic snapshots on the real file journal: taken by record count, written off the loop,
and recovery from snapshot + tail gives the same state as the live system."""

from __future__ import annotations

from pathlib import Path

import trio

from kvrouter.actors.core.commands import AddRequest, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import Durability
from kvrouter.simulations.checkers import states_digest

SCOPE = ScopeKey("m", "default")


async def test_snapshots_bound_the_replayed_tail(tmp_path: Path) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            system = ActorSystem(journal, WallClock(), snapshot_every_records=25)
            await nursery.start(system.run)
            await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
            for i in range(120):
                await system.ask(SCOPE, AddRequest(f"r{i}", 1, i % 2, (i % 7, i), 5))
                if i % 3 == 0:
                    await system.ask(SCOPE, FreeRequest(f"r{i}"))
            while system.snapshots_taken < 4:  # noqa: ASYNC110 - snapshots run in their own task
                await trio.sleep(0.01)
            live = states_digest(system.states())
            nursery.cancel_scope.cancel()
    await journal.aclose()

    reopened = FileJournal.open(tmp_path, Durability.ALWAYS)
    recovered = recover(reopened)
    assert recovered.snapshot_lsn > 100  # most of the history is in the snapshot...
    assert recovered.replayed_records < 60  # ...and only the tail is replayed
    assert states_digest(list(recovered.states.values())) == live
