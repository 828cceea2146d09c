"""Predicted vs realised cache hits: how far the router's view of the workers' caches is from what they report.

When a selection books a reservation, the router predicted how many of its prompt tokens the chosen rank has
cached: the prompt length minus ``effective_prefill_tokens`` of the reply (device blocks, plus lower tiers at
their hit weights, in tokens, at most the prompt). When the engine finishes the prefill it knows how many were
really cached (vLLM: ``usage.prompt_tokens_details.cached_tokens``); a client may send that figure with
``POST /reservations/{id}/prefill_complete`` and this compares the two: per worker, the tokens predicted and
realised and how many reservations were over- and under-predicted; and a histogram of the size of the error
(``|realised - predicted|`` in tokens; its direction is in the per-worker counters, since Prometheus
histograms take no negative observations).

Observability only, so not journaled: predictions live in memory (at most ``MAX_PREDICTIONS``, the oldest
forgotten first: a reservation expired without a release is dropped that way), and a restart forgets them
(a report for a reservation booked before it counts as unpredicted) and starts the counters at zero, as
any Prometheus counter does after a restart.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.metric_families import Family, Labels, counter, histogram
from kvrouter.journal.latency import BucketCounts

MAX_PREDICTIONS = 65_536
# Token error buckets: 0 is an exact prediction; a block is typically 16-64 tokens.
ERROR_BOUNDS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0)


@attrs.frozen
class Prediction:
    worker_id: int
    dp_rank: int
    predicted_tokens: int
    isl_tokens: int


@attrs.define
class WorkerAccuracy:
    """Per worker, over the reservations with a prediction and a reported figure."""

    reservations: int = 0
    predicted_tokens: int = 0
    realised_tokens: int = 0
    over: int = 0  # the router predicted more cached tokens than the engine found
    under: int = 0  # fewer


class HitAccuracy:
    def __init__(self, max_predictions: int = MAX_PREDICTIONS) -> None:
        self.max_predictions = max_predictions
        self._predictions: dict[str, Prediction] = {}  # insertion order: the oldest first
        self.by_worker: dict[int, WorkerAccuracy] = {}
        self.error_tokens = BucketCounts(ERROR_BOUNDS)
        self.unpredicted = 0  # reports for a reservation without a prediction (restart, explicit booking, repeat)
        self.forgotten = 0  # predictions dropped at the cap, never reported

    def predicted(self, selection: Selection) -> None:
        """Remember what a booking's selection predicted (a selection without a reservation books nothing)."""
        if selection.reservation_id is None:
            return
        cached = max(0, selection.isl_tokens - selection.effective_prefill_tokens)
        self._remember(
            selection.reservation_id,
            Prediction(selection.worker_id, selection.dp_rank, cached, selection.isl_tokens),
        )

    def predicted_tokens(self, reservation_id: str, worker_id: int, dp_rank: int, cached: int, isl: int) -> None:
        """An explicit booking that gave its own ``effective_prefill_tokens``: its prediction is ``isl - that``."""
        self._remember(reservation_id, Prediction(worker_id, dp_rank, max(0, cached), isl))

    def _remember(self, reservation_id: str, prediction: Prediction) -> None:
        predictions = self._predictions
        predictions.pop(reservation_id, None)  # re-inserted at the end
        predictions[reservation_id] = prediction
        if len(predictions) > self.max_predictions:
            del predictions[next(iter(predictions))]
            self.forgotten += 1

    def forget(self, reservation_id: str) -> None:
        self._predictions.pop(reservation_id, None)

    def realised(self, reservation_id: str, cached_tokens: int) -> Prediction | None:
        """Compare the engine's figure with the prediction (which is then used up); None: there was none."""
        prediction = self._predictions.pop(reservation_id, None)
        if prediction is None:
            self.unpredicted += 1
            return None
        row = self.by_worker.get(prediction.worker_id)
        if row is None:
            row = self.by_worker[prediction.worker_id] = WorkerAccuracy()
        row.reservations += 1
        row.predicted_tokens += prediction.predicted_tokens
        row.realised_tokens += cached_tokens
        row.over += prediction.predicted_tokens > cached_tokens
        row.under += prediction.predicted_tokens < cached_tokens
        self.error_tokens.observe(float(abs(cached_tokens - prediction.predicted_tokens)))
        return prediction

    def worker_removed(self, worker_id: int) -> None:
        self.by_worker.pop(worker_id, None)

    def families(self) -> list[Family]:
        rows = sorted(self.by_worker.items())

        def per_worker(field: str) -> dict[Labels, float]:
            return {(str(worker),): float(getattr(row, field)) for worker, row in rows}

        worker = ("worker_id",)
        return [
            counter(
                "kvrouter_cache_hit_reports",
                "prefill_complete reports with cached_tokens compared with a prediction",
                worker,
                per_worker("reservations"),
            ),
            counter(
                "kvrouter_cache_hit_predicted_tokens",
                "Prompt tokens the router predicted cached on the chosen worker, over reported reservations",
                worker,
                per_worker("predicted_tokens"),
            ),
            counter(
                "kvrouter_cache_hit_realised_tokens",
                "Prompt tokens the engine reported cached (cached_tokens), over the same reservations",
                worker,
                per_worker("realised_tokens"),
            ),
            counter(
                "kvrouter_cache_hit_overpredicted",
                "Reservations where the router predicted more cached tokens than the engine found",
                worker,
                per_worker("over"),
            ),
            counter(
                "kvrouter_cache_hit_underpredicted",
                "Reservations where the engine found more cached tokens than the router predicted",
                worker,
                per_worker("under"),
            ),
            histogram(
                "kvrouter_cache_hit_error_tokens",
                "|realised - predicted| cached tokens per reported reservation (0: exact)",
                (),
                {(): self.error_tokens},
            ),
            counter(
                "kvrouter_cache_hit_unpredicted_reports",
                "Reports for a reservation without a prediction here (booked before a restart, "
                "explicitly without effective_prefill_tokens, or reported twice)",
                (),
                {(): float(self.unpredicted)},
            ),
            counter(
                "kvrouter_cache_hit_forgotten_predictions",
                f"Predictions dropped unreported at the cap of {self.max_predictions} (oldest first)",
                (),
                {(): float(self.forgotten)},
            ),
        ]
