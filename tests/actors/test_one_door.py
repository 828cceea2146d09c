"""The mailbox is the only door into a scope actor: nothing but the actor system and the actor itself touches a
mailbox, the actor table or the in-task turn; a worker's KV run enters through ``ActorSystem.apply_kv`` and is
applied in mailbox order (never ahead of a command sent before it); what one scope must know of the others
(schedulable workers anywhere) is kept by the system from applied decisions."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import trio
import trio.testing

from kvrouter.actors.actor import ActorPorts, ScopeActor
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import ExpireStale, IngestKvBatch, RemoveWorker, UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.pending import PendingSelections
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.mailbox import Envelope
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from tests.support.journals import RoomJournal

ROOT = Path(__file__).resolve().parent.parent.parent
SCOPE = ScopeKey("m", "a")
OTHER = ScopeKey("m", "b")
BLOCK = 4
DOOR_KEEPERS = {"actors/system.py", "actors/actor.py"}
# What only the keepers may touch: the actors' mailboxes (their send side), the in-task turn, the actor table.
GUARDED = {"outbox", "apply_now", "_actors", "actors"}


def guarded_uses(source: str) -> list[str]:
    """``x.outbox``, ``x.apply_now``, ``x.actors`` and ``x._actors`` in ``source`` (attribute access on anything
    but a module path such as ``kvrouter.actors``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in GUARDED:
            if node.attr == "actors" and isinstance(node.value, ast.Name) and node.value.id == "kvrouter":
                continue
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_only_the_system_and_the_actor_touch_mailboxes() -> None:
    offenders = {}
    for folder in ("actors", "api", "simulations", "client", "journal"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            uses = guarded_uses(path.read_text())
            if uses and name not in DOOR_KEEPERS:
                offenders[name] = uses
    assert offenders == {}


def test_the_check_finds_a_reach_into_a_mailbox() -> None:
    assert sorted(guarded_uses("actor = system.actors.get(scope)\nactor.outbox.send_nowait(e)\n")) == [
        "line 1: .actors",
        "line 2: .outbox",
    ]
    assert guarded_uses("import kvrouter.actors.system\n") == []


def record(worker_id: int, scope: ScopeKey = SCOPE) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        scope.model_name,
        scope.tenant_id,
        endpoint=f"http://w{worker_id}",
        kv_events_endpoint=f"tcp://127.0.0.1:{5000 + worker_id}",
        block_size=BLOCK,
    )


def ingest(seq: int) -> IngestKvBatch:
    batch = KvBatch(0.0, (BlockStored((100 + seq,), None, tuple(range(BLOCK)), BLOCK),))
    return IngestKvBatch(1, 0, seq, batch)


async def test_a_kv_run_waits_behind_what_the_mailbox_holds(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = RoomJournal()
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False)
    await nursery.start(system.run)
    await system.ask(SCOPE, UpsertWorker(record(1)))
    journal.close_room()  # the actor's next turn ends waiting for the disk: what is sent now stays queued
    await system.submit(SCOPE, ExpireStale(1, at=0))
    await trio.testing.wait_all_tasks_blocked()
    await system.submit(SCOPE, ingest(0))
    before = journal.last_lsn
    applied = trio.Event()

    async def run() -> None:
        await system.apply_kv(SCOPE, ingest(1))
        applied.set()

    nursery.start_soon(run)
    await trio.testing.wait_all_tasks_blocked()
    assert not applied.is_set() and journal.last_lsn == before  # not taken ahead of the queued run
    assert [(scope, waiting) for scope, waiting, _ in system.mailboxes()] == [(SCOPE, 2)]
    journal.open_room()
    await trio.testing.wait_all_tasks_blocked()
    state = system.state(SCOPE)
    assert applied.is_set() and journal.last_lsn == before + 2
    assert state is not None and state.selection.kv_watermarks[WorkerRank(1, 0)] == 1


async def test_a_kv_run_for_a_scope_without_an_actor_is_dropped(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = MemoryJournal()
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False)
    await nursery.start(system.run)
    await system.apply_kv(SCOPE, ingest(0))
    assert journal.last_lsn == 0 and system.scopes() == []


async def test_the_in_task_turn_is_refused_while_a_command_is_handed_to_the_actor(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    # Sent and handed to the actor's task, which has not run yet: taking the run first would reorder them.
    state = ScopeState(SCOPE)
    fold(state, decide(state, UpsertWorker(record(1))).events)
    journal = MemoryJournal()
    ports = ActorPorts(journal, [], lambda: None, lambda actor: None)
    actor = ScopeActor(state, ports, random.Random(0), PendingSelections())
    nursery.start_soon(actor.run)
    await trio.testing.wait_all_tasks_blocked()
    first, second = Envelope(ingest(0), awaited=False), Envelope(ingest(1), awaited=False)
    actor.outbox.send_nowait(first)
    assert not actor.apply_now(second)
    assert first.decision is None and second.decision is None
    actor.outbox.send_nowait(second)
    await trio.testing.wait_all_tasks_blocked()
    assert 0 < first.lsn < second.lsn


async def test_the_system_knows_which_scopes_have_a_schedulable_worker(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)
    await nursery.start(system.run)
    assert not system.schedulable_elsewhere(SCOPE, True, False)
    await system.ask(OTHER, UpsertWorker(record(2, OTHER)))
    assert system.schedulable_elsewhere(SCOPE, True, False) and not system.schedulable_elsewhere(OTHER, True, False)
    assert not system.schedulable_elsewhere(SCOPE, True, True)  # with queueing, it lacks max_num_batched_tokens
    await system.ask(SCOPE, UpsertWorker(record(1)))
    assert system.schedulable_elsewhere(OTHER, True, False)
    await system.ask(OTHER, RemoveWorker(2))
    assert not system.schedulable_elsewhere(SCOPE, True, False) and system.schedulable_elsewhere(OTHER, True, False)
