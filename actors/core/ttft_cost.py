"""The ``kv_ttft`` routing mode: each eligible rank's predicted time to first token, and the pick. Pure.

For a prompt of ``isl`` tokens and a candidate rank, with that rank's prefill rates (``ttft_model.py``: per
pass, per token, and per pass at a full KV cache of decoding sequences)::

    cached     = min(effective cached tokens * overlap_factor, cacheable)   # tier-weighted, drift-discounted
    new        = isl - cached                                               # the prompt's own uncached tokens
    queued     = prefill tokens booked on the rank and not computed yet (below)
    in_flight  = in_flight_ms(min(queued, batch_tokens))    if the rank runs any request, else 0
    queue_ms   = in_flight + compute_ms(queued + new) - compute_ms(new)
    prefill_ms = compute_ms(new)
    decode_ms  = decode_ms(queued + new, decode_share)
    ttft_ms    = queue_ms + prefill_ms + decode_ms                          # the prediction
    load_ms    = LOAD_FACTOR * live_tokens * ms_per_token
    cost       = ttft_ms + load_ms

``effective cached tokens`` is the ``kv`` cost's (device blocks, lower tiers at their hit weights);
``cacheable`` is ``((isl - 1) // block_size) * block_size`` (an engine always computes the last token).
``decode_share`` is the rank's active decode blocks over its ``total_kv_blocks`` (0 when the record does not
give it); ``live_tokens`` is its active decode blocks times the block size. ``queued`` is the rank's active
prefill tokens less what it has computed of them since it started on the oldest (the later of that booking
and the rank's previous prefill completion), at its full-pass rate, but never less than the tokens booked
behind the oldest one. ``in_flight`` is half of the pass a busy rank is running when the request arrives.

``load_ms`` is not part of the prediction: it stands for the rank's live sequences, which keep its batches
large and, in multi-turn and agent traffic, come back to it with their next turn. Without it the cheapest rank
for each request in turn can leave whole ranks cold: once a shared prefix is cached on some ranks, a cold rank
looks slower for every single request even while the warm ones queue (``docs/routing.md``, the ablation).

The pick: the lowest cost; every rank within ``max(TIE_MS, TIE_FRACTION * lowest)`` of it is a near tie, and
among near ties the one with the most cached tokens wins (what it holds now is what later requests of the same
prefix will find), then the lowest cost, then the shell's seeded draw among exact ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import RankCandidate, effective_cached_tokens
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.ttft_model import DEFAULT_BATCH_TOKENS, NO_VIEW, RankTiming, TtftView

TIE_MS = 2.0  # costs this close are a tie whatever their size
TIE_FRACTION = 0.05  # ... and so are costs within this fraction of the lowest
LOAD_FACTOR = 0.1  # the load term: this share of the time the rank would take to prefill what its live sequences hold


class TtftTerms(NamedTuple):
    """One rank's prediction, in milliseconds, with the token counts it came from."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    load_ms: float
    cached_tokens: int  # after the drift discount
    new_tokens: int
    queued_tokens: int  # prefill tokens still ahead of it, as estimated
    tokens_per_s: float  # the rank's fitted full-pass prefill rate
    samples: int  # completions its rates were fitted from (0: the prior)
    overlap_factor: float

    @property
    def ttft_ms(self) -> float:
        """The predicted time to first token."""
        return self.queue_ms + self.prefill_ms + self.decode_ms

    @property
    def cost_ms(self) -> float:
        """The cost: the predicted time to first token and what it costs the requests that follow."""
        return self.queue_ms + self.prefill_ms + self.decode_ms + self.load_ms


