"""The explanation of a selection, as data (``actors/core/explain.py`` derives it): what ``"explain": true``
adds to a ``/select`` reply and what ``GET /ws/decisions`` sends. Never journaled."""

from __future__ import annotations

import attrs

CACHE, LOAD, TIE, CONSTRAINT = "cache", "load", "tie", "constraint"


@attrs.frozen
class TtftBreakdown:
    """``kv_ttft``'s prediction for one rank (``actors/core/ttft_cost.py``): its terms in milliseconds (the time to
    first token is queue + prefill + decode; the cost adds load) and what they came from: cached tokens after the
    drift discount, prefill tokens still queued ahead, the rank's fitted prefill rate (tokens/s at full passes),
    the completions it was fitted from (0: the prior), the drift discount."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    load_ms: float
    cost_ms: float
    cached_tokens: int
    queued_tokens: int
    tokens_per_s: float
    fit_samples: int
    overlap_factor: float


@attrs.frozen
class CandidateTerms:
    """One rank as the selection weighed it. Overlap in blocks per tier (``host``/``disk``/``external``:
    how far each lower tier extends the device match); ``cost`` None when it was not scored (excluded, or a
    mode without a cost); ``excluded`` names the rule that left it out."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    external_blocks: int
    cached_tokens: int  # effective: lower tiers weighted by their hit weights
    new_prefill_tokens: int  # prompt tokens it would still compute
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int
    potential_decode_blocks: int
    cost: float | None  # kv: the cost in blocks; kv_ttft: predicted time to first token + load, in ms
    excluded: str | None = None
    ttft: TtftBreakdown | None = None  # kv_ttft only


@attrs.frozen
class Explanation:
    router_mode: str
    temperature: float
    isl_tokens: int
    block_size: int
    candidates: list[CandidateTerms]
    rule: str | None = None  # set when a rule rather than the cost chose (see the module doc)
    # Filled in once the decision is known (``finish``):
    worker_id: int | None = None
    dp_rank: int | None = None
    reason: str | None = None
