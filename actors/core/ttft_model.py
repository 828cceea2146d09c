"""The prefill-time model behind ``kv_ttft``: how long a rank takes to compute prompt tokens, learnt online. Pure.

A rank computes prompts in forward passes of at most ``batch_tokens`` tokens (its ``max_num_batched_tokens``),
and while some of its sequences decode, every pass also carries their next tokens. So computing ``x`` prompt
tokens takes about::

    t(x) = passes(x) * ms_per_pass + x * ms_per_token + passes(x) * decode_ms_per_pass * decode_share
    passes(x) = ceil(x / batch_tokens)            (0 when x = 0)

where ``decode_share`` is the part of the rank's KV capacity its live sequences fill. The three rates are
fitted per rank from what the router is told. The prefill completions a rank reports from one forward pass (at
most :data:`SAME_PASS_NS` apart) make one sample: its size is their uncached tokens (``isl - cached_tokens``
when the client reported ``cached_tokens``, else what the router booked), its duration runs from when the rank
could start on them (the first one's booking, after the pass then in flight if the rank was busy, or the rank's
previous completion if that came later). The fit is ridge regression towards :data:`PRIOR` (worth
:data:`PRIOR_WEIGHT` samples) with old samples fading by :data:`FORGET` per sample, so a rank that slows down is
followed within some tens of requests. Until a rank has samples its rates are the prior's.

The prior is of the order of an 8B-parameter model on one current data-centre GPU: 20 ms per pass, 50,000
prompt tokens/s, and 50 ms more per pass when the KV cache is full of decoding sequences.

The same reports drive the drift discount: when a rank's reported ``cached_tokens`` fall short of what the
router predicted it held, its predicted overlap is scaled by ``overlap_factor`` (an exponential average of
realised / predicted, at most 1, weight :data:`DRIFT_ALPHA` per report) until the two agree again.

Owned by the shell (one per scope), fed with timestamps and figures that arrive in commands and events; it
reads no clock. Not journaled: a restart starts again from the prior (and from no drift).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from kvrouter.actors.core.ids import WorkerRank


@attrs.frozen
class PrefillRates:
    """One rank's prefill timing (see the module doc): milliseconds per pass, per prompt token, and per pass at a
    full KV cache of decoding sequences."""

    ms_per_pass: float
    ms_per_token: float
    decode_ms_per_pass: float

    def compute_ms(self, tokens: float, batch_tokens: int) -> float:
        """Pass overhead and per-token time of ``tokens`` prompt tokens (no decode interference)."""
        if tokens <= 0:
            return 0.0
        return math.ceil(tokens / batch_tokens) * self.ms_per_pass + tokens * self.ms_per_token

    def decode_ms(self, tokens: float, batch_tokens: int, decode_share: float) -> float:
        """What decoding sequences add to the passes that compute ``tokens`` prompt tokens."""
        if tokens <= 0 or decode_share <= 0:
            return 0.0
        return math.ceil(tokens / batch_tokens) * self.decode_ms_per_pass * decode_share

    def in_flight_ms(self, tokens: float, decode_share: float) -> float:
        """What is left, on average, of the pass a busy rank is running when a request arrives: half a pass
        computing ``tokens`` prompt tokens beside its decoding sequences."""
        return 0.5 * (self.ms_per_pass + tokens * self.ms_per_token + self.decode_ms_per_pass * decode_share)

    def tokens_per_s(self, batch_tokens: int) -> float:
        """Prompt tokens per second at full passes without decoding: the rate operators compare."""
        return 1000.0 / (self.ms_per_token + self.ms_per_pass / batch_tokens)


PRIOR = PrefillRates(ms_per_pass=20.0, ms_per_token=0.02, decode_ms_per_pass=50.0)
PRIOR_WEIGHT = 2.0  # the prior counts as this many samples of a one-pass prompt of 1,024 tokens
FORGET = 0.98  # each new sample multiplies the weight of the older ones by this (about 50 samples of memory)
DRIFT_ALPHA = 0.2  # weight of one cached_tokens report in a rank's overlap factor
DEFAULT_BATCH_TOKENS = 8192  # when a worker's record does not say (vLLM's default for chunked prefill)
SAME_PASS_NS = 1_000_000  # completions on a rank this close together came out of the same forward pass
MAX_BOOKINGS = 65_536  # bookings remembered per scope (the oldest forgotten first beyond this)
_SCALES = (1.0, 1024.0, 0.25)  # a typical sample (passes, tokens, passes * decode share): the prior's strength


@attrs.frozen
class RankTiming:
    """What a ``kv_ttft`` selection knows about one rank beyond the router's loads."""

    rank: WorkerRank
    rates: PrefillRates = PRIOR
    samples: int = 0  # prefill completions fitted so far
    last_prefill_done_at: int | None = None  # ns, the rank's latest prefill completion
    overlap_factor: float = 1.0  # drift discount of its predicted overlap, in [0, 1]


