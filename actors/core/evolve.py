"""evolve(state, event): apply one fact. Total: it never validates and never rejects.

It is the only code that runs during recovery, so a change to the rules in ``decide`` can never
rewrite history.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import singledispatch

from actors.core.events import (
    Event,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    WorkerRegistered,
    WorkerUnregistered,
)
from actors.core.ids import WorkerRank
from actors.core.state import ActiveRequest, RankState, ScopeState, admit


def evolve(state: ScopeState, event: Event) -> ScopeState:
    _evolve(event, state)
    return state


def fold(state: ScopeState, events: Iterable[Event]) -> ScopeState:
    for event in events:
        _evolve(event, state)
    return state


@singledispatch
def _evolve(event: Event, state: ScopeState) -> None:
    raise TypeError(f"no evolution for {type(event).__name__}")


@_evolve.register
def _registered(event: WorkerRegistered, state: ScopeState) -> None:
    state.block_size = event.block_size
    state.workers[event.worker_id] = (event.dp_start, event.dp_size)
    for dp_rank in range(event.dp_start, event.dp_start + event.dp_size):
        state.ranks[WorkerRank(event.worker_id, dp_rank)] = RankState()


@_evolve.register
def _unregistered(event: WorkerUnregistered, state: ScopeState) -> None:
    start, size = state.workers.pop(event.worker_id)
    for dp_rank in range(start, start + size):
        rank = state.ranks.pop(WorkerRank(event.worker_id, dp_rank))
        for request_id in rank.requests:
            del state.requests[request_id]
    if not state.workers:
        state.block_size = None  # the tracker dissolves with its last worker


@_evolve.register
def _added(event: RequestAdded, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    admit(state, ActiveRequest(event.request_id, rank, event.sequence_hashes, event.at), event.prefill_tokens)


@_evolve.register
def _prefill_completed(event: PrefillCompleted, state: ScopeState) -> None:
    rank = state.ranks[state.requests[event.request_id].rank]
    rank.prefill_tokens -= rank.prefill.pop(event.request_id)


@_evolve.register
def _freed(event: RequestFreed, state: ScopeState) -> None:
    _release(state, event.request_id)


@_evolve.register
def _expired(event: RequestsExpired, state: ScopeState) -> None:
    for request_id in event.request_ids:
        _release(state, request_id)


def _release(state: ScopeState, request_id: str) -> None:
    request = state.requests.pop(request_id)
    rank = state.ranks[request.rank]
    del rank.requests[request_id]
    rank.trie.remove(request.sequence_hashes)
    tokens = rank.prefill.pop(request_id, 0)
    rank.prefill_tokens -= tokens
