"""KvHealth.predicted_ranks (asked for every rank on every selection) against its definition: the ranks whose
``mode`` is predicted, ``mode`` asked rank by rank. Two instances follow the same random history (listeners
dropping and returning, bookings, KV batches, time passing); after every step both name the same ranks and
keep the same "first seen down" times."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import KvIndexed, RequestAdded
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_modes import KvMode
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.kv_health import KvHealth

SCOPE = ScopeKey("m", "default")
SECOND = 1_000_000_000
WORKERS = (
    WorkerRecord(1, "m", "default", data_parallel_size=2),
    WorkerRecord(2, "m", "default"),
    WorkerRecord(3, "m", "default", data_parallel_size=3),
)
RANKS = [rank for record in WORKERS for rank in record.ranks]


def by_definition(health: KvHealth, state: ScopeState, now: int) -> frozenset[WorkerRank]:
    if health.stale_after_secs <= 0:
        return frozenset()  # the fallback is off: nothing is asked
    return frozenset(
        rank
        for record in WORKERS
        for rank in record.ranks
        if health.mode(state.scope, rank, now).mode is KvMode.PREDICTED
    )


STEP = st.one_of(
    st.tuples(st.just("listener"), st.sampled_from(RANKS), st.sampled_from([True, False, None])),
    st.tuples(st.just("book"), st.sampled_from(RANKS)),
    st.tuples(st.just("batch"), st.sampled_from(RANKS)),
    st.tuples(st.just("wait"), st.integers(0, 15 * SECOND)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40), st.sampled_from([0.0, 1.0, 10.0]))
def test_predicted_ranks_are_the_ranks_whose_mode_is_predicted(steps: list[tuple], stale_secs: float) -> None:
    listeners: dict[WorkerRank, bool | None] = dict.fromkeys(RANKS, True)

    def connected(worker_id: int, dp_rank: int) -> bool | None:
        return listeners[WorkerRank(worker_id, dp_rank)]

    def all_connected() -> bool:
        return all(listener is not False for listener in listeners.values())

    fast, defined = KvHealth(connected, stale_secs, all_connected), KvHealth(connected, stale_secs)
    state = ScopeState(SCOPE)
    now = 0
    for step in steps:
        kind = step[0]
        if kind == "listener":
            listeners[step[1]] = step[2]
        elif kind in ("book", "batch"):
            rank = step[1]
            event = (
                RequestAdded(f"r{now}", rank.worker_id, rank.dp_rank, (), 0, now)
                if kind == "book"
                else KvIndexed(rank.worker_id, rank.dp_rank, rank.dp_rank, 1, ())
            )
            for health in (fast, defined):
                health.observe(state, None, (event,))  # type: ignore[arg-type]
        else:
            now += step[1]
        # a selection after every step
        assert fast.predicted_ranks(state, WORKERS, now) == by_definition(defined, state, now)
        assert fast._down_since == defined._down_since