@attrs.frozen
class TtftView:
    """The model as a selection sees it (carried by the command, so ``decide`` stays pure): one row per rank
    with data; other ranks get ``RankTiming(rank)`` (the prior). ``queue_term`` / ``load_term`` False leave the
    queued prefill / the load term out of the cost (ablations, simulator only)."""

    ranks: tuple[RankTiming, ...] = ()
    queue_term: bool = True
    load_term: bool = True
    # Derived from ``ranks`` (never changed after construction): a selection looks every candidate up.
    _by_rank: dict[WorkerRank, RankTiming] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_rank", {row.rank: row for row in self.ranks})

    def timing(self, rank: WorkerRank) -> RankTiming:
        row = self._by_rank.get(rank)
        return row if row is not None else RankTiming(rank)


NO_VIEW = TtftView()


@attrs.frozen
class Outcome:
    """A booking's prefill completed: its TTFT as the router saw it (booking to completion) and what the
    ``kv_ttft`` selection predicted (None when another mode chose the rank)."""

    rank: WorkerRank
    realised_ms: float
    predicted_ms: float | None


class _Booking:
    __slots__ = ("at", "busy", "cacheable", "decode_share", "predicted_cached", "predicted_ms", "rank", "tokens")

    def __init__(self, rank: WorkerRank, at: int, tokens: int, decode_share: float, busy: bool) -> None:
        self.rank = rank
        self.at = at
        self.busy = busy  # the rank was running other requests: a pass was in flight
        self.tokens = tokens  # uncached prompt tokens, as booked
        self.decode_share = decode_share
        self.predicted_ms: float | None = None
        self.predicted_cached: int | None = None
        self.cacheable = 0  # the most tokens an engine can find cached for this prompt


class _Sample:
    """The prefills a rank completed in one pass (completions at most ``SAME_PASS_NS`` apart), measured from when
    the rank could start on them; fitted once the rank completes something later, so that the clients' reports
    of ``cached_tokens`` are in by then."""

    __slots__ = ("end", "fit", "members", "start")

    def __init__(self, start: int, end: int, fit: bool) -> None:
        self.start = start
        self.end = end
        self.fit = fit  # False: something booked earlier on the rank was still computing (out of order)
        self.members: dict[str, tuple[_Booking, int]] = {}  # request -> (booking, uncached tokens found)

    def tokens(self) -> int:
        return sum(tokens for _, tokens in self.members.values())

    def decode_share(self) -> float:
        return max(booking.decode_share for booking, _ in self.members.values())


class _Fit:
    """Ridge regression of sample durations on (passes, tokens, passes * decode share), per rank."""

    __slots__ = ("a", "rates", "samples", "v")

    def __init__(self) -> None:
        self.a = [0.0] * 9  # sum of x x^T (row-major 3 x 3), faded
        self.v = [0.0] * 3  # sum of x y, faded
        self.samples = 0
        self.rates = PRIOR

    def add(self, tokens: int, batch_tokens: int, decode_share: float, duration_ms: float) -> None:
        passes = float(math.ceil(tokens / batch_tokens)) if tokens > 0 else 0.0
        x = (passes, float(tokens), passes * decode_share)
        expected = self.rates.compute_ms(tokens, batch_tokens) + self.rates.decode_ms(
            tokens, batch_tokens, decode_share
        )
        # One odd sample (a preemption, a stall) moves the fit by a bounded step.
        y = min(max(duration_ms, 0.25 * expected), 4.0 * expected + 1.0)
        a, v = self.a, self.v
        for i in range(3):
            v[i] = FORGET * v[i] + x[i] * y
            for j in range(3):
                a[3 * i + j] = FORGET * a[3 * i + j] + x[i] * x[j]
        self.samples += 1
        self.rates = _solve(a, v)


