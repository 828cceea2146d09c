"""The scope's desk (``actors/core/desk.py``): what a command gets before it is decided (draws from the scope's
seeded source, in the order the actor always drew them, round-robin turns, predicted ranks, the service-wide
"nothing schedulable" answer, replayed templates) and what its decision leads to (templates kept, given back or
dropped; the waiting room)."""

from __future__ import annotations

import random
import uuid

import attrs
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    FreeRankBookings,
    Prompt,
    RegisterWorker,
    ReleaseReservation,
    Reserve,
    ReserveSelection,
    SelectDisaggregated,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.desk import ScopeDesk
from kvrouter.actors.core.events import RequestFreed
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_modes import StreamView
from kvrouter.actors.core.pending import PendingSelections
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import NO_SCHEDULABLE_WORKERS_ANYWHERE, no_schedulable_workers
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.waiting_room import QUEUE_FULL, WaitingRoom

SCOPE = ScopeKey("m", "t")
SECOND = 1_000_000_000
PROMPT = Prompt(tuple(range(16)))


class Elsewhere:
    def __init__(self, ranks: int = 0, schedulable: bool = False) -> None:
        self.ranks, self.schedulable = ranks, schedulable

    def ranks_elsewhere(self, scope: ScopeKey) -> int:
        return self.ranks

    def schedulable_elsewhere(self, scope: ScopeKey, use_kv_events: bool, queueing: bool) -> bool:
        return self.schedulable


def worker(worker_id: int, **fields: object) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        "m",
        "t",
        endpoint=f"http://w{worker_id}",
        block_size=4,
        kv_events_endpoint=f"tcp://w:{5000 + worker_id}",
        **fields,
    )


def scope_with(*records: WorkerRecord) -> ScopeState:
    state = ScopeState(SCOPE)
    for record in records:
        fold(state, decide(state, UpsertWorker(record)).events)
    return state


def desk_for(
    state: ScopeState, seed: int = 0, surroundings: Elsewhere | None = None, room_size: int = 8
) -> ScopeDesk[str]:
    room: WaitingRoom[str] = WaitingRoom(lambda ticket: False, max_waiting=room_size)
    return ScopeDesk(state, random.Random(seed), PendingSelections(), room, surroundings or Elsewhere())


@given(st.integers(0, 2**32), st.booleans())
def test_draws_come_from_the_scopes_seeded_source_in_a_fixed_order(seed: int, disaggregated: bool) -> None:
    # What the actor always drew, so a simulation's journal replays byte for byte: a generated reservation id
    # (128 bits, as a version-4 UUID) first, then each stage's uniform number.
    desk = desk_for(scope_with(worker(1)), seed)
    expected = random.Random(seed)
    if disaggregated:
        prepared = desk.prepare(SelectDisaggregated(PROMPT, RouterConfig()))
        assert isinstance(prepared, SelectDisaggregated)
        assert prepared.reservation_id == str(uuid.UUID(int=expected.getrandbits(128), version=4))
        assert (prepared.draw, prepared.decode_draw) == (expected.random(), expected.random())
    else:
        prepared = desk.prepare(SelectWorker(PROMPT, RouterConfig(), reserve=True))
        assert isinstance(prepared, SelectWorker)
        assert prepared.reservation_id == str(uuid.UUID(int=expected.getrandbits(128), version=4))
        assert prepared.draw == expected.random()
    given_id = desk.prepare(SelectWorker(PROMPT, RouterConfig(), reserve=True, selection_id="s"))
    assert isinstance(given_id, SelectWorker) and given_id.reservation_id == "s"  # nothing drawn for the id
    assert given_id.draw == expected.random()


def test_only_round_robin_selections_take_turns() -> None:
    desk = desk_for(scope_with(worker(1)))
    turns = [
        desk.prepare(SelectWorker(PROMPT, RouterConfig(router_mode=mode))).turn  # type: ignore[union-attr]
        for mode in ("round_robin", "kv", "round_robin", "random", "round_robin")
    ]
    assert turns == [0, 0, 1, 0, 2]


def test_a_registration_carries_what_the_other_scopes_hold() -> None:
    desk = desk_for(ScopeState(SCOPE), surroundings=Elsewhere(ranks=7))
    assert desk.prepare(RegisterWorker(1, 16, 0, 1)) == RegisterWorker(1, 16, 0, 1, ranks_elsewhere=7)
    assert desk.prepare(UpsertWorker(worker(1))) == UpsertWorker(worker(1), ranks_elsewhere=7)


