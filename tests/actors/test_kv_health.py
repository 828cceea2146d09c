"""The per-rank fallback to predicted blocks, end to end: what ``KvHealth.view`` hands a selection and what the
scope's desk makes of it (``kv_modes.predicted_ranks``) against a model of the rule, over random histories
(listeners dropping and returning, bookings, KV batches, time passing, a selection after every step); and
against ``KvHealth.modes``, the rank-by-rank answer ``GET /workers`` shows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import KvIndexed, RequestAdded
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_modes import HEALTHY, KvMode, predicted_ranks
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


class FakeListeners:
    """Each rank's listener: connected (True), not (False), or none at all (None)."""

    def __init__(self) -> None:
        self.state: dict[WorkerRank, bool | None] = dict.fromkeys(RANKS, True)

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        return self.state[WorkerRank(worker_id, dp_rank)]

    def all_connected(self) -> bool:
        return all(connected is not False for connected in self.state.values())

    def listening(self) -> list[tuple[int, int]]:
        return [tuple(rank) for rank, connected in self.state.items() if connected is not None]  # type: ignore[misc]


class Model:
    """The rule, plainly: a rank without a listener is exact; one whose listener is down is predicted once it was
    first seen down ``stale`` ago; a connected one once a booking on it went unanswered that long."""

    def __init__(self, stale_secs: float) -> None:
        self.stale_ns = round(stale_secs * SECOND)
        self.down_since: dict[WorkerRank, int] = {}
        self.unanswered: dict[WorkerRank, int] = {}

    def selection(self, listeners: FakeListeners, now: int) -> frozenset[WorkerRank]:
        for rank, connected in listeners.state.items():
            if connected is False:
                self.down_since.setdefault(rank, now)
            else:
                self.down_since.pop(rank, None)
        if self.stale_ns <= 0:
            return frozenset()
        predicted = set()
        for rank, connected in listeners.state.items():
            if connected is False and now - self.down_since[rank] >= self.stale_ns:
                predicted.add(rank)
            if connected is True and rank in self.unanswered and now - self.unanswered[rank] >= self.stale_ns:
                predicted.add(rank)
        return frozenset(predicted)


STEP = st.one_of(
    st.tuples(st.just("listener"), st.sampled_from(RANKS), st.sampled_from([True, False, None])),
    st.tuples(st.just("book"), st.sampled_from(RANKS)),
    st.tuples(st.just("batch"), st.sampled_from(RANKS)),
    st.tuples(st.just("wait"), st.integers(0, 15 * SECOND)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40), st.sampled_from([0.0, 1.0, 10.0]))
def test_a_selection_scores_predicted_exactly_the_ranks_the_rule_names(steps: list[tuple], stale_secs: float) -> None:
    listeners = FakeListeners()
    health, model = KvHealth(listeners, stale_secs), Model(stale_secs)
    state = ScopeState(SCOPE)
    now = 0
    for step in steps:
        kind = step[0]
        if kind == "listener":
            listeners.state[step[1]] = step[2]
        elif kind == "book":
            rank = step[1]
            health.observe(state, None, (RequestAdded(f"r{now}", rank.worker_id, rank.dp_rank, (), 0, now),))  # type: ignore[arg-type]
            model.unanswered.setdefault(rank, now)
        elif kind == "batch":
            rank = step[1]
            health.observe(state, None, (KvIndexed(rank.worker_id, rank.dp_rank, rank.dp_rank, 1, ()),))  # type: ignore[arg-type]
            model.unanswered.pop(rank, None)
        else:
            now += step[1]
        view = health.view(SCOPE, now)  # a selection after every step
        expected = model.selection(listeners, now)
        assert predicted_ranks(WORKERS, view, now, stale_secs) == expected
        by_rank = {
            r for record in WORKERS for r, m in health.modes(SCOPE, record, now).items() if m.mode is KvMode.PREDICTED
        }
        assert by_rank == expected


def test_a_healthy_service_hands_every_selection_the_same_empty_view() -> None:
    listeners = FakeListeners()
    health = KvHealth(listeners, 10.0)
    assert health.view(SCOPE, 0) is HEALTHY
    listeners.state[RANKS[0]] = None  # a rank without a listener is exact, whatever happens
    health.observe(ScopeState(SCOPE), None, (RequestAdded("r", *RANKS[0], (), 0, 0),))  # type: ignore[arg-type]
    assert health.view(SCOPE, 100 * SECOND).unanswered_since == ()
