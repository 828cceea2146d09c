"""The scope's two parts on the pure core: each part's snapshot and invariants, the selection read models
shared by ``decide_select`` and the inspection routes, reservation commands, output-block weights (spec
behaviour.md#slot-accounting) and partitions that outlive their last worker
(behaviour.md#loads-dump-and-session-affinity)."""

from __future__ import annotations

import attrs
import pytest

from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    CompleteReservationPrefill,
    FreeRequest,
    IngestKvBatch,
    Prompt,
    ReleaseReservation,
    RemoveWorker,
    Reserve,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted, Reason, Rejected
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.kv_index import KvIndex, Tier
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection_queries import (
    candidates,
    overlap_scores,
    partition_loads,
    potential_loads,
    selection_input,
)
from kvrouter.actors.core.selection_state import SelectionState
from kvrouter.actors.core.slots import SlotTracking
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("m", "default")
BLOCK = 4
TOKENS = tuple(range(100, 132))  # 8 blocks of 4


def record(worker_id: int, block_size: int | None = BLOCK, **fields: object) -> WorkerRecord:
    defaults: dict[str, object] = {"endpoint": f"http://w{worker_id}", "kv_events_endpoint": "tcp://w:1"}
    return WorkerRecord(worker_id, SCOPE.model_name, SCOPE.tenant_id, block_size=block_size, **{**defaults, **fields})


class Scope:
    """Drives the core like an actor: decide, fold what was accepted, check every invariant."""

    def __init__(self) -> None:
        self.state = ScopeState(SCOPE)

    def run(self, command):
        decision = decide(self.state, command)
        if isinstance(decision, Accepted):
            fold(self.state, decision.events)
        assert check(self.state) == [], command
        return decision

    def ok(self, command) -> Accepted:
        decision = self.run(command)
        assert isinstance(decision, Accepted), decision
        return decision

    def rejected(self, command, reason: Reason) -> str:
        decision = self.run(command)
        assert isinstance(decision, Rejected) and decision.reason is reason, decision
        return decision.message

    def decode_blocks(self, worker: int = 1, rank: int = 0) -> int:
        return self.state.slots.ranks[WorkerRank(worker, rank)].active_decode_blocks

    def store(self, worker: int, hashes: tuple[int, ...], tokens: tuple[int, ...], seq: int = 0) -> None:
        self.ok(IngestKvBatch(worker, 0, seq, KvBatch(0.0, (BlockStored(hashes, None, tokens, BLOCK),))))


