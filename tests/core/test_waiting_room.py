"""Property tests of the waiting room (``actors/core/waiting_room.py``), against a plain model: random parks
(prompts of random size and length, arrival times, queue policies, priority jumps), askers leaving, and
admissions from the front of the policy's order, under small bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.admission import Waiting, queue_key
from kvrouter.actors.core.commands import Prompt, SelectionOptions, SelectWorker
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Reason, Rejected
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.waiting_room import QUEUE_FULL, WaitingRoom, estimated_size, parks, prompt_tokens

MAX_WAITING = 5
MAX_BYTES = estimated_size(SelectWorker(Prompt(tuple(range(40))), RouterConfig())) * 3  # about three long prompts
POLICIES = ("fcfs", "lcfs", "wspt")


def selection(tokens: int, at: int, policy: str, jump: float, hashed: bool) -> SelectWorker:
    prompt = (
        Prompt(block_hashes=tuple(range(tokens // 4)), sequence_hashes=tuple(range(tokens // 4)), isl_tokens=tokens)
        if hashed
        else Prompt(tuple(range(tokens)))
    )
    config = RouterConfig(router_queue_threshold=1.0, router_queue_policy=policy)
    return SelectWorker(prompt, config, SelectionOptions(priority_jump=jump), at=at)


SELECTIONS = st.builds(
    selection,
    st.integers(1, 60),
    st.integers(0, 5),
    st.sampled_from(POLICIES),
    st.sampled_from([0.0, 0.0, 1e-9, 2e-9]),
    st.booleans(),
)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("park"), SELECTIONS),
        st.tuples(st.just("leave"), st.integers(0, 30)),
        st.tuples(st.just("admit"), st.integers(1, 3)),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(STEPS)
def test_the_room_is_a_bounded_queue_in_policy_order_that_drops_who_left(steps: list[tuple]) -> None:
    gone: set[int] = set()
    room: WaitingRoom[int] = WaitingRoom(gone.__contains__, max_waiting=MAX_WAITING, max_bytes=MAX_BYTES)
    model: list[tuple[int, SelectWorker, int]] = []  # (ticket, command, arrival number)
    tickets = arrivals = refused = 0
    for kind, value in steps:
        model = [w for w in model if w[0] not in gone]  # who left is never asked again
        if kind == "park":
            tickets += 1
            held = sum(estimated_size(c) for _, c, _ in model)
            full = len(model) >= MAX_WAITING or held + estimated_size(value) > MAX_BYTES
            refusal = room.park(tickets, value)
            if full:
                refused += 1
                assert refusal == QUEUE_FULL.format(count=len(model), size=held)
            else:
                assert refusal is None
                arrivals += 1
                model.append((tickets, value, arrivals))
        elif kind == "leave":
            gone.add(value)
        else:
            for waiter in room.in_order()[:value]:
                room.remove(waiter)
            model = sorted(model, key=_key)[value:]
        model = [w for w in model if w[0] not in gone]
        assert [w.ticket for w in room.in_order()] == [t for t, _, _ in sorted(model, key=_key)]
        assert len(room) == len(model) <= MAX_WAITING
        assert room.size == sum(estimated_size(c) for _, c, _ in model) <= MAX_BYTES
        assert room.isl_tokens == sum(prompt_tokens(c) for _, c, _ in model)
        assert room.refused == refused


def _key(waiter: tuple[int, SelectWorker, int]) -> tuple[float, int]:
    """The policy's order (``admission.queue_key``, tested on its own) over the model's arrival numbers."""
    _, command, arrival = waiter
    waiting = Waiting(command.at, arrival, prompt_tokens(command), command.options.priority_jump)
    return queue_key(command.config.router_queue_policy, waiting)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 60)), min_size=1, max_size=MAX_WAITING))
def test_first_come_first_served_admits_in_arrival_order_on_ties(arrivals: list[tuple[int, int]]) -> None:
    room: WaitingRoom[int] = WaitingRoom(lambda ticket: False, max_waiting=MAX_WAITING, max_bytes=MAX_BYTES * 10)
    for ticket, (at, tokens) in enumerate(arrivals):
        assert room.park(ticket, selection(tokens, at, "fcfs", 0.0, False)) is None
    expected = [ticket for ticket, _ in sorted(enumerate(arrivals), key=lambda pair: (pair[1][0], pair[0]))]
    assert [w.ticket for w in room.in_order()] == expected


def test_only_an_overloaded_refusal_with_queueing_on_parks() -> None:
    queueing = selection(8, 0, "fcfs", 0.0, False)
    plain = SelectWorker(Prompt((1, 2)), RouterConfig())
    overloaded = Rejected(Reason.OVERLOADED, "all 1 eligible workers are overloaded")
    assert parks(overloaded, queueing)
    assert not parks(overloaded, plain)
    assert not parks(Rejected(Reason.UNAVAILABLE, "none"), queueing)
    assert not parks(NOTHING_CHANGED, queueing)
