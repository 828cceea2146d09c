"""Property tests over random command sequences on the pure core."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core import decide as decide_module
from kvrouter.actors.core import selection_rules
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    AddRequest,
    CompletePrefill,
    CompleteReservationPrefill,
    ExpireStale,
    FreeRequest,
    IngestKvBatch,
    Prompt,
    RegisterWorker,
    ReleaseReservation,
    RemoveWorker,
    Reserve,
    SelectDisaggregated,
    SelectionOptions,
    SelectWorker,
    UnregisterWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.kv_wire import BlockRemoved, BlockStored, KvBatch
from kvrouter.actors.core.queries import loads
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import decode_record, digest, encode_record

SCOPE = ScopeKey("m", "t")
request_ids = st.sampled_from([f"r{i}" for i in range(8)])
hashes = st.lists(st.integers(0, 5), max_size=6).map(tuple)
commands = st.one_of(
    st.builds(RegisterWorker, st.integers(0, 3), st.just(16), st.integers(0, 2), st.integers(1, 3)),
    st.builds(UnregisterWorker, st.integers(0, 3)),
    st.builds(
        AddRequest,
        request_ids,
        st.integers(0, 3),
        st.integers(0, 4),
        hashes,
        st.integers(0, 100),
        at=st.integers(0, 1000),
    ),
    st.builds(CompletePrefill, request_ids),
    st.builds(FreeRequest, request_ids),
    st.builds(ExpireStale, st.just(300), at=st.integers(0, 1500)),
)


def run(sequence: list) -> tuple[ScopeState, list]:
    state = ScopeState(SCOPE)
    journal = []
    for command in sequence:
        decision = decide(state, command)
        if isinstance(decision, Accepted) and decision.events:
            journal.append(encode_record(SCOPE, decision.events))
            fold(state, decision.events)
        assert check(state) == [], command
        for row in loads(state):
            assert row.active_prefill_tokens >= 0 and row.active_decode_blocks >= 0
    return state, journal


@settings(max_examples=300, deadline=None)
@given(st.lists(commands, max_size=60))
def test_invariants_hold_and_loads_never_go_negative(sequence: list) -> None:
    run(sequence)


@settings(max_examples=200, deadline=None)
@given(st.lists(commands, max_size=60))
def test_freeing_every_request_returns_all_loads_to_zero(sequence: list) -> None:
    state, _ = run(sequence)
    for request_id in list(state.requests):
        fold(state, decide(state, FreeRequest(request_id)).events)
    assert all(
        (row.active_prefill_tokens, row.active_decode_blocks, row.active_requests) == (0, 0, 0) for row in loads(state)
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(commands, max_size=60))
def test_folding_the_journal_rebuilds_the_live_state(sequence: list) -> None:
    live, journal = run(sequence)
    replayed = ScopeState(SCOPE)
    for payload in journal:
        fold(replayed, decode_record(payload).events)
    assert digest(replayed.to_snapshot()) == digest(live.to_snapshot())
    restored = ScopeState.from_snapshot(live.to_snapshot())
    assert [r for r in loads(restored)] == [r for r in loads(live)]
    assert check(restored) == []


# -- the selection service's commands -----------------------------------------------------------------

SEL_BLOCK = 4
reservation_ids = st.sampled_from([f"s{i}" for i in range(6)])
prompt_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
    lambda blocks: tuple(t for b in blocks for t in range(b * SEL_BLOCK, (b + 1) * SEL_BLOCK))
)


def worker_record(
    worker_id: int, block_size: int, complete: bool, dp_size: int, role: str | None = None, zone: str = "a"
) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        SCOPE.model_name,
        SCOPE.tenant_id,
        endpoint="http://w" if complete else None,
        kv_events_endpoints=tuple((r, f"tcp://w:{r}") for r in range(dp_size)),
        block_size=block_size,
        data_parallel_size=dp_size,
        topology_domains=(("zone", zone),),
        kv_transfer_domain="zone" if role == "prefill" else None,
        worker_role=role,
    )


def stored(worker_id: int, tokens: tuple[int, ...], first_hash: int) -> IngestKvBatch:
    hashes = tuple(range(first_hash, first_hash + len(tokens) // SEL_BLOCK))
    return IngestKvBatch(worker_id, 0, None, KvBatch(0.0, (BlockStored(hashes, None, tokens, SEL_BLOCK),)))


selection_commands = st.one_of(
    st.builds(
        lambda w, bs, complete, dp, role, zone: UpsertWorker(worker_record(w, bs, complete, dp, role, zone)),
        st.integers(0, 2),
        st.sampled_from([SEL_BLOCK, SEL_BLOCK, 8]),
        st.booleans(),
        st.integers(1, 2),
        st.sampled_from([None, "prefill", "decode", "both"]),
        st.sampled_from(["a", "b"]),
    ),
    st.builds(RemoveWorker, st.integers(0, 2)),
    st.builds(stored, st.integers(0, 2), prompt_tokens, st.integers(1, 40)),
    st.builds(  # a tiny index cap: trims and refusals must keep the journal, snapshot and invariants in step
        lambda w, tokens, first, cap: attrs.evolve(stored(w, tokens, first), max_index_blocks=cap),
        st.integers(0, 2),
        prompt_tokens,
        st.integers(1, 40),
        st.integers(1, 6),
    ),
    st.builds(
        lambda w, h: IngestKvBatch(w, 0, None, KvBatch(0.0, (BlockRemoved((h,)),))),
        st.integers(0, 2),
        st.integers(1, 40),
    ),
    st.builds(
        lambda tokens, rid, t, draw, approx, mode, blocks, expected: SelectWorker(
            Prompt(token_ids=tokens),
            RouterConfig(
                router_temperature=t,
                use_kv_events=not approx,
                router_mode=mode,
                router_track_active_blocks=blocks,
                router_track_output_blocks=blocks,
            ),
            SelectionOptions(expected_output_tokens=expected),
            reserve=True,
            reservation_id=rid,
            draw=draw,
            at=0,
            turn=int(draw * 10),
        ),
        prompt_tokens,
        reservation_ids,
        st.sampled_from([0.0, 1.0]),
        st.floats(0.0, 0.999),
        st.booleans(),
        st.sampled_from(["kv", "kv", "round_robin", "random", "least_loaded"]),
        st.booleans(),
        st.sampled_from([None, 8]),
    ),
    st.builds(
        lambda tokens, rid, draw, approx: SelectDisaggregated(
            Prompt(token_ids=tokens),
            RouterConfig(use_kv_events=not approx),
            rid,
            draw=draw,
            decode_draw=(draw + 0.5) % 1.0,
            at=0,
        ),
        prompt_tokens,
        reservation_ids,
        st.floats(0.0, 0.999),
        st.booleans(),
    ),
    st.builds(
        lambda rid, w, r, hashes: Reserve(rid, w, r, hashes, isl_tokens=8, at=0),
        reservation_ids,
        st.integers(0, 2),
        st.integers(0, 1),
        hashes,
    ),
    st.builds(AddOutputBlock, reservation_ids, st.sampled_from([None, None, 0.5, 0.0, 1.0])),
    st.builds(AddOutputBlock, st.sampled_from(["s0:prefill", "s1:decode"])),
    st.builds(ReleaseReservation, st.sampled_from(["s0:prefill", "s0:decode", "s1:decode"])),
    st.builds(CompleteReservationPrefill, reservation_ids),
    st.builds(ReleaseReservation, reservation_ids),
    st.builds(ExpireStale, st.just(300), at=st.integers(0, 400) | st.just(121_000_000_000)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(selection_commands, max_size=40))
def test_selection_invariants_hold_and_the_journal_and_snapshot_rebuild_the_state(sequence: list) -> None:
    live, journal = run(sequence)
    replayed = ScopeState(SCOPE)
    for payload in journal:
        fold(replayed, decode_record(payload).events)
    assert digest(replayed.to_snapshot()) == digest(live.to_snapshot())
    restored = ScopeState.from_snapshot(live.to_snapshot())
    assert digest(restored.to_snapshot()) == digest(live.to_snapshot()) and check(restored) == []
    assert restored.exists == live.exists
    if live.selection.partition_block_size is not None:
        assert live.exists  # a partition outlives its workers


# -- the per-scope caps on active requests, patched tiny ----------------------------------------------

TINY_REQUESTS, TINY_BLOCKS = 3, 8


def rankful(worker_id: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        SCOPE.model_name,
        SCOPE.tenant_id,
        endpoint="http://w",
        kv_events_endpoint=f"tcp://w:{worker_id + 1}",
        block_size=SEL_BLOCK,
    )


# Bookings and what releases them, on workers registered first (so that most commands book).
tracker_bookings = st.lists(
    st.one_of(
        st.builds(
            AddRequest, request_ids, st.just(0), st.integers(0, 1), hashes, st.integers(0, 100), at=st.integers(0, 1000)
        ),
        st.builds(FreeRequest, request_ids),
        st.builds(ExpireStale, st.just(300), at=st.integers(0, 1500)),
        st.builds(UnregisterWorker, st.just(1)),
    ),
    min_size=10,
    max_size=40,
).map(lambda sequence: [RegisterWorker(0, 16, 0, 2), RegisterWorker(1, 16, 0, 1), *sequence])
selection_bookings = st.lists(
    st.one_of(
        st.builds(lambda rid, w, h: Reserve(rid, w, 0, h, isl_tokens=8), reservation_ids, st.integers(0, 1), hashes),
        st.builds(
            lambda tokens, rid: SelectWorker(
                Prompt(token_ids=tokens), RouterConfig(), reserve=True, reservation_id=rid
            ),
            prompt_tokens,
            reservation_ids,
        ),
        st.builds(
            lambda tokens, rid: SelectDisaggregated(Prompt(token_ids=tokens), RouterConfig(), rid),
            prompt_tokens,
            reservation_ids,
        ),
        st.builds(ReleaseReservation, reservation_ids | st.sampled_from(["s0:prefill", "s0:decode"])),
        st.builds(RemoveWorker, st.just(1)),
    ),
    min_size=10,
    max_size=40,
).map(lambda sequence: [UpsertWorker(rankful(0)), UpsertWorker(rankful(1)), *sequence])


@settings(max_examples=200, deadline=None)
@given(tracker_bookings | selection_bookings)
def test_tiny_active_request_caps_are_never_exceeded_and_the_journal_rebuilds_the_state(sequence: list) -> None:
    """With caps of 3 requests and 8 prompt blocks per scope (``actors/core/limits.py``), the bookings of both
    services keep the scope within them, the invariants (``prompt_blocks`` among them) hold, and the journal
    and the snapshot rebuild the same state."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (decide_module, selection_rules):
            patch.setattr(module, "MAX_ACTIVE_REQUESTS_PER_SCOPE", TINY_REQUESTS)
            patch.setattr(module, "MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE", TINY_BLOCKS)
        live = ScopeState(SCOPE)
        journal = []
        for command in sequence:
            decision = decide(live, command)
            if isinstance(decision, Accepted) and decision.events:
                journal.append(encode_record(SCOPE, decision.events))
                fold(live, decision.events)
            assert check(live) == [], command
            assert len(live.slots.requests) <= TINY_REQUESTS and live.slots.prompt_blocks <= TINY_BLOCKS, command
    replayed = ScopeState(SCOPE)
    for payload in journal:
        fold(replayed, decode_record(payload).events)
    assert digest(replayed.to_snapshot()) == digest(live.to_snapshot())
    restored = ScopeState.from_snapshot(live.to_snapshot())
    assert restored.slots.prompt_blocks == live.slots.prompt_blocks and check(restored) == []