def select(prompt: Prompt, **kwargs: object) -> SelectWorker:
    return SelectWorker(prompt, RouterConfig(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def warm() -> Scope:
    """Two workers; worker 1 caches the first 3 blocks of TOKENS and carries a booking."""
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    s.ok(
        UpsertWorker(
            record(
                2,
                data_parallel_size=2,
                kv_events_endpoint=None,
                kv_events_endpoints=((0, "tcp://w2:1"), (1, "tcp://w2:2")),
            )
        )
    )
    s.store(1, (11, 12, 13), TOKENS[:12])
    s.ok(Reserve("busy", 1, 0, (1, 2), isl_tokens=8))
    return s


# -- output blocks (behaviour.md#slot-accounting, checked on 1.6.1) ----------------------------------------------------


def test_output_blocks_keep_their_own_weight() -> None:
    """1.6.1 probe: a 4-block reservation, then output blocks with 0.5, none, none, 0.25 give /loads 3, 4, 5, 2
    (every output block is set to the latest fraction; one without a fraction weighs 1.0)."""
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    s.ok(select(Prompt(token_ids=tuple(range(16))), reserve=True, reservation_id="r1"))
    assert s.decode_blocks() == 4
    seen = []
    for fraction in (0.5, None, None, 0.25):
        s.ok(AddOutputBlock("r1", fraction))
        seen.append(s.decode_blocks())
    assert seen == [3, 4, 5, 2]  # 4x0.5+0.5 -> 2.5; +1.0 -> 3.5; +1.0 -> 4.5; 4x0.25+4x0.25 -> 2


def test_spec_fractional_decay_example() -> None:
    """behaviour.md#slot-accounting's worked example: r1=[1,2,3] -> 3; output(0.5) -> 2; add r2=[1,2] -> 2; output(r1,
    0.0) -> 1."""
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    s.ok(Reserve("r1", 1, 0, (1, 2, 3), isl_tokens=12))
    s.ok(AddOutputBlock("r1", 0.5))
    assert s.decode_blocks() == 2
    s.ok(Reserve("r2", 1, 0, (1, 2), isl_tokens=8))
    assert s.decode_blocks() == 2
    s.ok(AddOutputBlock("r1", 0.0))
    assert s.decode_blocks() == 1
    s.ok(ReleaseReservation("r1"))
    s.ok(ReleaseReservation("r2"))
    assert s.decode_blocks() == 0


# -- reservations are their own commands -------------------------------------------------------------


def test_reservation_lifecycle_commands_keep_the_selection_services_messages(warm: Scope) -> None:
    assert warm.rejected(CompleteReservationPrefill("nope"), Reason.NOT_FOUND) == "reservation nope not found"
    assert warm.rejected(ReleaseReservation("nope"), Reason.NOT_FOUND) == "reservation nope not found"
    assert warm.ok(CompleteReservationPrefill("busy")).events
    assert warm.run(CompleteReservationPrefill("busy")) is NOTHING_CHANGED  # a repeat changes nothing
    warm.ok(ReleaseReservation("busy"))
    assert warm.rejected(ReleaseReservation("busy"), Reason.NOT_FOUND) == "reservation busy not found"
    # On a scope that does not exist (the actor answers from an empty state) it is the same 404.
    assert decide(ScopeState(ScopeKey("x", "y")), ReleaseReservation("busy")) == Rejected(
        Reason.NOT_FOUND, "reservation busy not found"
    )
    assert warm.run(FreeRequest("busy")) is NOTHING_CHANGED  # the slot tracker's free stays idempotent


def test_free_request_no_longer_speaks_for_reservations() -> None:
    with pytest.raises(TypeError, match="reservation"):
        FreeRequest("r", reservation=True)  # type: ignore[call-arg]


# -- partitions outlive their last worker (behaviour.md#loads-dump-and-session-affinity, checked on 1.6.1) -------------


def test_a_partition_keeps_its_block_size_after_its_last_worker_leaves() -> None:
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    s.ok(RemoveWorker(1))
    assert s.state.exists and s.state.selection.partition_block_size == BLOCK
    assert partition_loads(s.state, True) == []
    s.ok(UpsertWorker(record(2, block_size=8)))  # reconciled against the partition's size: incomplete
    reasons = not_schedulable_reasons(s.state.selection.catalog[2], use_kv_events=True, partition_block_size=BLOCK)
    assert reasons == [
        "reconciliation failed: block_size mismatch for model=m tenant_id=default: existing=4 requested=8"
    ]
    assert s.state.selection.partition_block_size == BLOCK and partition_loads(s.state, True) == []
    restored = ScopeState.from_snapshot(s.state.to_snapshot())
    assert restored.exists and restored.selection.partition_block_size == BLOCK


def test_a_partition_of_incomplete_workers_is_not_listed_and_dissolves_with_them() -> None:
    s = Scope()
    s.ok(UpsertWorker(record(1, endpoint=None)))
    assert s.state.exists and partition_loads(s.state, True) is None
    s.ok(RemoveWorker(1))
    assert not s.state.exists


def test_loads_list_only_the_ranks_of_schedulable_workers(warm: Scope) -> None:
    warm.ok(UpsertWorker(record(3, endpoint=None)))  # incomplete: has ranks (bookable) but is not listed
    assert WorkerRank(3, 0) in warm.state.slots.ranks
    rows = partition_loads(warm.state, True)
    assert rows is not None
    assert [(r.rank, r.active_prefill_tokens, r.active_decode_blocks, r.active_requests) for r in rows] == [
        (WorkerRank(1, 0), 8, 2, 1),
        (WorkerRank(2, 0), 0, 0, 0),
        (WorkerRank(2, 1), 0, 0, 0),
    ]


# -- read models: what the routes show is what a selection weighs ------------------------------------


def test_selection_input_refuses_like_a_selection(warm: Scope) -> None:
    empty = ScopeState(ScopeKey("other", "default"))
    assert selection_input(empty, Prompt(token_ids=TOKENS), True) == Rejected(
        Reason.UNAVAILABLE, "no schedulable workers for model=other tenant_id=default"
    )
    bad = Prompt(block_hashes=(1, 2), sequence_hashes=(1,), isl_tokens=4)
    message = "block_hashes length 2 must match sequence_hashes length 1"
    assert selection_input(warm.state, bad, True) == Rejected(Reason.INVALID, message)
    assert decide(warm.state, select(bad)) == Rejected(Reason.INVALID, message)


def test_candidates_rows_and_the_selection_agree(warm: Scope) -> None:
    prompt = Prompt(token_ids=TOKENS[:20])
    prepared = selection_input(warm.state, prompt, True)
    assert not isinstance(prepared, Rejected)
    found = candidates(warm.state, prepared)
    assert [c.rank for c in found] == [WorkerRank(1, 0), WorkerRank(2, 0), WorkerRank(2, 1)]
    scores = overlap_scores(found)
    assert [(r.rank, r.device_blocks, r.disk_blocks) for r in scores] == [
        (WorkerRank(1, 0), 3, 3),
        (WorkerRank(2, 0), 0, 0),
        (WorkerRank(2, 1), 0, 0),
    ]
    rows = {row.rank: row for row in potential_loads(found, prepared, RouterConfig())}
    assert (rows[WorkerRank(1, 0)].potential_prefill_tokens, rows[WorkerRank(1, 0)].potential_decode_blocks) == (
        8 + 20 - 12,
        2 + 5,
    )
    # The rank a selection picks reports exactly what its potential-loads row projects.
    chosen = warm.ok(select(prompt, options=SelectionOptions(pinned_worker=(1, 0)))).reply
    assert chosen.overlap["gpu"] == 12
    row = rows[WorkerRank(1, 0)]
    assert 8 + chosen.effective_prefill_tokens == row.potential_prefill_tokens
    assert chosen.potential_decode_blocks == row.potential_decode_blocks


def test_candidates_carry_each_ranks_loads_through_bookings_outputs_and_releases() -> None:
    """A candidate's loads are its rank's (an idle rank's decode blocks are taken as 0 without asking)."""
    s = Scope()
    s.ok(
        UpsertWorker(
            record(
                1,
                data_parallel_size=2,
                kv_events_endpoint=None,
                kv_events_endpoints=((0, "tcp://w1:1"), (1, "tcp://w1:2")),
            )
        )
    )
    s.ok(UpsertWorker(record(2)))
    steps = [
        Reserve("a", 1, 0, (1, 2, 3), isl_tokens=12),
        Reserve("b", 1, 1, (1, 2), isl_tokens=8),
        AddOutputBlock("a", 0.5),
        AddOutputBlock("b", None),
        ReleaseReservation("b"),
        AddOutputBlock("a", 0.0),
        ReleaseReservation("a"),
    ]
    for step in [None, *steps]:
        if step is not None:
            s.ok(step)
        prepared = selection_input(s.state, Prompt(token_ids=TOKENS), True)
        assert not isinstance(prepared, Rejected)
        for c in candidates(s.state, prepared):
            loads = s.state.slots.ranks[c.rank]
            assert (c.active_prefill_tokens, c.active_decode_blocks, c.active_requests) == (
                loads.prefill_tokens,
                loads.active_decode_blocks,
                len(loads.requests),
            ), step


# -- each part's snapshot and invariants -------------------------------------------------------------


def test_each_part_round_trips_through_its_own_snapshot(warm: Scope) -> None:
    warm.ok(AddOutputBlock("busy", 0.5))
    warm.ok(AddOutputBlock("busy", None))
    slots = warm.state.slots.to_snapshot()
    selection = warm.state.selection.to_snapshot()
    assert SlotTracking.from_snapshot(slots).to_snapshot() == slots
    assert SelectionState.from_snapshot(selection).to_snapshot() == selection
    assert slots["requests"][0][6] == [1, 0.5, 1]  # one block at 0.5, one whole block since
    assert warm.state.to_snapshot() == {
        "model_name": "m",
        "tenant_id": "default",
        "slots": slots,
        "selection": selection,
    }


def test_slot_invariants_catch_corruption(warm: Scope) -> None:
    rank = warm.state.slots.ranks[WorkerRank(1, 0)]
    rank.prefill_tokens += 1
    rank.outputs["ghost"] = (1, 0.5, 0)
    rank.outputs["busy"] = (0, 0.5, 1)
    problems = check(warm.state)
    assert "WorkerRank(worker_id=1, dp_rank=0): prefill sum 9 != entries" in problems
    assert "WorkerRank(worker_id=1, dp_rank=0): output blocks of a request that is not active" in problems
    assert any("output blocks (0, 0.5, 1) are not a history" in p for p in problems)


def test_cross_part_invariants_catch_a_catalog_the_slots_do_not_follow(warm: Scope) -> None:
    warm.state.slots.workers[2] = (0, 1)
    del warm.state.slots.ranks[WorkerRank(2, 1)]
    warm.state.selection.kv_watermarks[WorkerRank(5, 0)] = 3
    problems = check(warm.state)
    assert "worker 2: registered range (0, 1) is not its record's" in problems
    assert "WorkerRank(worker_id=5, dp_rank=0): KV-event watermark kept for a rank that is not registered" in problems


def test_a_stale_schedulable_cache_is_an_invariant_violation(warm: Scope) -> None:
    warm.state.selection.schedulable(True)
    warm.state.selection.catalog[1] = record(1, endpoint=None)  # bypassing evolve leaves the cache stale
    assert "stale schedulable cache (use_kv_events=True)" in check(warm.state)


def test_a_stale_decoders_cache_is_an_invariant_violation(warm: Scope) -> None:
    warm.state.selection.schedulable_decoders(True)
    warm.state.selection.catalog[1] = record(1, worker_role="prefill")  # bypassing evolve: stale
    warm.state.selection.schedulable_cache.clear()
    assert "stale schedulable decoders cache (use_kv_events=True)" in check(warm.state)


def test_a_worker_that_becomes_prefill_only_is_no_longer_selected(warm: Scope) -> None:
    """Selections read the partition's cached decoding workers: a role change (an upsert) must reach them."""
    select = SelectWorker(Prompt(TOKENS), RouterConfig(), draw=0.0)
    assert warm.run(select).reply.worker_id == 2  # worker 1 carries a booking
    warm.ok(UpsertWorker(record(2, worker_role="prefill", kv_events_endpoint="tcp://w2:1")))
    assert {warm.run(attrs.evolve(select, draw=d / 10)).reply.worker_id for d in range(10)} == {1}
    warm.ok(UpsertWorker(record(1, worker_role="prefill")))
    refused = warm.run(select)
    assert isinstance(refused, Rejected) and refused.reason is Reason.UNAVAILABLE
    warm.ok(UpsertWorker(record(2, kv_events_endpoint="tcp://w2:1")))
    assert warm.run(select).reply.worker_id == 2


def indexed() -> KvIndex:
    index = KvIndex()
    r0, r1 = WorkerRank(1, 0), WorkerRank(2, 0)
    assert index.apply_stored(r0, Tier.DEVICE, None, [(11, 1), (12, 2), (13, 3)])
    assert index.apply_stored(r1, Tier.DEVICE, None, [(21, 1), (22, 5)])
    assert index.apply_stored(r0, Tier.HOST, 13, [(14, 4)])
    assert index.check() == []
    return index


def test_index_invariant_inverse_maps() -> None:
    index = indexed()
    r = index._ranks[WorkerRank(1, 0)]
    index._ext_add(r, 99, index._ext_find(r, 12))  # a second hash for the node, which the rank names 12
    assert "WorkerRank(worker_id=1, dp_rank=0): its table lists 4 entries, 3 nodes, counted 4" in index.check()


def test_index_invariant_cover_masks() -> None:
    index = indexed()
    node = index._ext_find(index._ranks[WorkerRank(2, 0)], 22)
    index._cover[node] |= index._ranks[WorkerRank(1, 0)].mask
    assert any(p.startswith(f"node {node}: cover mask") for p in index.check())


def test_index_invariant_prefix_closed() -> None:
    index = indexed()
    r = index._ranks[WorkerRank(1, 0)]
    middle = index._ext_find(r, 12)
    index._ext_remove(r, 12, middle)
    index._cover[middle] ^= r.mask
    problems = index.check()
    assert any("(not prefix-closed)" in p for p in problems)
    assert f"node {middle} is covered by no rank but not freed (leak)" in problems


def test_index_invariant_child_links() -> None:
    index = indexed()
    leaf = index._ext_find(index._ranks[WorkerRank(2, 0)], 22)
    index._first[index._parent[leaf]] = -1  # the sibling list loses the child the child table still has
    assert any("sibling list holds []" in p for p in index.check())


def test_index_invariant_lower_tier_edges() -> None:
    index = indexed()
    lower = index._ranks[WorkerRank(1, 0)].lower[0]
    assert lower is not None
    lower.by_ext[15] = lower.by_ext.pop(14)
    assert "WorkerRank(worker_id=1, dp_rank=0): host_pinned edge maps are not inverses" in index.check()


def test_index_invariant_leaked_node() -> None:
    """A position its last rank left but that was never freed."""
    index = indexed()
    r = index._ranks[WorkerRank(2, 0)]
    leaf = index._ext_find(r, 22)
    index._ext_remove(r, 22, leaf)
    index._cover[leaf] ^= r.mask
    index._blocks -= 1  # the block counter follows, so the leak is the one problem
    assert index.check() == [f"node {leaf} is covered by no rank but not freed (leak)"]
