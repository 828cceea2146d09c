"""The per-worker circuit breaker's state machine (``actors/core/breakers.py``), on a clock the test sets."""

from __future__ import annotations

from kvrouter.actors.core.breakers import (
    BACKOFF_FACTOR,
    COOL_DOWN_SECONDS,
    MAX_COOL_DOWN_SECONDS,
    BreakerPolicy,
    Breakers,
    BreakerState,
    Cause,
)

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def test_a_failure_opens_the_breaker_at_once_and_only_for_that_endpoint() -> None:
    breakers = Breakers()
    assert not breakers.out()
    assert breakers.failed(A, Cause.REFUSED, "refused", now=10.0)
    assert set(breakers.out()) == {A}
    assert breakers.state(A) is BreakerState.OPEN and breakers.state(B) is BreakerState.CLOSED
    assert breakers.counts.openings == {Cause.REFUSED: 1}


def test_failures_while_open_keep_the_cool_down_and_count_one_opening() -> None:
    breakers = Breakers(BreakerPolicy(cool_down=1.0))
    breakers.failed(A, Cause.REFUSED, "first", now=10.0)
    assert not breakers.failed(A, Cause.DROPPED, "second", now=10.5)
    assert breakers.next_trial() == 11.0
    (view,) = breakers.views(now=10.5)
    assert (view.cause, view.last_error, view.out_for_secs, view.next_trial_in_secs) == ("refused", "second", 0.5, 0.5)
    assert breakers.counts.openings == {Cause.REFUSED: 1}


def test_half_open_after_the_cool_down_then_a_passed_trial_closes() -> None:
    breakers = Breakers(BreakerPolicy(cool_down=1.0))
    breakers.failed(A, Cause.CONNECT_TIMEOUT, "timed out", now=10.0)
    assert breakers.due(now=10.999) == []
    assert breakers.due(now=11.0) == [A]
    assert breakers.state(A) is BreakerState.HALF_OPEN
    assert A in breakers.out()  # still not chosen while its trial runs
    assert breakers.due(now=12.0) == []  # one trial at a time
    assert breakers.next_trial() is None
    breakers.trial_passed(A)
    assert breakers.state(A) is BreakerState.CLOSED and not breakers.out()
    assert breakers.counts.trials_passed == 1


def test_failed_trials_back_off_exponentially_up_to_the_cap() -> None:
    policy = BreakerPolicy(cool_down=1.0, max_cool_down=5.0, factor=2.0)
    breakers = Breakers(policy)
    now = 0.0
    breakers.failed(A, Cause.SERVER_ERROR, "500", now=now)
    cool_downs = []
    for _ in range(5):
        due_at = breakers.next_trial()
        assert due_at is not None
        cool_downs.append(due_at - now)
        now = due_at
        assert breakers.due(now) == [A]
        breakers.trial_failed(A, "still down", now)
    assert cool_downs == [1.0, 2.0, 4.0, 5.0, 5.0]
    (view,) = breakers.views(now)
    assert view.state == "open" and view.failed_trials == 5 and view.out_for_secs == now
    assert breakers.counts.trials_failed == 5


def test_a_closed_breaker_starts_again_from_the_first_cool_down() -> None:
    breakers = Breakers(BreakerPolicy(cool_down=1.0))
    breakers.failed(A, Cause.REFUSED, "x", now=0.0)
    breakers.due(1.0)
    breakers.trial_failed(A, "x", 1.0)
    breakers.due(3.0)
    breakers.trial_passed(A)
    breakers.failed(A, Cause.REFUSED, "again", now=100.0)
    assert breakers.next_trial() == 101.0
    assert breakers.counts.openings == {Cause.REFUSED: 2}


def test_trial_results_for_breakers_not_on_trial_change_nothing() -> None:
    breakers = Breakers()
    breakers.trial_passed(A)
    breakers.trial_failed(A, "x", 1.0)
    breakers.failed(B, Cause.REFUSED, "x", now=0.0)
    breakers.trial_passed(B)  # open, not half-open: a stale probe answer does not close it
    assert breakers.state(B) is BreakerState.OPEN
    assert breakers.counts.trials_passed == breakers.counts.trials_failed == 0


def test_forget_keeps_only_endpoints_still_in_the_catalog() -> None:
    breakers = Breakers()
    breakers.failed(A, Cause.REFUSED, "x", now=0.0)
    breakers.failed(B, Cause.REFUSED, "x", now=0.0)
    breakers.forget([B, "http://127.0.0.1:3"])
    assert set(breakers.out()) == {B}


def test_the_earliest_trial_is_the_next_one() -> None:
    breakers = Breakers(BreakerPolicy(cool_down=2.0))
    breakers.failed(A, Cause.REFUSED, "x", now=5.0)
    breakers.failed(B, Cause.REFUSED, "x", now=4.0)
    assert breakers.next_trial() == 6.0
    assert breakers.due(6.0) == [B]


def test_the_documented_defaults() -> None:
    policy = BreakerPolicy()
    assert (policy.cool_down, policy.max_cool_down, policy.factor) == (
        COOL_DOWN_SECONDS,
        MAX_COOL_DOWN_SECONDS,
        BACKOFF_FACTOR,
    )
    assert (COOL_DOWN_SECONDS, MAX_COOL_DOWN_SECONDS, BACKOFF_FACTOR) == (1.0, 30.0, 2.0)
