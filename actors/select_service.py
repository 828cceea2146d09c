"""SelectService: the selection service's commands and queries, in plain data, over the actor system.

What the HTTP routes (``api/routes/selection.py``) call, and what anything else that drives the service
calls: each method takes plain values, returns plain values, and raises ``Refused`` (with a reason),
``Overloaded``, ``ReplyTimeout`` or ``JournalUnavailable``. It stamps commands with the clock, applies
the router configuration (and per-request overrides), and keeps service-wide identity:

* worker ids: every catalog write goes through the ``CatalogWriter`` (one owner, one at a time);
* reservation ids: a booking claims its id in the ``Directory`` before it reaches a scope's mailbox, so
  an id is booked at most once in the whole service (409 otherwise), and lifecycle calls find the
  reservation's scope in O(1) from the directory, which follows applied events.

Reads look at actor state between awaits (trio runs one task at a time, so a read is consistent) and
then wait for a read barrier: the scope's own last write for single-scope reads, every write for
service-wide ones, so no read shows a write that a crash could still take back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio

from kvrouter.actors.catalog_writer import CatalogWriter, DeleteWorker, PatchWorker, PutWorker
from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    BindSession,
    CompleteReservationPrefill,
    FreeRankBookings,
    Prompt,
    RecoveredRun,
    RecoverKv,
    ReleaseReservation,
    Reserve,
    ReserveSelection,
    SelectDisaggregated,
    SelectionOptions,
    SelectWorker,
)
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.desk import nowhere_schedulable, streams_predicted
from kvrouter.actors.core.disaggregation import DECODE_PART, PREFILL_PART, DisaggregatedSelection, part_id
from kvrouter.actors.core.dump import dump_document
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_modes import HEALTHY, StreamView
from kvrouter.actors.core.queries import PotentialLoad, RankLoad
from kvrouter.actors.core.router_config import RouterConfig, RouterConfigOverride, config_problem
from kvrouter.actors.core.routing_modes import MODE_KV_TTFT
from kvrouter.actors.core.selection_queries import (
    OverlapScore,
    SelectionInput,
    candidates,
    overlap_scores,
    partition_loads,
    potential_loads,
    selection_input,
)
from kvrouter.actors.core.selection_rules import Booked, Selection, reservation_not_found, tracked_output
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.decision_feed import DecisionBatch, Want
from kvrouter.actors.directory import Directory
from kvrouter.actors.hit_accuracy import HitAccuracy
from kvrouter.actors.index_counters import IndexCounters
from kvrouter.actors.kv_health import KvHealth
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.load_feed import LoadChange, LoadChanges, LoadFeed, read_changes
from kvrouter.actors.mailbox import JournalUnavailable, Overloaded, ReplyTimeout
from kvrouter.actors.metric_families import Family, FamilySource
from kvrouter.actors.service_metrics import index_families, listener_families, system_families
from kvrouter.actors.service_support import EVERY_SCOPE, Refused, ScopeFilter, accepted
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.ttft_tracker import FULL, Ablation, TtftTracker

log = logging.getLogger("kvrouter.select_service")


@attrs.frozen
class WorkerStatus:
    """A catalog record with its derived lifecycle and, when KV ingest runs, its listeners per dp rank."""

    record: WorkerRecord
    reasons: tuple[str, ...]  # why it is not schedulable; empty when it is
    listeners: dict[str, dict[str, object]] = attrs.Factory(dict)
    # Per dp rank, how selections score it: {"mode": "exact" | "predicted", "reason"?} (core/kv_modes.py).
    kv_modes: dict[str, dict[str, str]] = attrs.Factory(dict)
    # Its blocks the scope's KV index evicted and refused at its cap since this process started.
    index_evicted_blocks: int = 0
    index_refused_blocks: int = 0
    # Per dp rank out of selection: why and since when (actors/core/kv_liveness.py); empty while all are in.
    out_of_selection: dict[str, dict[str, object]] = attrs.Factory(dict)
    # A discovered worker's model-card tokenizer checksum against --model-path's (actors/fleet/tokenizer_check.py).
    tokenizer: dict[str, object] = attrs.Factory(dict)

    @property
    def schedulable(self) -> bool:
        return not self.reasons


@attrs.frozen
class SelectionRequest:
    scope: ScopeKey
    prompt: Prompt
    options: SelectionOptions = attrs.Factory(SelectionOptions)
    override: RouterConfigOverride | None = None
    selection_id: str | None = None
    reservation_id: str | None = None  # select_and_reserve only
    router_mode: str | None = None  # this request's router mode (a canonical name); None: the service's
    explain: bool = False  # the selection carries its explanation (select, select_and_reserve)


@attrs.frozen
class Booking:
    """Where a reservation was booked."""

    scope: ScopeKey
    reservation_id: str
    worker_id: int | None
    dp_rank: int | None
    endpoint: str | None


def _booking(scope: ScopeKey, reservation_id: str, decision: Accepted) -> Booking:
    """Where the booking went, as its decision says (``selection_rules.Booked``)."""
    booked: Booked = decision.reply
    return Booking(scope, reservation_id, booked.worker_id, booked.dp_rank, booked.endpoint)


@attrs.frozen
class PartitionLoads:
    scope: ScopeKey
    loads: list[RankLoad]
    pending_count: int = 0  # selections waiting in the scope's queue
    pending_isl_tokens: int = 0


@attrs.frozen
class OverlapScores:
    block_size: int
    num_blocks: int
    workers: list[OverlapScore]


class SelectService:
    def __init__(
        self,
        system: ActorSystem,
        config: RouterConfig,
        ingest: KvIngest | None = None,
        directory: Directory | None = None,
        writer_id: int = 0,
        ttft_ablation: Ablation = FULL,
    ) -> None:
        self.system = system
        self.config = config
        self.ingest = ingest
        # This replica's id: the version writer of the session bindings it makes (replica sync's router id).
        self.writer_id = writer_id
        # Per-rank fallback to predicted blocks while a rank's KV events are absent or stale, and taking a rank out
        # of selection when they stop while it has traffic (KV-event mode, ranks with a KV listener only; a fleet adds
        # Dynamo's event plane to the listeners followed: ``KvHealth.add_feed``).
        self.health = (
            KvHealth(ingest, config.kv_events_stale_secs, config.kv_events_timeout_secs)
            if ingest is not None
            and config.use_kv_events
            and (config.kv_events_stale_secs > 0 or config.kv_events_timeout_secs > 0)
            else None
        )
        self.directory = directory or Directory()
        # Blocks each scope's KV index evicted or refused at its cap (actors/core/index_bounds.py).
        self.index_counters = IndexCounters()
        # Predicted vs engine-reported cache hits per reservation (actors/hit_accuracy.py; not journaled).
        self.hit_accuracy = HitAccuracy()
        # kv_ttft's prefill-time model per scope (actors/ttft_tracker.py; not journaled), idle until kv_ttft is used.
        self.ttft = TtftTracker(system, active=config.router_mode == MODE_KV_TTFT, ablation=ttft_ablation)
        # More figures for GET /metrics: each is called at scrape time and returns plain Family values.
        self.metric_sources: list[FamilySource] = []
        # More of GET /ready (discovery and event-plane state, actors/fleet), and per-rank KV-feed statuses for
        # GET /workers from feeds other than the ZMQ listeners (Dynamo's event plane): plain data, read on demand.
        self.readiness_sources: list[Callable[[], dict[str, Any]]] = []
        self.kv_status_sources: list[Callable[[int], dict[str, dict[str, object]]]] = []
        # A discovered worker's tokenizer against the local one, for GET /workers (actors/fleet/tokenizer_check.py).
        self.tokenizer_status: Callable[[int], dict[str, object]] | None = None
        self._catalog = CatalogWriter(
            system,
            self.directory,
            ingest,
            use_kv_events=config.use_kv_events,
            endpoint_allow=config.worker_endpoint_allow,
        )
        self._now = system.clock.now_ns
        # Which scopes' loads changed, for GET /ws/loads (one O(1) bump per applied change).
        self.load_feed = LoadFeed()
        system.observers.append(self.load_feed.observe)
        system.queue_observers.append(self.load_feed.bump)  # pending counts move without events
        self.metric_sources.append(system.decisions.families)  # explained selections by reason
        self.metric_sources.append(self.ttft.families)
        if self.health is not None:
            self.metric_sources.append(self.health.families)

    async def run(self, *, task_status: trio.TaskStatus[SelectService] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the catalog writer and follow applied events; ``await nursery.start(service.run)``."""
        # Adopt what was recovered and subscribe in one synchronous step: no event falls in between.
        for state in self.system.states():
            self.directory.adopt(state)
        self.system.observers.append(self.directory.observe)
        self.system.observers.append(self.index_counters.observe)
        if self.health is not None:
            self.system.observers.append(self.health.observe)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._catalog.run)
                if self.health is not None and self.health.liveness.enabled:
                    nursery.start_soon(self._follow_kv_liveness, self.health)
                task_status.started(self)
        finally:
            if self.directory.observe in self.system.observers:
                self.system.observers.remove(self.directory.observe)
            if self.index_counters.observe in self.system.observers:
                self.system.observers.remove(self.index_counters.observe)
            if self.health is not None and self.health.observe in self.system.observers:
                self.system.observers.remove(self.health.observe)
            self.ttft.stop()

    async def _follow_kv_liveness(self, health: KvHealth) -> None:
        """Take ranks out of selection when their KV events stop while they have traffic, and free their bookings
        (a journaled command per rank, so a restart does not bring them back); bring back those whose stream
        reconnected. Checked a few times per timeout, so a rank is out at most a quarter timeout (or a second) late."""
        period = min(1.0, max(0.05, self.config.kv_events_timeout_secs / 4))
        while True:
            await trio.sleep(period)
            for change in health.check(self._now()):
                if not change.out:
                    continue
                command = FreeRankBookings(change.rank.worker_id, change.rank.dp_rank, at=self._now())
                try:
                    await self.system.ask(change.scope, command)
                except (Overloaded, ReplyTimeout, JournalUnavailable) as error:
                    # Out of selection already; its bookings stay until they end, expire, or the next taking-out.
                    log.warning("bookings of %s not freed: %s", change.rank, error)

    # -- the catalog ----------------------------------------------------------------------------------

    async def put_worker(self, record: WorkerRecord) -> WorkerStatus:
        """Create or replace ``record`` (a record naming another scope moves the worker there)."""
        return self._status(await self._catalog.write(PutWorker(record)))

    async def patch_worker(self, worker_id: int, patch: WorkerPatch) -> WorkerStatus:
        """Replace the fields ``patch`` gives; 404 if unknown, 400 if the patched record is refused."""
        return self._status(await self._catalog.write(PatchWorker(worker_id, patch)))

    async def remove_worker(self, worker_id: int, discovered_by: str | None = None) -> WorkerRecord:
        """Remove the worker; returns its record as it was. 404 if unknown; 409 if a discovery source owns it
        and ``discovered_by`` does not name that source."""
        record = await self._catalog.write(DeleteWorker(worker_id, discovered_by))
        self.hit_accuracy.worker_removed(worker_id)
        return record

    async def readiness(self) -> dict[str, Any]:
        """What ``GET /ready`` says beyond the workers: the discovery source's and the event plane's state."""
        found: dict[str, Any] = {}
        for source in self.readiness_sources:
            found.update(source())
        return found

    async def workers(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[WorkerStatus]:
        rows = [
            self._status(record, state)
            for state in self.system.states()
            if wanted(state.scope)
            for _, record in sorted(state.selection.catalog.items())
        ]
        await self.system.read_barrier()
        return rows

    def _status(self, record: WorkerRecord, state: ScopeState | None = None) -> WorkerStatus:
        if state is None:
            state = self.system.state(record.scope)
        reasons = not_schedulable_reasons(
            record,
            use_kv_events=self.config.use_kv_events,
            partition_block_size=state.selection.partition_block_size if state else None,
            queueing=self.config.queueing,
        )
        listeners = self.ingest.status(record.worker_id) if self.ingest is not None else {}
        for source in self.kv_status_sources:
            listeners = {**listeners, **source(record.worker_id)}
        evicted, refused = self.index_counters.worker(record.scope, record.ranks)
        out = self.health.outages(record.scope, record, self._now()) if self.health is not None else {}
        tokenizer = self.tokenizer_status(record.worker_id) if self.tokenizer_status is not None else {}
        return WorkerStatus(record, tuple(reasons), listeners, self._kv_modes(record), evicted, refused, out, tokenizer)

    def _kv_modes(self, record: WorkerRecord) -> dict[str, dict[str, str]]:
        if not self.config.use_kv_events:
            return {str(rank.dp_rank): {"mode": "predicted", "reason": "approximate mode"} for rank in record.ranks}
        if self.health is None:
            return {}
        modes = self.health.modes(record.scope, record, self._now())
        return {
            str(rank.dp_rank): {"mode": m.mode.value, **({"reason": m.reason} if m.reason else {})}
            for rank, m in modes.items()
        }

    # -- selection ------------------------------------------------------------------------------------

    async def select(self, request: SelectionRequest) -> Selection:
        """Pick a rank and book nothing (with a ``selection_id``, remember it for ``reserve_selection``)."""
        command = self._selection(request, reserve=False)
        decision = self.system.query(request.scope, command)
        if isinstance(decision, Rejected) and decision.reason is Reason.OVERLOADED and command.config.queueing:
            # It waits in the scope's queue (behaviour.md#eligibility-busy-ranks-and-queueing).
            decision = await self.system.ask(request.scope, command)
        decision = accepted(decision)
        await self.system.read_barrier(request.scope)
        selection: Selection = decision.reply
        return selection

    async def select_and_reserve(self, request: SelectionRequest) -> Selection:
        """Pick a rank and book it under ``reservation_id``, else ``selection_id``, else a generated id."""
        command = self._selection(request, reserve=True)
        booking = request.reservation_id if request.reservation_id is not None else request.selection_id
        decision = await self._book(request.scope, command, booking)
        selection: Selection = decision.reply
        self.hit_accuracy.predicted(selection)
        if self.ttft.active:
            self.ttft.predicted(request.scope, selection)
        return selection

    async def select_disaggregated(self, request: SelectionRequest) -> DisaggregatedSelection:
        """Pick a prefill rank and a decode rank and book both under ``<id>:prefill`` and ``<id>:decode``
        (``actors/core/disaggregation.py``); ``<id>`` is ``reservation_id``, else ``selection_id``, else
        generated. Either both parts are booked or neither."""
        config = self._config(request)
        booking = request.reservation_id if request.reservation_id is not None else request.selection_id
        now = self._now()
        streams = self._streams(request.scope, now)
        command = SelectDisaggregated(
            request.prompt,
            config,
            booking,
            request.options,
            at=now,
            streams=streams,
            ttft=self.ttft.view(request.scope) if config.router_mode == MODE_KV_TTFT else None,
        )
        # A generated id (the scope's desk draws it) is unique; a given one is claimed, both parts, service-wide.
        parts = () if booking is None else (part_id(booking, PREFILL_PART), part_id(booking, DECODE_PART))
        claimed: list[str] = []
        for part in parts:
            conflict = self.directory.claim_reservation(part, request.scope)
            if conflict is not None:
                for held in claimed:
                    self.directory.release_claim(held)
                raise Refused.because(conflict)
            claimed.append(part)

        def release() -> None:
            for held in claimed:
                self.directory.release_claim(held)

        decision = accepted(await self.system.ask(request.scope, command, on_settled=release))
        chosen: DisaggregatedSelection = decision.reply
        return chosen

    def _config(self, request: SelectionRequest) -> RouterConfig:
        """The service's router configuration with this request's override and mode applied, checked."""
        config = request.override.apply(self.config) if request.override is not None else self.config
        if request.router_mode is not None:
            config = attrs.evolve(config, router_mode=request.router_mode)
        problem = config_problem(config)
        if problem is not None:
            raise Refused(Reason.INVALID, f"router_config_override: {problem}")
        return config

    def _selection(self, request: SelectionRequest, *, reserve: bool) -> SelectWorker:
        """The selection command: what the request asks and what only this shell knows (the time, the KV
        streams' health); what the scope knows (its workers, the other scopes) is read when it is decided."""
        config = self._config(request)
        now = self._now()
        return SelectWorker(
            request.prompt,
            config,
            request.options,
            reserve=reserve,
            reservation_id=request.reservation_id if reserve else None,
            selection_id=request.selection_id,
            at=now,
            writer_id=self.writer_id,
            explain=request.explain,
            ttft=self.ttft.view(request.scope) if config.router_mode == MODE_KV_TTFT else None,
            streams=self._streams(request.scope, now),
        )

    def _streams(self, scope: ScopeKey, now: int) -> StreamView:
        """What the KV-event streams look like now, for a selection in ``scope`` (``kv_health.py``)."""
        return self.health.view(scope, now) if self.health is not None else HEALTHY

    # -- reservations ---------------------------------------------------------------------------------

    async def reserve(
        self,
        scope: ScopeKey,
        reservation_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: tuple[int, ...],
        isl_tokens: int,
        effective_prefill_tokens: int | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
    ) -> Booking:
        """Book a prompt on a chosen rank (the seed's explicit reservation)."""
        command = Reserve(
            reservation_id,
            worker_id,
            dp_rank,
            sequence_hashes,
            isl_tokens,
            effective_prefill_tokens,
            track_prefill_tokens,
            config_tracks_prefill=self.config.router_track_prefill_tokens,
            at=self._now(),
            expected_output_tokens=tracked_output(self.config, expected_output_tokens),
            track_active_blocks=self.config.router_track_active_blocks,
        )
        decision = await self._book(scope, command, reservation_id)
        if effective_prefill_tokens is not None:  # the caller's own prediction of what is cached
            cached = isl_tokens - effective_prefill_tokens
            self.hit_accuracy.predicted_tokens(reservation_id, worker_id, dp_rank, cached, isl_tokens)
        return _booking(scope, reservation_id, decision)

    async def reserve_selection(self, scope: ScopeKey, selection_id: str) -> Booking:
        """Book exactly what an earlier ``select`` with this ``selection_id`` chose (1.6.1's replay form)."""
        decision = await self._book(scope, ReserveSelection(selection_id, at=self._now()), selection_id)
        if isinstance(decision.reply, Selection):
            self.hit_accuracy.predicted(decision.reply)
        return _booking(scope, selection_id, decision)

    async def _book(
        self, scope: ScopeKey, command: SelectWorker | Reserve | ReserveSelection, booking: str | None
    ) -> Accepted:
        release = None
        if booking is not None:
            conflict = self.directory.claim_reservation(booking, scope)
            if conflict is not None:
                raise Refused.because(conflict)
            release = partial(self.directory.release_claim, booking)
        return accepted(await self.system.ask(scope, command, on_settled=release))

    async def complete_prefill(self, reservation_id: str, cached_tokens: int | None = None) -> None:
        """The reservation's prefill is done; ``cached_tokens``: what the engine found cached, compared
        with what the router predicted (``hit_accuracy``)."""
        if cached_tokens is not None and cached_tokens < 0:
            raise Refused(Reason.INVALID, "cached_tokens must be a non-negative integer")
        scope = await self._reservation_scope(reservation_id)
        at = self._now()
        accepted(await self.system.ask(scope, CompleteReservationPrefill(reservation_id, at=at)))
        if cached_tokens is not None:
            self.hit_accuracy.realised(reservation_id, cached_tokens)
        if self.ttft.active:
            self.ttft.completed(scope, reservation_id, at)
            self.ttft.reported(scope, reservation_id, cached_tokens)

    async def add_output_block(self, reservation_id: str, decay_fraction: float | None = None) -> None:
        """One more output block (weight 1.0), or with ``decay_fraction`` f in [0, 1] every block weighs f."""
        if decay_fraction is not None and not 0.0 <= decay_fraction <= 1.0:
            raise Refused(Reason.INVALID, "decay_fraction must be between 0.0 and 1.0")
        scope = await self._reservation_scope(reservation_id)
        accepted(await self.system.ask(scope, AddOutputBlock(reservation_id, decay_fraction, at=self._now())))

    async def release(self, reservation_id: str) -> None:
        scope = await self._reservation_scope(reservation_id)
        accepted(await self.system.ask(scope, ReleaseReservation(reservation_id, at=self._now())))
        self.hit_accuracy.forget(reservation_id)

    async def _reservation_scope(self, reservation_id: str) -> ScopeKey:
        scope = self.directory.reservation_scope(reservation_id)
        if scope is None:
            await self.system.read_barrier()  # "not found" must not rest on a release a crash could undo
            raise Refused.because(reservation_not_found(reservation_id))
        return scope

    # -- inspection -----------------------------------------------------------------------------------

    async def loads(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[PartitionLoads]:
        """Current loads of each listed partition's schedulable ranks, sorted."""
        use_kv_events = self.config.use_kv_events
        partitions = []
        for state in self.system.states():
            rows = partition_loads(state, use_kv_events, queueing=self.config.queueing) if wanted(state.scope) else None
            if rows is not None:
                partitions.append(PartitionLoads(state.scope, rows, *self.system.pending_loads(state.scope)))
        await self.system.read_barrier()
        return partitions

    async def load_changes(self, epoch: str, cursor: int, wait_seconds: float) -> LoadChanges:
        """``GET /loads`` of the partitions changed after ``cursor`` of feed ``epoch``, waiting up to ``wait_seconds``
        seconds (at most 2) for one; every partition if the cursor is of another epoch or too old."""
        use_kv_events, queueing = self.config.use_kv_events, self.config.queueing

        def measure(scope: ScopeKey, version: int) -> LoadChange:
            state = self.system.state(scope)
            rows = partition_loads(state, use_kv_events, queueing=queueing) if state is not None else None
            return LoadChange(scope, version, rows, *self.system.pending_loads(scope))

        return await read_changes(self.load_feed, self.system, epoch, cursor, wait_seconds, measure)

    async def decision_changes(
        self, epoch: str, cursor: int, wait_seconds: float, wants: list[Want] | None = None, reader: str = ""
    ) -> DecisionBatch:
        """Explained selections after ``cursor`` of feed ``epoch``, waiting up to ``wait_seconds`` (at most 2)
        for one; a cursor of another epoch starts from now. Each call keeps selections explained a while, at most
        as many as ``wants`` asks for ``reader`` (``actors/decision_feed.py``). Answered after a read barrier (a
        booking shown is durable)."""
        batch = await self.system.decisions.read(epoch, cursor, wait_seconds, wants, reader)
        await self.system.read_barrier()
        return batch

    async def potential_loads(
        self, scope: ScopeKey, prompt: Prompt, override: RouterConfigOverride | None = None
    ) -> list[PotentialLoad]:
        """What each schedulable rank would carry with ``prompt``, as ``select`` weighs it."""
        config = override.apply(self.config) if override is not None else self.config
        prepared, found = self._prompt_read(scope, prompt)
        rows = potential_loads(found, prepared, config)
        await self.system.read_barrier(scope)
        return rows

    async def overlap_scores(self, scope: ScopeKey, prompt: Prompt) -> OverlapScores:
        prepared, found = self._prompt_read(scope, prompt)
        scores = OverlapScores(prepared.block_size, len(prepared.prompt.local_hashes), overlap_scores(found))
        await self.system.read_barrier(scope)
        return scores

    def _prompt_read(self, scope: ScopeKey, prompt: Prompt) -> tuple[SelectionInput, list[Any]]:
        """A read of the scope's state (between awaits, so consistent), weighed as a selection would be."""
        config = self.config
        state = self.system.state(scope) or ScopeState(scope)
        nowhere = nowhere_schedulable(state, config, self.system)
        if nowhere is not None:
            raise Refused.because(nowhere)
        prepared = selection_input(state, prompt, config.use_kv_events, queueing=config.queueing)
        if not isinstance(prepared, SelectionInput):
            raise Refused.because(prepared)
        now = self._now()
        predicted = streams_predicted(state, config, self._streams(scope, now), now)
        return prepared, candidates(state, prepared, predicted_ranks=predicted, all_predicted=not config.use_kv_events)

    async def dump(self) -> dict[str, Any]:
        """The index of every scope in the standalone indexer's recovery format."""
        document = dump_document(self.system.states(), include_predicted=not self.config.use_kv_events)
        await self.system.read_barrier()
        return document

    async def bind_session(
        self, scope: ScopeKey, session_id: str, worker_id: int, dp_rank: int, sequence: int, writer_id: int
    ) -> None:
        """A replica peer's session binding (applied when newer than ours; ignored without affinity)."""
        if self.config.affinity_ttl_ns <= 0:
            return
        command = BindSession(
            session_id, worker_id, dp_rank, sequence, writer_id, self.config.affinity_ttl_ns, self._now()
        )
        await self.system.ask(scope, command)

    async def recover_index(self, scope: ScopeKey, runs: tuple[RecoveredRun, ...]) -> None:
        """Seed ``scope``'s index with a peer's runs (``--indexer-peers``), before serving."""
        command = RecoverKv(runs, at=self._now(), max_index_blocks=self.system.max_index_blocks_per_scope)
        accepted(await self.system.ask(scope, command))

    async def cluster(self) -> dict[str, Any]:
        """``GET /cluster`` of a service that is no cluster replica (no ``--cluster``): nothing to show."""
        return {"cluster": None, "member": None, "lease": None, "members": [], "scopes": [], "followers": []}

    # -- metrics --------------------------------------------------------------------------------------

    async def metrics(self) -> list[Family]:
        """The actor side's figures for ``GET /metrics`` (see ``actors/service_metrics.py``)."""
        families = system_families(self.system) + index_families(self.system, self.index_counters)
        if self.ingest is not None:
            families += listener_families(self.ingest)
        families += self.hit_accuracy.families()
        for source in self.metric_sources:
            families.extend(source())
        return families
