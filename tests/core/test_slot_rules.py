"""Table tests of the slot tracker rules (behaviour.md#slot-accounting edge cases 1-25), on the pure core."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.commands import (
    AddRequest,
    CompletePrefill,
    ExpireStale,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank, to_u64
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.queries import loads, potential_loads
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("llama", "default")
SECOND = 1_000_000_000


class Scope:
    """Drives the core like an actor does: decide, then fold what was accepted."""

    def __init__(self) -> None:
        self.state = ScopeState(SCOPE)

    def run(self, command):
        decision = decide(self.state, command)
        if isinstance(decision, Accepted):
            fold(self.state, decision.events)
        assert check(self.state) == []
        return decision

    def ok(self, command) -> Accepted:
        decision = self.run(command)
        assert isinstance(decision, Accepted), decision
        return decision

    def rejected(self, command, reason: Reason) -> str:
        decision = self.run(command)
        assert isinstance(decision, Rejected) and decision.reason is reason, decision
        return decision.message

    def load(self, worker: int = 1, rank: int = 0) -> tuple[int, int]:
        by_rank = {row.rank: row for row in loads(self.state)}
        row = by_rank[WorkerRank(worker, rank)]
        return row.active_prefill_tokens, row.active_decode_blocks


def add(request_id: str, hashes: list[int], isl: int = 0, worker: int = 1, rank: int = 0, at: int = 0) -> AddRequest:
    return AddRequest(request_id, worker, rank, tuple(to_u64(h) for h in hashes), isl, at=at)


@pytest.fixture
def scope() -> Scope:
    s = Scope()
    s.ok(RegisterWorker(1, 16, 0, 1))
    return s


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (RegisterWorker(1, 0, 0, 1), "block_size must be greater than 0"),
        (RegisterWorker(1, 16, 0, 0), "dp_size must be greater than 0"),
        (RegisterWorker(1, 16, 4294967295, 1), "dp range overflows u32: start=4294967295 size=1"),
    ],
)
def test_register_rejects_invalid_ranges(command: RegisterWorker, message: str) -> None:
    s = Scope()
    assert s.rejected(command, Reason.INVALID) == message
    assert not s.state.exists


def test_register_creates_a_zero_row_per_rank() -> None:
    s = Scope()
    assert s.ok(RegisterWorker(1, 16, 2, 2)).created
    assert [(r.rank, r.active_prefill_tokens, r.active_decode_blocks) for r in loads(s.state)] == [
        (WorkerRank(1, 2), 0, 0),
        (WorkerRank(1, 3), 0, 0),
    ]


def test_reregistering_a_worker_conflicts_even_with_the_same_range(scope: Scope) -> None:
    message = scope.rejected(RegisterWorker(1, 16, 0, 1), Reason.CONFLICT)
    assert message == "worker 1 already registered for model=llama tenant_id=default"


def test_block_size_is_fixed_by_the_first_worker(scope: Scope) -> None:
    message = scope.rejected(RegisterWorker(2, 32, 0, 1), Reason.CONFLICT)
    assert message == "block_size mismatch for model=llama tenant_id=default: existing=16, requested=32"


def test_add_to_an_unknown_rank_books_nothing(scope: Scope) -> None:
    message = scope.rejected(add("r", [1], rank=1), Reason.NOT_FOUND)
    assert "worker_id: 1, dp_rank: 1" in message
    assert scope.state.requests == {}


def test_add_without_tracker_is_not_found() -> None:
    assert Scope().rejected(add("r", [1]), Reason.NOT_FOUND) == "no slot tracker for model=llama tenant_id=default"


def test_empty_prompt_counts_a_request_but_no_blocks(scope: Scope) -> None:
    scope.ok(add("r", []))
    assert scope.load() == (0, 0)
    assert potential_loads(scope.state, (), 0)[0].active_requests == 1


def test_signed_hashes_are_reinterpreted(scope: Scope) -> None:
    scope.ok(add("r", [-1]))
    (row,) = potential_loads(scope.state, (to_u64(-1),), 0)
    assert row.potential_decode_blocks == 1


def test_duplicate_request_ids_conflict_anywhere_in_the_tracker(scope: Scope) -> None:
    scope.ok(RegisterWorker(2, 16, 0, 1))
    scope.ok(add("r", [1, 2], isl=10))
    scope.rejected(add("r", [7], worker=2), Reason.CONFLICT)
    assert scope.load(1) == (10, 2) and scope.load(2) == (0, 0)


def test_prefill_complete_keeps_blocks_and_repeats_as_noop(scope: Scope) -> None:
    scope.ok(add("r", [1, 2, 3], isl=48))
    assert scope.ok(CompletePrefill("r")).events
    assert scope.load() == (0, 3)
    assert scope.ok(CompletePrefill("r")).events == ()
    assert scope.rejected(CompletePrefill("nope"), Reason.NOT_FOUND) == "Request nope not found"


def test_free_is_idempotent_and_early_free_is_forgotten(scope: Scope) -> None:
    assert scope.ok(FreeRequest("ghost")).events == ()
    scope.ok(add("ghost", [1], isl=4))
    assert scope.load() == (4, 1)
    scope.ok(FreeRequest("ghost"))
    scope.ok(FreeRequest("ghost"))
    assert scope.load() == (0, 0)


def test_free_without_tracker_is_not_found() -> None:
    assert Scope().rejected(FreeRequest("r"), Reason.NOT_FOUND).startswith("no slot tracker")


def test_shared_prefix_is_counted_once(scope: Scope) -> None:
    scope.ok(add("a", [1, 2, 3]))
    scope.ok(add("b", [1, 2, 4]))
    assert scope.load() == (0, 4)
    scope.ok(FreeRequest("a"))
    assert scope.load() == (0, 3)


def test_edge_case_19_block_and_token_sequence(scope: Scope) -> None:
    steps = []
    scope.ok(add("r1", [1, 2, 3], isl=12))
    steps.append(scope.load())
    scope.ok(add("r2", [5], isl=4))
    steps.append(scope.load())
    scope.ok(add("r3", [1, 2, 3, 4]))
    steps.append(scope.load())
    for request_id in ("r2", "r3", "r1"):
        scope.ok(FreeRequest(request_id))
        steps.append(scope.load())
    assert steps == [(12, 3), (16, 4), (16, 5), (12, 4), (12, 3), (0, 0)]


def test_appendix_prefix_trie_counts(scope: Scope) -> None:
    counts = []
    for request_id, hashes in [
        ("a", [1, 2, 3, 4]),
        ("b", [1, 2, 5]),
        ("c", [9, 2, 3]),
        ("d", [1, 1, 1]),
        ("e", [1, 2, 3, 4]),
        ("f", [1, 2]),
    ]:
        scope.ok(add(request_id, hashes))
        counts.append(scope.load()[1])
    scope.ok(FreeRequest("a"))
    counts.append(scope.load()[1])
    assert counts == [4, 5, 8, 10, 10, 10, 10]


def test_potential_loads_reuse_active_hashes_and_add_uniform_prefill(scope: Scope) -> None:
    scope.ok(add("r1", [1, 2, 3], isl=8))
    (row,) = potential_loads(scope.state, (1, 2, 4), 5)
    assert (row.potential_prefill_tokens, row.potential_decode_blocks, row.active_requests) == (13, 4, 1)


def test_unregister_drops_requests_and_dissolves_the_tracker(scope: Scope) -> None:
    scope.ok(add("r", [1, 2], isl=3))
    scope.ok(UnregisterWorker(1))
    assert not scope.state.exists and scope.state.requests == {}
    assert scope.rejected(UnregisterWorker(1), Reason.NOT_FOUND) == (
        "worker 1 not found for model=llama tenant_id=default"
    )
    scope.ok(RegisterWorker(1, 32, 0, 1))  # a new tracker may pick another block size
    assert scope.load() == (0, 0)


def test_expiry_drops_requests_older_than_the_cutoff(scope: Scope) -> None:
    scope.ok(add("old", [1, 2], isl=5, at=0))
    scope.ok(add("young", [1, 3], isl=7, at=100 * SECOND))
    scope.ok(CompletePrefill("old"))  # completion does not refresh the age
    assert scope.ok(ExpireStale(300 * SECOND, at=300 * SECOND)).events == ()
    expired = scope.ok(ExpireStale(300 * SECOND, at=331 * SECOND))
    assert [e.request_ids for e in expired.events] == [("old",)]
    assert scope.load() == (7, 2)
    assert list(scope.state.requests) == ["young"]


def test_approximate_bookings_expire_after_their_ttl() -> None:
    from kvrouter.actors.core.catalog import WorkerRecord
    from kvrouter.actors.core.commands import Prompt, SelectWorker, UpsertWorker
    from kvrouter.actors.core.router_config import RouterConfig

    s = Scope()
    s.ok(UpsertWorker(WorkerRecord(1, "llama", "default", endpoint="http://w", block_size=4), use_kv_events=False))
    config = RouterConfig(use_kv_events=False, router_ttl_secs=120.0)
    prompt = Prompt(token_ids=tuple(range(8)))
    s.ok(SelectWorker(prompt, config, reserve=True, reservation_id="r", at=0))
    assert s.state.selection.predicted.block_count() == 2
    s.ok(FreeRequest("r", at=SECOND))  # the cache outlives the request
    assert s.state.selection.predicted.block_count() == 2
    assert s.ok(ExpireStale(300 * SECOND, at=119 * SECOND)).events == ()
    s.ok(ExpireStale(300 * SECOND, at=120 * SECOND))
    assert s.state.selection.predicted.block_count() == 0 and s.state.selection.approx_expiry == {}
