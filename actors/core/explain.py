"""Why a selection chose what it chose: every candidate's overlap per tier, load terms and cost, and the reason.

Derived data, never journaled: the shell asks for it only when someone wants it (a ``/ws/decisions``
subscriber, or ``"explain": true`` in the request), on the same state and command the decision is made from,
so it retraces the decision's own steps (``selection_rules.decide_select``) with the same functions. Pure.

Reasons (``reason``), in the order they are tested:

* ``constraint``: a rule, not the cost, chose: ``pinned_worker``, ``affinity_target``, a session's bound rank
  (``session``), a router mode other than ``kv`` (``router_mode``), or one eligible rank left
  (``only_eligible``: the partition's only rank, or the request's allowed workers, required taints, or busy
  thresholds left one); ``rule`` names which;
* ``tie``: several eligible ranks shared the lowest cost and the random draw picked one;
* ``cache``: the chosen rank holds more of the prompt (effective cached tokens) than some other eligible rank;
* ``load``: otherwise: it won on load alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvrouter.actors.core.admission import not_busy
from kvrouter.actors.core.commands import SelectWorker
from kvrouter.actors.core.constraints import RoutingConstraints, can_decode
from kvrouter.actors.core.decisions import Rejected
from kvrouter.actors.core.explanation import CACHE, CONSTRAINT, LOAD, TIE, CandidateTerms, Explanation, TtftBreakdown
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.routing_modes import COST_MODES, MODE_KV_TTFT
from kvrouter.actors.core.selection import (
    RankCandidate,
    cost,
    effective_cached_tokens,
    effective_prefill_tokens,
    eligible,
    potential_decode_blocks,
)
from kvrouter.actors.core.selection_queries import candidates, selection_input
from kvrouter.actors.core.selection_rules import _affinity_target, with_workers
from kvrouter.actors.core.session_rules import preferred_rank
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.ttft_cost import predict
from kvrouter.actors.core.ttft_model import NO_VIEW


def explain_selection(state: ScopeState, command: SelectWorker) -> Explanation | None:
    """The candidates and their terms for ``command`` in ``state`` (before it is decided); None when the
    selection is refused before any rank is weighed (no schedulable worker, a malformed prompt)."""
    config = command.config
    request = selection_input(state, command.prompt, config.use_kv_events, queueing=config.queueing)
    if isinstance(request, Rejected):
        return None
    serving = with_workers(request, can_decode)
    if serving is None:
        return None
    options = command.options
    found = candidates(state, serving, predicted_ranks=command.predicted_ranks, all_predicted=not config.use_kv_events)
    pinned = WorkerRank(*options.pinned_worker) if options.pinned_worker is not None else None
    constraints = RoutingConstraints(options.required_taints, options.preferred_taints)
    targeted, allowed = _affinity_target(found, options, constraints)
    kept = eligible(targeted, allowed_worker_ids=allowed, required_taints=constraints.required, pinned=pinned)
    free = not_busy(kept, state.selection.catalog, config) if isinstance(kept, list) else []
    free = free if isinstance(free, list) else []
    free_ranks = {c.rank for c in free}
    rule = _rule(state, command, found, free, pinned, allowed is not options.allowed_worker_ids)
    prompt = serving.prompt
    isl, block_size = prompt.isl_tokens, serving.block_size
    num_seq_hashes = len(prompt.sequence_hashes) if config.router_track_active_blocks else 0
    scored = config.router_mode in COST_MODES and bool(free)
    min_prefill = min((c.active_prefill_tokens for c in free), default=0)
    preferred = dict(constraints.preferred)
    rows = []
    for c in found:
        cached = effective_cached_tokens(c.overlap, config, block_size)
        rank_cost: float | None = None
        breakdown: TtftBreakdown | None = None
        if scored and c.rank in free_ranks and config.router_mode == MODE_KV_TTFT:
            breakdown = _ttft_breakdown(state, c, command, isl, block_size)
            rank_cost = breakdown.cost_ms
        elif scored and c.rank in free_ranks:
            rank_cost = cost(
                c,
                isl=isl,
                num_seq_hashes=num_seq_hashes,
                block_size=block_size,
                config=config,
                min_active_prefill=min_prefill,
                preferred_taints=preferred,
            )
        rows.append(
            CandidateTerms(
                c.rank.worker_id,
                c.rank.dp_rank,
                c.overlap.device,
                c.overlap.host_ext,
                c.overlap.disk_ext,
                c.overlap.external_ext,
                cached,
                effective_prefill_tokens(isl, cached),
                c.active_prefill_tokens,
                c.active_decode_blocks,
                c.active_requests,
                potential_decode_blocks(c.active_decode_blocks, num_seq_hashes, c.prompt_overlap_depth),
                rank_cost,
                None if c.rank in free_ranks else _exclusion(c, targeted, kept, pinned, allowed, constraints),
                breakdown,
            )
        )
    return Explanation(config.router_mode, config.router_temperature, isl, block_size, rows, rule)


def _ttft_breakdown(
    state: ScopeState, candidate: RankCandidate, command: SelectWorker, isl: int, block_size: int
) -> TtftBreakdown:
    """``kv_ttft``'s terms for one rank, as the selection computes them (``actors/core/ttft_cost.py``)."""
    view = command.ttft or NO_VIEW
    terms = predict(
        state,
        candidate,
        view.timing(candidate.rank),
        isl=isl,
        block_size=block_size,
        config=command.config,
        at=command.at,
        view=view,
    )
    return TtftBreakdown(
        queue_ms=round(terms.queue_ms, 3),
        prefill_ms=round(terms.prefill_ms, 3),
        decode_ms=round(terms.decode_ms, 3),
        ttft_ms=round(terms.ttft_ms, 3),
        load_ms=round(terms.load_ms, 3),
        cost_ms=round(terms.cost_ms, 3),
        cached_tokens=terms.cached_tokens,
        queued_tokens=terms.queued_tokens,
        tokens_per_s=round(terms.tokens_per_s, 1),
        fit_samples=terms.samples,
        overlap_factor=round(terms.overlap_factor, 4),
    )


