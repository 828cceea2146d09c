"""evolve(state, event): apply one fact. Total: it never validates and never rejects.

It is the only code that runs during recovery, so a change to the rules in ``decide`` can never
rewrite history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import singledispatch
from typing import Any

from kvrouter.actors.core.events import (
    ApproxBlocksBooked,
    ApproxBlocksExpired,
    Event,
    KvBlocksRefused,
    KvClearedOp,
    KvIndexed,
    KvIndexTrimmed,
    KvRemovedOp,
    KvStoredOp,
    KvStreamReset,
    OutputBlockAdded,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    SessionBound,
    SessionReleased,
    SessionsExpired,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.sessions import SessionBinding
from kvrouter.actors.core.slots import NO_OUTPUTS, ActiveRequest, add_output_block
from kvrouter.actors.core.state import ScopeState


def evolve(state: ScopeState, event: Event) -> ScopeState:
    return fold(state, (event,))


def fold(state: ScopeState, events: Iterable[Event]) -> ScopeState:
    appliers = _APPLIERS
    for event in events:
        apply = appliers.get(event.__class__)
        if apply is None:
            apply = appliers[event.__class__] = _evolve.dispatch(event.__class__)
        apply(event, state)
    return state


# Each event class's evolution, as ``_evolve`` dispatches it: a plain dict lookup per event instead of
# singledispatch's weak-keyed cache and wrapper (on every write, and every replayed record). Bounded by the
# event classes.
_APPLIERS: dict[type, Callable[[Any, ScopeState], None]] = {}


@singledispatch
def _evolve(event: Event, state: ScopeState) -> None:
    raise TypeError(f"no evolution for {type(event).__name__}")


@_evolve.register
def _registered(event: WorkerRegistered, state: ScopeState) -> None:
    state.slots.block_size = event.block_size
    state.slots.add_range(event.worker_id, event.dp_start, event.dp_size)


@_evolve.register
def _unregistered(event: WorkerUnregistered, state: ScopeState) -> None:
    slots = state.slots
    start, size = slots.workers.pop(event.worker_id)
    for dp_rank in range(start, start + size):
        slots.drop_rank(WorkerRank(event.worker_id, dp_rank))
    if not slots.workers:
        slots.block_size = None  # the tracker dissolves with its last worker


@_evolve.register
def _added(event: RequestAdded, state: ScopeState) -> None:
    slots = state.slots
    rank = slots.ranks[(event.worker_id, event.dp_rank)]  # type: ignore[index]  # a WorkerRank is this tuple
    request = ActiveRequest(event.request_id, rank.key, event.sequence_hashes, event.at, event.expected_output_tokens)
    slots.admit_on(rank, request, event.prefill_tokens)


@_evolve.register
def _prefill_completed(event: PrefillCompleted, state: ScopeState) -> None:
    slots = state.slots
    rank = slots.ranks[slots.requests[event.request_id].rank]
    rank.prefill_tokens -= rank.prefill.pop(event.request_id)


@_evolve.register
def _freed(event: RequestFreed, state: ScopeState) -> None:
    state.slots.release(event.request_id)


@_evolve.register
def _expired(event: RequestsExpired, state: ScopeState) -> None:
    release = state.slots.release
    for request_id in event.request_ids:
        release(request_id)


def _drop_rank(state: ScopeState, rank_key: WorkerRank) -> None:
    state.slots.drop_rank(rank_key)
    state.selection.forget_rank(rank_key)


# -- selection service ------------------------------------------------------------------------------


@_evolve.register
def _upserted(event: WorkerUpserted, state: ScopeState) -> None:
    record = event.record
    slots, selection = state.slots, state.selection
    previous = selection.catalog.get(record.worker_id)
    selection.put_record(record, event.partition_block_size)
    wanted = set(record.ranks) if record.dp_size > 0 else set()
    for rank_key in [r for r in slots.ranks if r.worker_id == record.worker_id]:
        stream_changed = previous is not None and (
            previous.kv_events_endpoint_for(rank_key.dp_rank) != record.kv_events_endpoint_for(rank_key.dp_rank)
        )
        if rank_key not in wanted:
            _drop_rank(state, rank_key)
        elif stream_changed:
            selection.forget_stream(rank_key)
    if wanted:
        slots.add_range(record.worker_id, record.dp_start, record.dp_size)
    else:
        slots.workers.pop(record.worker_id, None)


@_evolve.register
def _removed(event: WorkerRemoved, state: ScopeState) -> None:
    # The partition (and its block size) outlives its last worker, as in 1.6.1.
    state.selection.remove_record(event.worker_id)
    for rank_key in [r for r in state.slots.ranks if r.worker_id == event.worker_id]:
        _drop_rank(state, rank_key)
    state.slots.workers.pop(event.worker_id, None)


@_evolve.register
def _kv_indexed(event: KvIndexed, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    selection = state.selection
    index = selection.index
    for op in event.ops:
        if isinstance(op, KvStoredOp):
            # A run KV ingest decided (it has a seq) names distinct hashes: ``stored_blocks`` checked them, in every
            # version that wrote such records, so the index need not compare them again. A peer's recovered run is
            # checked by the index as always (a record of one naming a hash twice replays as it applied).
            index.apply_stored(rank, _tier(op.tier), op.parent_hash, op.blocks, event.seq is not None)
        elif isinstance(op, KvRemovedOp):
            index.apply_removed(rank, _tier(op.tier), op.block_hashes)
        elif isinstance(op, KvClearedOp):
            index.apply_cleared(rank)
    if event.seq is not None:
        selection.kv_watermarks[WorkerRank(event.worker_id, event.stream_rank)] = event.seq


# The tiers by value: ``Tier(value)`` goes through the enum machinery (~1 us), and every op of a KV run asks.
_TIERS_BY_VALUE: dict[int, Tier] = {tier.value: tier for tier in Tier}


def _tier(value: int) -> Tier:
    tier = _TIERS_BY_VALUE.get(value)
    return Tier(value) if tier is None else tier  # Tier() words the error for a value no tier has


@_evolve.register
def _index_trimmed(event: KvIndexTrimmed, state: ScopeState) -> None:
    state.selection.index.trim(WorkerRank(event.worker_id, event.dp_rank), event.keep_depth)


@_evolve.register
def _blocks_refused(event: KvBlocksRefused, state: ScopeState) -> None:
    pass  # on record only: the blocks were not stored


@_evolve.register
def _stream_reset(event: KvStreamReset, state: ScopeState) -> None:
    state.selection.forget_stream(WorkerRank(event.worker_id, event.dp_rank))


@_evolve.register
def _approx_booked(event: ApproxBlocksBooked, state: ScopeState) -> None:
    state.selection.book_predicted(WorkerRank(event.worker_id, event.dp_rank), event.blocks, event.expires_at)


@_evolve.register
def _approx_expired(event: ApproxBlocksExpired, state: ScopeState) -> None:
    state.selection.expire_predicted(WorkerRank(event.worker_id, event.dp_rank), event.block_hashes)


@_evolve.register
def _session_bound(event: SessionBound, state: ScopeState) -> None:
    selection = state.selection
    old = selection.sessions.get(event.session_id)
    live = state.slots.requests
    requests = {r for r in old.requests if r in live} if old is not None else set()
    if event.reservation_id is not None:
        requests.add(event.reservation_id)
    binding = SessionBinding(
        event.worker_id, event.dp_rank, event.at, event.ttl_ns, event.sequence, event.writer_id, requests
    )
    selection.bind_session(event.session_id, binding)


@_evolve.register
def _session_released(event: SessionReleased, state: ScopeState) -> None:
    selection = state.selection
    binding = selection.sessions.get(event.session_id)
    if binding is not None:
        binding.requests.discard(event.reservation_id)
        binding.last_used = max(binding.last_used, event.at)
    selection.session_of.pop(event.reservation_id, None)


@_evolve.register
def _sessions_expired(event: SessionsExpired, state: ScopeState) -> None:
    for session_id in event.session_ids:
        state.selection.drop_session(session_id)


@_evolve.register
def _output_block(event: OutputBlockAdded, state: ScopeState) -> None:
    """1.6.1: a block of weight 1.0, or with a fraction f every output block of the request weighs f and
    the prompt's exclusively held tail decays to f."""
    slots = state.slots
    request = slots.requests[event.request_id]
    rank = slots.ranks[request.rank]
    if event.decay_fraction is not None:
        rank.trie.decay_exclusive_tail(request.sequence_hashes, event.decay_fraction)
    rank.outputs[event.request_id] = add_output_block(
        rank.outputs.get(event.request_id, NO_OUTPUTS), event.decay_fraction
    )
