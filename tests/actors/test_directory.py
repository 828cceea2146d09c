"""The directory: service-wide worker and reservation ids, kept from applied events, with claims."""

from __future__ import annotations

import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import AddRequest, FreeRequest, RemoveWorker, Reserve, UpsertWorker
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.directory import Directory, ScopedIds
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

A, B, C = ScopeKey("m", "a"), ScopeKey("m", "b"), ScopeKey("m", "c")


def test_a_duplicate_id_stays_behind_the_first_holder_until_it_leaves() -> None:
    ids: ScopedIds[str] = ScopedIds()
    ids.add("r", B)
    ids.add("r", A)  # a duplicate from outside the booking path (a replica peer, an old journal)
    ids.add("r", A)  # applied twice: counted once
    assert ids.get("r") == B and ids.scopes("r") == (B, A)
    assert (ids.count(A), ids.count(B), len(ids)) == (1, 1, 1)
    ids.discard("r", C)  # never held there: nothing happens
    ids.discard("r", B)
    assert ids.get("r") == A and ids.scopes("r") == (A,) and ids.count(B) == 0
    ids.discard("r", A)
    assert "r" not in ids and ids.scopes("r") == () and ids.count(A) == 0


def test_claims_exclude_other_scopes_and_count_within_one() -> None:
    directory = Directory()
    assert directory.claim_reservation("r", A) is None
    refused = directory.claim_reservation("r", B)
    assert refused is not None and refused.reason is Reason.CONFLICT
    assert directory.claim_reservation("r", A) is None  # the scope's actor will judge the second booking
    directory.release_claim("r")
    assert directory.claim_reservation("r", B) is not None  # one booking in A is still in flight
    directory.release_claim("r")
    assert directory.claims == 0
    assert directory.claim_reservation("r", B) is None


def record(worker_id: int, scope: ScopeKey, dp_size: int = 1) -> WorkerRecord:
    return WorkerRecord(
        worker_id, scope.model_name, scope.tenant_id, endpoint="http://w", block_size=4, data_parallel_size=dp_size
    )


async def test_it_follows_applied_events_and_rebuilds_from_states(nursery: trio.Nursery) -> None:
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)
    await nursery.start(system.run)
    directory = Directory()
    system.observers.append(directory.observe)
    await system.ask(A, UpsertWorker(record(1, A, dp_size=2), use_kv_events=False))
    await system.ask(B, UpsertWorker(record(2, B), use_kv_events=False))
    await system.ask(A, Reserve("r1", 1, 0, (1,), 4))
    await system.ask(A, Reserve("r2", 1, 1, (1,), 4))
    await system.ask(B, AddRequest("r3", 2, 0, (1,), 4, remote=True))
    assert (directory.worker_scope(1), directory.worker_scope(2), directory.worker_scope(3)) == (A, B, None)
    assert [directory.reservation_scope(r) for r in ("r1", "r2", "r3")] == [A, A, B]
    assert Directory.of(system.states()).reservations.scopes("r1") == (A,)

    await system.ask(B, FreeRequest("r3"))
    await system.ask(A, UpsertWorker(record(1, A, dp_size=1), use_kv_events=False))  # rank 1 and r2 go
    assert [directory.reservation_scope(r) for r in ("r1", "r2", "r3")] == [A, None, None]
    await system.ask(A, RemoveWorker(1))
    assert directory.worker_scope(1) is None and directory.reservation_scope("r1") is None
    rebuilt = Directory.of(system.states())
    assert (len(rebuilt.workers), len(rebuilt.reservations)) == (len(directory.workers), 0) == (1, 0)
