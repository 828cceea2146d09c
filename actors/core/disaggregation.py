"""Disaggregated prefill/decode selection: one request, a prefill rank and a decode rank, booked together. Pure.

The seed's "Disaggregated Serving" and ``topology-aware-kv-transfer.md``, behaviour.md#constraints-and-disaggregation:

1. The prefill stage picks among the workers that can prefill (``worker_role`` prefill or both) with the
   KV-aware cost; its booking tracks prefill tokens and holds no decode blocks (a prefill worker does not
   decode: the prefill router runs with active-block tracking off).
2. The decode constraint is derived from the chosen prefill worker's ``kv_transfer_domain`` (see
   ``actors/core/constraints.py``) and merged into the request's own constraints. A ``required`` policy that
   cannot be derived fails the request here, before anything is booked.
3. The decode stage picks among the workers that can decode (decode or both) on load alone: no overlap
   credit in any tier, no prefill tokens (the KV cache arrives by transfer; the prefill was booked on the
   prefill worker). Its booking holds the prompt's decode blocks.
4. Both bookings are events of one decision, so one journal record: both or neither survive a crash. They
   are two reservations, ``<id>:prefill`` and ``<id>:decode``, each with the usual lifecycle routes.

When no prefill rank is available (no prefill-capable worker, the request's constraints exclude them all, or
every one is busy by the overload thresholds), the request falls back to decode only, as the seed says: one
booking, ``<id>:decode``, chosen and booked like an aggregated selection (KV-aware, prefill tracked) among
the decode-capable workers. A disaggregated selection never waits in the queue: when every decode rank is
busy it is refused (429).
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import SelectDisaggregated
from kvrouter.actors.core.constraints import (
    NO_CONSTRAINTS,
    RoutingConstraints,
    can_decode,
    can_prefill,
    decode_constraint,
)
from kvrouter.actors.core.decisions import Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.routing_modes import MODE_DIRECT, MODE_KV, MODE_KV_TTFT
from kvrouter.actors.core.selection import NO_ENDPOINTS
from kvrouter.actors.core.selection_queries import SelectionInput, candidates, selection_input
from kvrouter.actors.core.selection_rules import (
    Selection,
    already_reserved,
    booked_blocks,
    booked_prefill,
    booking_events,
    booking_refusal,
    choose_rank,
    prefill_overflow,
    selection_of,
    tracked_output,
    with_workers,
)
from kvrouter.actors.core.state import ScopeState

PREFILL_PART = "prefill"
DECODE_PART = "decode"

NO_DECODE_WORKERS = f"{NO_ENDPOINTS}: no schedulable worker can decode (every one has worker_role prefill)"
DIRECT_NOT_DISAGGREGATED = (
    "router_mode direct is not available for a disaggregated selection (it picks two workers); "
    "use POST /select_and_reserve with pinned_worker, or another router_mode"
)


def part_id(reservation_id: str, part: str) -> str:
    """The reservation id of one part: ``req-1:prefill``, ``req-1:decode``."""
    return f"{reservation_id}:{part}"


def prefill_stage_config(config: RouterConfig) -> RouterConfig:
    """The prefill stage: KV-aware, prefill tokens as configured, no decode blocks and so no output blocks."""
    return attrs.evolve(config, router_track_active_blocks=False, router_track_output_blocks=False)


def decode_stage_config(config: RouterConfig) -> RouterConfig:
    """The decode stage: load only. No overlap credit from any tier and no prefill tokens tracked; ``kv_ttft``
    (a prediction of the prefill) decodes with ``kv``'s load terms."""
    return attrs.evolve(
        config,
        router_mode=MODE_KV if config.router_mode == MODE_KV_TTFT else config.router_mode,
        overlap_score_credit=0.0,
        overlap_score_credit_decay=0.0,
        host_cache_hit_weight=0.0,
        disk_cache_hit_weight=0.0,
        shared_cache_multiplier=0.0,
        router_track_prefill_tokens=False,
    )


@attrs.frozen
class DisaggregatedSelection:
    """What a disaggregated selection chose and booked."""

    reservation_id: str
    prefill: Selection | None  # None: decode only (fallback_reason says why)
    decode: Selection
    decode_constraints: RoutingConstraints  # the decode stage's, the request's own merged with the derived one
    fallback_reason: str | None = None


