"""Worker selection arithmetic: cached tokens, projected loads, the cost of each rank, and the pick.

Pure functions over plain values (behaviour.md#overlap-and-tiers, #eligibility-busy-ranks-and-queueing); the shell
gathers overlaps from the KV index and loads from
the active-request state, calls these, and draws the random number that :func:`pick` consumes. Every formula
here was checked against Dynamo 1.6.1 (see tests/core/test_selection.py); where 1.6.1 and the spec's newer
source disagree, 1.6.1 wins and the docstring says so.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from kvrouter.actors.core.constraints import preference_factor
from kvrouter.actors.core.ids import U64_MASK, ScopeKey, WorkerRank
from kvrouter.actors.core.router_config import RouterConfig


class TierOverlap(NamedTuple):
    """How many leading query blocks a rank holds per tier (behaviour.md#overlap-and-tiers).

    ``device`` is the GPU prefix match; the ``*_ext`` counts continue the prefix beyond it in the lower tiers.
    ``shared_beyond_device`` counts shared-cache hits past the device match (0 unless a shared cache is used).
    A named tuple (immutable, hashable) rather than an attrs class: one is built per matched rank per selection,
    at a fraction of a frozen attrs instance's cost.
    """

    device: int = 0
    host_ext: int = 0
    disk_ext: int = 0
    external_ext: int = 0
    shared_beyond_device: int = 0


NO_OVERLAP = TierOverlap()


def effective_overlap_blocks(overlap: TierOverlap, config: RouterConfig) -> float:
    """Device blocks count fully, lower tiers by their hit weight; external blocks are weighted like disk."""
    return (
        overlap.device
        + config.host_cache_hit_weight * overlap.host_ext
        + config.disk_cache_hit_weight * (overlap.disk_ext + overlap.external_ext)
    )


def effective_cached_tokens(overlap: TierOverlap, config: RouterConfig, block_size: int) -> int:
    """``max(0, round(effective_overlap_blocks * block_size))``, rounding halves away from zero as Rust does."""
    return max(0, _round_half_away(effective_overlap_blocks(overlap, config) * block_size))


def effective_prefill_tokens(isl: int, cached: int) -> int:
    """Prompt tokens the rank still has to compute: ``isl - min(cached, isl)``, so always in ``[0, isl]``."""
    return isl - min(max(cached, 0), isl)


def request_blocks(isl: int, block_size: int) -> int:
    """Blocks the prompt occupies, a partial last block included: ``ceil(isl / block_size)``."""
    return -(-isl // block_size)


def potential_decode_blocks(active_decode_blocks: int, num_blocks: int, prompt_overlap_depth: int) -> int:
    """Decode blocks the rank would hold with this prompt: the new blocks its live prompts do not already hold.

    ``prompt_overlap_depth`` is how many leading prompt blocks the rank's *active* requests already hold (the
    active-request prefix trie, not the KV cache), so it never exceeds ``num_blocks`` or the active blocks. The
    cost and ``/potential_loads`` use ``num_blocks = len(sequence_hashes)``; the ``/select`` response uses
    :func:`reported_decode_blocks`.
    """
    return active_decode_blocks + num_blocks - prompt_overlap_depth


def reported_decode_blocks(
    active_decode_blocks: int, *, num_seq_hashes: int, isl: int, block_size: int, prompt_overlap_depth: int
) -> int:
    """The ``potential_decode_blocks`` of a ``/select`` response, which counts a partial last block too.

    1.6.1 uses ``max(len(sequence_hashes), ceil(isl / block_size))`` blocks here (17 tokens at block size 4 ⇒ 5;
    on the hash path 4 hashes with isl 1 ⇒ 4), unlike the cost and ``/potential_loads`` (4 for both).
    """
    num_blocks = max(num_seq_hashes, request_blocks(isl, block_size))
    return potential_decode_blocks(active_decode_blocks, num_blocks, prompt_overlap_depth)


def potential_prefill_tokens(active_prefill_tokens: int, isl: int, cached: int, track: bool) -> int:
    """Prefill tokens the rank would carry with this prompt (``/potential_loads``); only active ones if untracked."""
    potential = active_prefill_tokens + (effective_prefill_tokens(isl, cached) if track else 0)
    return min(potential, U64_MASK)  # saturate: the wire type is u64 (as the slot tracker's /potential_loads)


def overlap_summary(per_rank: Mapping[int, TierOverlap], block_size: int) -> dict[str, object]:
    """The ``overlap`` object of a select response, in tokens, with Mooncake's cumulative tiers
    (behaviour.md#overlap-and-tiers).

    ``per_rank`` must hold **every** dp rank of the chosen worker, unmatched ones as :data:`NO_OVERLAP`: 1.6.1
    lists all of them in ``dp`` (a 3-rank worker with nothing cached reports ``{"0": 0, "1": 0, "2": 0}``). Per
    rank, gpu = device, cpu = device + host, disk = device + host + disk + external; the summary takes the max
    of each over the ranks. ``dp`` is ordered by rank.
    """
    gpu = cpu = disk = 0
    dp: dict[str, int] = {}
    for rank in sorted(per_rank):
        o = per_rank[rank]
        rank_gpu = o.device * block_size
        rank_cpu = (o.device + o.host_ext) * block_size
        rank_disk = (o.device + o.host_ext + o.disk_ext + o.external_ext) * block_size
        dp[str(rank)] = rank_gpu
        gpu, cpu, disk = max(gpu, rank_gpu), max(cpu, rank_cpu), max(disk, rank_disk)
    return {"longest_matched": max(gpu, cpu, disk), "gpu": gpu, "dp": dp, "cpu": cpu, "disk": disk}


class RankCandidate(NamedTuple):
    """Everything the cost needs about one schedulable rank for one request (a named tuple, as ``TierOverlap``:
    one is built per rank per selection)."""

    rank: WorkerRank
    overlap: TierOverlap = NO_OVERLAP
    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    active_requests: int = 0
    prompt_overlap_depth: int = 0  # leading prompt blocks already held by the rank's active requests
    taints: frozenset[str] = frozenset()


def cost(
    candidate: RankCandidate,
    *,
    isl: int,
    num_seq_hashes: int,
    block_size: int,
    config: RouterConfig,
    min_active_prefill: int,
    preferred_taints: Mapping[str, float] | None = None,
    decode_pool: bool = False,
) -> float:
    """The rank's cost in blocks, lower is better (behaviour.md#cost, as 1.6.1 computes it).

    ``config`` is the effective config (per-request override already applied, deprecated weight folded in).
    ``min_active_prefill`` is the least active prefill among the eligible ranks; it matters only with a
    credit decay. ``decode_pool`` selects the decode-pool formula used when a disaggregated decode router keeps
    a positive credit.

    Raw prefill is ``active + isl - min(c, isl) + c`` whether or not prefill tokens are tracked: 1.6.1 keeps it
    with ``DYN_ROUTER_TRACK_PREFILL_TOKENS=false`` (a warm rank with 2 busy decode blocks beat a cold idle one),
    where newer Dynamo zeroes it, which would make an untracked router ignore the cache. Every candidate has a
    load row here (idle ranks are zeros), so the reference's "no load row ⇒ isl" branch does not arise.
    """
    overlap = candidate.overlap
    cached = effective_cached_tokens(overlap, config, block_size)
    active_prefill = candidate.active_prefill_tokens
    raw_prefill_blocks = (active_prefill + effective_prefill_tokens(isl, cached) + cached) / block_size

    decay = 1.0
    blocks = request_blocks(isl, block_size)
    if config.router_track_prefill_tokens and config.overlap_score_credit_decay > 0.0 and blocks > 0:
        # Backlog above the least-loaded eligible rank, in units of this request's size.
        excess_blocks = max(0, active_prefill - min_active_prefill) / block_size
        decay = 1.0 / (1.0 + config.overlap_score_credit_decay * (excess_blocks / blocks))

    credit_blocks = (
        config.overlap_score_credit * decay * overlap.device
        + config.host_cache_hit_weight * overlap.host_ext
        + config.disk_cache_hit_weight * (overlap.disk_ext + overlap.external_ext)
        + config.shared_cache_multiplier * overlap.shared_beyond_device
    )
    decode_blocks = potential_decode_blocks(
        candidate.active_decode_blocks, num_seq_hashes, candidate.prompt_overlap_depth
    )
    request_cost = config.decode_active_request_weight * candidate.active_requests

    if decode_pool and not config.router_track_prefill_tokens and config.overlap_score_credit > 0.0:
        logit = max(0.0, decode_blocks - credit_blocks) + request_cost
    else:
        logit = config.prefill_load_scale * max(0.0, raw_prefill_blocks - credit_blocks) + decode_blocks + request_cost

    if preferred_taints:
        logit *= preference_factor(candidate.taints, preferred_taints)
    return logit


def pick(costs: Sequence[tuple[WorkerRank, float]], *, temperature: float, draw: float) -> WorkerRank:
    """Choose a rank from its cost; deterministic given ``draw`` ∈ [0, 1), which the shell draws uniformly.

    Candidates are considered in rank order (``(worker_id, dp_rank)``), so the result does not depend on the
    order of ``costs``. Temperature 0: the minimum cost, exact ties resolved by ``draw`` (the k tied ranks split
    [0, 1) into k equal slices), which is a uniform choice like 1.6.1's reservoir sampling. Temperature > 0:
    softmax over min-max normalised costs, ``p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min)*T))``, uniform when all
    costs are equal; the first rank whose cumulative probability reaches ``draw`` wins.
    """
    if not costs:
        raise ValueError("pick needs at least one candidate")
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {draw!r}")
    if math.isnan(temperature):
        raise ValueError("temperature must not be NaN")
    low = high = costs[0][1]
    for _, c in costs:  # one pass (this runs for every selection): NaN check, min and max
        if c != c:
            raise ValueError("costs must not be NaN")
        if c < low:
            low = c
        elif c > high:
            high = c
    spread = high - low
    if temperature <= 0.0 or not math.isfinite(spread):  # an infinite spread cannot be normalised: take the min
        tied = sorted([rank for rank, c in costs if c == low])  # in rank order; usually one
        return tied[_slice(draw, len(tied))]
    ordered = sorted(costs)
    if spread == 0.0:
        return ordered[_slice(draw, len(ordered))][0]
    # Normalise first: ``spread * temperature`` can underflow to 0 when the spread is subnormal.
    weights = [math.exp(-((c - low) / spread) / temperature) for _, c in ordered]
    total = math.fsum(weights)
    cumulative = 0.0
    for (rank, _), weight in zip(ordered, weights, strict=True):
        cumulative += weight / total
        if draw <= cumulative:
            return rank
    return ordered[-1][0]  # rounding left the last cumulative a hair under draw


def _slice(draw: float, count: int) -> int:
    return min(int(draw * count), count - 1)


def rank_candidates(
    workers: Sequence[Any], loads: Mapping[WorkerRank, Any], matches: Mapping[WorkerRank, Any], sequence_hashes: Any
) -> list[RankCandidate]:
    """One candidate per rank of ``workers`` (catalog records), in their order then rank order: its overlap per
    tier from ``matches`` (a tuple of ``TierOverlap``'s fields, or absent), its loads from ``loads`` (a rank's
    ``prefill_tokens``, ``active_decode_blocks``, ``requests`` and the ``trie`` of their blocks), and how many
    leading blocks of ``sequence_hashes`` its live requests already hold. Here (compiled) rather than beside its
    caller: it runs for every rank of every selection."""
    out = []
    new = tuple.__new__  # the named tuples' own constructors are Python functions: ~3x the cost, per rank
    for record in workers:
        taints = record.taint_set
        for rank in record.ranks:
            rank_loads = loads[rank]
            found = matches.get(rank)
            requests = rank_loads.requests
            # A rank without live requests holds no decode blocks (its trie is its requests' blocks, its output
            # blocks are theirs: the slots invariants), so the property's call is spared for idle ranks.
            fields = (
                rank,
                _tier_overlap(found) if found else NO_OVERLAP,
                rank_loads.prefill_tokens,
                rank_loads.active_decode_blocks if requests else 0,
                len(requests),
                rank_loads.trie.overlap_depth(sequence_hashes) if requests else 0,
                taints,
            )
            out.append(new(RankCandidate, fields))
    return out


def _tier_overlap(found: Sequence[int]) -> TierOverlap:
    """``TierOverlap(*found)``, without the constructor's Python frame for the KV index's four tiers."""
    if len(found) == 4:
        return tuple.__new__(TierOverlap, (found[0], found[1], found[2], found[3], 0))
    return TierOverlap(*found)


def cheapest(
    kept: Sequence[RankCandidate],
    *,
    isl: int,
    num_seq_hashes: int,
    block_size: int,
    config: RouterConfig,
    preferred_taints: Mapping[str, float],
    draw: float,
) -> RankCandidate:
    """The cost function's pick among the eligible ranks (behaviour.md#cost): each rank's ``cost`` (computed once per
    distinct situation: idle, cold ranks all cost the same), then ``pick`` at the configured temperature."""
    min_prefill = kept[0].active_prefill_tokens
    for c in kept:
        if c.active_prefill_tokens < min_prefill:
            min_prefill = c.active_prefill_tokens
    memo: dict[tuple[object, ...], float] = {}
    costs = []
    idle_cost = None  # the cost of an idle rank with nothing cached (most ranks, often): its taints do not count
    for c in kept:
        if (
            c.overlap is NO_OVERLAP
            and not c.active_prefill_tokens
            and not c.active_decode_blocks
            and not c.active_requests
            and not c.prompt_overlap_depth
            and not preferred_taints
        ):
            if idle_cost is None:
                idle_cost = cost(
                    c,
                    isl=isl,
                    num_seq_hashes=num_seq_hashes,
                    block_size=block_size,
                    config=config,
                    min_active_prefill=min_prefill,
                    preferred_taints=preferred_taints,
                )
            costs.append((c.rank, idle_cost))
            continue
        key = c[1:]  # everything but the rank
        value = memo.get(key)
        if value is None:
            value = memo[key] = cost(
                c,
                isl=isl,
                num_seq_hashes=num_seq_hashes,
                block_size=block_size,
                config=config,
                min_active_prefill=min_prefill,
                preferred_taints=preferred_taints,
            )
        costs.append((c.rank, value))
    chosen = pick(costs, temperature=config.router_temperature, draw=draw)
    for c in kept:
        if c.rank == chosen:
            return c
    raise AssertionError("pick chose a rank that is not a candidate")  # pragma: no cover - pick returns an input


class Refusal(enum.Enum):
    """Why no rank can take the request; the API maps each to one HTTP status."""

    INVALID = "invalid"  # 400: the request contradicts itself
    UNAVAILABLE = "unavailable"  # 503: nothing eligible


@attrs.frozen
class Ineligible:
    reason: Refusal
    message: str


NO_ENDPOINTS = "no endpoints available to route work"
# When no partition in the whole service has a schedulable worker, 1.6.1 answers every select with this instead.
NO_SCHEDULABLE_WORKERS_ANYWHERE = "no schedulable workers are available"


def no_schedulable_workers(scope: ScopeKey) -> str:
    """503 text when the request's partition has no schedulable worker (1.6.1 labels the group routing_group=)."""
    return f"no schedulable workers for {scope.describe()}"


