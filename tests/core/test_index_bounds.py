"""The KV-event index of a scope stays under its block cap (actors/core/index_bounds.py)."""

from __future__ import annotations

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import IngestKvBatch, RecoveredRun, RecoverKv, UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import KvBlocksRefused, KvIndexed, KvIndexTrimmed
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import decode_record, digest, encode_record

SCOPE = ScopeKey("m", "t")
BLOCK = 4


def scope_with(*worker_ids: int) -> tuple[ScopeState, list[bytes]]:
    state, journal = ScopeState(SCOPE), []
    for worker_id in worker_ids:
        record = WorkerRecord(
            worker_id,
            SCOPE.model_name,
            SCOPE.tenant_id,
            block_size=BLOCK,
            kv_events_endpoints=((0, f"tcp://w:{worker_id}"),),
        )
        apply(state, journal, UpsertWorker(record))
    return state, journal


def apply(state: ScopeState, journal: list[bytes], command: object) -> Accepted:
    decision = decide(state, command)  # type: ignore[arg-type]
    assert isinstance(decision, Accepted), decision
    if decision.events:
        journal.append(encode_record(SCOPE, decision.events))
        fold(state, decision.events)
    assert check(state) == []
    return decision


def chain(worker_id: int, first_hash: int, blocks: int, cap: int, parent: int | None = None) -> IngestKvBatch:
    """One store of ``blocks`` chained blocks (external hashes first_hash, first_hash + 1, ...)."""
    hashes = tuple(range(first_hash, first_hash + blocks))
    tokens = tuple(range(first_hash * BLOCK, (first_hash + blocks) * BLOCK))
    event = BlockStored(hashes, parent, tokens, BLOCK)
    return IngestKvBatch(worker_id, 0, None, KvBatch(0.0, (event,)), max_index_blocks=cap)


def replayed(journal: list[bytes]) -> ScopeState:
    state = ScopeState(SCOPE)
    for payload in journal:
        fold(state, decode_record(payload).events)
    return state


def test_a_flooding_rank_is_trimmed_deepest_first_and_the_index_never_passes_the_cap() -> None:
    cap = 100
    state, journal = scope_with(1, 2)
    apply(state, journal, chain(2, 10_000, 10, cap))  # an honest rank: one 10-block prompt
    for step in range(40):  # a rank that stores and never removes: 400 blocks offered
        apply(state, journal, chain(1, 1_000 * (step + 1), 10, cap))
        assert state.selection.index.block_count() <= cap
    index = state.selection.index
    assert index.block_count(WorkerRank(2, 0)) == 10  # the honest rank kept everything
    flooder = WorkerRank(1, 0)
    assert 0 < index.block_count(flooder) <= cap - 10
    # Deepest first: what the flooder keeps are its prompts' first blocks, never a tail without its head.
    kept = {ext for run in index.dump_events() if run.rank == flooder for ext, _ in run.blocks}
    assert {h for h in kept if h % 1000 == 0} and all(h - 1 in kept for h in kept if h % 1000)
    # The journal replays to the same index, whatever cap a later start runs with (the trims are on record).
    assert digest(replayed(journal).to_snapshot()) == digest(state.to_snapshot())
    assert digest(ScopeState.from_snapshot(state.to_snapshot()).to_snapshot()) == digest(state.to_snapshot())


def test_a_trim_is_recorded_with_the_blocks_it_drops_and_takes_at_least_an_eighth() -> None:
    cap = 64
    state, journal = scope_with(1)
    for step in range(6):
        apply(state, journal, chain(1, 100 * (step + 1), 10, cap))
    before = state.selection.index.block_count()
    decision = apply(state, journal, chain(1, 5_000, 10, cap))
    trims = [e for e in decision.events if isinstance(e, KvIndexTrimmed)]
    assert len(trims) == 1 and trims[0].blocks >= before // 8
    # The decision counted exactly what the fold dropped: 60 held, 10 new, trimmed blocks gone.
    assert state.selection.index.block_count() == before - trims[0].blocks + 10 <= cap


def test_lower_tier_blocks_go_before_device_blocks() -> None:
    cap = 30
    state, journal = scope_with(1)
    apply(state, journal, chain(1, 100, 10, cap))
    host = BlockStored(tuple(range(500, 515)), 109, tuple(range(15 * BLOCK)), BLOCK, tier=Tier.HOST)
    apply(state, journal, IngestKvBatch(1, 0, None, KvBatch(0.0, (host,)), max_index_blocks=cap))
    decision = apply(state, journal, chain(1, 200, 10, cap))
    assert [e.keep_depth for e in decision.events if isinstance(e, KvIndexTrimmed)] == [None]
    index = state.selection.index
    assert index.block_count(WorkerRank(1, 0), Tier.HOST) == 0 and index.block_count(WorkerRank(1, 0)) == 20


def test_a_batch_larger_than_the_whole_cap_is_stored_up_to_it_and_the_rest_refused() -> None:
    cap = 8
    state, journal = scope_with(1)
    decision = apply(state, journal, chain(1, 100, 20, cap))
    refused = [e for e in decision.events if isinstance(e, KvBlocksRefused)]
    assert refused == [KvBlocksRefused(1, 0, 12)]
    stored = [e for e in decision.events if isinstance(e, KvIndexed)]
    assert len(stored) == 1 and stored[0].seq is None
    assert state.selection.index.block_count() == cap
    # The stored part is the chain's first blocks, so it still matches the prompt's head.
    assert {ext for run in state.selection.index.dump_events() for ext, _ in run.blocks} == set(range(100, 108))


def test_a_peer_dump_beyond_the_cap_is_seeded_up_to_it() -> None:
    cap = 12
    state, journal = ScopeState(SCOPE), []
    runs = tuple(RecoveredRun(w, 0, 0, None, tuple((1000 * w + i, 7000 * w + i) for i in range(10))) for w in (1, 2))
    decision = apply(state, journal, RecoverKv(runs, max_index_blocks=cap))
    assert state.selection.index.block_count() == cap
    assert [e for e in decision.events if isinstance(e, KvBlocksRefused)] == [KvBlocksRefused(2, 0, 8)]
    assert digest(replayed(journal).to_snapshot()) == digest(state.to_snapshot())


def test_under_the_cap_nothing_is_trimmed() -> None:
    state, journal = scope_with(1)
    decision = apply(state, journal, chain(1, 100, 10, cap=10))
    assert [type(e) for e in decision.events] == [KvIndexed]


def test_a_peer_run_naming_a_hash_twice_is_not_seeded_and_the_others_are() -> None:
    """The index refuses a store naming one external hash twice (or its parent among its blocks): a peer's
    recovered run that does stores nothing, live and replayed (KV ingest's runs skip that check at fold: their
    hashes were checked when decided)."""
    state, journal = scope_with(1, 2)
    repeated = RecoveredRun(1, 0, 0, None, ((11, 1), (12, 2), (11, 3)))
    parent_inside = RecoveredRun(1, 0, 0, 12, ((12, 4), (13, 5)))
    clean = RecoveredRun(2, 0, 0, None, ((21, 6), (22, 7)))
    apply(state, journal, RecoverKv((repeated, parent_inside, clean), max_index_blocks=100))
    assert state.selection.index.block_count(WorkerRank(1, 0)) == 0
    assert state.selection.index.block_count(WorkerRank(2, 0)) == 2
    assert check(replayed(journal)) == [] and replayed(journal).selection.index.block_count() == 2
