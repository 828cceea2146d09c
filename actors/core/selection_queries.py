"""Read models of the selection service, computed from a scope's state. Pure.

``decide_select`` and the inspection routes (``/potential_loads``, ``/overlap_scores``, ``/loads``) read
through the same functions, so what a route shows is what a selection weighs: the candidates (one per
schedulable rank, with its overlap per tier, loads, prompt overlap depth and taints), and the rows derived
from them. Routes only format the rows.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Prompt
from kvrouter.actors.core.decisions import Reason, Rejected
from kvrouter.actors.core.hashing import prompt_hashes
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.limits import MAX_PROMPT_BLOCKS
from kvrouter.actors.core.queries import PotentialLoad, RankLoad, rank_load
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import (
    RankCandidate,
    effective_cached_tokens,
    no_schedulable_workers,
    potential_decode_blocks,
    potential_prefill_tokens,
    rank_candidates,
)
from kvrouter.actors.core.state import ScopeState


@attrs.frozen
class NormalizedPrompt:
    local_hashes: tuple[int, ...]  # per full block, for the KV index
    sequence_hashes: tuple[int, ...]  # chained, for active-block accounting
    isl_tokens: int


@attrs.frozen
class SelectionInput:
    """A prompt ready to be scored in a partition: its schedulable workers, block size, and hashes."""

    workers: tuple[WorkerRecord, ...]
    block_size: int
    prompt: NormalizedPrompt


@attrs.frozen
class OverlapScore:
    """One rank's ``/overlap_scores`` row: cumulative blocks per tier, and each lower tier's extension."""

    rank: WorkerRank
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int


def schedulable(state: ScopeState, use_kv_events: bool, queueing: bool = False) -> tuple[WorkerRecord, ...]:
    return state.selection.schedulable(use_kv_events, queueing)


def normalize(prompt: Prompt, block_size: int) -> NormalizedPrompt | str:
    """Token ids are hashed here; precomputed hashes are checked (behaviour.md#prompt-inputs). A string is a 400."""
    if prompt.token_ids is not None:
        blocks = len(prompt.token_ids) // block_size
        if blocks > MAX_PROMPT_BLOCKS:
            return f"token_ids make {blocks} blocks of {block_size} tokens, beyond the maximum of {MAX_PROMPT_BLOCKS}"
        local, chained = prompt_hashes(prompt.token_ids, block_size, lora_name=prompt.lora_name)
        return NormalizedPrompt(local, chained, len(prompt.token_ids))
    if prompt.block_hashes is None:
        return "block_hashes is required without token_ids"
    if prompt.sequence_hashes is None:
        return "sequence_hashes is required without token_ids"
    if prompt.isl_tokens is None:
        return "isl_tokens is required without token_ids"
    if prompt.isl_tokens <= 0:
        return "isl_tokens must be greater than 0"
    if len(prompt.block_hashes) != len(prompt.sequence_hashes):
        return (
            f"block_hashes length {len(prompt.block_hashes)} must match "
            f"sequence_hashes length {len(prompt.sequence_hashes)}"
        )
    return NormalizedPrompt(prompt.block_hashes, prompt.sequence_hashes, prompt.isl_tokens)


def selection_input(
    state: ScopeState, prompt: Prompt, use_kv_events: bool, *, queueing: bool = False
) -> SelectionInput | Rejected:
    """The partition's schedulable workers and the normalized prompt, or why the prompt cannot be scored
    here (no schedulable worker: unavailable; a malformed prompt: invalid), in that order as in 1.6.1."""
    selection = state.selection
    block_size = selection.partition_block_size
    workers = selection.schedulable(use_kv_events, queueing) if state.exists else ()
    if not workers or block_size is None:
        return Rejected(Reason.UNAVAILABLE, no_schedulable_workers(state.scope))
    normalized = normalize(prompt, block_size)
    if isinstance(normalized, str):
        return Rejected(Reason.INVALID, normalized)
    return SelectionInput(workers, block_size, normalized)


def candidates(
    state: ScopeState,
    request: SelectionInput,
    *,
    predicted_ranks: Collection[WorkerRank] = (),
    all_predicted: bool = False,
) -> list[RankCandidate]:
    """One candidate per rank of every schedulable worker, in catalog order then rank order.

    A rank is scored on the KV-event index, or, when predicted (``all_predicted`` in approximate mode, else
    listed in ``predicted_ranks``), on the longer device match of its predicted (booked) blocks and of what
    the index last knew (in approximate mode the index holds only what peers' dumps recovered).
    """
    prompt = request.prompt
    local_hashes = prompt.local_hashes
    sequence_hashes = prompt.sequence_hashes
    selection = state.selection
    matches = selection.index.find_matches(local_hashes) if local_hashes else {}
    if local_hashes and (all_predicted or predicted_ranks):
        for rank, guess in selection.predicted.find_matches(local_hashes).items():
            if all_predicted or rank in predicted_ranks:
                known = matches.get(rank)
                if known is None or guess.device > known.device:
                    matches[rank] = guess
    return rank_candidates(request.workers, state.slots.ranks, matches, sequence_hashes)


def potential_loads(found: list[RankCandidate], request: SelectionInput, config: RouterConfig) -> list[PotentialLoad]:
    """What each candidate would carry with this prompt (behaviour.md#loads-dump-and-session-affinity): prefill beyond
    its cache, if tracked,
    and the prompt blocks its live requests do not already hold."""
    prompt = request.prompt
    track = config.router_track_prefill_tokens
    return [
        PotentialLoad(
            c.rank,
            potential_prefill_tokens(
                c.active_prefill_tokens,
                prompt.isl_tokens,
                effective_cached_tokens(c.overlap, config, request.block_size),
                track,
            ),
            potential_decode_blocks(c.active_decode_blocks, len(prompt.sequence_hashes), c.prompt_overlap_depth),
            c.active_requests,
        )
        for c in found
    ]


def overlap_scores(found: list[RankCandidate]) -> list[OverlapScore]:
    """Per candidate, sorted by rank: tiers cumulative as 1.6.1 reports them (external counts as disk)."""
    rows = []
    for c in sorted(found, key=lambda c: c.rank):
        o = c.overlap
        host = o.device + o.host_ext
        rows.append(
            OverlapScore(
                c.rank,
                device_blocks=o.device,
                host_pinned_blocks=host,
                disk_blocks=host + o.disk_ext + o.external_ext,
                host_pinned_extension_blocks=o.host_ext,
                disk_extension_blocks=o.disk_ext + o.external_ext,
            )
        )
    return rows


def partition_loads(state: ScopeState, use_kv_events: bool, *, queueing: bool = False) -> list[RankLoad] | None:
    """``GET /loads`` of one partition: the current loads of its schedulable workers' ranks, sorted; None
    while no schedulable worker has fixed the partition's block size (1.6.1 does not list it then)."""
    if not state.selection.listed:
        return None
    ranks = state.slots.ranks
    shown = sorted(rank for record in state.selection.schedulable(use_kv_events, queueing) for rank in record.ranks)
    return [rank_load(rank, ranks[rank]) for rank in shown]
