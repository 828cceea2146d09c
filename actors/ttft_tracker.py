"""The shell side of ``kv_ttft``: one prefill-time model per scope, fed from applied events and client reports.

It follows the actors' applied events (an observer: bookings, prefill completions with their command's time,
releases, workers leaving) and the ``cached_tokens`` clients report with ``prefill_complete``; a ``kv_ttft``
selection carries the scope's current ``TtftView`` into the pure core (``actors/core/ttft_model.py`` fits,
``actors/core/ttft_cost.py`` predicts). It also counts how far the predictions were from what happened, for
``GET /metrics``.

It costs nothing until it is needed: the observer is attached when the service's router mode is ``kv_ttft``,
or at the first selection that asks for it (``router_mode`` in the body); from then on it learns from every
booking, whatever mode made it. Not journaled: a restart starts each rank again from the prior.

Bounds: scopes are bounded by the actor system's cap (a model is dropped with its scope's last worker); each
model remembers at most ``MAX_BOOKINGS`` bookings (the oldest forgotten first, counted).
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import (
    Event,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    WorkerRemoved,
    WorkerUnregistered,
)
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.ttft_model import DEFAULT_BATCH_TOKENS, PrefillModel, TtftView
from kvrouter.actors.metric_families import Family, Labels, counter, gauge, histogram
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.latency import BucketCounts

# |realised - predicted| TTFT, ms: a pass is ~10-200 ms; a queue can hold seconds.
ERROR_BOUNDS_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0)


@attrs.frozen
class Ablation:
    """Terms of ``kv_ttft`` left out (the simulator's ablation policies; a service keeps all three)."""

    queue_term: bool = True
    fit: bool = True
    drift: bool = True
    load_term: bool = True


FULL = Ablation()


@attrs.define
class RankErrors:
    """Per rank, over completed ``kv_ttft`` bookings."""

    predictions: int = 0
    predicted_ms: float = 0.0
    realised_ms: float = 0.0


class TtftTracker:
    def __init__(self, system: ActorSystem, *, active: bool = False, ablation: Ablation = FULL) -> None:
        self.system = system
        self.ablation = ablation
        self.models: dict[ScopeKey, PrefillModel] = {}
        self.errors = BucketCounts(ERROR_BOUNDS_MS)
        self.by_rank: dict[tuple[ScopeKey, WorkerRank], RankErrors] = {}
        self.active = False
        if active:
            self.activate()

    def activate(self) -> None:
        """Start following applied events (once)."""
        if not self.active:
            self.active = True
            self.system.observers.append(self.observe)

    def stop(self) -> None:
        if self.observe in self.system.observers:
            self.system.observers.remove(self.observe)
        self.active = False

    # -- what selections read ----------------------------------------------------------------------------

    def view(self, scope: ScopeKey) -> TtftView:
        self.activate()
        return self._model(scope).view(self.ablation.queue_term, self.ablation.load_term)

    # -- what the service is told ------------------------------------------------------------------------

    def predicted(self, scope: ScopeKey, selection: Selection) -> None:
        """A booked selection's predictions (its TTFT when ``kv_ttft`` chose, and the tokens it counted cached)."""
        model = self.models.get(scope)
        if model is None or selection.reservation_id is None:
            return
        cached = max(0, selection.isl_tokens - selection.effective_prefill_tokens)
        block = max(1, selection.block_size)
        cacheable = (selection.isl_tokens - 1) // block * block
        model.predicted(selection.reservation_id, selection.predicted_ttft_ms, cached, cacheable)

    def completed(self, scope: ScopeKey, reservation_id: str, at: int) -> None:
        """A ``prefill_complete`` the service applied at ``at``. A booking with prefill tokens was already taken
        from its event; one without (the router counted its whole prompt cached) journals none, so it is taken
        here."""
        state = self.system.state(scope)
        if state is not None:
            self._completed(state, reservation_id, at)

    def reported(self, scope: ScopeKey, reservation_id: str, cached_tokens: int | None) -> None:
        """A client's ``prefill_complete`` answered: what it said was cached (None: it did not say)."""
        model = self.models.get(scope)
        if model is not None:
            model.reported(reservation_id, cached_tokens)

    # -- applied events ----------------------------------------------------------------------------------

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        scope = state.scope
        for event in events:
            if isinstance(event, RequestAdded):
                rank = WorkerRank(event.worker_id, event.dp_rank)
                model = self._model(scope)
                loads = state.slots.ranks.get(rank)
                busy = loads is not None and len(loads.requests) > 1
                model.booked(event.request_id, rank, event.at, event.prefill_tokens, _decode_share(state, rank), busy)
            elif isinstance(event, PrefillCompleted):
                self._completed(state, event.request_id, command.at)
            elif isinstance(event, RequestFreed):
                self._released(scope, (event.request_id,))
            elif isinstance(event, RequestsExpired):
                self._released(scope, event.request_ids)
            elif isinstance(event, WorkerRemoved | WorkerUnregistered):
                self._worker_left(state, event.worker_id)

    def _completed(self, state: ScopeState, request_id: str, at: int) -> None:
        model = self.models.get(state.scope)
        if model is None:
            return
        request = state.slots.requests.get(request_id)
        batch = _batch_tokens(state, request.rank.worker_id) if request is not None else DEFAULT_BATCH_TOKENS
        outcome = model.completed(request_id, at, batch)
        if outcome is None or outcome.predicted_ms is None:
            return
        self.errors.observe(abs(outcome.realised_ms - outcome.predicted_ms))
        key = (state.scope, outcome.rank)
        row = self.by_rank.get(key)
        if row is None:
            row = self.by_rank[key] = RankErrors()
        row.predictions += 1
        row.predicted_ms += outcome.predicted_ms
        row.realised_ms += outcome.realised_ms

    def _released(self, scope: ScopeKey, request_ids: tuple[str, ...]) -> None:
        model = self.models.get(scope)
        if model is not None:
            for request_id in request_ids:
                model.released(request_id)

    def _worker_left(self, state: ScopeState, worker_id: int) -> None:
        scope = state.scope
        model = self.models.get(scope)
        if model is None:
            return
        for row in list(model.rows()):
            if row.rank.worker_id == worker_id:
                model.rank_removed(row.rank)
        for key in [k for k in self.by_rank if k[0] == scope and k[1].worker_id == worker_id]:
            del self.by_rank[key]
        if not state.exists:
            del self.models[scope]

    def _model(self, scope: ScopeKey) -> PrefillModel:
        model = self.models.get(scope)
        if model is None:
            model = self.models[scope] = PrefillModel(fit=self.ablation.fit, drift=self.ablation.drift)
        return model

    # -- GET /metrics ------------------------------------------------------------------------------------

    def families(self) -> list[Family]:
        if not self.active:
            return []
        rank_labels = ("model_name", "tenant_id", "worker_id", "dp_rank")
        errors = sorted(self.by_rank.items())

        def per_rank(field: str) -> dict[Labels, float]:
            return {_labels(scope, rank): float(getattr(row, field)) for (scope, rank), row in errors}

        rates: dict[Labels, float] = {}
        samples: dict[Labels, float] = {}
        factors: dict[Labels, float] = {}
        for scope, model in sorted(self.models.items()):
            for row in model.rows():
                labels = _labels(scope, row.rank)
                rates[labels] = row.rates.tokens_per_s(DEFAULT_BATCH_TOKENS)
                samples[labels] = float(row.samples)
                factors[labels] = row.overlap_factor
        return [
            histogram(
                "kvrouter_ttft_prediction_error_ms",
                "kv_ttft: |realised - predicted| time to first token per completed booking, booking to "
                "prefill_complete, in ms",
                (),
                {(): self.errors},
            ),
            counter(
                "kvrouter_ttft_predictions",
                "kv_ttft bookings whose prefill completed",
                rank_labels,
                per_rank("predictions"),
            ),
            counter(
                "kvrouter_ttft_predicted_ms",
                "Sum of the predicted TTFT (ms) of those bookings; against kvrouter_ttft_realised_ms it shows the bias",
                rank_labels,
                per_rank("predicted_ms"),
            ),
            counter(
                "kvrouter_ttft_realised_ms",
                "Sum of the realised TTFT (ms, booking to prefill_complete) of the same bookings",
                rank_labels,
                per_rank("realised_ms"),
            ),
            gauge(
                "kvrouter_ttft_prefill_tokens_per_second",
                f"The rank's fitted prefill rate at full passes of {DEFAULT_BATCH_TOKENS} tokens "
                "(the prior until it has samples)",
                rank_labels,
                rates,
            ),
            gauge(
                "kvrouter_ttft_fit_samples",
                "Prefill completions the rank's rates were fitted from",
                rank_labels,
                samples,
            ),
            gauge(
                "kvrouter_ttft_overlap_factor",
                "Drift discount of the rank's predicted overlap (1: reported cached_tokens agree with predictions)",
                rank_labels,
                factors,
            ),
        ]


def _labels(scope: ScopeKey, rank: WorkerRank) -> Labels:
    return (scope.model_name, scope.tenant_id, str(rank.worker_id), str(rank.dp_rank))


def _batch_tokens(state: ScopeState, worker_id: int) -> int:
    record = state.selection.catalog.get(worker_id)
    return (record.max_num_batched_tokens if record is not None else None) or DEFAULT_BATCH_TOKENS


def _decode_share(state: ScopeState, rank: WorkerRank) -> float:
    """The part of the rank's KV capacity its live sequences fill, as ``kv_ttft`` predicts with it."""
    record = state.selection.catalog.get(rank.worker_id)
    loads = state.slots.ranks.get(rank)
    if record is None or not record.total_kv_blocks or loads is None:
        return 0.0
    return min(1.0, loads.active_decode_blocks / record.total_kv_blocks)