def _rule(
    state: ScopeState,
    command: SelectWorker,
    found: Sequence[RankCandidate],
    free: Sequence[RankCandidate],
    pinned: WorkerRank | None,
    targeted: bool,
) -> str | None:
    options = command.options
    if pinned is not None:
        return "pinned_worker"
    if targeted:
        return "affinity_target"
    explicit = options.affinity_target is not None
    session_id = options.session_id if command.config.affinity_ttl_ns > 0 and not explicit else None
    bound = preferred_rank(state.selection, session_id, command.at, state.slots.requests)
    if bound is not None and any(c.rank == bound for c in free):
        return "session"
    if command.config.router_mode not in COST_MODES:
        return "router_mode"
    if len(free) == 1:
        return "only_eligible"
    return None


def _exclusion(
    candidate: RankCandidate,
    targeted: Sequence[RankCandidate],
    kept: object,
    pinned: WorkerRank | None,
    allowed: frozenset[int] | None,
    constraints: RoutingConstraints,
) -> str:
    if candidate not in targeted:
        return "affinity_target"
    if allowed is not None and candidate.rank.worker_id not in allowed:
        return "allowed_worker_ids"
    if pinned is not None and candidate.rank != pinned:
        return "pinned_worker"
    if not constraints.required <= candidate.taints:
        return "required_taints"
    return "busy" if isinstance(kept, list) else "ineligible"


def finish(explanation: Explanation, chosen: WorkerRank) -> Explanation:
    """``explanation`` with the rank the decision took and the reason (see the module doc)."""
    rows = explanation.candidates
    if explanation.rule is not None:
        reason = CONSTRAINT
    else:
        chosen_row = next((r for r in rows if (r.worker_id, r.dp_rank) == chosen), None)
        costs = [r.cost for r in rows if r.cost is not None]
        if chosen_row is None or chosen_row.cost is None:
            reason = CONSTRAINT
        elif chosen_row.cost == min(costs) and costs.count(chosen_row.cost) > 1:
            reason = TIE
        else:
            others = [r.cached_tokens for r in rows if r.cost is not None and r is not chosen_row]
            reason = CACHE if others and chosen_row.cached_tokens > min(others) else LOAD
    return attrs.evolve(explanation, worker_id=chosen[0], dp_rank=chosen[1], reason=reason)