def test_nothing_schedulable_anywhere_is_answered_before_anything_is_drawn() -> None:
    state = ScopeState(SCOPE)
    alone = desk_for(state, seed=3)
    refused = alone.prepare(SelectWorker(PROMPT, RouterConfig(), reserve=True))
    assert refused == Rejected(Reason.UNAVAILABLE, NO_SCHEDULABLE_WORKERS_ANYWHERE)
    assert alone.prepare(SelectDisaggregated(PROMPT, RouterConfig())) == refused
    prepared = alone.prepare(SelectWorker(PROMPT, RouterConfig(), reserve=True, selection_id="s"))
    assert prepared == refused
    # Another scope has one: the scope's own answer, from decide.
    elsewhere = desk_for(state, seed=3, surroundings=Elsewhere(schedulable=True))
    command = elsewhere.prepare(SelectWorker(PROMPT, RouterConfig()))
    assert isinstance(command, SelectWorker) and command.draw == random.Random(3).random()
    assert decide(state, command) == Rejected(Reason.UNAVAILABLE, no_schedulable_workers(SCOPE))


def test_the_streams_view_and_the_scopes_ranks_decide_the_predicted_ranks() -> None:
    desk = desk_for(scope_with(worker(1), worker(2)))
    rank = WorkerRank(1, 0)
    down_long = StreamView(down_since=((rank, 0), (WorkerRank(9, 0), 0)))  # worker 9 is not in this scope
    prepared = desk.prepare(SelectWorker(PROMPT, RouterConfig(), at=20 * SECOND, streams=down_long))
    assert isinstance(prepared, SelectWorker) and prepared.predicted_ranks == frozenset({rank})
    fresh = desk.prepare(SelectWorker(PROMPT, RouterConfig(), at=SECOND, streams=down_long))
    assert isinstance(fresh, SelectWorker) and fresh.predicted_ranks == frozenset()  # not down for 10 s yet


def test_a_selection_leaves_its_template_and_a_replay_books_it_once() -> None:
    state = scope_with(worker(1))
    desk = desk_for(state)
    assert desk.prepare(ReserveSelection("s", at=1)) == Rejected(
        Reason.NOT_FOUND, f"no pending selection s for {SCOPE.describe()} (expired, already used, or never selected)"
    )
    asked = SelectWorker(PROMPT, RouterConfig(), selection_id="s")
    command = desk.prepare(asked)
    decision = decide(state, command)  # type: ignore[arg-type]
    assert desk.decided(asked, command, decision, None) == decision and len(desk.pending) == 1  # type: ignore[arg-type]
    replay = ReserveSelection("s", at=5)
    booking = desk.prepare(replay)
    assert isinstance(booking, Reserve) and (booking.reservation_id, booking.at) == ("s", 5)
    assert len(desk.pending) == 0  # taken
    refused = Rejected(Reason.CONFLICT, "selection s is already reserved or being reserved")
    desk.decided(replay, booking, refused, None)
    assert len(desk.pending) == 1  # a failed booking leaves it where it was
    booking = desk.prepare(replay)
    desk.decided(replay, booking, decide(state, booking), None)  # type: ignore[arg-type]
    assert len(desk.pending) == 0 and isinstance(desk.prepare(replay), Rejected)


def test_a_booking_under_a_selection_id_drops_its_template() -> None:
    state = scope_with(worker(1))
    desk = desk_for(state)
    asked = SelectWorker(PROMPT, RouterConfig(), selection_id="s")
    command = desk.prepare(asked)
    desk.decided(asked, command, decide(state, command), None)  # type: ignore[arg-type]
    explicit = Reserve("s", 1, 0, (1,), 4)
    desk.decided(explicit, explicit, decide(state, explicit), None)
    assert len(desk.pending) == 0
    desk.decided(asked, command, decide(state, command), None)  # type: ignore[arg-type]
    reserved = attrs.evolve(asked, reserve=True)
    prepared = desk.prepare(reserved)
    desk.decided(reserved, prepared, decide(state, prepared), None)  # type: ignore[arg-type]
    assert len(desk.pending) == 0


