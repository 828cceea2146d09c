"""The actor shell under an autojump clock (no real I/O in flight): ordering, backpressure,
replies held until durable, retirement of dissolved scopes, time-driven expiry."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvrouter.actors.core.commands import AddRequest, FreeRequest, RegisterWorker, UnregisterWorker
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import loads
from kvrouter.actors.mailbox import ENQUEUE_TIMEOUT, MAILBOX_SIZE, Overloaded
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "default")


class GatedJournal:
    """A MemoryJournal whose durability the test releases by hand."""

    def __init__(self) -> None:
        self.inner = MemoryJournal()
        self.durable = 0
        self._moved = trio.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    @property
    def durable_lsn(self) -> int:
        return self.durable

    def release(self) -> None:
        self.durable = self.inner.last_lsn
        self._moved.set()
        self._moved = trio.Event()

    async def wait_durable(self, lsn: int) -> None:
        while self.durable < lsn:
            await self._moved.wait()


async def start(nursery: trio.Nursery, journal: object | None = None) -> ActorSystem:
    system = ActorSystem(journal or MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    await nursery.start(system.run)
    return system


async def test_commands_apply_in_mailbox_order(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery)
    await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    results = []

    async def client(i: int) -> None:
        results.append((i, await system.ask(SCOPE, AddRequest("same", 1, 0, (i,), 1))))

    async with trio.open_nursery() as clients:
        for i in range(5):
            clients.start_soon(client, i)
    assert sum(isinstance(d, Accepted) for _, d in results) == 1
    assert sum(isinstance(d, Rejected) for _, d in results) == 4


async def test_reply_waits_for_durability(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    journal = GatedJournal()
    system = await start(nursery, journal)
    replies = []

    async def register() -> None:
        replies.append(await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1)))

    nursery.start_soon(register)
    await trio.testing.wait_all_tasks_blocked()
    assert replies == [] and journal.inner.last_lsn == 1  # journaled, not yet acknowledged
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert len(replies) == 1 and isinstance(replies[0], Accepted)


class FullDiskJournal(GatedJournal):
    """The writer never catches up: actors block on ``wait_for_room`` after their first turn."""

    def has_room(self) -> bool:
        return False

    async def wait_for_room(self) -> None:
        await trio.sleep_forever()


async def test_full_mailbox_answers_overloaded(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery, FullDiskJournal())
    nursery.start_soon(system.ask, SCOPE, RegisterWorker(1, 16, 0, 1))
    await trio.testing.wait_all_tasks_blocked()  # the actor is now stuck waiting for room
    for i in range(MAILBOX_SIZE):
        nursery.start_soon(system.ask, SCOPE, FreeRequest(f"x{i}"))
    await trio.testing.wait_all_tasks_blocked()
    started = trio.current_time()
    with pytest.raises(Overloaded, match="mailbox of model=m tenant_id=default is full"):
        await system.ask(SCOPE, FreeRequest("one too many"))
    assert trio.current_time() - started == pytest.approx(ENQUEUE_TIMEOUT)


async def test_dissolved_scope_retires_its_actor(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery)
    await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    assert SCOPE in system.actors
    await system.ask(SCOPE, UnregisterWorker(1))
    await trio.testing.wait_all_tasks_blocked()
    assert SCOPE not in system.actors and system.state(SCOPE) is None
    rejected = await system.ask(SCOPE, FreeRequest("r"))
    assert isinstance(rejected, Rejected) and rejected.message.startswith("no slot tracker")
    assert isinstance(await system.ask(SCOPE, RegisterWorker(1, 32, 0, 1)), Accepted)


async def test_stale_requests_expire_without_traffic(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery)
    await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    await system.ask(SCOPE, AddRequest("old", 1, 0, (1, 2), 5, at=system.clock.now_ns()))
    await trio.sleep(299)
    state = system.state(SCOPE)
    assert state is not None and loads(state)[0].active_decode_blocks == 2
    await trio.sleep(61)  # by ~360 s after admission the sweep has removed it
    assert loads(state)[0].active_decode_blocks == 0 and state.requests == {}
