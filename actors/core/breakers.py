"""Per-worker circuit breakers: which worker endpoints the frontend must stop choosing, and when to try them again.

Pure: the caller passes the time (``now``, seconds on any monotonic clock), so the state machine is tested
without sleeping. A breaker exists only for an endpoint that failed and is not back yet; a worker with no
breaker is closed (chosen as usual). ``docs/frontend.md#dead-workers`` describes it for operators.

- **closed** → **open**: a request to the endpoint failed (connection refused, connect timeout, the connection
  dropped before any answer, a 5xx other than 503). The endpoint is out of selection at once.
- **open** → **half-open**: the cool-down passed (``due``). One trial (the shell's probe) is under way; the
  endpoint stays out of selection until it answers.
- **half-open** → **closed**: the trial passed; the breaker is dropped and the endpoint is chosen again.
- **half-open** → **open**: the trial failed; the next cool-down is ``BACKOFF_FACTOR`` times the last, at most
  the cap.

Failures reported while a breaker is already open (requests that were in flight when the worker died) update
its last error only: they do not lengthen the cool-down. Bounded by the endpoints in the catalog: ``forget``
drops the breakers of endpoints no worker has any more.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

import attrs

COOL_DOWN_SECONDS = 1.0  # the first cool-down after a worker fails
MAX_COOL_DOWN_SECONDS = 30.0  # the cap of the exponential backoff between failed trials
BACKOFF_FACTOR = 2.0  # each failed trial multiplies the cool-down by this


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Cause(enum.Enum):
    """Why a request to a worker counted as the worker failing (the ``cause`` label of the openings)."""

    REFUSED = "refused"  # connection refused or reset while connecting
    CONNECT_TIMEOUT = "connect_timeout"
    DROPPED = "dropped"  # connected, and the connection closed before any answer (twice)
    SERVER_ERROR = "server_error"  # an HTTP 5xx other than 503


@attrs.frozen
class BreakerPolicy:
    cool_down: float = COOL_DOWN_SECONDS
    max_cool_down: float = MAX_COOL_DOWN_SECONDS
    factor: float = BACKOFF_FACTOR

    def next_cool_down(self, last: float) -> float:
        return min(self.max_cool_down, last * self.factor)


@attrs.define
class Breaker:
    """One endpoint that failed: open (waiting out ``cool_down``) or half-open (its trial under way)."""

    state: BreakerState
    cause: Cause
    last_error: str
    opened_at: float  # when it first went out (kept across failed trials)
    cool_down: float
    next_trial: float
    failed_trials: int = 0


@attrs.frozen
class BreakerView:
    """What ``/frontend/stats`` shows of one endpoint that is out."""

    endpoint: str
    state: str
    cause: str
    last_error: str
    out_for_secs: float
    next_trial_in_secs: float
    failed_trials: int


@attrs.define
class BreakerCounts:
    """Since the frontend started (``/metrics``)."""

    openings: dict[Cause, int] = attrs.Factory(dict)
    trials_passed: int = 0
    trials_failed: int = 0


class Breakers:
    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self._open: dict[str, Breaker] = {}
        self.counts = BreakerCounts()

    def out(self) -> Collection[str]:
        """The endpoints out of selection now (open or half-open); empty in the common case."""
        return self._open.keys()

    def state(self, endpoint: str) -> BreakerState:
        breaker = self._open.get(endpoint)
        return BreakerState.CLOSED if breaker is None else breaker.state

    def failed(self, endpoint: str, cause: Cause, error: str, now: float) -> bool:
        """A request to ``endpoint`` failed; True when this opened its breaker (it was closed)."""
        breaker = self._open.get(endpoint)
        if breaker is not None:
            breaker.last_error = error
            return False
        cool_down = self.policy.cool_down
        self._open[endpoint] = Breaker(BreakerState.OPEN, cause, error, now, cool_down, now + cool_down)
        self.counts.openings[cause] = self.counts.openings.get(cause, 0) + 1
        return True

    def due(self, now: float) -> list[str]:
        """The open endpoints whose cool-down has passed, now half-open: one trial each is for the caller."""
        found = [endpoint for endpoint, b in self._open.items() if b.state is BreakerState.OPEN and b.next_trial <= now]
        for endpoint in found:
            self._open[endpoint].state = BreakerState.HALF_OPEN
        return found

    def next_trial(self) -> float | None:
        """When the earliest open breaker's cool-down ends (None: none is waiting)."""
        waiting = [b.next_trial for b in self._open.values() if b.state is BreakerState.OPEN]
        return min(waiting) if waiting else None

    def trial_passed(self, endpoint: str) -> None:
        """The endpoint answered its trial: closed, chosen again."""
        breaker = self._open.get(endpoint)
        if breaker is not None and breaker.state is BreakerState.HALF_OPEN:
            del self._open[endpoint]
            self.counts.trials_passed += 1

    def trial_failed(self, endpoint: str, error: str, now: float) -> None:
        """The endpoint failed its trial: open again, for a longer cool-down (up to the cap)."""
        breaker = self._open.get(endpoint)
        if breaker is None or breaker.state is not BreakerState.HALF_OPEN:
            return
        breaker.state = BreakerState.OPEN
        breaker.last_error = error
        breaker.cool_down = self.policy.next_cool_down(breaker.cool_down)
        breaker.next_trial = now + breaker.cool_down
        breaker.failed_trials += 1
        self.counts.trials_failed += 1

    def forget(self, known: Iterable[str]) -> None:
        """Drop the breakers of endpoints no worker in the catalog has (removed, or registered elsewhere)."""
        kept = set(known)
        for endpoint in [e for e in self._open if e not in kept]:
            del self._open[endpoint]

    def views(self, now: float) -> list[BreakerView]:
        return [
            BreakerView(
                endpoint,
                b.state.value,
                b.cause.value,
                b.last_error,
                round(now - b.opened_at, 3),
                round(max(0.0, b.next_trial - now), 3) if b.state is BreakerState.OPEN else 0.0,
                b.failed_trials,
            )
            for endpoint, b in sorted(self._open.items())
        ]