def predict(
    state: ScopeState,
    candidate: RankCandidate,
    timing: RankTiming,
    *,
    isl: int,
    block_size: int,
    config: RouterConfig,
    at: int,
    view: TtftView = NO_VIEW,
) -> TtftTerms:
    """``candidate``'s predicted time to first token for this prompt (see the module doc)."""
    record = state.selection.catalog.get(candidate.rank.worker_id)
    batch = (record.max_num_batched_tokens if record is not None else None) or DEFAULT_BATCH_TOKENS
    kv_blocks = record.total_kv_blocks if record is not None else None
    share = min(1.0, candidate.active_decode_blocks / kv_blocks) if kv_blocks else 0.0
    rates = timing.rates
    cacheable = max(0, (isl - 1) // block_size * block_size) if block_size > 0 else 0
    cached = min(int(effective_cached_tokens(candidate.overlap, config, block_size) * timing.overlap_factor), cacheable)
    new = isl - cached
    queued = in_flight = 0.0
    if view.queue_term:
        queued = _queued_tokens(state, candidate, timing, at, batch, share)
        if candidate.active_requests:  # it is running passes: the one in flight ends first
            in_flight = rates.in_flight_ms(min(queued, batch), share)
    own = rates.compute_ms(new, batch)
    live_tokens = candidate.active_decode_blocks * block_size
    return TtftTerms(
        queue_ms=in_flight + rates.compute_ms(queued + new, batch) - own,
        prefill_ms=own,
        decode_ms=rates.decode_ms(queued + new, batch, share),
        load_ms=LOAD_FACTOR * live_tokens * rates.ms_per_token if view.load_term else 0.0,
        cached_tokens=cached,
        new_tokens=new,
        queued_tokens=round(queued),
        tokens_per_s=rates.tokens_per_s(batch),
        samples=timing.samples,
        overlap_factor=timing.overlap_factor,
    )


def _queued_tokens(
    state: ScopeState, candidate: RankCandidate, timing: RankTiming, at: int, batch: int, share: float
) -> float:
    """The rank's booked prefill tokens not yet computed: booked minus progress since it started the oldest."""
    queued = candidate.active_prefill_tokens
    if queued <= 0:
        return 0.0
    rank = state.slots.ranks.get(candidate.rank)
    if rank is None or not rank.prefill:
        return float(queued)
    oldest_id = next(iter(rank.prefill))
    oldest = state.slots.requests.get(oldest_id)
    started = oldest.started_at if oldest is not None else at
    if timing.last_prefill_done_at is not None and timing.last_prefill_done_at > started:
        started = timing.last_prefill_done_at
    elapsed_ms = max(0, at - started) / 1e6
    rates = timing.rates
    ms_per_token = rates.ms_per_token + (rates.ms_per_pass + rates.decode_ms_per_pass * share) / batch
    done = elapsed_ms / ms_per_token
    behind = queued - rank.prefill[oldest_id]
    return float(max(queued - done, behind, 0))


def fastest(
    state: ScopeState,
    kept: Sequence[RankCandidate],
    *,
    isl: int,
    block_size: int,
    config: RouterConfig,
    view: TtftView | None,
    at: int,
    draw: float,
) -> tuple[RankCandidate, TtftTerms]:
    """The ``kv_ttft`` pick among the eligible ranks and its prediction (see the module doc)."""
    view = view or NO_VIEW
    scored = [
        (
            c,
            predict(
                state,
                c,
                view.timing(c.rank),
                isl=isl,
                block_size=block_size,
                config=config,
                at=at,
                view=view,
            ),
        )
        for c in kept
    ]
    index = pick_fastest([(c.rank, t.cost_ms, t.cached_tokens) for c, t in scored], draw=draw)
    return scored[index]


def pick_fastest(rows: Sequence[tuple[WorkerRank, float, int]], *, draw: float) -> int:
    """Index of the chosen row among ``(rank, ttft_ms, cached_tokens)`` rows (see the module doc); ``draw`` in
    [0, 1) splits exact ties in rank order, so the result does not depend on the rows' order."""
    if not rows:
        raise ValueError("pick_fastest needs at least one candidate")
    best = min(ttft for _, ttft, _ in rows)
    bound = best + max(TIE_MS, TIE_FRACTION * best)
    near = [i for i, (_, ttft, _) in enumerate(rows) if ttft <= bound]
    most = max(rows[i][2] for i in near)
    near = [i for i in near if rows[i][2] == most]
    quickest = min(rows[i][1] for i in near)
    tied = sorted((rows[i][0], i) for i in near if rows[i][1] == quickest)
    return tied[min(int(draw * len(tied)), len(tied) - 1)][1]
