"""evolve(state, event): apply one fact. Total: it never validates and never rejects.

It is the only code that runs during recovery, so a change to the rules in ``decide`` can never
rewrite history.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import singledispatch

from kvrouter.actors.core.events import (
    ApproxBlocksBooked,
    ApproxBlocksExpired,
    Event,
    KvClearedOp,
    KvIndexed,
    KvRemovedOp,
    KvStoredOp,
    KvStreamReset,
    OutputBlockAdded,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.state import ActiveRequest, RankState, ScopeState, admit


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
    if rank.outputs:
        rank.outputs.pop(request_id, None)


def _drop_rank(state: ScopeState, rank_key: WorkerRank) -> None:
    rank = state.ranks.pop(rank_key)
    for request_id in rank.requests:
        del state.requests[request_id]
    state.index.remove_rank(rank_key)
    state.kv_watermarks.pop(rank_key, None)
    state.approx_expiry.pop(rank_key, None)


# -- selection service ------------------------------------------------------------------------------


@_evolve.register
def _upserted(event: WorkerUpserted, state: ScopeState) -> None:
    record = event.record
    state.schedulable_cache.clear()
    previous = state.catalog.get(record.worker_id)
    state.catalog[record.worker_id] = record
    state.block_size = event.partition_block_size
    wanted = set(record.ranks) if record.dp_size > 0 else set()
    for rank_key in [r for r in state.ranks if r.worker_id == record.worker_id]:
        stream_changed = previous is not None and (
            previous.kv_events_endpoint_for(rank_key.dp_rank) != record.kv_events_endpoint_for(rank_key.dp_rank)
        )
        if rank_key not in wanted:
            _drop_rank(state, rank_key)
        elif stream_changed:
            # Another publisher now speaks for this rank: what the old one said no longer holds.
            state.index.apply_cleared(rank_key)
            state.kv_watermarks.pop(rank_key, None)
    for rank_key in sorted(wanted):
        if rank_key not in state.ranks:
            state.ranks[rank_key] = RankState()
    if wanted:
        state.workers[record.worker_id] = (record.dp_start, record.dp_size)
    else:
        state.workers.pop(record.worker_id, None)


@_evolve.register
def _removed(event: WorkerRemoved, state: ScopeState) -> None:
    state.schedulable_cache.clear()
    del state.catalog[event.worker_id]
    for rank_key in [r for r in state.ranks if r.worker_id == event.worker_id]:
        _drop_rank(state, rank_key)
    state.workers.pop(event.worker_id, None)
    if not state.catalog and not state.workers:
        state.block_size = None


@_evolve.register
def _kv_indexed(event: KvIndexed, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    index = state.index
    for op in event.ops:
        if isinstance(op, KvStoredOp):
            index.apply_stored(rank, Tier(op.tier), op.parent_hash, op.blocks)
        elif isinstance(op, KvRemovedOp):
            index.apply_removed(rank, Tier(op.tier), op.block_hashes)
        elif isinstance(op, KvClearedOp):
            index.apply_cleared(rank)
    if event.seq is not None:
        state.kv_watermarks[WorkerRank(event.worker_id, event.stream_rank)] = event.seq


@_evolve.register
def _stream_reset(event: KvStreamReset, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    state.index.apply_cleared(rank)
    state.kv_watermarks.pop(rank, None)


@_evolve.register
def _approx_booked(event: ApproxBlocksBooked, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    state.index.apply_stored(rank, Tier.DEVICE, None, event.blocks)
    expiry = state.approx_expiry.setdefault(rank, {})
    for seq_hash, _ in event.blocks:
        expiry[seq_hash] = event.expires_at


@_evolve.register
def _approx_expired(event: ApproxBlocksExpired, state: ScopeState) -> None:
    rank = WorkerRank(event.worker_id, event.dp_rank)
    state.index.apply_removed(rank, Tier.DEVICE, event.block_hashes)
    expiry = state.approx_expiry.get(rank, {})
    for seq_hash in event.block_hashes:
        expiry.pop(seq_hash, None)
    if not expiry:
        state.approx_expiry.pop(rank, None)


@_evolve.register
def _output_block(event: OutputBlockAdded, state: ScopeState) -> None:
    request = state.requests[event.request_id]
    rank = state.ranks[request.rank]
    count, weight = rank.outputs.get(event.request_id, (0, 1.0))
    if event.decay_fraction is not None:
        weight = event.decay_fraction
        rank.trie.decay_exclusive_tail(request.sequence_hashes, event.decay_fraction)
    rank.outputs[event.request_id] = (count + 1, weight)