def _solve(a: list[float], v: list[float]) -> PrefillRates:
    """The ridge solution ``(L + A) theta = L theta0 + v`` (L: the prior's precision), within sane bounds."""
    prior = (PRIOR.ms_per_pass, PRIOR.ms_per_token, PRIOR.decode_ms_per_pass)
    m = [list(a[3 * i : 3 * i + 3]) for i in range(3)]
    rhs = list(v)
    for i in range(3):
        weight = PRIOR_WEIGHT * _SCALES[i] * _SCALES[i]
        m[i][i] += weight
        rhs[i] += weight * prior[i]
    theta = _gauss(m, rhs)
    return PrefillRates(
        ms_per_pass=min(max(theta[0], 0.0), 10.0 * prior[0]),
        ms_per_token=min(max(theta[1], prior[1] / 10.0), 10.0 * prior[1]),
        decode_ms_per_pass=min(max(theta[2], 0.0), 10.0 * prior[2]),
    )


def _gauss(m: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small symmetric positive-definite system by elimination with partial pivoting."""
    n = len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for row in range(col + 1, n):
            f = m[row][col] / m[col][col]
            for k in range(col, n):
                m[row][k] -= f * m[col][k]
            rhs[row] -= f * rhs[col]
    out = [0.0] * n
    for row in range(n - 1, -1, -1):
        out[row] = (rhs[row] - sum(m[row][k] * out[k] for k in range(row + 1, n))) / m[row][row]
    return out


class PrefillModel:
    """One scope's bookings in flight, per-rank fits, last completions and drift factors (see the module doc).

    ``fit`` False keeps the prior (the ablation without a throughput model); ``drift`` False keeps every
    overlap factor at 1 (the ablation without the drift discount).
    """

    def __init__(self, *, fit: bool = True, drift: bool = True, max_bookings: int = MAX_BOOKINGS) -> None:
        self.fit_enabled = fit
        self.drift_enabled = drift
        self.max_bookings = max_bookings
        self._bookings: dict[str, _Booking] = {}  # booking order
        self._queues: dict[WorkerRank, dict[str, None]] = {}  # per rank, its bookings in booking order
        self._fits: dict[WorkerRank, _Fit] = {}
        self._last_done: dict[WorkerRank, int] = {}
        self._factors: dict[WorkerRank, float] = {}
        self._pending: dict[WorkerRank, _Sample] = {}  # at most one per rank
        self._view: TtftView | None = None
        self.forgotten = 0

    # -- what the router is told ---------------------------------------------------------------------------

    def booked(
        self, request_id: str, rank: WorkerRank, at: int, tokens: int, decode_share: float, busy: bool = False
    ) -> None:
        """A request was booked on ``rank`` at ``at`` (ns) with ``tokens`` uncached prompt tokens; ``busy``: the
        rank was running other requests then."""
        self._drop(request_id)
        self._bookings[request_id] = _Booking(rank, at, tokens, decode_share, busy)
        self._queues.setdefault(rank, {})[request_id] = None
        if len(self._bookings) > self.max_bookings:
            self._drop(next(iter(self._bookings)))
            self.forgotten += 1

    def predicted(self, request_id: str, ttft_ms: float | None, cached_tokens: int, cacheable: int) -> None:
        """What the selection that booked ``request_id`` predicted: its TTFT (``kv_ttft`` only) and the tokens
        the chosen rank holds, as booked; ``cacheable`` is the most an engine can find cached for the prompt
        (it always computes the last token), which drift compares reports with."""
        booking = self._bookings.get(request_id)
        if booking is not None:
            booking.predicted_ms = ttft_ms
            booking.predicted_cached = max(0, cached_tokens)
            booking.cacheable = max(0, cacheable)

    def completed(self, request_id: str, at: int, batch_tokens: int) -> Outcome | None:
        """The request's prefill completed at ``at`` (ns); None if its booking is unknown here."""
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return None
        rank = booking.rank
        queue = self._queues[rank]
        oldest = next(iter(queue)) == request_id
        del queue[request_id]
        if not queue:
            del self._queues[rank]
        sample = self._pending.get(rank)
        if sample is None or at - sample.end > SAME_PASS_NS:
            if sample is not None:
                self._settle(rank, sample, batch_tokens)
            start = self._last_done.get(rank, booking.at)
            if booking.at >= start:  # it could start once the pass in flight then was over
                fit = self._fits.get(rank)
                wait = (fit.rates if fit is not None else PRIOR).in_flight_ms(0, booking.decode_share)
                start = booking.at + (round(wait * 1e6) if booking.busy else 0)
            sample = self._pending[rank] = _Sample(min(start, at), at, oldest)
        sample.end = max(sample.end, at)
        sample.fit = sample.fit and oldest
        sample.members[request_id] = (booking, booking.tokens)
        self._last_done[rank] = max(at, self._last_done.get(rank, at))
        self._view = None
        return Outcome(rank, (at - booking.at) / 1e6, booking.predicted_ms)

    def reported(self, request_id: str, cached_tokens: int | None) -> None:
        """The client's report for a completed prefill: what the engine found cached (None: it did not say)."""
        if cached_tokens is None:
            return
        for sample in self._pending.values():
            member = sample.members.get(request_id)
            if member is not None:
                booking = member[0]
                predicted = booking.predicted_cached
                if predicted is not None:
                    # The booked figure, corrected by what was found.
                    sample.members[request_id] = (booking, max(1, booking.tokens + predicted - cached_tokens))
                    self._drift(booking, predicted, cached_tokens)
                return

    def released(self, request_id: str) -> None:
        """The booking ended (freed, expired) whether or not its prefill completed."""
        if self._drop(request_id):
            self._view = None

    def rank_removed(self, rank: WorkerRank) -> None:
        for request_id in list(self._queues.get(rank, ())):
            self._drop(request_id)
        for table in (self._fits, self._last_done, self._factors, self._pending):
            table.pop(rank, None)
        self._view = None

    # -- what a selection reads ----------------------------------------------------------------------------

    def view(self, queue_term: bool = True, load_term: bool = True) -> TtftView:
        """The per-rank rows a selection needs (built again only after something changed)."""
        view = self._view
        if view is None or (view.queue_term, view.load_term) != (queue_term, load_term):
            ranks = sorted(set(self._fits) | set(self._last_done) | set(self._factors))
            view = self._view = TtftView(tuple(self._row(rank) for rank in ranks), queue_term, load_term)
        return view

    def rows(self) -> Iterable[RankTiming]:
        return self.view().ranks

    @property
    def in_flight(self) -> int:
        return len(self._bookings)

    # -- internals -----------------------------------------------------------------------------------------

    def _row(self, rank: WorkerRank) -> RankTiming:
        fit = self._fits.get(rank)
        return RankTiming(
            rank,
            fit.rates if fit is not None else PRIOR,
            fit.samples if fit is not None else 0,
            self._last_done.get(rank),
            self._factors.get(rank, 1.0),
        )

    def _settle(self, rank: WorkerRank, sample: _Sample, batch_tokens: int) -> None:
        if not (self.fit_enabled and sample.fit):
            return
        fit = self._fits.get(rank)
        if fit is None:
            fit = self._fits[rank] = _Fit()
        fit.add(sample.tokens(), batch_tokens, sample.decode_share(), (sample.end - sample.start) / 1e6)

    def _drift(self, booking: _Booking, predicted: int, cached_tokens: int) -> None:
        expected = min(predicted, booking.cacheable)
        if not self.drift_enabled or expected <= 0:
            return
        factor = self._factors.get(booking.rank, 1.0)
        factor += DRIFT_ALPHA * (min(1.0, cached_tokens / expected) - factor)
        if factor >= 0.999:
            self._factors.pop(booking.rank, None)  # agreed again: no discount left to carry
        else:
            self._factors[booking.rank] = factor
        self._view = None

    def _drop(self, request_id: str) -> bool:
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return False
        queue = self._queues.get(booking.rank)
        if queue is not None:
            queue.pop(request_id, None)
            if not queue:
                del self._queues[booking.rank]
        return True
