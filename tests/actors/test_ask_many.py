"""ActorSystem.ask_many (a batch of slot tracker writes, one mailbox post per scope): the same decisions, in
the same order, as asking each command after the one before, and each failure in its own command's place."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvrouter.actors.core.commands import (
    AddRequest,
    Command,
    CompletePrefill,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from kvrouter.actors.core.decisions import Accepted, Decision, Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import loads
from kvrouter.actors.mailbox import JournalUnavailable, ReplyTimeout
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from tests.support.journals import GatedJournal

A = ScopeKey("a", "default")
B = ScopeKey("b", "t1")


def lifecycles() -> list[tuple[ScopeKey, Command]]:
    """Commands across two scopes whose answers depend on their order: before the scope exists, a duplicate
    registration, a request completed and freed before and after it is added, a worker gone mid-way."""
    commands: list[tuple[ScopeKey, Command]] = [
        (B, FreeRequest("early")),  # no scope yet: answered from an empty state
        (A, RegisterWorker(1, 16, 0, 2)),
        (B, CompletePrefill("early")),
        (B, RegisterWorker(1, 16, 0, 1)),
        (A, RegisterWorker(1, 16, 0, 2)),  # 409: already registered
        (A, RegisterWorker(2, 0, 0, 1)),  # 400: block size 0
    ]
    for i in range(40):
        for scope in (A, B):
            commands.append((scope, CompletePrefill(f"r{i}")))  # 404: not added yet
            commands.append((scope, AddRequest(f"r{i}", 1, i % 2 if scope == A else 0, (i, i + 1), 16)))
            commands.append((scope, AddRequest(f"r{i}", 1, 0, (i,), 16)))  # the same id again
            commands.append((scope, AddRequest(f"x{i}", 7, 0, (i,), 16)))  # 404: no worker 7
            commands.append((scope, CompletePrefill(f"r{i}")))
            if i % 3 == 0:
                commands.append((scope, FreeRequest(f"r{i}")))
    commands += [(A, UnregisterWorker(1)), (A, AddRequest("late", 1, 0, (1,), 16)), (A, FreeRequest("r1"))]
    return commands


def summary(outcome: Decision | Exception) -> tuple[object, ...]:
    if isinstance(outcome, Accepted):
        return ("accepted", outcome.created, len(outcome.events))
    if isinstance(outcome, Rejected):
        return ("rejected", outcome.reason, outcome.message)
    return (type(outcome).__name__,)


async def start(nursery: trio.Nursery, journal: object, **options: object) -> ActorSystem:
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False, **options)  # type: ignore[arg-type]
    await nursery.start(system.run)
    return system


def state_of(system: ActorSystem) -> list[object]:
    return [(state.scope, loads(state), sorted(state.requests)) for state in system.states()]


async def test_a_batch_answers_as_the_same_commands_asked_one_after_another(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    commands = lifecycles()
    one_by_one = await start(nursery, MemoryJournal())
    expected = [summary(await one_by_one.ask(scope, command)) for scope, command in commands]
    journal = MemoryJournal()
    batched = await start(nursery, journal)
    got = [summary(outcome) for outcome in await batched.ask_many(commands)]
    assert got == expected
    kinds = {outcome[0] for outcome in got}
    assert kinds == {"accepted", "rejected"}
    assert state_of(batched) == state_of(one_by_one)
    assert journal.durable_lsn == journal.last_lsn == one_by_one.journal.last_lsn  # one record per change


async def test_nothing_is_answered_before_every_write_of_the_batch_is_durable(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    system = await start(nursery, journal)
    answers: list[list[Decision | Exception]] = []

    async def ask() -> None:
        answers.append(await system.ask_many(lifecycles()))

    nursery.start_soon(ask)
    await trio.testing.wait_all_tasks_blocked()
    appended = journal.inner.last_lsn
    assert appended > 100 and answers == []
    journal.release(appended - 1)  # all but the last record
    await trio.testing.wait_all_tasks_blocked()
    assert answers == []
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert len(answers) == 1 and len(answers[0]) == len(lifecycles())


class BreaksAfter(MemoryJournal):
    """A journal whose writer fails for good after ``limit`` records (a full disk)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def append(self, payload: bytes, rebuildable: bool = False) -> int:
        if self.last_lsn >= self.limit:
            raise trio.BrokenResourceError("the journal writer failed")
        return super().append(payload, rebuildable)


async def test_a_journal_failing_mid_batch_fails_that_write_and_the_rest_of_its_scope(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    system = await start(nursery, BreaksAfter(3))
    commands: list[tuple[ScopeKey, Command]] = [
        (A, RegisterWorker(1, 16, 0, 1)),
        (A, AddRequest("r1", 1, 0, (1,), 16)),
        (A, FreeRequest("nobody")),  # no record: decided, but behind the failure below it is not reached
        (A, AddRequest("r2", 1, 0, (2,), 16)),
        (A, AddRequest("r3", 1, 0, (3,), 16)),  # the 4th record: refused by the journal
        (A, FreeRequest("r1")),
    ]
    got = [summary(outcome) for outcome in await system.ask_many(commands)]
    assert got == [
        ("accepted", True, 1),
        ("accepted", True, 1),
        ("accepted", False, 0),
        ("accepted", True, 1),
        ("JournalUnavailable",),
        ("JournalUnavailable",),
    ]
    state = system.state(A)
    assert state is not None and sorted(state.requests) == ["r1", "r2"]  # r3 and the free were never applied


async def test_a_batch_past_its_reply_deadline_answers_timeouts_and_still_applies(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()  # never durable until released
    system = await start(nursery, journal, reply_deadline=5.0)
    started = trio.current_time()
    got = await system.ask_many([(A, RegisterWorker(1, 16, 0, 1)), (A, AddRequest("r1", 1, 0, (1,), 16))])
    assert trio.current_time() - started == pytest.approx(5.0)
    assert [type(outcome) for outcome in got] == [ReplyTimeout, ReplyTimeout]
    state = system.state(A)
    assert state is not None and list(state.requests) == ["r1"]  # applied: only the reply was late


async def test_a_halted_system_refuses_the_whole_batch(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    system = await start(nursery, MemoryJournal())
    system.halt(OSError(28, "No space left on device"))
    got = await system.ask_many([(A, RegisterWorker(1, 16, 0, 1)), (B, FreeRequest("r1"))])
    assert [type(outcome) for outcome in got] == [JournalUnavailable, JournalUnavailable]
    assert "No space left on device" in str(got[0])
