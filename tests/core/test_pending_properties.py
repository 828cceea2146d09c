"""Property tests of the pending-selection cache and its templates (``actors/core/pending.py``).

The cache against a plain model (several scopes' caches sharing one byte budget, small bounds): random puts,
takes, give-backs and discards at random times. The template: booked right away, a remembered ``/select``
books exactly what ``/select_and_reserve`` with the same draw would have booked."""

from __future__ import annotations

import attrs
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    IngestKvBatch,
    Prompt,
    Reserve,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.pending import (
    PendingSelections,
    SelectionCacheBudget,
    entry_bytes,
    replayed,
    template,
)
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState

SECOND = 1_000_000_000
TTL_SECONDS = 2.0
MAX_ENTRIES = 3
IDS = [f"s{i}" for i in range(5)]


def booking(blocks: int) -> Reserve:
    return Reserve("", 1, 0, tuple(range(blocks)), isl_tokens=blocks * 16)


BUDGET = entry_bytes("s0", booking(20)) * 4  # a few entries across every cache
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 1), st.sampled_from(IDS), st.integers(0, 60)),
        st.tuples(st.just("take"), st.integers(0, 1), st.sampled_from(IDS)),
        st.tuples(st.just("give_back"), st.integers(0, 1), st.sampled_from(IDS), st.integers(0, 60)),
        st.tuples(st.just("discard"), st.integers(0, 1), st.sampled_from(IDS)),
        st.tuples(st.just("wait"), st.integers(0, 3 * SECOND)),
    ),
    max_size=50,
)


class Model:
    """One scope's cache as its policy reads: insertion order, latest put wins and moves to the young end; the
    storing scope evicts its own oldest while over its count or the shared budget; too big for the budget: not
    kept; a take is a pop, None when missing or older than the TTL."""

    def __init__(self, shared: dict[str, int]) -> None:
        self.entries: dict[str, tuple[Reserve, int, int]] = {}
        self.shared = shared

    def store(self, selection_id: str, reservation: Reserve, at: int) -> None:
        size = entry_bytes(selection_id, reservation)
        if size > BUDGET:
            return
        self.entries[selection_id] = (reservation, at, size)
        self.shared["used"] += size
        while self.entries and (len(self.entries) > MAX_ENTRIES or self.shared["used"] > BUDGET):
            self.pop(next(iter(self.entries)))

    def pop(self, selection_id: str) -> tuple[Reserve, int, int] | None:
        entry = self.entries.pop(selection_id, None)
        if entry is not None:
            self.shared["used"] -= entry[2]
        return entry


@settings(max_examples=400, deadline=None)
@given(STEPS)
def test_the_cache_keeps_its_bounds_and_answers_as_its_policy_says(steps: list[tuple]) -> None:
    budget = SelectionCacheBudget(BUDGET)
    caches = [PendingSelections(ttl_seconds=TTL_SECONDS, max_entries=MAX_ENTRIES, budget=budget) for _ in range(2)]
    shared = {"used": 0}
    models = [Model(shared), Model(shared)]
    now = 0
    for step in steps:
        kind = step[0]
        if kind == "wait":
            now += step[1]
            continue
        cache, model, selection_id = caches[step[1]], models[step[1]], step[2]
        if kind == "put":
            caches[step[1]].put(selection_id, booking(step[3]), now)
            model.pop(selection_id)
            model.store(selection_id, booking(step[3]), now)
        elif kind == "take":
            entry = model.pop(selection_id)
            fresh = entry is not None and now - entry[1] <= TTL_SECONDS * SECOND
            assert cache.take(selection_id, now) == (entry[0] if fresh and entry is not None else None)
        elif kind == "give_back":
            cache.give_back(selection_id, booking(step[3]), now)
            if selection_id not in model.entries:
                model.store(selection_id, booking(step[3]), now)
        else:
            cache.discard(selection_id)
            model.pop(selection_id)
        assert budget.used == shared["used"] <= BUDGET
        assert [len(c) for c in caches] == [len(m.entries) for m in models]
        assert all(len(c) <= MAX_ENTRIES for c in caches)


# -- templates ----------------------------------------------------------------------------------------

SCOPE = ScopeKey("m", "t")
BLOCK = 4


def worker(worker_id: int, dp_size: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        SCOPE.model_name,
        SCOPE.tenant_id,
        endpoint=f"http://w{worker_id}",
        kv_events_endpoints=tuple((r, f"tcp://w{worker_id}:{5000 + r}") for r in range(dp_size)),
        block_size=BLOCK,
        data_parallel_size=dp_size,
    )


def tokens(blocks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(t for b in blocks for t in range(b * BLOCK, (b + 1) * BLOCK))


PROMPTS = st.lists(st.integers(0, 5), min_size=1, max_size=6).map(tuple)
SETUP = st.lists(
    st.one_of(
        st.builds(lambda w, dp: UpsertWorker(worker(w, dp)), st.integers(1, 3), st.integers(1, 2)),
        st.builds(
            lambda w, blocks, first: IngestKvBatch(
                w,
                0,
                None,
                KvBatch(0.0, (BlockStored(tuple(range(first, first + len(blocks))), None, tokens(blocks), BLOCK),)),
            ),
            st.integers(1, 3),
            PROMPTS,
            st.integers(1, 30),
        ),
        st.builds(
            lambda blocks, rid, draw: SelectWorker(
                Prompt(tokens(blocks)), RouterConfig(), reserve=True, reservation_id=rid, draw=draw
            ),
            PROMPTS,
            st.sampled_from(["r0", "r1", "sel"]),
            st.floats(0.0, 0.999),
        ),
    ),
    min_size=1,
    max_size=12,
)
CONFIGS = st.builds(
    lambda approx, blocks, prefill, outputs, affinity: RouterConfig(
        use_kv_events=not approx,
        router_track_active_blocks=blocks,
        router_track_prefill_tokens=prefill,
        router_track_output_blocks=outputs,
        session_affinity_ttl_secs=affinity,
    ),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 30.0]),
)


@settings(max_examples=300, deadline=None)
@given(SETUP, PROMPTS, CONFIGS, st.floats(0.0, 0.999), st.sampled_from([None, 8]), st.sampled_from([None, "chat"]))
def test_a_replayed_template_books_what_select_and_reserve_would_have(
    setup: list, blocks: tuple[int, ...], config: RouterConfig, draw: float, output: int | None, session: str | None
) -> None:
    state = ScopeState(SCOPE)
    for command in setup:
        decision = decide(state, command)
        if isinstance(decision, Accepted):
            fold(state, decision.events)
    options = SelectionOptions(expected_output_tokens=output, session_id=session)
    select = SelectWorker(Prompt(tokens(blocks)), config, options, selection_id="sel", draw=draw, at=SECOND)
    chosen = decide(state, select)
    event("selected" if isinstance(chosen, Accepted) else "refused")
    if not isinstance(chosen, Accepted):
        return
    kept = template(select, chosen.reply)
    assert attrs.evolve(replayed(kept, "sel", 5), reservation_id="", at=0) == kept  # what giving back undoes
    replay = decide(state, replayed(kept, "sel", 2 * SECOND))
    direct = decide(state, attrs.evolve(select, reserve=True, reservation_id="sel", at=2 * SECOND))
    event(f"booked: {not isinstance(direct, Rejected)}")
    if isinstance(direct, Rejected):
        assert isinstance(replay, Rejected) and replay.reason is direct.reason
    else:
        assert isinstance(replay, Accepted) and replay.events == direct.events
        assert (replay.reply.worker_id, replay.reply.dp_rank) == (direct.reply.worker_id, direct.reply.dp_rank)
