"""decide() rules of the selection service: catalog, KV events, selection, reservations.

Registered on the same dispatcher as the slot tracker's rules (``actors/core/decide.py``), so one
actor, journal and recovery path serve both services. Pure: the random number a selection needs
arrives in the command (``SelectWorker.draw``).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    IngestKvBatch,
    Prompt,
    RecoverKv,
    RemoveWorker,
    Reserve,
    ResetKvStream,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.events import (
    ApproxBlocksBooked,
    KvClearedOp,
    KvIndexed,
    KvOp,
    KvRemovedOp,
    KvStoredOp,
    KvStreamReset,
    OutputBlockAdded,
    RequestAdded,
    WorkerRemoved,
    WorkerUpserted,
)
from kvrouter.actors.core.hashing import block_hashes as hash_blocks
from kvrouter.actors.core.hashing import sequence_hashes as chain_hashes
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, stored_blocks
from kvrouter.actors.core.selection import (
    NO_OVERLAP,
    RankCandidate,
    Refusal,
    TierOverlap,
    cost,
    effective_cached_tokens,
    effective_prefill_tokens,
    eligible,
    no_schedulable_workers,
    overlap_summary,
    pick,
    reported_decode_blocks,
)
from kvrouter.actors.core.state import ScopeState

REFUSAL_REASON = {Refusal.INVALID: Reason.INVALID, Refusal.UNAVAILABLE: Reason.UNAVAILABLE}


@attrs.frozen
class NormalizedPrompt:
    local_hashes: tuple[int, ...]  # per full block, for the KV index
    sequence_hashes: tuple[int, ...]  # chained, for active-block accounting
    isl_tokens: int


@attrs.frozen
class Selection:
    """What ``/select`` and ``/select_and_reserve`` answer (and what a replayed selection books)."""

    worker_id: int
    dp_rank: int
    endpoint: str | None
    block_size: int
    overlap: dict[str, Any]
    effective_prefill_tokens: int
    potential_decode_blocks: int
    sequence_hashes: tuple[int, ...]
    isl_tokens: int
    track_prefill_tokens: bool
    reservation_id: str | None = None
    local_hashes: tuple[int, ...] = ()
    approx_ttl_ns: int = 0  # > 0 in approximate mode: a booking counts as cached this long


def schedulable(state: ScopeState, use_kv_events: bool) -> tuple[WorkerRecord, ...]:
    cached = state.schedulable_cache.get(use_kv_events)
    if cached is None:
        cached = state.schedulable_cache[use_kv_events] = tuple(
            record
            for record in state.catalog.values()
            if not not_schedulable_reasons(record, use_kv_events=use_kv_events, partition_block_size=state.block_size)
        )
    return cached


def normalize(prompt: Prompt, block_size: int) -> NormalizedPrompt | str:
    """Token ids are hashed here; precomputed hashes are checked (spec §2.2). A string is a 400."""
    if prompt.token_ids is not None:
        local = hash_blocks(prompt.token_ids, block_size, lora_name=prompt.lora_name)
        return NormalizedPrompt(tuple(local), tuple(chain_hashes(local)), len(prompt.token_ids))
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


def partition_block_size_after(state: ScopeState, record: WorkerRecord, use_kv_events: bool) -> int | None:
    """The first schedulable worker fixes a partition's block size; it stays while one remains."""
    others = [r for r in state.catalog.values() if r.worker_id != record.worker_id]
    current = state.block_size
    if current is not None and any(
        not not_schedulable_reasons(r, use_kv_events=use_kv_events, partition_block_size=current) for r in others
    ):
        return current
    if not not_schedulable_reasons(record, use_kv_events=use_kv_events, partition_block_size=None):
        return record.block_size
    return current if others else None


def decide_upsert(command: UpsertWorker, state: ScopeState) -> Decision:
    record = command.record
    block_size = partition_block_size_after(state, record, command.use_kv_events)
    return Accepted((WorkerUpserted(record, block_size),), created=True)


def decide_remove(command: RemoveWorker, state: ScopeState) -> Decision:
    if command.worker_id not in state.catalog:
        return Rejected(Reason.NOT_FOUND, f"worker {command.worker_id} not found")
    return Accepted((WorkerRemoved(command.worker_id),))


