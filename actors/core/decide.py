"""decide(state, command) -> Accepted(events) | Rejected: validation and rules, pure.

It never mutates ``state``. Rules and messages follow the reference slot tracker (behaviour.md#slot-accounting), with
``tenant_id`` naming the scope field.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import singledispatch
from typing import Any

from kvrouter.actors.core import disaggregation, predictions, selection_rules, session_rules
from kvrouter.actors.core.commands import (
    AddRequest,
    Command,
    CompletePrefill,
    ExpireStale,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.events import (
    Event,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    WorkerRegistered,
    WorkerUnregistered,
)
from kvrouter.actors.core.ids import U32_MAX, U64_MASK, WorkerRank
from kvrouter.actors.core.limits import (
    MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE,
    MAX_ACTIVE_REQUESTS_PER_SCOPE,
    MAX_RANKS_PER_SCOPE,
    MAX_RANKS_PER_WORKER,
)
from kvrouter.actors.core.state import ScopeState

MAX_DP_SIZE = MAX_RANKS_PER_WORKER  # the reference's cap on one registration's DP range


def decide(state: ScopeState, command: Command) -> Decision:
    rule = _RULES.get(command.__class__)
    if rule is None:
        rule = _RULES[command.__class__] = _decide.dispatch(command.__class__)
    return rule(command, state)


# Each command class's rule, as ``_decide`` dispatches it: a plain dict lookup per command instead of
# singledispatch's weak-keyed cache and wrapper (~0.5 µs, on every write). Bounded by the command classes.
_RULES: dict[type, Callable[[Any, ScopeState], Decision]] = {}


def describe_rank(rank: WorkerRank) -> str:
    """The reference's spelling of a rank in messages (Rust Debug of WorkerWithDpRank)."""
    return f"WorkerWithDpRank {{ worker_id: {rank.worker_id}, dp_rank: {rank.dp_rank} }}"


def no_tracker(state: ScopeState) -> Rejected:
    return Rejected(Reason.NOT_FOUND, f"no slot tracker for {state.scope.describe()}")


@singledispatch
def _decide(command: Command, state: ScopeState) -> Decision:
    raise TypeError(f"no rule for {type(command).__name__}")


@_decide.register
def _register(command: RegisterWorker, state: ScopeState) -> Decision:
    if command.block_size <= 0:
        return Rejected(Reason.INVALID, "block_size must be greater than 0")
    if command.dp_size <= 0:
        return Rejected(Reason.INVALID, "dp_size must be greater than 0")
    if command.dp_size > MAX_DP_SIZE:
        return Rejected(Reason.INVALID, f"dp_size {command.dp_size} exceeds the maximum {MAX_DP_SIZE}")
    if command.dp_start + command.dp_size > U32_MAX:
        return Rejected(Reason.INVALID, f"dp range overflows u32: start={command.dp_start} size={command.dp_size}")
    slots = state.slots
    if command.worker_id not in slots.workers:
        if len(slots.ranks) + command.dp_size > MAX_RANKS_PER_SCOPE:
            return selection_rules.scope_full(state, len(slots.ranks), command.dp_size)
        service_full = selection_rules.service_refusal(state, command.ranks_elsewhere, 0, command.dp_size)
        if service_full is not None:
            return service_full
    if slots.block_size is not None and slots.block_size != command.block_size:
        return Rejected(
            Reason.CONFLICT,
            f"block_size mismatch for {state.scope.describe()}: "
            f"existing={slots.block_size}, requested={command.block_size}",
        )
    if command.worker_id in slots.workers:
        return Rejected(Reason.CONFLICT, f"worker {command.worker_id} already registered for {state.scope.describe()}")
    event = WorkerRegistered(command.worker_id, command.block_size, command.dp_start, command.dp_size)
    return Accepted((event,), created=True)


@_decide.register
def _unregister(command: UnregisterWorker, state: ScopeState) -> Decision:
    if command.worker_id not in state.slots.workers:
        return Rejected(Reason.NOT_FOUND, f"worker {command.worker_id} not found for {state.scope.describe()}")
    return Accepted((WorkerUnregistered(command.worker_id),))


