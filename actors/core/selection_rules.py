"""decide() rules of the selection service: catalog, KV events, selection, reservations.

Registered on the same dispatcher as the slot tracker's rules (``actors/core/decide.py``), so one
actor, journal and recovery path serve both services. Pure: the random number a selection needs
arrives in the command (``SelectWorker.draw``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kvrouter.actors.core import predictions, session_rules
from kvrouter.actors.core.admission import not_busy
from kvrouter.actors.core.catalog import WorkerRecord, allow_list_refusal, not_schedulable_reasons, record_problem
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    CompleteReservationPrefill,
    FreeRankBookings,
    IngestKvBatch,
    RecoverKv,
    ReleaseReservation,
    RemoveWorker,
    Reserve,
    ReserveSelection,
    ResetKvStream,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.constraints import RoutingConstraints, catalog_problem
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.events import (
    Event,
    KvClearedOp,
    KvIndexed,
    KvOp,
    KvRemovedOp,
    KvStoredOp,
    KvStreamReset,
    OutputBlockAdded,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    WorkerRemoved,
    WorkerUpserted,
)
from kvrouter.actors.core.explanation import Explanation
from kvrouter.actors.core.ids import U64_MASK, WorkerRank
from kvrouter.actors.core.index_bounds import fit_ops, incoming_blocks, make_room, refused_event
from kvrouter.actors.core.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashedBlocksStored,
    hashed_blocks,
    stored_blocks,
)
from kvrouter.actors.core.limits import (
    MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE,
    MAX_ACTIVE_REQUESTS_PER_SCOPE,
    MAX_RANKS_PER_SCOPE,
    MAX_RANKS_PER_SERVICE,
    MAX_WORKERS_PER_SCOPE,
)
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.routing_modes import (
    DIRECT_NEEDS_PIN,
    MODE_DIRECT,
    MODE_KV,
    MODE_KV_TTFT,
    choose_without_cost,
)
from kvrouter.actors.core.selection import (
    NO_ENDPOINTS,
    RankCandidate,
    Refusal,
    cheapest,
    effective_cached_tokens,
    effective_prefill_tokens,
    eligible,
    overlap_summary,
    reported_decode_blocks,
)
from kvrouter.actors.core.selection_queries import SelectionInput, candidates, selection_input
from kvrouter.actors.core.session_rules import preferred_rank
from kvrouter.actors.core.slots import NO_OUTPUTS, expected_decay, output_block_count
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.ttft_cost import fastest, predict
from kvrouter.actors.core.ttft_model import NO_VIEW, RankTiming, TtftView
from kvrouter.actors.core.worker_endpoints import EndpointAllowList

REFUSAL_REASON = {Refusal.INVALID: Reason.INVALID, Refusal.UNAVAILABLE: Reason.UNAVAILABLE}


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
    approx_ttl_ns: int = 0  # > 0 on a predicted rank: a booking counts as cached this long
    # What a later booking of this selection (the replay form) needs to pin the session and prune predictions.
    session_id: str | None = None
    session_ttl_ns: int = 0
    writer_id: int = 0
    max_predicted_blocks: int = 2**20
    predicted_prune_target: int = 838_860
    track_active_blocks: bool = True  # False: the booking holds no decode blocks
    explanation: Explanation | None = None  # only when the request asked ("explain": true); never journaled
    predicted_ttft_ms: float | None = None  # kv_ttft: the chosen rank's predicted time to first token


def partition_block_size_after(state: ScopeState, record: WorkerRecord, use_kv_events: bool) -> int | None:
    """The first schedulable worker fixes a partition's block size; it stays for the partition's life, even
    once its last worker has left, and later workers are reconciled against it (as in 1.6.1)."""
    current = state.selection.partition_block_size
    if current is not None:
        return current
    if not not_schedulable_reasons(record, use_kv_events=use_kv_events, partition_block_size=None):
        return record.block_size
    return None


def upsert_refusal(
    state: ScopeState, record: WorkerRecord, ranks_elsewhere: int = 0, allow: EndpointAllowList | None = None
) -> Rejected | None:
    """Why ``record`` cannot enter ``state``'s catalog: invalid or outside the operator's allow-list of worker
    hosts (400), or the scope or the service is full (409). ``ranks_elsewhere``: what the service's other scopes
    count toward ``MAX_RANKS_PER_SERVICE``; ``allow``: ``--worker-endpoint-allow`` (None: any host)."""
    problem = record_problem(record) or allow_list_refusal(record, allow) or catalog_problem(record)
    if problem is not None:
        return Rejected(Reason.INVALID, problem)
    catalog = state.selection.catalog
    if record.worker_id not in catalog and len(catalog) >= MAX_WORKERS_PER_SCOPE:
        return Rejected(
            Reason.CONFLICT,
            f"{state.scope.describe()} already has {len(catalog)} workers, the limit per scope; remove one first",
        )
    slots = state.slots
    held = slots.workers.get(record.worker_id, (0, 0))[1]  # this worker's ranks now (replaced by the upsert)
    others = len(slots.ranks) - held
    if others + record.dp_size > MAX_RANKS_PER_SCOPE:
        return scope_full(state, others, record.dp_size)
    previous = catalog.get(record.worker_id)
    held_weight = (held or 1) if previous is not None else 0
    return service_refusal(state, ranks_elsewhere, held_weight, max(1, record.dp_size))


def service_weight(state: ScopeState) -> int:
    """What a scope counts toward ``MAX_RANKS_PER_SERVICE``: its ranks, and one per catalog worker holding none
    (a selection-service worker of ``data_parallel_size`` 0), so catalog records are bounded service-wide too."""
    return len(state.slots.ranks) + sum(1 for record in state.selection.catalog.values() if not record.dp_size)


def service_refusal(state: ScopeState, ranks_elsewhere: int, held: int, wanted: int) -> Rejected | None:
    """409 when replacing ``held`` of the scope's weight by ``wanted`` would take the service past its rank
    limit; a change that does not grow is always allowed."""
    if wanted <= held:
        return None
    total = ranks_elsewhere + service_weight(state)
    if total - held + wanted <= MAX_RANKS_PER_SERVICE:
        return None
    return Rejected(
        Reason.CONFLICT,
        f"the service holds {total} ranks in all scopes; {wanted - held} more would exceed the limit of "
        f"{MAX_RANKS_PER_SERVICE} ranks per service; unregister workers first",
    )


def scope_full(state: ScopeState, ranks: int, more: int) -> Rejected:
    return Rejected(
        Reason.CONFLICT,
        f"{state.scope.describe()} has {ranks} ranks; {more} more would exceed the limit of "
        f"{MAX_RANKS_PER_SCOPE} ranks per scope",
    )


def decide_upsert(command: UpsertWorker, state: ScopeState) -> Decision:
    record = command.record
    refusal = upsert_refusal(state, record, command.ranks_elsewhere, command.endpoint_allow)
    if refusal is not None:
        return refusal
    block_size = partition_block_size_after(state, record, command.use_kv_events)
    return Accepted((WorkerUpserted(record, block_size),), created=True)


def decide_remove(command: RemoveWorker, state: ScopeState) -> Decision:
    if command.worker_id not in state.selection.catalog:
        return Rejected(Reason.NOT_FOUND, f"worker {command.worker_id} not found")
    return Accepted((WorkerRemoved(command.worker_id),))


def decide_ingest(command: IngestKvBatch, state: ScopeState) -> Decision:
    """A rank's batch and those that followed it: one ``KvIndexed`` per run of batches placing their blocks on
    the same dp rank (ops in stream order, watermark at the run's last seq), under one check of the index cap."""
    selection, ranks = state.selection, state.slots.ranks
    record = selection.catalog.get(command.worker_id)
    if record is None:
        return NOTHING_CHANGED  # the worker left while its batch was in flight
    if WorkerRank(command.worker_id, command.dp_rank) not in ranks:
        return NOTHING_CHANGED  # the listener's rank left the worker's DP range meanwhile
    block_size = record.block_size or selection.partition_block_size or 0
    runs: list[tuple[int, int | None, list[KvOp]]] = []  # (dp rank, last seq, ops)
    incoming = 0
    known_rank = command.dp_rank  # a dp rank checked above: most batches name their listener's, or none
    for seq, batch in ((command.seq, command.batch), *command.following):
        dp_rank = batch.dp_rank if batch.dp_rank is not None else command.dp_rank
        if dp_rank != known_rank:
            if WorkerRank(command.worker_id, dp_rank) not in ranks:
                continue
            known_rank = dp_rank
        if runs and runs[-1][0] == dp_rank:
            ops = runs[-1][2]
            runs[-1] = (dp_rank, seq, ops)
        else:
            ops = []
            runs.append((dp_rank, seq, ops))
        for event in batch.events:
            if isinstance(event, BlockStored):
                blocks = stored_blocks(event, block_size)
                if blocks:
                    ops.append(KvStoredOp(int(event.tier), event.parent_hash, blocks))
                    incoming += len(blocks)
            elif isinstance(event, BlockRemoved):
                if event.block_hashes:
                    ops.append(KvRemovedOp(int(event.tier), event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                ops.append(KvClearedOp())
            elif isinstance(event, HashedBlocksStored):
                blocks = hashed_blocks(event)
                if blocks:
                    ops.append(KvStoredOp(int(event.tier), event.parent_hash, blocks))
                    incoming += len(blocks)
    if not runs:
        return NOTHING_CHANGED
    cap = command.max_index_blocks
    if selection.index.block_count() + incoming <= cap:
        return Accepted(
            tuple(KvIndexed(command.worker_id, dp, command.dp_rank, seq, tuple(ops)) for dp, seq, ops in runs)
        )
    trims, room = make_room(selection.index, cap, incoming)
    events: list[Event] = [*trims]
    for dp, seq, ops in runs:
        kept, refused = fit_ops(ops, room)
        room -= incoming_blocks(kept)
        events.append(KvIndexed(command.worker_id, dp, command.dp_rank, seq, kept))
        events.extend(refused_event(WorkerRank(command.worker_id, dp), refused))
    return Accepted(tuple(events))


def decide_recover(command: RecoverKv, state: ScopeState) -> Decision:
    runs = [run for run in command.runs if run.blocks]
    index = state.selection.index
    incoming = sum(len(run.blocks) for run in runs)
    trims: tuple[Event, ...] = ()
    room = incoming
    if index.block_count() + incoming > command.max_index_blocks:
        trims, room = make_room(index, command.max_index_blocks, incoming)
    events: list[Event] = []
    refused: dict[WorkerRank, int] = {}
    for run in runs:
        take = min(room, len(run.blocks))
        room -= take
        if take < len(run.blocks):
            rank = WorkerRank(run.worker_id, run.dp_rank)
            refused[rank] = refused.get(rank, 0) + len(run.blocks) - take
        if take:
            stored = KvStoredOp(run.tier, run.parent_hash, run.blocks[:take])
            events.append(KvIndexed(run.worker_id, run.dp_rank, run.dp_rank, None, (stored,)))
    for rank, blocks in sorted(refused.items()):
        events.extend(refused_event(rank, blocks))
    return Accepted((*trims, *events))


def decide_reset(command: ResetKvStream, state: ScopeState) -> Decision:
    if WorkerRank(command.worker_id, command.dp_rank) not in state.slots.ranks:
        return NOTHING_CHANGED
    return Accepted((KvStreamReset(command.worker_id, command.dp_rank),))


def decide_select(command: SelectWorker, state: ScopeState) -> Decision:
    config = command.config
    request = selection_input(state, command.prompt, config.use_kv_events, queueing=config.queueing)
    if isinstance(request, Rejected):
        return request
    options = command.options
    pinned = WorkerRank(*options.pinned_worker) if options.pinned_worker is not None else None
    if config.router_mode == MODE_DIRECT and pinned is None:
        return Rejected(Reason.INVALID, DIRECT_NEEDS_PIN)
    serving = decoding(state, request, config)
    if serving is None:
        return Rejected(Reason.UNAVAILABLE, ONLY_PREFILL_WORKERS)
    found = candidates(state, serving, predicted_ranks=command.predicted_ranks, all_predicted=not config.use_kv_events)
    if command.out_ranks and pinned is None:
        found = in_selection(found, command.out_ranks)
    # An explicit pinned_worker or affinity_target bypasses the session: it is neither preferred nor moved
    # (1.6.1, probed).
    explicit = pinned is not None or options.affinity_target is not None
    session_id = options.session_id if config.affinity_ttl_ns > 0 and not explicit else None
    chosen = choose_rank(
        state,
        found,
        serving,
        options,
        RoutingConstraints(options.required_taints, options.preferred_taints)
        if options.required_taints or options.preferred_taints
        else NO_CONSTRAINTS,
        pinned=pinned,
        config=config,
        draw=command.draw,
        turn=command.turn,
        at=command.at,
        session_id=session_id,
        ttft=command.ttft,
    )
    if isinstance(chosen, Rejected):
        booked = command.reservation_id or ""
        if chosen.reason is Reason.OVERLOADED and command.reserve and booked in state.slots.requests:
            return already_reserved(booked)  # it would wait in the queue for nothing, then get 429
        return chosen
    selection = selection_of(
        state,
        serving,
        found,
        chosen,
        config,
        command.reservation_id if command.reserve else None,
        predicted_ranks=command.predicted_ranks,
        session_id=session_id,
        writer_id=command.writer_id,
    )
    if config.router_mode == MODE_KV_TTFT:
        selection = attrs.evolve(selection, predicted_ttft_ms=predicted_ttft(state, serving, chosen, command))
    if not command.reserve:
        return Accepted(reply=selection)
    reservation_id = command.reservation_id or ""
    if reservation_id in state.slots.requests:
        return already_reserved(reservation_id)
    overflow = prefill_overflow(state, [booked_prefill(selection)]) or booking_refusal(
        state, 1, booked_blocks(selection)
    )
    if overflow is not None:
        return overflow
    events = booking_events(state, selection, command.at, tracked_output(config, options.expected_output_tokens))
    return Accepted(events, created=True, reply=selection)


def in_selection(found: list[RankCandidate], out: frozenset[WorkerRank]) -> list[RankCandidate]:
    """``found`` without the ranks taken out of selection (their KV-event stream stopped: ``kv_liveness``)."""
    return [candidate for candidate in found if candidate.rank not in out]


def decide_free_rank(command: FreeRankBookings, state: ScopeState) -> Decision:
    """Free every booking on a rank taken out of selection, in booking order; a rank without any: nothing."""
    loads = state.slots.ranks.get(WorkerRank(command.worker_id, command.dp_rank))
    if loads is None or not loads.requests:
        return NOTHING_CHANGED
    freed = tuple(loads.requests)
    ended = session_rules.released(state.selection, freed, command.at)
    return Accepted((*(RequestFreed(request_id) for request_id in freed), *ended))


def tracked_output(config: RouterConfig, expected_output_tokens: int | None) -> int | None:
    """What a booking keeps of ``expected_output_tokens``: with ``router_track_output_blocks`` its output blocks
    decay by it (``actors/core/slots.py``, ``expected_decay``), so it is stored; otherwise it is not needed."""
    return expected_output_tokens if config.router_track_output_blocks else None


# 503 text when the partition's only schedulable workers cannot decode (aggregated selections need one).
ONLY_PREFILL_WORKERS = (
    f"{NO_ENDPOINTS}: every schedulable worker has worker_role prefill (use POST /select_disaggregated)"
)


NO_CONSTRAINTS = RoutingConstraints()


def decoding(state: ScopeState, request: SelectionInput, config: RouterConfig) -> SelectionInput | None:
    """``with_workers(request, can_decode)`` for ``request`` from ``selection_input`` (whose workers are the
    partition's schedulable ones), from the partition's cached list of them."""
    decoders = state.selection.schedulable_decoders(config.use_kv_events, config.queueing)
    if decoders is request.workers:
        return request
    return attrs.evolve(request, workers=decoders) if decoders else None


def with_workers(request: SelectionInput, usable: Callable[[WorkerRecord], bool]) -> SelectionInput | None:
    """``request`` restricted to the workers ``usable`` accepts (by role), or None when none is left."""
    workers = tuple(record for record in request.workers if usable(record))
    if len(workers) == len(request.workers):
        return request
    return attrs.evolve(request, workers=workers) if workers else None


def choose_rank(
    state: ScopeState,
    found: list[RankCandidate],
    request: SelectionInput,
    options: SelectionOptions,
    constraints: RoutingConstraints,
    *,
    pinned: WorkerRank | None,
    config: RouterConfig,
    draw: float,
    turn: int,
    at: int,
    session_id: str | None = None,
    ttft: TtftView | None = None,
) -> RankCandidate | Rejected:
    """The rank a selection takes (behaviour.md#cost, #eligibility-busy-ranks-and-queueing,
    #constraints-and-disaggregation), or why there is none: the eligible ranks (allowed ids,
    required taints, pin, affinity target), minus busy ones; then a session's pinned rank while it is among them;
    else the router mode's pick (the cost function for ``kv``, the predicted time to first token for
    ``kv_ttft`` with the shell's prefill model ``ttft``)."""
    found, allowed = _affinity_target(found, options, constraints)
    kept = eligible(found, allowed_worker_ids=allowed, required_taints=constraints.required, pinned=pinned)
    if not isinstance(kept, list):
        return Rejected(REFUSAL_REASON[kept.reason], kept.message)
    free = not_busy(kept, state.selection.catalog, config)  # behaviour.md#eligibility-busy-ranks-and-queueing: busy
    # ranks are left out
    if isinstance(free, Rejected):
        return free
    preferred = preferred_rank(state.selection, session_id, at, state.slots.requests)
    if preferred is not None:
        chosen = next((c for c in free if c.rank == preferred), None)  # a pinned session's rank, while eligible
        if chosen is not None:
            return chosen
    if config.router_mode != MODE_KV:
        if config.router_mode == MODE_KV_TTFT:
            isl, block_size = request.prompt.isl_tokens, request.block_size
            return fastest(state, free, isl=isl, block_size=block_size, config=config, view=ttft, at=at, draw=draw)[0]
        chosen_rank = choose_without_cost(config.router_mode, free, draw=draw, turn=turn)
        return next(c for c in free if c.rank == chosen_rank)
    prompt = request.prompt
    # Without active-block tracking a booking adds no decode blocks, so none are projected either.
    num_seq_hashes = len(prompt.sequence_hashes) if config.router_track_active_blocks else 0
    return cheapest(
        free,
        isl=prompt.isl_tokens,
        num_seq_hashes=num_seq_hashes,
        block_size=request.block_size,
        config=config,
        preferred_taints=dict(constraints.preferred),
        draw=draw,
    )


def predicted_ttft(state: ScopeState, request: SelectionInput, chosen: RankCandidate, command: SelectWorker) -> float:
    """The ``kv_ttft`` prediction for the rank a selection took (whatever rule took it), in milliseconds."""
    view = command.ttft
    timing = view.timing(chosen.rank) if view is not None else RankTiming(chosen.rank)
    terms = predict(
        state,
        chosen,
        timing,
        isl=request.prompt.isl_tokens,
        block_size=request.block_size,
        config=command.config,
        at=command.at,
        view=view if view is not None else NO_VIEW,
    )
    return terms.ttft_ms


def _affinity_target(
    found: list[RankCandidate], options: SelectionOptions, constraints: RoutingConstraints
) -> tuple[list[RankCandidate], frozenset[int] | None]:
    """1.6.1's ``affinity_target``, as probed: when its worker is eligible (allowed, carrying the required
    taints), the request may use only that worker (only the named rank when the worker has it) and the rest of
    the rules apply to that, a ``pinned_worker`` elsewhere included (400, or 503 for another rank); a target
    that is not eligible is ignored. Returns the candidates and allowed worker ids to select from."""
    allowed = options.allowed_worker_ids
    if options.affinity_target is None:
        return found, allowed
    worker_id, dp_rank = options.affinity_target
    usable = eligible(found, allowed_worker_ids=allowed, required_taints=constraints.required)
    if not isinstance(usable, list) or not any(c.rank.worker_id == worker_id for c in usable):
        return found, allowed
    if any(c.rank == (worker_id, dp_rank) for c in usable):
        found = [c for c in found if c.rank.worker_id != worker_id or c.rank.dp_rank == dp_rank]
    return found, frozenset({worker_id})


def selection_of(
    state: ScopeState,
    request: SelectionInput,
    found: list[RankCandidate],
    chosen: RankCandidate,
    config: RouterConfig,
    reservation_id: str | None,
    *,
    predicted_ranks: frozenset[WorkerRank] = frozenset(),
    session_id: str | None = None,
    writer_id: int = 0,
) -> Selection:
    """What a selection of ``chosen`` answers, and everything its booking (now or replayed) needs."""
    block_size = request.block_size
    prompt = request.prompt
    cached = effective_cached_tokens(chosen.overlap, config, block_size)
    record = state.selection.catalog[chosen.rank.worker_id]
    # Every rank of the chosen worker is a candidate (the worker is schedulable), filtered out or not; a worker
    # with one rank: the chosen candidate is that one.
    if len(record.ranks) == 1:
        per_rank = {chosen.rank.dp_rank: chosen.overlap}
    else:
        per_rank = {c.rank.dp_rank: c.overlap for c in found if c.rank.worker_id == chosen.rank.worker_id}
    predicted = not config.use_kv_events or chosen.rank in predicted_ranks
    tracks_blocks = config.router_track_active_blocks
    return Selection(
        worker_id=chosen.rank.worker_id,
        dp_rank=chosen.rank.dp_rank,
        endpoint=record.endpoint,
        block_size=block_size,
        overlap=overlap_summary(per_rank, block_size),
        effective_prefill_tokens=effective_prefill_tokens(prompt.isl_tokens, cached),
        potential_decode_blocks=reported_decode_blocks(
            chosen.active_decode_blocks,
            num_seq_hashes=len(prompt.sequence_hashes) if tracks_blocks else 0,
            isl=prompt.isl_tokens if tracks_blocks else 0,
            block_size=block_size,
            prompt_overlap_depth=chosen.prompt_overlap_depth if tracks_blocks else 0,
        ),
        sequence_hashes=prompt.sequence_hashes,
        isl_tokens=prompt.isl_tokens,
        track_prefill_tokens=config.router_track_prefill_tokens,
        reservation_id=reservation_id,
        local_hashes=prompt.local_hashes,
        approx_ttl_ns=int(config.router_ttl_secs * 1e9) if predicted else 0,
        session_id=session_id,
        session_ttl_ns=config.affinity_ttl_ns,
        writer_id=writer_id,
        max_predicted_blocks=config.router_max_tree_size,
        predicted_prune_target=config.prune_target,
        track_active_blocks=tracks_blocks,
    )


def booking_events(
    state: ScopeState,
    selection: Selection,
    at: int,
    expected_output_tokens: int | None,
    *,
    predict: bool = True,
) -> tuple[Event, ...]:
    """The events that book ``selection`` under its reservation id: its loads (no decode blocks without
    active-block tracking), its blocks as predicted on a rank scored without KV events (unless ``predict`` is
    off), and its session's pin."""
    rank = WorkerRank(selection.worker_id, selection.dp_rank)
    reservation_id = selection.reservation_id or ""
    booked = RequestAdded(
        reservation_id,
        selection.worker_id,
        selection.dp_rank,
        selection.sequence_hashes if selection.track_active_blocks else (),
        selection.effective_prefill_tokens if selection.track_prefill_tokens else 0,
        at,
        expected_output_tokens,
    )
    predicted: tuple[Event, ...] = ()
    if predict:
        predicted = predictions.book(
            state.selection,
            rank,
            selection.sequence_hashes,
            selection.local_hashes,
            ttl_ns=selection.approx_ttl_ns,
            at=at,
            max_blocks=selection.max_predicted_blocks,
            prune_target=selection.predicted_prune_target,
        )
    pinned_session: tuple[Event, ...] = ()
    if selection.session_id is not None:
        pinned_session = session_rules.bind(
            state,
            selection.session_id,
            rank,
            reservation_id,
            at=at,
            ttl_ns=selection.session_ttl_ns,
            writer_id=selection.writer_id,
        )
    return (booked, *predicted, *pinned_session)


def prefill_overflow(state: ScopeState, bookings: Iterable[tuple[WorkerRank, int]]) -> Rejected | None:
    """Refuse bookings whose prefill tokens would take a rank's load past u64, the wire type of every load
    (1.6.1 wraps; kvrouter's slot tracker refuses the same way). Ranks are known to exist."""
    extra: dict[WorkerRank, int] = {}
    for rank, tokens in bookings:
        extra[rank] = extra.get(rank, 0) + tokens
    for rank, tokens in extra.items():
        if state.slots.ranks[rank].prefill_tokens + tokens > U64_MASK:
            return Rejected(
                Reason.INVALID,
                f"{tokens} prefill tokens would overflow the prefill load of worker {rank.worker_id} "
                f"dp_rank {rank.dp_rank}",
            )
    return None


def booking_refusal(state: ScopeState, requests: int, blocks: int) -> Rejected | None:
    """409 when ``requests`` more active requests holding ``blocks`` prompt blocks would take the scope past
    ``MAX_ACTIVE_REQUESTS_PER_SCOPE`` or ``MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE`` (``actors/core/limits.py``)."""
    slots = state.slots
    if (
        len(slots.requests) + requests <= MAX_ACTIVE_REQUESTS_PER_SCOPE
        and slots.prompt_blocks + blocks <= MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE
    ):
        return None
    return bookings_full(state, requests, blocks)


def bookings_full(state: ScopeState, requests: int, blocks: int) -> Rejected:
    """``booking_refusal``'s 409, once a cap is known to be exceeded: it names the requests cap when that is
    the one, else the prompt-blocks cap."""
    slots = state.slots
    held = len(slots.requests)
    if held + requests > MAX_ACTIVE_REQUESTS_PER_SCOPE:
        return Rejected(
            Reason.CONFLICT,
            f"{state.scope.describe()} has {held} active requests; {requests} more would exceed the limit of "
            f"{MAX_ACTIVE_REQUESTS_PER_SCOPE} active requests per scope; free requests first",
        )
    return Rejected(
        Reason.CONFLICT,
        f"{state.scope.describe()}'s active requests hold {slots.prompt_blocks} prompt blocks; {blocks} more "
        f"would exceed the limit of {MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE} active prompt blocks per scope; "
        "free requests first",
    )


def booked_blocks(selection: Selection) -> int:
    """The prompt blocks a booking of ``selection`` holds (``booking_events``' ``RequestAdded``)."""
    return len(selection.sequence_hashes) if selection.track_active_blocks else 0


def booked_prefill(selection: Selection) -> tuple[WorkerRank, int]:
    """The rank a booking of ``selection`` loads, and its prefill tokens."""
    tokens = selection.effective_prefill_tokens if selection.track_prefill_tokens else 0
    return WorkerRank(selection.worker_id, selection.dp_rank), tokens


def already_reserved(reservation_id: str) -> Rejected:
    return Rejected(Reason.CONFLICT, f"selection {reservation_id} is already reserved or being reserved")


@attrs.frozen
class Booked:
    """What a booking on a chosen rank (``Reserve``, or a replayed selection) answers: where it went."""

    worker_id: int
    dp_rank: int
    endpoint: str | None


def decide_reserve(command: Reserve, state: ScopeState) -> Decision:
    if command.effective_prefill_tokens is not None and command.effective_prefill_tokens > command.isl_tokens:
        return Rejected(
            Reason.INVALID,
            f"effective_prefill_tokens ({command.effective_prefill_tokens}) must not exceed "
            f"isl_tokens ({command.isl_tokens})",
        )
    if command.reservation_id in state.slots.requests:
        return already_reserved(command.reservation_id)
    rank = WorkerRank(command.worker_id, command.dp_rank)
    if command.worker_id not in state.selection.catalog or rank not in state.slots.ranks:
        return Rejected(
            Reason.NOT_FOUND,
            f"worker {command.worker_id} dp_rank {command.dp_rank} not found for {state.scope.describe()}",
        )
    if command.effective_prefill_tokens is not None:
        tracked = command.track_prefill_tokens is not False
        prefill = command.effective_prefill_tokens if tracked else 0
    else:
        override = command.track_prefill_tokens
        tracked = command.config_tracks_prefill if override is None else override
        prefill = command.isl_tokens if tracked else 0
    hashes = command.sequence_hashes if command.track_active_blocks else ()
    overflow = prefill_overflow(state, [(rank, prefill)]) or booking_refusal(state, 1, len(hashes))
    if overflow is not None:
        return overflow
    event = RequestAdded(
        command.reservation_id,
        command.worker_id,
        command.dp_rank,
        hashes,
        prefill,
        command.at,
        command.expected_output_tokens,
    )
    booked = predictions.book(
        state.selection,
        rank,
        command.sequence_hashes,
        command.local_hashes,
        ttl_ns=command.approx_ttl_ns,
        at=command.at,
        max_blocks=command.max_predicted_blocks,
        prune_target=command.predicted_prune_target,
    )
    pinned_session: tuple[Event, ...] = ()
    if command.session_id is not None and command.session_ttl_ns > 0:
        pinned_session = session_rules.bind(
            state,
            command.session_id,
            rank,
            command.reservation_id,
            at=command.at,
            ttl_ns=command.session_ttl_ns,
            writer_id=command.writer_id,
        )
    where = Booked(command.worker_id, command.dp_rank, state.selection.catalog[command.worker_id].endpoint)
    return Accepted((event, *booked, *pinned_session), created=True, reply=where)


def no_pending_selection(state: ScopeState, selection_id: str) -> Rejected:
    return Rejected(
        Reason.NOT_FOUND,
        f"no pending selection {selection_id} for {state.scope.describe()} (expired, already used, or never selected)",
    )


def decide_reserve_selection(command: ReserveSelection, state: ScopeState) -> Decision:
    """Pending selections live in the scope's desk, which turns a replay into the booking it describes
    (``actors/core/desk.py``); a scope without one (no worker was ever registered there) has none."""
    return no_pending_selection(state, command.selection_id)


def reservation_not_found(reservation_id: str) -> Rejected:
    return Rejected(Reason.NOT_FOUND, f"reservation {reservation_id} not found")


def decide_output_block(command: AddOutputBlock, state: ScopeState) -> Decision:
    request = state.slots.requests.get(command.request_id)
    if request is None:
        return reservation_not_found(command.request_id)
    decay = command.decay_fraction
    expected = request.expected_output_tokens
    block_size = state.block_size
    if decay is None and expected is not None and block_size:  # booked with output-block tracking
        so_far = output_block_count(state.slots.ranks[request.rank].outputs.get(command.request_id, NO_OUTPUTS))
        decay = expected_decay(so_far, block_size, expected)
    return Accepted((OutputBlockAdded(command.request_id, decay),))


def decide_reservation_prefill(command: CompleteReservationPrefill, state: ScopeState) -> Decision:
    slots = state.slots
    request = slots.requests.get(command.reservation_id)
    if request is None:
        return reservation_not_found(command.reservation_id)
    if command.reservation_id not in slots.ranks[request.rank].prefill:
        return NOTHING_CHANGED  # repeated completion, or booked without prefill tracking
    return Accepted((PrefillCompleted(command.reservation_id),))


def decide_release(command: ReleaseReservation, state: ScopeState) -> Decision:
    if command.reservation_id not in state.slots.requests:
        return reservation_not_found(command.reservation_id)
    ended = session_rules.released(state.selection, (command.reservation_id,), command.at)
    return Accepted((RequestFreed(command.reservation_id), *ended))
