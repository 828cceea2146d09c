"""Property tests over random command sequences on the pure core."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.commands import (
    AddRequest,
    CompletePrefill,
    ExpireStale,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.queries import loads
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
