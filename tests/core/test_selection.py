"""Selection arithmetic: cached tokens, projections, overlap summary, cost, pick and eligibility.

Cases marked "verified against 1.6.1" were reproduced on ``python -m dynamo.select_service`` (1.6.1) with
``DYN_USE_KV_EVENTS=false`` (the approximate indexer: a booking makes its blocks a device overlap of the chosen
rank) or with KV events published over ZMQ for the lower tiers. The comment gives the setup and the observation.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import (
    NO_ENDPOINTS,
    NO_OVERLAP,
    NO_SCHEDULABLE_WORKERS_ANYWHERE,
    Ineligible,
    RankCandidate,
    Refusal,
    TierOverlap,
    cost,
    effective_cached_tokens,
    effective_overlap_blocks,
    effective_prefill_tokens,
    eligible,
    no_schedulable_workers,
    overlap_summary,
    pick,
    potential_decode_blocks,
    potential_prefill_tokens,
    reported_decode_blocks,
    request_blocks,
)

DEFAULT = RouterConfig()
W20, W21, W22 = WorkerRank(20, 0), WorkerRank(21, 0), WorkerRank(22, 0)


def costs_of(
    candidates: list[RankCandidate],
    *,
    isl: int,
    num_seq_hashes: int,
    block_size: int = 4,
    config: RouterConfig = DEFAULT,
    preferred_taints: dict[str, float] | None = None,
) -> dict[WorkerRank, float]:
    floor = min(c.active_prefill_tokens for c in candidates)
    return {
        c.rank: cost(
            c,
            isl=isl,
            num_seq_hashes=num_seq_hashes,
            block_size=block_size,
            config=config,
            min_active_prefill=floor,
            preferred_taints=preferred_taints,
        )
        for c in candidates
    }


# --- effective cached tokens and effective prefill (behaviour.md#overlap-and-tiers) -----------------------------------


def test_effective_cached_tokens_spec_example() -> None:
    config = RouterConfig(host_cache_hit_weight=0.5, disk_cache_hit_weight=0.25)
    overlap = TierOverlap(device=2, host_ext=3, disk_ext=4, external_ext=5)
    assert effective_overlap_blocks(overlap, config) == 5.75
    assert effective_cached_tokens(overlap, config, 16) == 92


@pytest.mark.parametrize(
    ("overlap", "block_size", "isl", "effective_prefill"),
    [
        # verified against 1.6.1, KV events over ZMQ, query tokens 1..20: rank with 2 GPU blocks, 1 CPU_PINNED and
        # 2 DISK blocks continuing it => effective_prefill_tokens 7 (cached 2 + 0.75 + 0.5 = 3.25 blocks = 13).
        (TierOverlap(device=2, host_ext=1, disk_ext=2), 4, 20, 7),
        # 1 GPU block then 1 DISK block => 15.
        (TierOverlap(device=1, disk_ext=1), 4, 20, 15),
        # Block size 2, query 12 tokens, blocks stored at the root of a lower tier only. Halves round away from
        # zero like Rust: 1 disk block = 0.5 tokens -> 1 => 11; 5 disk = 2.5 -> 3 => 9; 3 disk = 1.5 -> 2 => 10;
        # 1 host = 1.5 -> 2 => 10; medium "EXTERNAL" weighs like disk => 11.
        (TierOverlap(disk_ext=1), 2, 12, 11),
        (TierOverlap(disk_ext=5), 2, 12, 9),
        (TierOverlap(disk_ext=3), 2, 12, 10),
        (TierOverlap(host_ext=1), 2, 12, 10),
        (TierOverlap(external_ext=1), 2, 12, 11),
        # Case 34: 17 cold tokens => 17. Appendix: 48 of 64 tokens on the GPU => 16.
        (NO_OVERLAP, 4, 17, 17),
        (TierOverlap(device=3), 16, 64, 16),
        # Case 38, hash path: 4 cached blocks of 4 tokens against isl_tokens 4 => 0, never negative.
        (TierOverlap(device=4), 4, 4, 0),
        # token_ids [] is accepted: isl 0, effective_prefill_tokens 0.
        (NO_OVERLAP, 4, 0, 0),
    ],
)
def test_effective_prefill_tokens(overlap: TierOverlap, block_size: int, isl: int, effective_prefill: int) -> None:
    cached = effective_cached_tokens(overlap, DEFAULT, block_size)
    assert effective_prefill_tokens(isl, cached) == effective_prefill


@given(isl=st.integers(0, 1 << 20), cached=st.integers(-(1 << 20), 1 << 22))
def test_effective_prefill_is_within_the_prompt(isl: int, cached: int) -> None:
    assert 0 <= effective_prefill_tokens(isl, cached) <= isl


@given(
    overlap=st.builds(TierOverlap, *(st.integers(0, 1000) for _ in range(4))),
    host=st.floats(0, 1),
    disk=st.floats(0, 1),
    block_size=st.integers(1, 256),
)
def test_cached_tokens_never_negative_nor_beyond_the_matched_blocks(
    overlap: TierOverlap, host: float, disk: float, block_size: int
) -> None:
    config = RouterConfig(host_cache_hit_weight=host, disk_cache_hit_weight=disk)
    cached = effective_cached_tokens(overlap, config, block_size)
    matched = overlap.device + overlap.host_ext + overlap.disk_ext + overlap.external_ext
    assert overlap.device * block_size <= cached <= matched * block_size


# --- overlap summary (Mooncake tiers) -----------------------------------------------------------------------------


def test_overlap_summary_spec_example() -> None:
    per_rank = {0: TierOverlap(device=2, host_ext=1, disk_ext=2), 1: TierOverlap(device=1, disk_ext=1)}
    assert overlap_summary(per_rank, 16) == {
        "longest_matched": 80,
        "gpu": 32,
        "dp": {"0": 32, "1": 16},
        "cpu": 48,
        "disk": 80,
    }


def test_overlap_summary_verified_three_ranks() -> None:
    # verified against 1.6.1: worker with data_parallel_size 3, block 4, KV events: rank 0 holds 2 GPU + 1
    # CPU_PINNED + 2 DISK blocks of tokens 1..20, ranks 1 and 2 one GPU block each. Every select (pinned to any
    # rank or not) reported {"longest_matched": 20, "gpu": 8, "dp": {"0": 8, "1": 4, "2": 4}, "cpu": 12,
    # "disk": 20}: the summary is per worker, the same whichever rank was chosen.
    per_rank = {2: TierOverlap(device=1), 0: TierOverlap(device=2, host_ext=1, disk_ext=2), 1: TierOverlap(device=1)}
    summary = overlap_summary(per_rank, 4)
    assert summary == {"longest_matched": 20, "gpu": 8, "dp": {"0": 8, "1": 4, "2": 4}, "cpu": 12, "disk": 20}
    assert list(summary["dp"]) == ["0", "1", "2"]  # type: ignore[call-overload]


def test_overlap_summary_lists_every_rank_of_the_worker() -> None:
    # verified against 1.6.1 (approximate mode, worker 3 with data_parallel_size 3, block 4):
    # nothing cached => dp {"0": 0, "1": 0, "2": 0}; after booking 3 blocks on rank 1 and 2 on rank 2, a 4-block
    # prompt => {"longest_matched": 12, "gpu": 12, "dp": {"0": 0, "1": 12, "2": 8}, "cpu": 12, "disk": 12}.
    cold = {r: NO_OVERLAP for r in range(3)}
    assert overlap_summary(cold, 4) == {
        "longest_matched": 0,
        "gpu": 0,
        "dp": {"0": 0, "1": 0, "2": 0},
        "cpu": 0,
        "disk": 0,
    }
    warm = {0: NO_OVERLAP, 1: TierOverlap(device=3), 2: TierOverlap(device=2)}
    assert overlap_summary(warm, 4) == {
        "longest_matched": 12,
        "gpu": 12,
        "dp": {"0": 0, "1": 12, "2": 8},
        "cpu": 12,
        "disk": 12,
    }


def test_overlap_summary_of_a_single_cold_rank() -> None:
    # verified against 1.6.1: a cold select => {"longest_matched": 0, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 0}.
    assert overlap_summary({0: NO_OVERLAP}, 4) == {
        "longest_matched": 0,
        "gpu": 0,
        "dp": {"0": 0},
        "cpu": 0,
        "disk": 0,
    }


def test_overlap_summary_lower_tier_only() -> None:
    # verified against 1.6.1 (block 2, one CPU_PINNED block at the root): cpu 2 and disk 2 but gpu 0; a DISK block
    # => cpu 0, disk 2 (edge case 58: CPU_PINNED counts in cpu, not gpu).
    assert overlap_summary({0: TierOverlap(host_ext=1)}, 2) == {
        "longest_matched": 2,
        "gpu": 0,
        "dp": {"0": 0},
        "cpu": 2,
        "disk": 2,
    }
    assert overlap_summary({0: TierOverlap(disk_ext=1)}, 2)["cpu"] == 0


# --- projections (behaviour.md#selection-endpoints-and-overrides, #loads-dump-and-session-affinity) -------------------


@pytest.mark.parametrize(
    ("active", "seq", "isl", "depth", "reported", "potential"),
    [
        # All verified against 1.6.1, block size 4. "reported" is /select's potential_decode_blocks, "potential"
        # is /potential_loads'.
        (0, 4, 17, 0, 5, 4),  # case 34: token_ids 1..17 on an idle worker
        (0, 0, 2, 0, 1, 0),  # token_ids [1, 2]
        (0, 0, 0, 0, 0, 0),  # token_ids []
        (0, 4, 5, 0, 4, 4),  # hash path: 4 hashes, isl 5
        (0, 1, 16, 0, 4, 1),  # 1 hash, isl 16
        (0, 1, 17, 0, 5, 1),
        (0, 4, 1, 0, 4, 4),  # 4 hashes, isl 1
        (0, 0, 9, 0, 3, 0),
        (4, 3, 12, 2, 5, 5),  # behaviour.md#loads-dump-and-session-affinity probe: 4 active blocks; 3 blocks sharing 2
        (4, 3, 13, 2, 6, 5),
        (4, 6, 24, 4, 6, 6),
        (0, 6, 24, 0, 6, 6),  # the same prompt after the booking was freed (its KV overlap stays, its blocks go)
        (2, 4, 5, 2, 4, 4),  # active [11, 12]; query [11, 12, 13, 14] isl 5
        (2, 1, 17, 1, 6, 2),  # query [11] isl 17
        (2, 3, 4, 2, 3, 3),  # query [11, 12, 99] isl 4
        (3, 4, 16, 3, 4, 4),  # dp rank holding 3 blocks of a 4-block prompt
    ],
)
def test_decode_block_projections(active: int, seq: int, isl: int, depth: int, reported: int, potential: int) -> None:
    assert potential_decode_blocks(active, seq, depth) == potential
    assert (
        reported_decode_blocks(active, num_seq_hashes=seq, isl=isl, block_size=4, prompt_overlap_depth=depth)
        == reported
    )


@pytest.mark.parametrize(
    ("active", "isl", "cached", "track", "expected"),
    [
        # All verified against 1.6.1 (/potential_loads, block size 4).
        (17, 12, 8, True, 21),  # behaviour.md#loads-dump-and-session-affinity probe: active 17 tokens; 3 blocks
        # sharing 2
        (0, 17, 0, True, 17),
        (0, 24, 16, True, 8),  # after the booking was freed, its 4 blocks still cached
        (0, 4, 16, True, 0),  # hash path, cached beyond isl
        (8, 5, 8, True, 8),
        (8, 17, 4, True, 21),
        (4, 12, 0, True, 16),
        (4, 12, 0, False, 4),  # router_config_override.track_prefill_tokens false: active only
        (0, 12, 12, False, 0),
    ],
)
def test_potential_prefill_tokens(active: int, isl: int, cached: int, track: bool, expected: int) -> None:
    assert potential_prefill_tokens(active, isl, cached, track) == expected


def test_request_blocks() -> None:
    assert [request_blocks(n, 4) for n in (0, 1, 4, 5, 17)] == [0, 1, 1, 2, 5]


# --- cost (behaviour.md#cost) -----------------------------------------------------------------------------------------


def test_classic_cost_with_defaults() -> None:
    # max(0, (active_prefill + isl)/bs - device - 0.75 host - 0.25 disk) + active_decode + new blocks
    candidate = RankCandidate(
        WorkerRank(1, 0),
        TierOverlap(device=2, host_ext=1, disk_ext=2),
        active_prefill_tokens=8,
        active_decode_blocks=3,
        prompt_overlap_depth=1,
    )
    expected = max(0.0, (8 + 20) / 4 - 2 - 0.75 - 0.5) + 3 + 5 - 1
    assert cost(candidate, isl=20, num_seq_hashes=5, block_size=4, config=DEFAULT, min_active_prefill=0) == expected


def test_own_booking_cancels_its_cache_credit() -> None:
    # verified against 1.6.1: tokens 1..8 booked on worker 20, then query tokens 1..12: worker 20 has active
    # prefill 8, 2 decode blocks, 2 device blocks cached and 2 prompt blocks held => cost 6; idle worker 21 => 6.
    # 1.6.1 split 17/13 between them.
    warm = RankCandidate(
        W20,
        TierOverlap(device=2),
        active_prefill_tokens=8,
        active_decode_blocks=2,
        active_requests=1,
        prompt_overlap_depth=2,
    )
    costs = costs_of([warm, RankCandidate(W21)], isl=12, num_seq_hashes=3)
    assert costs == {W20: 6.0, W21: 6.0}


def test_three_dp_ranks_tie() -> None:
    # verified against 1.6.1 (worker 3, dp size 3): rank 1 holds a 3-block booking, rank 2 a 2-block booking of
    # the same prefix; a 4-block prompt costs 8 on every rank (1.6.1 picked rank 2 once, rank 0 when pinned).
    ranks = [
        RankCandidate(WorkerRank(3, 0)),
        RankCandidate(
            WorkerRank(3, 1),
            TierOverlap(device=3),
            active_prefill_tokens=12,
            active_decode_blocks=3,
            active_requests=1,
            prompt_overlap_depth=3,
        ),
        RankCandidate(
            WorkerRank(3, 2),
            TierOverlap(device=2),
            active_prefill_tokens=8,
            active_decode_blocks=2,
            active_requests=1,
            prompt_overlap_depth=2,
        ),
    ]
    assert set(costs_of(ranks, isl=16, num_seq_hashes=4).values()) == {8.0}


# Scenario S (all verified against 1.6.1): worker 20 holds 8 cached device blocks of tokens 1..32 (booked, then
# freed) and an unrelated live booking of 8 tokens (2 blocks, 1 request); worker 21 is idle; query tokens 1..36
# (9 blocks). Default costs: 20 => 11 - 8 + 11 = 14, 21 => 18.
WARM_BUSY = RankCandidate(
    W20, TierOverlap(device=8), active_prefill_tokens=8, active_decode_blocks=2, active_requests=1
)
IDLE = RankCandidate(W21)


@pytest.mark.parametrize(
    ("config", "winner"),
    [
        (DEFAULT, W20),
        # credit decay: 1/(1 + d * ((8 - 0)/4)/9); 20 wins iff 8 * decay > 4, i.e. d < 4.5 (4.5 is an exact tie)
        (RouterConfig(overlap_score_credit_decay=4.0), W20),
        (RouterConfig(overlap_score_credit_decay=5.0), W21),
        (RouterConfig(overlap_score_credit_decay=4.5), None),
        # active-request weight w adds w to 20 only: tie at 4
        (RouterConfig(decode_active_request_weight=3.9), W20),
        (RouterConfig(decode_active_request_weight=4.1), W21),
        (RouterConfig(decode_active_request_weight=4.0), None),
        # credit c: 20 => 11 - 8c + 11; tie at 0.5
        (RouterConfig(overlap_score_credit=0.5), None),
        (RouterConfig(overlap_score_credit=0.49), W21),
        # scale s: 20 => 3s + 11, 21 => 9s + 9; tie at 1/3
        (RouterConfig(prefill_load_scale=0.3), W21),
        (RouterConfig(prefill_load_scale=0.4), W20),
    ],
)
def test_cost_knobs(config: RouterConfig, winner: WorkerRank | None) -> None:
    costs = costs_of([WARM_BUSY, IDLE], isl=36, num_seq_hashes=9, config=config)
    if winner is None:
        assert costs[W20] == costs[W21] == 18.0
    else:
        assert min(costs, key=costs.__getitem__) == winner


def test_decay_leaves_the_least_loaded_rank_its_full_credit() -> None:
    config = RouterConfig(overlap_score_credit_decay=100.0)
    busy_floor = RankCandidate(W20, TierOverlap(device=8), active_prefill_tokens=40, active_decode_blocks=2)
    assert cost(busy_floor, isl=36, num_seq_hashes=9, block_size=4, config=config, min_active_prefill=40) == cost(
        busy_floor, isl=36, num_seq_hashes=9, block_size=4, config=DEFAULT, min_active_prefill=40
    )


def test_untracked_prefill_still_counts_the_prompt() -> None:
    # verified against 1.6.1 with DYN_ROUTER_TRACK_PREFILL_TOKENS=false, scenario S: the unrelated booking books no
    # prefill, so 20 has 0 active prefill, 2 decode blocks, 8 cached blocks. 1.6.1 chose 20 (20 of 20): cost
    # (0 + 36)/4 - 8 + 11 = 12 against 21's 18. Newer Dynamo zeroes raw prefill when untracked, which would give
    # 11 against 9 and pick 21.
    config = RouterConfig(router_track_prefill_tokens=False)
    warm = RankCandidate(W20, TierOverlap(device=8), active_decode_blocks=2, active_requests=1)
    assert costs_of([warm, IDLE], isl=36, num_seq_hashes=9, config=config) == {W20: 12.0, W21: 18.0}


def test_cached_beyond_the_prompt_counts_as_prefill() -> None:
    # verified against 1.6.1, hash path: worker 20 caches 4 blocks (block_hashes [1,2,3,4], freed) and has an
    # unrelated live booking of isl 8 with no blocks; query the same 4 hashes with isl_tokens 4. Raw prefill is
    # active + max(isl, cached) = 8 + 16 => 20 costs 24/4 - 4 + 4 = 6, 21 costs 1 + 4 = 5; 1.6.1 chose 21 (20/20).
    warm = RankCandidate(W20, TierOverlap(device=4), active_prefill_tokens=8, active_requests=1)
    assert costs_of([warm, IDLE], isl=4, num_seq_hashes=4) == {W20: 6.0, W21: 5.0}


def test_lower_tiers_earn_weighted_credit() -> None:
    # verified against 1.6.1 (KV events, dp size 3, tokens 1..20): the unpinned select chose rank 0, the rank
    # holding 2 GPU + 1 host + 2 disk blocks (cost 5 - 3.25 + 5 = 6.75) over ranks holding one GPU block (9).
    ranks = [
        RankCandidate(WorkerRank(1, 0), TierOverlap(device=2, host_ext=1, disk_ext=2)),
        RankCandidate(WorkerRank(1, 1), TierOverlap(device=1)),
        RankCandidate(WorkerRank(1, 2), TierOverlap(device=1)),
    ]
    assert costs_of(ranks, isl=20, num_seq_hashes=5) == {
        WorkerRank(1, 0): 6.75,
        WorkerRank(1, 1): 9.0,
        WorkerRank(1, 2): 9.0,
    }


def test_shared_cache_hits_earn_the_multiplier() -> None:
    candidate = RankCandidate(W20, TierOverlap(device=1, shared_beyond_device=4))
    base = cost(candidate, isl=32, num_seq_hashes=8, block_size=4, config=DEFAULT, min_active_prefill=0)
    shared = cost(
        candidate,
        isl=32,
        num_seq_hashes=8,
        block_size=4,
        config=RouterConfig(shared_cache_multiplier=0.5),
        min_active_prefill=0,
    )
    assert base - shared == 2.0


def test_decode_pool_formula() -> None:
    # behaviour.md#cost: decode pool, prefill untracked, positive credit => max(0, decode - credit) + request weight.
    config = RouterConfig(router_track_prefill_tokens=False, decode_active_request_weight=0.5)
    candidate = RankCandidate(W20, TierOverlap(device=3), active_decode_blocks=5, active_requests=2)
    kwargs = {"isl": 16, "num_seq_hashes": 4, "block_size": 4, "config": config, "min_active_prefill": 0}
    assert cost(candidate, decode_pool=True, **kwargs) == (5 + 4 - 3) + 1.0  # type: ignore[arg-type]
    assert cost(candidate, decode_pool=False, **kwargs) == 4 - 3 + 9 + 1.0  # type: ignore[arg-type]
    zero_credit = RouterConfig(router_track_prefill_tokens=False, overlap_score_credit=0.0)
    assert (
        cost(
            candidate,
            decode_pool=True,
            isl=16,
            num_seq_hashes=4,
            block_size=4,
            config=zero_credit,
            min_active_prefill=0,
        )
        == 4 + 9
    )


# Scenario T (verified against 1.6.1): worker 20 (taints p, q) carries an unrelated live booking of 4 tokens
# (1 block); 21 is idle; query tokens 1..8 => costs 6 and 4. 20 wins iff exp(-tanh(w)) < 2/3, i.e. w > 0.4296.
LOADED_TAINTED = RankCandidate(
    W20, active_prefill_tokens=4, active_decode_blocks=1, active_requests=1, taints=frozenset({"p", "q"})
)


@pytest.mark.parametrize(
    ("preferred", "winner"),
    [
        (None, W21),
        ({"p": 0.42}, W21),
        ({"p": 0.44}, W20),
        ({"p": 1.0}, W20),
        ({"p": 0.21, "q": 0.21, "absent": 5.0}, W21),  # weights of matched taints add up; absent ones are ignored
        ({"p": 0.22, "q": 0.22, "absent": 5.0}, W20),
    ],
)
def test_preferred_taints(preferred: dict[str, float] | None, winner: WorkerRank) -> None:
    costs = costs_of([LOADED_TAINTED, RankCandidate(W21)], isl=8, num_seq_hashes=2, preferred_taints=preferred)
    assert min(costs, key=costs.__getitem__) == winner


def test_preferred_taint_multiplier_applies_to_the_decode_term_too() -> None:
    # verified against 1.6.1, hash path: worker 20 (taint p) has an unrelated live booking of isl 4 and no blocks;
    # query isl_tokens 16 with weight 0.164 (multiplier 0.85). With no sequence hashes the costs are 5 and 4 and 21
    # wins; with 4 (uncached) hashes they are 9 and 8 and 20 wins (0.85 * 9 < 8); with weight 0.1 21 wins again.
    loaded = RankCandidate(W20, active_prefill_tokens=4, active_requests=1, taints=frozenset({"p"}))
    for seq, weight, winner in ((0, 0.164, W21), (4, 0.164, W20), (4, 0.1, W21)):
        costs = costs_of([loaded, RankCandidate(W21)], isl=16, num_seq_hashes=seq, preferred_taints={"p": weight})
        assert min(costs, key=costs.__getitem__) == winner


def test_case_47_preferred_weight_one() -> None:
    plain = cost(LOADED_TAINTED, isl=8, num_seq_hashes=2, block_size=4, config=DEFAULT, min_active_prefill=0)
    preferred = cost(
        LOADED_TAINTED,
        isl=8,
        num_seq_hashes=2,
        block_size=4,
        config=DEFAULT,
        min_active_prefill=0,
        preferred_taints={"p": 1.0},
    )
    assert preferred / plain == pytest.approx(math.exp(-math.tanh(1.0)))
    assert preferred / plain == pytest.approx(0.466, abs=1e-3)  # the spec's "about 0.466"
    repelled = cost(
        LOADED_TAINTED,
        isl=8,
        num_seq_hashes=2,
        block_size=4,
        config=DEFAULT,
        min_active_prefill=0,
        preferred_taints={"p": -1.0},
    )
    assert repelled / plain == pytest.approx(math.e ** math.tanh(1.0))


@given(
    device=st.integers(0, 16),
    extra_blocks=st.integers(0, 16),
    partial=st.integers(0, 3),
    active_prefill=st.integers(0, 500),
    active_decode=st.integers(0, 50),
)
def test_case_37_warm_beats_cold_by_its_device_blocks(
    device: int, extra_blocks: int, partial: int, active_prefill: int, active_decode: int
) -> None:
    blocks = device + extra_blocks
    isl = blocks * 4 + partial
    loads = {"active_prefill_tokens": active_prefill, "active_decode_blocks": active_decode}
    warm = RankCandidate(W20, TierOverlap(device=device), **loads)
    cold = RankCandidate(W21, **loads)
    costs = costs_of([warm, cold], isl=isl, num_seq_hashes=blocks)
    assert costs[W21] - costs[W20] == pytest.approx(device)
    if device > 0:
        assert pick(list(costs.items()), temperature=0.0, draw=0.999) == W20


# --- pick (behaviour.md#cost) -----------------------------------------------------------------------------------------


def test_pick_minimum() -> None:
    costs = [(W21, 4.0), (W20, 6.0), (W22, 8.0)]
    assert {pick(costs, temperature=0.0, draw=d) for d in (0.0, 0.5, 0.99)} == {W21}


def test_pick_ties_split_the_draw_in_rank_order() -> None:
    # edge case 36: two idle workers are each chosen for some draws. Verified against 1.6.1: 30 selects over
    # three tied ranks gave 12/9/9, 30 over ranks tied after a -1 preferred taint gave 12/18.
    costs = [(W22, 1.0), (W20, 1.0), (W21, 2.0)]
    assert pick(costs, temperature=0.0, draw=0.0) == W20
    assert pick(costs, temperature=0.0, draw=0.4999) == W20
    assert pick(costs, temperature=0.0, draw=0.5) == W22
    assert pick(costs, temperature=0.0, draw=0.9999999) == W22


def test_softmax_two_workers() -> None:
    # verified against 1.6.1 with DYN_ROUTER_TEMPERATURE=1, scenario T: costs 6 (worker 20) and 4 (worker 21);
    # p(20) = e^-1 / (1 + e^-1) = 0.269; 1.6.1 chose 20 in 1041 of 4000 selects.
    costs = [(W21, 4.0), (W20, 6.0)]
    p20 = math.exp(-1) / (1 + math.exp(-1))
    assert pick(costs, temperature=1.0, draw=p20 - 1e-9) == W20
    assert pick(costs, temperature=1.0, draw=p20 + 1e-9) == W21


def test_softmax_three_workers_matches_the_reference_frequencies() -> None:
    # verified against 1.6.1 with DYN_ROUTER_TEMPERATURE=2: costs 20 => 6, 21 => 4, 22 => 8; 4000 selects gave
    # 1351 / 1655 / 994, against 1306 / 1677 / 1017 expected from exp(-(c - 4) / (4 * 2)).
    costs = [(W20, 6.0), (W21, 4.0), (W22, 8.0)]
    steps = 100_000
    counts = {W20: 0, W21: 0, W22: 0}
    for i in range(steps):
        counts[pick(costs, temperature=2.0, draw=(i + 0.5) / steps)] += 1
    weights = {r: math.exp(-(c - 4.0) / 8.0) for r, c in costs}
    total = sum(weights.values())
    for rank, count in counts.items():
        assert count / steps == pytest.approx(weights[rank] / total, abs=1e-4)
    observed = {W20: 1351, W21: 1655, W22: 994}
    for rank, count in observed.items():
        assert count / 4000 == pytest.approx(weights[rank] / total, abs=0.03)


def test_softmax_with_equal_costs_is_uniform() -> None:
    costs = [(W21, 3.0), (W20, 3.0)]
    assert pick(costs, temperature=0.7, draw=0.25) == W20
    assert pick(costs, temperature=0.7, draw=0.75) == W21


def test_pick_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        pick([], temperature=0.0, draw=0.0)
    with pytest.raises(ValueError):
        pick([(W20, 1.0)], temperature=0.0, draw=1.0)
    with pytest.raises(ValueError):
        pick([(W20, math.nan)], temperature=0.0, draw=0.5)


def test_infinite_spread_falls_back_to_the_minimum() -> None:
    assert pick([(W20, math.inf), (W21, 1.0)], temperature=1.0, draw=0.9) == W21


ranks = st.builds(WorkerRank, st.integers(0, 50), st.integers(0, 3))
cost_values = st.sampled_from([0.0, 0.5, 1.0, 2.25, 7.0]) | st.floats(0, 1e6, allow_nan=False)
cost_tables = st.dictionaries(ranks, cost_values, min_size=1, max_size=12).map(lambda d: list(d.items()))
draws = st.floats(0.0, 1.0, exclude_max=True)


@given(costs=cost_tables, draw=draws)
def test_zero_temperature_returns_a_minimum(costs: list[tuple[WorkerRank, float]], draw: float) -> None:
    chosen = pick(costs, temperature=0.0, draw=draw)
    assert dict(costs)[chosen] == min(c for _, c in costs)


@given(costs=cost_tables)
def test_every_tied_rank_is_reachable(costs: list[tuple[WorkerRank, float]]) -> None:
    low = min(c for _, c in costs)
    tied = sorted(r for r, c in costs if c == low)
    chosen = [pick(costs, temperature=0.0, draw=(i + 0.5) / len(tied)) for i in range(len(tied))]
    assert chosen == tied


def test_softmax_with_a_subnormal_spread() -> None:
    """Costs 5e-324 apart (found by hypothesis): normalising first keeps the weights finite."""
    costs = [(WorkerRank(0, 0), 0.0), (WorkerRank(0, 1), 5e-324)]
    assert pick(costs, temperature=0.1, draw=0.0) == WorkerRank(0, 0)
    assert pick(costs, temperature=0.1, draw=0.99999) == WorkerRank(0, 1)


@given(costs=cost_tables, draw=draws, temperature=st.sampled_from([0.0, 0.1, 1.0, 5.0]), data=st.data())
def test_pick_ignores_input_order(
    costs: list[tuple[WorkerRank, float]], draw: float, temperature: float, data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(costs))
    assert pick(shuffled, temperature=temperature, draw=draw) == pick(costs, temperature=temperature, draw=draw)


# --- eligibility (behaviour.md#eligibility-busy-ranks-and-queueing, #constraints-and-disaggregation) ------------------

# The catalog of the verified probes: worker 10 (taints gpu=a100, zone=x) and worker 11 with 2 dp ranks.
R10, R11_0, R11_1 = WorkerRank(10, 0), WorkerRank(11, 0), WorkerRank(11, 1)
CATALOG = [
    RankCandidate(R10, taints=frozenset({"gpu=a100", "zone=x"})),
    RankCandidate(R11_0),
    RankCandidate(R11_1),
]
UNAVAILABLE = Ineligible(Refusal.UNAVAILABLE, "no endpoints available to route work")


def missing_taints(shown: str) -> Ineligible:
    """1.6.1 answers the same 503 with only "no endpoints available to route work"; kvrouter names the taints."""
    return Ineligible(
        Refusal.UNAVAILABLE,
        f"no endpoints available to route work: no eligible worker carries every required taint of "
        f"routing_constraints [{shown}]",
    )


def ranks_of(result: list[RankCandidate] | Ineligible) -> list[WorkerRank] | Ineligible:
    return result if isinstance(result, Ineligible) else [c.rank for c in result]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # All verified against 1.6.1 with the catalog above.
        ({}, [R10, R11_0, R11_1]),
        ({"required_taints": ["nope"]}, missing_taints("nope")),  # case 47: required taint missing everywhere => 503
        ({"required_taints": ["gpu=a100"]}, [R10]),
        ({"required_taints": []}, [R10, R11_0, R11_1]),
        ({"allowed_worker_ids": [99]}, UNAVAILABLE),
        ({"allowed_worker_ids": []}, UNAVAILABLE),  # an empty allow-list allows nothing
        ({"allowed_worker_ids": [11]}, [R11_0, R11_1]),
        ({"allowed_worker_ids": [11, 11]}, [R11_0, R11_1]),
        ({"pinned": WorkerRank(11, 5)}, UNAVAILABLE),  # rank out of range
        ({"pinned": WorkerRank(99, 0)}, UNAVAILABLE),  # unknown worker
        ({"pinned": R11_1}, [R11_1]),
        (
            {"pinned": R11_1, "allowed_worker_ids": [10]},
            Ineligible(Refusal.INVALID, "pinned worker 11 is not in allowed worker set"),
        ),
        # the allow-list check comes before the existence check, and an empty list counts
        (
            {"pinned": WorkerRank(99, 0), "allowed_worker_ids": [10]},
            Ineligible(Refusal.INVALID, "pinned worker 99 is not in allowed worker set"),
        ),
        (
            {"pinned": R10, "allowed_worker_ids": []},
            Ineligible(Refusal.INVALID, "pinned worker 10 is not in allowed worker set"),
        ),
        (
            {"pinned": R10, "allowed_worker_ids": [11], "required_taints": ["a"]},
            Ineligible(Refusal.INVALID, "pinned worker 10 is not in allowed worker set"),
        ),
        ({"pinned": R11_1, "required_taints": ["gpu=a100"]}, missing_taints("gpu=a100")),  # pinned one lacks it
        # another filter already left nothing: the taints are not what excluded the workers
        ({"allowed_worker_ids": [99], "required_taints": ["gpu=a100"]}, UNAVAILABLE),
        ({"pinned": R10, "required_taints": ["gpu=a100"]}, [R10]),
        ({"pinned": R10, "allowed_worker_ids": [10, 11]}, [R10]),
    ],
)
def test_eligibility(kwargs: dict, expected: list[WorkerRank] | Ineligible) -> None:
    assert ranks_of(eligible(CATALOG, **kwargs)) == expected


def test_required_taints_match_exactly() -> None:
    assert ranks_of(eligible(CATALOG, required_taints=["GPU=A100"])) == missing_taints("GPU=A100")
    assert ranks_of(eligible(CATALOG, required_taints=["gpu=a100", "zone=x"])) == [R10]


def test_unavailable_messages() -> None:
    # verified against 1.6.1: a partition without schedulable workers => 503 "no schedulable workers for model=x
    # routing_group=default" (kvrouter names the group tenant_id=, like its other messages); when no partition
    # of the service has a schedulable worker => 503 "no schedulable workers are available".
    assert no_schedulable_workers(ScopeKey("x", "default")) == "no schedulable workers for model=x tenant_id=default"
    assert NO_SCHEDULABLE_WORKERS_ANYWHERE == "no schedulable workers are available"
    assert NO_ENDPOINTS == "no endpoints available to route work"
    assert eligible([], allowed_worker_ids=None) == UNAVAILABLE