def test_an_overloaded_selection_waits_when_queueing_is_on_and_its_asker_is_there() -> None:
    config = RouterConfig(router_queue_threshold=1.0)
    state = scope_with(worker(1, max_num_batched_tokens=4))
    desk = desk_for(state, room_size=1)
    hog = Reserve("hog", 1, 0, (), isl_tokens=100)
    fold(state, decide(state, hog).events)  # 100 prefill tokens > 1.0 x 4: busy
    asked = SelectWorker(PROMPT, config, reserve=True, reservation_id="r")
    command = desk.prepare(asked)
    decision = decide(state, command)  # type: ignore[arg-type]
    assert isinstance(decision, Rejected) and decision.reason is Reason.OVERLOADED
    assert desk.decided(asked, command, decision, None) == decision  # nobody to answer later: answered now
    assert desk.decided(asked, command, decision, "ticket") is None and len(desk.room) == 1
    full = desk.decided(asked, command, decision, "another")
    assert full == Rejected(Reason.OVERLOADED, QUEUE_FULL.format(count=1, size=desk.room.size))
    fold(state, decide(state, attrs.evolve(hog, reservation_id="x", isl_tokens=0)).events)
    (waiter,) = desk.waiting()
    again = desk.readmitted(waiter, last_at=9)
    assert again.at == 9 and desk.admitted(waiter, again, decide(state, again)) is None  # still busy: waits
    fold(state, decide(state, ReleaseReservation("hog")).events)
    answer = desk.admitted(waiter, again, decide(state, again))
    assert isinstance(answer, Accepted) and len(desk.room) == 0


def test_ranks_out_of_selection_are_left_out_unless_every_rank_is() -> None:
    state = scope_with(worker(1), worker(2))
    desk = desk_for(state)
    out_one = StreamView(out=(WorkerRank(1, 0), WorkerRank(9, 0)))  # worker 9 is not in this scope
    prepared = desk.prepare(SelectWorker(PROMPT, RouterConfig(), streams=out_one))
    assert isinstance(prepared, SelectWorker) and prepared.out_ranks == frozenset({WorkerRank(1, 0)})
    for _ in range(20):
        chosen = decide(state, desk.prepare(SelectWorker(PROMPT, RouterConfig(), streams=out_one)))  # type: ignore[arg-type]
        assert isinstance(chosen, Accepted) and chosen.reply.worker_id == 2
    # Pinned to it: the caller's explicit choice still reaches it.
    pinned = SelectWorker(PROMPT, RouterConfig(), streams=out_one, options=SelectionOptions(pinned_worker=(1, 0)))
    chosen = decide(state, desk.prepare(pinned))  # type: ignore[arg-type]
    assert isinstance(chosen, Accepted) and chosen.reply.worker_id == 1
    # Every rank out: none is left out (fail open); approximate mode: never.
    out_all = StreamView(out=(WorkerRank(1, 0), WorkerRank(2, 0)))
    assert desk.prepare(SelectWorker(PROMPT, RouterConfig(), streams=out_all)).out_ranks == frozenset()  # type: ignore[union-attr]
    approx = RouterConfig(use_kv_events=False)
    assert desk.prepare(SelectWorker(PROMPT, approx, streams=out_one)).out_ranks == frozenset()  # type: ignore[union-attr]
    split = desk.prepare(SelectDisaggregated(PROMPT, RouterConfig(), streams=out_one))
    assert isinstance(split, SelectDisaggregated) and split.out_ranks == frozenset({WorkerRank(1, 0)})


def test_freeing_a_ranks_bookings_frees_only_them_and_replays_to_the_same_state() -> None:
    records = (worker(1, data_parallel_size=2), worker(2))
    state, journal = ScopeState(SCOPE), []
    commands = [UpsertWorker(record) for record in records]
    commands += [Reserve(rid, w, r, (1, 2), 8, at=SECOND) for rid, w, r in [("a", 1, 0), ("b", 1, 1), ("c", 1, 0)]]
    commands.append(Reserve("d", 2, 0, (1, 2), 8, at=SECOND))
    for command in commands:
        events = decide(state, command).events
        fold(state, events)
        journal.extend(events)
    decision = decide(state, FreeRankBookings(1, 0, at=2 * SECOND))
    assert isinstance(decision, Accepted)
    assert decision.events == (RequestFreed("a"), RequestFreed("c"))
    fold(state, decision.events)
    journal.extend(decision.events)
    assert sorted(state.requests) == ["b", "d"]
    assert decide(state, FreeRankBookings(1, 0, at=3 * SECOND)).events == ()  # nothing left: nothing changes
    assert decide(state, FreeRankBookings(7, 0, at=3 * SECOND)).events == ()  # unknown rank: nothing either
    replayed = ScopeState(SCOPE)
    fold(replayed, journal)  # recovery runs evolve only: the frees are in the journal
    assert replayed.to_snapshot() == state.to_snapshot()