@_decide.register
def _add(command: AddRequest, state: ScopeState) -> Decision:
    slots = state.slots
    if not (slots.workers or state.exists):  # (a scope with workers exists: the property only when it has none)
        return no_tracker(state)
    loads = slots.ranks.get((command.worker_id, command.dp_rank))  # type: ignore[call-overload]  # a WorkerRank is this
    if loads is None:
        return Rejected(
            Reason.NOT_FOUND,
            f"Worker {describe_rank(WorkerRank(command.worker_id, command.dp_rank))} not found",
        )
    existing = slots.requests.get(command.request_id)
    if existing is not None:
        return Rejected(
            Reason.CONFLICT,
            f"Request {command.request_id} already exists (assigned to worker {describe_rank(existing.rank)})",
        )
    if loads.prefill_tokens + command.isl_tokens > U64_MASK:
        # The reference wraps and then panics on this rank; kvrouter refuses the request instead.
        return Rejected(
            Reason.INVALID,
            f"new_isl_tokens {command.isl_tokens} would overflow the prefill load of {describe_rank(loads.key)}",
        )
    hashes = command.sequence_hashes
    # The per-scope caps on active requests, inline (every streamed /add passes here); the refusal says which.
    if (
        len(slots.requests) >= MAX_ACTIVE_REQUESTS_PER_SCOPE
        or slots.prompt_blocks + len(hashes) > MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE
    ):
        return selection_rules.bookings_full(state, 1, len(hashes))
    isl_tokens = command.isl_tokens
    event = RequestAdded(
        command.request_id,
        command.worker_id,
        command.dp_rank,
        hashes,
        isl_tokens if isl_tokens > 0 else 0,
        command.at,
    )
    return Accepted((event,), True)


@_decide.register
def _complete_prefill(command: CompletePrefill, state: ScopeState) -> Decision:
    slots = state.slots
    if not (slots.workers or state.exists):
        return no_tracker(state)
    request = slots.requests.get(command.request_id)
    if request is None:
        return Rejected(Reason.NOT_FOUND, f"Request {command.request_id} not found")
    if command.request_id not in slots.ranks[request.rank].prefill:
        return NOTHING_CHANGED  # repeated completion, or a request without prefill tracking
    return Accepted((PrefillCompleted(command.request_id),))


@_decide.register
def _free(command: FreeRequest, state: ScopeState) -> Decision:
    if not (state.slots.workers or state.exists):
        return no_tracker(state)
    if command.request_id not in state.slots.requests:
        return NOTHING_CHANGED  # idempotent; an early free is forgotten, as in the reference
    if command.request_id in state.selection.session_of:  # a selection-service booking bound to a session
        ended = session_rules.released(state.selection, (command.request_id,), command.at)
        return Accepted((RequestFreed(command.request_id), *ended))
    return Accepted((RequestFreed(command.request_id),))


@_decide.register
def _expire(command: ExpireStale, state: ScopeState) -> Decision:
    cutoff = command.at - command.max_age_ns
    stale = tuple(r.request_id for r in state.slots.requests.values() if r.started_at < cutoff)
    events: list[Event] = [RequestsExpired(stale, command.at)] if stale else []
    events.extend(session_rules.released(state.selection, stale, command.at))
    events.extend(predictions.lapsed(state.selection, command.at))
    events.extend(session_rules.expired(state, command.at))
    return Accepted(tuple(events)) if events else NOTHING_CHANGED


# The selection service's rules live in their own module and share this dispatcher.
_decide.register(selection_rules.decide_upsert)
_decide.register(selection_rules.decide_remove)
_decide.register(selection_rules.decide_ingest)
_decide.register(selection_rules.decide_reset)
_decide.register(selection_rules.decide_recover)
_decide.register(selection_rules.decide_select)
_decide.register(selection_rules.decide_reserve)
_decide.register(selection_rules.decide_reserve_selection)
_decide.register(selection_rules.decide_output_block)
_decide.register(selection_rules.decide_reservation_prefill)
_decide.register(selection_rules.decide_release)
_decide.register(selection_rules.decide_free_rank)
_decide.register(session_rules.decide_bind_session)
_decide.register(disaggregation.decide_select_disaggregated)