def eligible(
    candidates: Sequence[RankCandidate],
    *,
    allowed_worker_ids: Collection[int] | None = None,
    required_taints: Collection[str] = (),
    pinned: WorkerRank | None = None,
) -> list[RankCandidate] | Ineligible:
    """The candidates the request may use, in input order, or why there are none
    (behaviour.md#eligibility-busy-ranks-and-queueing, #constraints-and-disaggregation).

    ``candidates`` are the partition's schedulable ranks; the caller answers :func:`no_schedulable_workers`
    itself when there are none, before calling this (1.6.1 checks that first). Overload thresholds are the
    caller's too. As in 1.6.1: a pinned worker outside ``allowed_worker_ids`` is a 400, checked before anything
    else; an empty ``allowed_worker_ids`` allows nothing; a worker must carry every required taint (exact
    strings); a pinned rank that is unknown, out of range, or filtered out leaves nothing eligible (503).
    """
    allowed = None if allowed_worker_ids is None else frozenset(allowed_worker_ids)
    if pinned is not None and allowed is not None and pinned.worker_id not in allowed:
        return Ineligible(Refusal.INVALID, f"pinned worker {pinned.worker_id} is not in allowed worker set")
    required = frozenset(required_taints)
    if allowed is None and pinned is None:
        reachable = list(candidates)  # (the common request names none of them: no test per candidate)
    else:
        reachable = [
            c
            for c in candidates
            if (allowed is None or c.rank.worker_id in allowed) and (pinned is None or c.rank == pinned)
        ]
    kept = [c for c in reachable if required <= c.taints] if required else reachable
    if not kept:
        if reachable:  # the required taints alone left nothing: say which (1.6.1 says only the first part)
            return Ineligible(Refusal.UNAVAILABLE, missing_required_taints(required))
        return Ineligible(Refusal.UNAVAILABLE, NO_ENDPOINTS)
    return kept


def missing_required_taints(required: Collection[str]) -> str:
    """503 text when no otherwise eligible worker carries every required taint."""
    shown = ", ".join(sorted(required))
    return f"{NO_ENDPOINTS}: no eligible worker carries every required taint of routing_constraints [{shown}]"


def _round_half_away(value: float) -> int:
    """Round a non-negative value to nearest, halves up (Rust ``f64::round``); Python's round(0.5) gives 0."""
    whole = math.floor(value)
    if value - whole >= 0.5:
        whole += 1
    return int(whole)
