"""KV-stream liveness (``actors/core/kv_liveness.py``) against a model of the rule, over random histories: bookings,
batches, listeners connecting, dropping and going away, time passing and a check after each step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_liveness import (
    BACK_EVENTS,
    BACK_RECONNECTED,
    KV_EVENTS_STOPPED,
    KvLiveness,
    Transition,
    excluded_ranks,
)

SCOPES = (ScopeKey("m", "default"), ScopeKey("n", "default"))
SECOND = 1_000_000_000
TIMEOUT_SECS = 2.0
RANKS = (WorkerRank(1, 0), WorkerRank(1, 1), WorkerRank(2, 0))

scope_st = st.sampled_from(SCOPES)
rank_st = st.sampled_from(RANKS)
step_st = st.one_of(
    st.tuples(st.just("book"), scope_st, rank_st),
    st.tuples(st.just("heard"), scope_st, rank_st),
    st.tuples(st.just("listener"), rank_st, st.sampled_from([True, False, None])),
    st.tuples(st.just("wait"), st.integers(0, 3 * SECOND)),
    st.tuples(st.just("remove"), scope_st, st.sampled_from([1, 2])),
)


class Model:
    """The rule, spelled out plainly."""

    def __init__(self) -> None:
        self.unanswered: dict[tuple[ScopeKey, WorkerRank], int] = {}
        self.out: dict[tuple[ScopeKey, WorkerRank], bool] = {}  # -> seen disconnected while out

    def check(self, now: int, listeners: dict[WorkerRank, bool | None]) -> list[Transition]:
        changes = []
        for scope, rank in sorted(self.out):
            state = listeners[rank]
            if state is None:
                del self.out[scope, rank]
            elif state is False:
                self.out[scope, rank] = True
            elif self.out[scope, rank]:
                del self.out[scope, rank]
                changes.append(Transition(scope, rank, False, BACK_RECONNECTED))
        for (scope, rank), since in sorted(self.unanswered.items()):
            if now - since >= TIMEOUT_SECS * SECOND and listeners[rank] is not None:
                del self.unanswered[scope, rank]
                self.out[scope, rank] = False
                changes.append(Transition(scope, rank, True, KV_EVENTS_STOPPED, now - since))
        return changes


def run(steps: list[tuple]) -> tuple[list[Transition], KvLiveness]:
    """Apply ``steps`` to a KvLiveness and the model side by side, checking after each that they agree."""
    live, model = KvLiveness(TIMEOUT_SECS), Model()
    listeners: dict[WorkerRank, bool | None] = dict.fromkeys(RANKS, True)
    now = 1_000 * SECOND
    seen: list[Transition] = []
    for step in steps:
        kind = step[0]
        if kind == "book":
            live.booked(step[1], step[2], now)
            model.unanswered.setdefault((step[1], step[2]), now)
        elif kind == "heard":
            back = live.heard(step[1], step[2])
            model.unanswered.pop((step[1], step[2]), None)
            was_out = model.out.pop((step[1], step[2]), None) is not None
            assert back == (Transition(step[1], step[2], False, BACK_EVENTS) if was_out else None)
            if back is not None:
                seen.append(back)
        elif kind == "listener":
            listeners[step[1]] = step[2]
        elif kind == "wait":
            now += step[1]
        else:
            live.forget_worker(step[1], step[2])
            for table in (model.unanswered, model.out):
                for key in [k for k in table if k[0] == step[1] and k[1].worker_id == step[2]]:
                    del table[key]
        changes = live.check(now, listeners.__getitem__)
        assert changes == model.check(now, listeners)
        seen.extend(changes)
        for scope in SCOPES:
            assert set(live.out(scope)) == {rank for s, rank in model.out if s == scope}
            assert dict(live.unanswered(scope)) == {
                rank: at for (s, rank), at in model.unanswered.items() if s == scope
            }
    return seen, live


@settings(max_examples=300, deadline=None)
@given(st.lists(step_st, max_size=40))
def test_liveness_follows_the_rule(steps: list[tuple]) -> None:
    seen, live = run(steps)
    # Counted as they happened; a rank still out is one taken out and not back (or dropped with its listener).
    assert live.counts.taken_out == sum(1 for change in seen if change.out)
    assert sum(live.counts.returned.values()) == sum(1 for change in seen if not change.out)
    assert live.out_count() <= live.counts.taken_out - sum(live.counts.returned.values())


@settings(max_examples=100, deadline=None)
@given(st.lists(step_st, max_size=40))
def test_the_same_history_gives_the_same_transitions(steps: list[tuple]) -> None:
    assert run(steps)[0] == run(steps)[0]


def test_a_rank_without_a_listener_is_never_taken_out() -> None:
    live = KvLiveness(TIMEOUT_SECS)
    scope, rank = SCOPES[0], RANKS[0]
    live.booked(scope, rank, 0)
    assert live.check(100 * SECOND, lambda _: None) == []
    assert not live.any_out()


def test_a_silent_rank_goes_out_at_the_timeout_and_back_on_its_next_batch() -> None:
    live = KvLiveness(TIMEOUT_SECS)
    scope, rank = SCOPES[0], RANKS[0]
    live.booked(scope, rank, 0)
    live.booked(scope, rank, SECOND)  # the first unanswered booking counts
    assert live.check(2 * SECOND - 1, lambda _: True) == []
    assert live.check(2 * SECOND, lambda _: True) == [Transition(scope, rank, True, KV_EVENTS_STOPPED, 2 * SECOND)]
    assert set(live.out(scope)) == {rank}
    assert live.heard(scope, rank) == Transition(scope, rank, False, BACK_EVENTS)
    assert not live.any_out() and live.counts.returned == {BACK_EVENTS: 1}


def test_disabled_liveness_takes_nothing_out() -> None:
    live = KvLiveness(0)
    live.booked(SCOPES[0], RANKS[0], 0)
    assert live.check(100 * SECOND, lambda _: True) == []


@given(st.sets(rank_st), st.lists(st.sampled_from([1, 2]), min_size=1, max_size=2, unique=True))
def test_a_selection_never_leaves_out_every_rank(out: set[WorkerRank], worker_ids: list[int]) -> None:
    records = [WorkerRecord(w, "m", "default", data_parallel_size=2 if w == 1 else 1) for w in worker_ids]
    ranks = {rank for record in records for rank in record.ranks}
    excluded = excluded_ranks(tuple(sorted(out)), records)
    assert excluded <= out & ranks
    assert excluded != ranks
    assert excluded == (out & ranks if (out & ranks) != ranks else frozenset())
