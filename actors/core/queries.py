"""Read models of the slot tracker, computed from a scope's state: current loads and projected loads.

Pure functions; the shell calls them between awaits, so they see a consistent state. The selection
service's read models (``selection_queries.py``) build on the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvrouter.actors.core.ids import U64_MASK, WorkerRank
from kvrouter.actors.core.slots import RankState
from kvrouter.actors.core.state import ScopeState


@attrs.frozen
class RankLoad:
    rank: WorkerRank
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int


@attrs.frozen
class PotentialLoad:
    rank: WorkerRank
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


def rank_load(rank_key: WorkerRank, rank: RankState) -> RankLoad:
    """Decode blocks include output blocks and decay (both zero for the slot tracker, which has neither)."""
    return RankLoad(rank_key, rank.prefill_tokens, rank.active_decode_blocks, len(rank.requests))


def loads(state: ScopeState) -> list[RankLoad]:
    """Every registered rank, idle ones included, sorted by (worker_id, dp_rank)."""
    return [rank_load(rank, r) for rank, r in sorted(state.slots.ranks.items())]


def potential_loads(state: ScopeState, sequence_hashes: Sequence[int], isl_tokens: int) -> list[PotentialLoad]:
    """Loads each rank would carry if it took the request (docs/slot-tracker.md projection formulas).

    Prefill grows uniformly by ``isl_tokens`` (the tracker knows nothing of the KV cache); decode
    blocks grow by the blocks the rank's live prompts do not already hold.
    """
    n = len(sequence_hashes)
    return [
        PotentialLoad(
            rank,
            min(r.prefill_tokens + isl_tokens, U64_MASK),  # saturate: the wire type is u64
            r.trie.size + n - r.trie.overlap_depth(sequence_hashes),
            len(r.requests),
        )
        for rank, r in state.slots.ranks.items()
    ]
