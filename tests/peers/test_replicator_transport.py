"""The replicator without sockets: the seam a caller-owned transport (the simulations) uses."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvrouter.actors.core.commands import AddRequest, CompletePrefill, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.peers.replica_wire import AddRequestData, Free, MarkPrefillCompleted, decode
from kvrouter.actors.peers.replicator import DropReason, Replicator
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "g")


async def detached(nursery: trio.Nursery, router_id: int) -> tuple[ActorSystem, Replicator]:
    journal = MemoryJournal()
    system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
    await nursery.start(journal.run)
    await nursery.start(system.run)
    await system.ask(SCOPE, RegisterWorker(7, block_size=16, dp_start=0, dp_size=2))
    replicator = Replicator(system, port=0, peers=(), router_id=router_id)
    replicator.start_without_sockets()
    return system, replicator


async def test_published_frames_carry_the_lifecycle_to_a_peer_without_echo() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            a_system, a = await detached(nursery, 1)
            b_system, b = await detached(nursery, 2)
            await a_system.ask(SCOPE, AddRequest("r1", 7, 1, (1, 2, 3), 12))
            await a_system.ask(SCOPE, CompletePrefill("r1"))
            await a_system.ask(SCOPE, FreeRequest("r1"))
            published = a.take_published()
            kinds = [type(decode(frames).data) for frames in published]
            assert kinds == [AddRequestData, MarkPrefillCompleted, Free]
            assert a.take_published() == []  # taken once

            await b.receive(published[0], "router-a")
            await trio.testing.wait_all_tasks_blocked()
            state = b_system.state(SCOPE)
            assert state is not None and state.requests["r1"].rank == WorkerRank(7, 1)
            for frames in published[1:]:
                await b.receive(frames, "router-a")
            await trio.testing.wait_all_tasks_blocked()
            assert "r1" not in state.requests
            assert b.take_published() == []  # what B applied for a peer is never re-published
            await a.receive(published[0], "itself")
            assert a.stats.dropped == {DropReason.OWN_ROUTER: 1}
            nursery.cancel_scope.cancel()


async def test_a_replicator_started_without_sockets_cannot_also_run() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _, replicator = await detached(nursery, 3)
            with pytest.raises(AssertionError, match="runs once"):
                await replicator.run()
            nursery.cancel_scope.cancel()