def decide_ingest(command: IngestKvBatch, state: ScopeState) -> Decision:
    record = state.catalog.get(command.worker_id)
    if record is None:
        return NOTHING_CHANGED  # the worker left while its batch was in flight
    dp_rank = command.batch.dp_rank if command.batch.dp_rank is not None else command.dp_rank
    if WorkerRank(command.worker_id, dp_rank) not in state.ranks:
        return NOTHING_CHANGED
    block_size = record.block_size or state.block_size or 0
    ops: list[KvOp] = []
    for event in command.batch.events:
        if isinstance(event, BlockStored):
            blocks = stored_blocks(event, block_size)
            if blocks:
                ops.append(KvStoredOp(int(event.tier), event.parent_hash, tuple(blocks)))
        elif isinstance(event, BlockRemoved):
            if event.block_hashes:
                ops.append(KvRemovedOp(int(event.tier), event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            ops.append(KvClearedOp())
    return Accepted((KvIndexed(command.worker_id, dp_rank, command.dp_rank, command.seq, tuple(ops)),))


def decide_recover(command: RecoverKv, state: ScopeState) -> Decision:
    events = tuple(
        KvIndexed(run.worker_id, run.dp_rank, run.dp_rank, None, (KvStoredOp(run.tier, run.parent_hash, run.blocks),))
        for run in command.runs
        if run.blocks
    )
    return Accepted(events)


def decide_reset(command: ResetKvStream, state: ScopeState) -> Decision:
    if WorkerRank(command.worker_id, command.dp_rank) not in state.ranks:
        return NOTHING_CHANGED
    return Accepted((KvStreamReset(command.worker_id, command.dp_rank),))


def decide_select(command: SelectWorker, state: ScopeState) -> Decision:
    config = command.config
    workers = schedulable(state, config.use_kv_events) if state.exists else []
    if not workers or state.block_size is None:
        return Rejected(Reason.UNAVAILABLE, no_schedulable_workers(state.scope))
    block_size = state.block_size
    prompt = normalize(command.prompt, block_size)
    if isinstance(prompt, str):
        return Rejected(Reason.INVALID, prompt)
    matches = state.index.find_matches(prompt.local_hashes) if prompt.local_hashes else {}
    candidates = []
    for record in workers:
        taints = record.taint_set
        for rank in record.ranks:
            loads = state.ranks[rank]
            found = matches.get(rank)
            candidates.append(
                RankCandidate(
                    rank,
                    TierOverlap(*found) if found else NO_OVERLAP,
                    loads.prefill_tokens,
                    loads.active_decode_blocks,
                    len(loads.requests),
                    loads.trie.overlap_depth(prompt.sequence_hashes) if loads.requests else 0,
                    taints,
                )
            )
    options = command.options
    pinned = WorkerRank(*options.pinned_worker) if options.pinned_worker is not None else None
    kept = eligible(
        candidates,
        allowed_worker_ids=options.allowed_worker_ids,
        required_taints=options.required_taints,
        pinned=pinned,
    )
    if not isinstance(kept, list):
        return Rejected(REFUSAL_REASON[kept.reason], kept.message)
    min_prefill = min(c.active_prefill_tokens for c in kept)
    preferred = dict(options.preferred_taints)
    # Ranks in the same situation (typically idle and cold) cost the same: compute each once.
    memo: dict[tuple[object, ...], float] = {}
    costs = []
    for c in kept:
        key = (
            c.overlap,
            c.active_prefill_tokens,
            c.active_decode_blocks,
            c.active_requests,
            c.prompt_overlap_depth,
            c.taints,
        )
        value = memo.get(key)
        if value is None:
            value = memo[key] = cost(
                c,
                isl=prompt.isl_tokens,
                num_seq_hashes=len(prompt.sequence_hashes),
                block_size=block_size,
                config=config,
                min_active_prefill=min_prefill,
                preferred_taints=preferred,
            )
        costs.append((c.rank, value))
    chosen_rank = pick(costs, temperature=config.router_temperature, draw=command.draw)
    chosen = next(c for c in kept if c.rank == chosen_rank)
    cached = effective_cached_tokens(chosen.overlap, config, block_size)
    effective = effective_prefill_tokens(prompt.isl_tokens, cached)
    record = state.catalog[chosen_rank.worker_id]
    per_rank = {}
    for rank in record.ranks:
        found = matches.get(rank)
        per_rank[rank.dp_rank] = TierOverlap(*found) if found else NO_OVERLAP
    track = config.router_track_prefill_tokens
    selection = Selection(
        worker_id=chosen_rank.worker_id,
        dp_rank=chosen_rank.dp_rank,
        endpoint=record.endpoint,
        block_size=block_size,
        overlap=overlap_summary(per_rank, block_size),
        effective_prefill_tokens=effective,
        potential_decode_blocks=reported_decode_blocks(
            chosen.active_decode_blocks,
            num_seq_hashes=len(prompt.sequence_hashes),
            isl=prompt.isl_tokens,
            block_size=block_size,
            prompt_overlap_depth=chosen.prompt_overlap_depth,
        ),
        sequence_hashes=prompt.sequence_hashes,
        isl_tokens=prompt.isl_tokens,
        track_prefill_tokens=track,
        reservation_id=command.reservation_id if command.reserve else None,
        local_hashes=prompt.local_hashes,
        approx_ttl_ns=0 if config.use_kv_events else int(config.router_ttl_secs * 1e9),
    )
    if not command.reserve:
        return Accepted(reply=selection)
    reservation_id = command.reservation_id or ""
    if reservation_id in state.requests:
        return already_reserved(reservation_id)
    event = RequestAdded(
        reservation_id,
        chosen_rank.worker_id,
        chosen_rank.dp_rank,
        prompt.sequence_hashes,
        effective if track else 0,
        command.at,
    )
    return Accepted(
        (
            event,
            *approx_booking(
                chosen_rank, prompt.sequence_hashes, prompt.local_hashes, selection.approx_ttl_ns, command.at
            ),
        ),
        created=True,
        reply=selection,
    )


def approx_booking(
    rank: WorkerRank, sequence_hashes: tuple[int, ...], local_hashes: tuple[int, ...], ttl_ns: int, at: int
) -> tuple[ApproxBlocksBooked, ...]:
    """Approximate mode (spec §3.2): without KV events, what was just booked on a rank is assumed
    cached there for ``router_ttl_secs``. Nothing in KV-event mode or without local hashes."""
    if ttl_ns <= 0 or not local_hashes or len(local_hashes) != len(sequence_hashes):
        return ()
    blocks = tuple(zip(sequence_hashes, local_hashes, strict=True))
    return (ApproxBlocksBooked(rank.worker_id, rank.dp_rank, blocks, at + ttl_ns),)


def already_reserved(reservation_id: str) -> Rejected:
    return Rejected(Reason.CONFLICT, f"selection {reservation_id} is already reserved or being reserved")


def decide_reserve(command: Reserve, state: ScopeState) -> Decision:
    if command.effective_prefill_tokens is not None and command.effective_prefill_tokens > command.isl_tokens:
        return Rejected(
            Reason.INVALID,
            f"effective_prefill_tokens ({command.effective_prefill_tokens}) must not exceed "
            f"isl_tokens ({command.isl_tokens})",
        )
    if command.reservation_id in state.requests:
        return already_reserved(command.reservation_id)
    rank = WorkerRank(command.worker_id, command.dp_rank)
    if command.worker_id not in state.catalog or rank not in state.ranks:
        return Rejected(
            Reason.NOT_FOUND,
            f"worker {command.worker_id} dp_rank {command.dp_rank} not found for {state.scope.describe()}",
        )
    if command.effective_prefill_tokens is not None:
        tracked = command.track_prefill_tokens is not False
        prefill = command.effective_prefill_tokens if tracked else 0
    else:
        tracked = command.track_prefill_tokens
        if tracked is None:
            tracked = command.config_tracks_prefill
        prefill = command.isl_tokens if tracked else 0
    event = RequestAdded(
        command.reservation_id, command.worker_id, command.dp_rank, command.sequence_hashes, prefill, command.at
    )
    booked = approx_booking(rank, command.sequence_hashes, command.local_hashes, command.approx_ttl_ns, command.at)
    return Accepted((event, *booked), created=True)


def decide_output_block(command: AddOutputBlock, state: ScopeState) -> Decision:
    if command.request_id not in state.requests:
        return Rejected(Reason.NOT_FOUND, f"reservation {command.request_id} not found")
    return Accepted((OutputBlockAdded(command.request_id, command.decay_fraction),))
