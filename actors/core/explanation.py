"""The explanation of a selection, as data (``actors/core/explain.py`` derives it): what ``"explain": true``
adds to a ``/select`` reply and what ``GET /ws/decisions`` sends. Never journaled."""

from __future__ import annotations

import attrs

CACHE, LOAD, TIE, CONSTRAINT = "cache", "load", "tie", "constraint"


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
    cost: float | None
    excluded: str | None = None


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
