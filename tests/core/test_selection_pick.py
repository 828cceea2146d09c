"""selection.pick (one pass for the minimum; sorting only where the softmax needs rank order) against its
earlier, plainer form kept here as the definition: same rank or same error for any costs, temperature and
draw, infinities and NaN included; and selection.cheapest picks what pick picks over each rank's cost."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import RankCandidate, TierOverlap, cheapest, cost, pick


def defined_pick(costs: list[tuple[WorkerRank, float]], *, temperature: float, draw: float) -> WorkerRank:
    if not costs:
        raise ValueError("pick needs at least one candidate")
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {draw!r}")
    if math.isnan(temperature):
        raise ValueError("temperature must not be NaN")
    ordered = sorted(costs)
    if any(math.isnan(c) for _, c in ordered):
        raise ValueError("costs must not be NaN")
    low = min(c for _, c in ordered)
    high = max(c for _, c in ordered)
    spread = high - low
    if temperature <= 0.0 or not math.isfinite(spread):
        tied = [rank for rank, c in ordered if c == low]
        return tied[min(int(draw * len(tied)), len(tied) - 1)]
    if spread == 0.0:
        return ordered[min(int(draw * len(ordered)), len(ordered) - 1)][0]
    weights = [math.exp(-((c - low) / spread) / temperature) for _, c in ordered]
    total = math.fsum(weights)
    cumulative = 0.0
    for (rank, _), weight in zip(ordered, weights, strict=True):
        cumulative += weight / total
        if draw <= cumulative:
            return rank
    return ordered[-1][0]


def outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except ValueError as exc:
        return "error", str(exc)


COSTS = st.one_of(
    st.sampled_from([0.0, 1.0, 2.5, math.inf, -math.inf, math.nan]), st.floats(-10.0, 10.0), st.integers(0, 3)
)


@settings(max_examples=500, deadline=None)
@given(
    costs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), COSTS), max_size=8, unique_by=lambda t: t[:2]),
    temperature=st.one_of(st.sampled_from([0.0, -1.0, math.nan, 1e-300]), st.floats(0.0, 3.0)),
    draw=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.sampled_from([0.0, 0.999999, 1.0, -0.1])),
)
def test_pick_is_its_definition(costs: list[tuple[int, int, float]], temperature: float, draw: float) -> None:
    ranked = [(WorkerRank(w, d), c) for w, d, c in reversed(costs)]  # not in rank order
    assert outcome(lambda: pick(ranked, temperature=temperature, draw=draw)) == outcome(
        lambda: defined_pick(ranked, temperature=temperature, draw=draw)
    )


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 3000), st.integers(0, 100), st.integers(0, 5)),
        min_size=1,
        max_size=8,
    ),
    temperature=st.sampled_from([0.0, 0.5]),
    draw=st.floats(0.0, 1.0, exclude_max=True),
)
def test_cheapest_takes_what_pick_takes(
    loads: list[tuple[int, int, int, int]], temperature: float, draw: float
) -> None:
    config = RouterConfig(router_temperature=temperature)
    candidates = [
        RankCandidate(WorkerRank(i, 0), TierOverlap(device), prefill, decode, requests)
        for i, (device, prefill, decode, requests) in enumerate(loads)
    ]
    least = min(c.active_prefill_tokens for c in candidates)
    costs = [
        (c.rank, cost(c, isl=256, num_seq_hashes=16, block_size=16, config=config, min_active_prefill=least))
        for c in candidates
    ]
    chosen = cheapest(
        candidates, isl=256, num_seq_hashes=16, block_size=16, config=config, preferred_taints={}, draw=draw
    )
    assert chosen.rank == pick(costs, temperature=temperature, draw=draw)
