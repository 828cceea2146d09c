"""Predicted blocks (behaviour.md#approximate-mode): a booking on a rank scored without KV events counts as cached
there.

Pure. Each booked block lives ``router_ttl_secs`` (expired by the sweep, ``decide.ExpireStale``), and when the
scope holds more than ``router_max_tree_size`` predicted blocks the oldest are pruned (oldest expiry first, in
booking order) down to ``router_prune_target_ratio`` of it, in the same decision as the booking that overflowed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvrouter.actors.core.events import ApproxBlocksBooked, ApproxBlocksExpired
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.selection_state import SelectionState


def book(
    selection: SelectionState,
    rank: WorkerRank,
    sequence_hashes: tuple[int, ...],
    local_hashes: tuple[int, ...],
    *,
    ttl_ns: int,
    at: int,
    max_blocks: int,
    prune_target: int,
) -> tuple[ApproxBlocksExpired | ApproxBlocksBooked, ...]:
    """The events that book a prompt's blocks on ``rank`` until ``at + ttl_ns``, pruning first if they overflow.

    Nothing without a TTL or without local hashes (a reservation that names only sequence hashes).
    """
    if ttl_ns <= 0 or not local_hashes or len(local_hashes) != len(sequence_hashes):
        return ()
    held = selection.approx_expiry.get(rank, {})
    fresh = sum(1 for h in sequence_hashes if h not in held)
    booked = ApproxBlocksBooked(
        rank.worker_id, rank.dp_rank, tuple(zip(sequence_hashes, local_hashes, strict=True)), at + ttl_ns
    )
    if selection.approx_count + fresh <= max_blocks:
        return (booked,)
    keep = set(sequence_hashes)
    excess = selection.approx_count + fresh - prune_target
    victims: dict[WorkerRank, list[int]] = {}
    for _, victim_rank, seq_hash in _oldest_first(selection):
        if excess <= 0:
            break
        if victim_rank == rank and seq_hash in keep:
            continue  # being booked again now
        victims.setdefault(victim_rank, []).append(seq_hash)
        excess -= 1
    pruned = tuple(ApproxBlocksExpired(r.worker_id, r.dp_rank, tuple(hashes)) for r, hashes in sorted(victims.items()))
    return (*pruned, booked)


def lapsed(selection: SelectionState, at: int) -> tuple[ApproxBlocksExpired, ...]:
    """Expiry events for every predicted block whose time ran out by ``at``."""
    events = []
    for rank, expiry in selection.approx_expiry.items():
        gone = tuple(h for h, expires_at in expiry.items() if expires_at <= at)
        if gone:
            events.append(ApproxBlocksExpired(rank.worker_id, rank.dp_rank, gone))
    return tuple(events)


def _oldest_first(selection: SelectionState) -> Iterator[tuple[int, WorkerRank, int]]:
    """Every predicted block as (expires_at, rank, sequence hash), merging each rank's booking order."""
    per_rank = [_entries(rank, expiry) for rank, expiry in sorted(selection.approx_expiry.items())]
    return heapq.merge(*per_rank)


def _entries(rank: WorkerRank, expiry: dict[int, int]) -> Iterator[tuple[int, WorkerRank, int]]:
    for seq_hash, expires_at in expiry.items():
        yield expires_at, rank, seq_hash