def decide_select_disaggregated(command: SelectDisaggregated, state: ScopeState) -> Decision:
    config = command.config
    request = selection_input(state, command.prompt, config.use_kv_events, queueing=config.queueing)
    if isinstance(request, Rejected):
        return request
    if config.router_mode == MODE_DIRECT:
        return Rejected(Reason.INVALID, DIRECT_NOT_DISAGGREGATED)
    reservation_id = command.reservation_id
    if reservation_id is None:
        return Rejected(Reason.INVALID, "a disaggregated selection needs a reservation id")
    prefill_id = part_id(reservation_id, PREFILL_PART)
    decode_id = part_id(reservation_id, DECODE_PART)
    for booked in (prefill_id, decode_id):
        if booked in state.slots.requests:
            return already_reserved(booked)
    decode_pool = with_workers(request, can_decode)
    if decode_pool is None:
        return Rejected(Reason.UNAVAILABLE, NO_DECODE_WORKERS)
    options = command.options
    own = RoutingConstraints(options.required_taints, options.preferred_taints)

    prefill: Selection | None = None
    fallback: str | None = None
    prefill_config = prefill_stage_config(config)
    prefill_pool = with_workers(request, can_prefill)
    if prefill_pool is None:
        fallback = "no schedulable worker can prefill (worker_role prefill or both)"
    else:
        chosen = _select_stage(state, command, prefill_pool, own, prefill_config, command.draw, prefill_id)
        if isinstance(chosen, Rejected):
            if chosen.reason not in (Reason.UNAVAILABLE, Reason.OVERLOADED):
                return chosen
            fallback = f"no prefill rank is available ({chosen.message})"
        else:
            prefill = chosen

    if prefill is None:
        decode_config, derived = config, NO_CONSTRAINTS  # decode only: the decode worker prefills too
    else:
        derivation = decode_constraint(state.selection.catalog[prefill.worker_id])
        if isinstance(derivation, str):
            return Rejected(Reason.UNAVAILABLE, derivation)  # fail closed: nothing is booked
        decode_config, derived = decode_stage_config(config), derivation
    constraints = own.merged(derived)
    decode = _select_stage(state, command, decode_pool, constraints, decode_config, command.decode_draw, decode_id)
    if isinstance(decode, Rejected):
        if derived.required and decode.reason is Reason.UNAVAILABLE and prefill is not None:
            return Rejected(
                Reason.UNAVAILABLE,
                f"{NO_ENDPOINTS}: no eligible decode worker carries {derived.describe_required()}, which prefill "
                f"worker {prefill.worker_id}'s kv_transfer_domain requires",
            )
        return decode

    # Predicted blocks (a rank scored without KV events) go where the prompt is computed: the prefill rank, or
    # the decode rank when it prefills itself. The decode stage never scores cached blocks.
    parts = [selection for selection in (prefill, decode) if selection is not None]
    overflow = prefill_overflow(state, [booked_prefill(selection) for selection in parts]) or booking_refusal(
        state, len(parts), sum(booked_blocks(selection) for selection in parts)
    )
    if overflow is not None:
        return overflow
    events: list[Event] = []
    if prefill is not None:
        events.extend(booking_events(state, prefill, command.at, None))
    expected = tracked_output(decode_config, options.expected_output_tokens)
    events.extend(booking_events(state, decode, command.at, expected, predict=prefill is None))
    reply = DisaggregatedSelection(reservation_id, prefill, decode, constraints, fallback)
    return Accepted(tuple(events), created=True, reply=reply)


def _select_stage(
    state: ScopeState,
    command: SelectDisaggregated,
    pool: SelectionInput,
    constraints: RoutingConstraints,
    config: RouterConfig,
    draw: float,
    booking_id: str,
) -> Selection | Rejected:
    """One stage's choice (prefill or decode): score the pool's ranks, pick one, describe its booking."""
    found = candidates(
        state, pool, predicted_ranks=command.predicted_ranks, all_predicted=not command.config.use_kv_events
    )
    if command.out_ranks:
        found = [candidate for candidate in found if candidate.rank not in command.out_ranks]
    chosen = choose_rank(
        state,
        found,
        pool,
        command.options,
        constraints,
        pinned=None,
        config=config,
        draw=draw,
        turn=command.turn,
        at=command.at,
        ttft=command.ttft,
    )
    if isinstance(chosen, Rejected):
        return chosen
    return selection_of(state, pool, found, chosen, config, booking_id, predicted_ranks=command.predicted_ranks)
