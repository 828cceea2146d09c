"""The predicted-vs-realised accounting on its own: what a report does, its bound and what it forgets."""

from __future__ import annotations

from kvrouter.actors.hit_accuracy import HitAccuracy


def test_a_report_uses_its_prediction_up_and_a_second_one_counts_as_unpredicted() -> None:
    accuracy = HitAccuracy()
    accuracy.predicted_tokens("r", worker_id=3, dp_rank=0, cached=64, isl=100)
    prediction = accuracy.realised("r", 80)
    assert prediction is not None and prediction.predicted_tokens == 64
    row = accuracy.by_worker[3]
    assert (row.reservations, row.predicted_tokens, row.realised_tokens, row.over, row.under) == (1, 64, 80, 0, 1)
    assert accuracy.error_tokens.count == 1 and accuracy.error_tokens.total == 16
    assert accuracy.realised("r", 80) is None
    assert accuracy.unpredicted == 1 and accuracy.by_worker[3].reservations == 1


def test_predictions_are_bounded_and_the_oldest_is_forgotten_first() -> None:
    accuracy = HitAccuracy(max_predictions=2)
    for reservation in ("a", "b", "c"):
        accuracy.predicted_tokens(reservation, worker_id=1, dp_rank=0, cached=16, isl=32)
    assert accuracy.forgotten == 1
    assert accuracy.realised("a", 16) is None  # forgotten at the cap
    assert accuracy.realised("b", 16) is not None and accuracy.realised("c", 0) is not None
    assert accuracy.by_worker[1].over == 1


def test_a_release_or_a_removed_worker_drops_what_it_held() -> None:
    accuracy = HitAccuracy()
    accuracy.predicted_tokens("r", worker_id=1, dp_rank=0, cached=8, isl=8)
    accuracy.forget("r")
    assert accuracy.realised("r", 8) is None
    accuracy.predicted_tokens("s", worker_id=1, dp_rank=0, cached=8, isl=8)
    accuracy.realised("s", 8)
    accuracy.worker_removed(1)
    assert accuracy.by_worker == {}
    names = {family.name for family in accuracy.families()}
    assert {"kvrouter_cache_hit_reports", "kvrouter_cache_hit_error_tokens"} <= names
