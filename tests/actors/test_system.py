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
from kvrouter.actors.mailbox import ENQUEUE_TIMEOUT, MAILBOX_SIZE, JournalUnavailable, Overloaded, ReplyTimeout
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from tests.support.journals import GatedJournal

SCOPE = ScopeKey("m", "default")


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
    assert system.mailbox_rejections == {SCOPE: 1}  # for GET /metrics


class SlowDiskJournal(GatedJournal):
    """The writer falls behind until ``catch_up``: actors wait for room after each turn meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.caught_up = trio.Event()

    def has_room(self) -> bool:
        return self.caught_up.is_set()

    async def wait_for_room(self) -> None:
        await self.caught_up.wait()


async def test_mailbox_peak_depth_is_what_waited_when_a_turn_started(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    """300 commands wait while the actor waits for the journal: its next turn takes 256 (MAX_TURN) and leaves
    44, so the peak is 300 (more than one turn holds), not 256."""
    journal = SlowDiskJournal()
    system = await start(nursery, journal)
    nursery.start_soon(system.ask, SCOPE, RegisterWorker(1, 16, 0, 1))
    await trio.testing.wait_all_tasks_blocked()
    assert system.mailboxes() == [(SCOPE, 0, 1)]
    for i in range(300):
        nursery.start_soon(system.ask, SCOPE, FreeRequest(f"x{i}"))
    await trio.testing.wait_all_tasks_blocked()
    assert system.mailboxes() == [(SCOPE, 300, 1)]
    journal.caught_up.set()
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert system.mailboxes() == [(SCOPE, 0, 300)]
    assert system.mailbox_rejections == {}


async def test_dissolved_scope_retires_its_actor(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery)
    await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    assert system.scopes() == [SCOPE]
    await system.ask(SCOPE, UnregisterWorker(1))
    await trio.testing.wait_all_tasks_blocked()
    assert system.scopes() == [] and system.state(SCOPE) is None
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


async def test_a_reply_past_its_deadline_is_a_timeout_and_the_command_still_applies(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    journal = GatedJournal()  # never durable until released
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False, reply_deadline=5.0)  # type: ignore[arg-type]
    await nursery.start(system.run)
    started = trio.current_time()
    with pytest.raises(ReplyTimeout) as raised:
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    assert trio.current_time() - started == pytest.approx(5.0)
    request_id = raised.value.request_id
    assert len(request_id) == 16 and request_id in str(raised.value)
    assert [r.getMessage() for r in caplog.records if request_id in r.getMessage()] == [
        f"no reply within 5 s for RegisterWorker in model=m tenant_id=default (request_id {request_id}); "
        "it may still be applied"
    ]
    state = system.state(SCOPE)
    assert state is not None and state.slots.workers == {1: (0, 1)}  # applied: only the reply was late
    replies = []

    async def unregister() -> None:
        replies.append(await system.ask(SCOPE, UnregisterWorker(1)))

    nursery.start_soon(unregister)
    await trio.testing.wait_all_tasks_blocked()
    journal.release()  # in time, this once
    await trio.testing.wait_all_tasks_blocked()
    assert len(replies) == 1 and isinstance(replies[0], Accepted)


class BreakableJournal(MemoryJournal):
    """A memory journal whose writer can fail for good, as a full disk makes the file journal fail."""

    broken = False

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        if self.broken:
            raise trio.BrokenResourceError("the journal writer failed")
        return super().append(payload, rebuildable)


async def test_a_journal_that_cannot_be_written_fails_the_write_not_the_actor(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = BreakableJournal()
    system = await start(nursery, journal)
    await system.ask(SCOPE, RegisterWorker(1, 16, 0, 1))
    journal.broken = True
    for request_id in ("r1", "r2"):  # the actor survives the first
        with pytest.raises(JournalUnavailable, match="the journal cannot be written"):
            await system.ask(SCOPE, AddRequest(request_id, 1, 0, (1,), 5))
    state = system.state(SCOPE)
    assert state is not None and state.requests == {}  # nothing was applied
    assert isinstance(await system.ask(SCOPE, FreeRequest("unknown")), Accepted)  # no events: nothing to write
    system.halt(OSError(28, "No space left on device"))
    with pytest.raises(JournalUnavailable, match="No space left on device"):
        await system.ask(SCOPE, FreeRequest("unknown"))
