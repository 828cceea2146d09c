"""Per-rank KV mode: score a rank on its KV-event index (exact) or on its predicted (booked) blocks.

Pure; the shell keeps each rank's stream timestamps and hands them over (a ``StreamView`` on each selection,
stamped with the current time), and the scope decides which of its ranks are predicted (``predicted_ranks``). In
approximate mode (``--no-use-kv-events``) every rank is predicted. With KV events, kvrouter goes beyond the
reference: a rank whose stream is absent, or silent for ``kv_events_stale_secs`` after a request was booked on
it (an engine that serves a request stores blocks and says so), is scored on what was booked on it until its
events resume; the next batch it sends makes it exact again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import WorkerRank

NS_PER_SECOND = 1_000_000_000
NO_RANKS: frozenset[WorkerRank] = frozenset()


class KvMode(enum.Enum):
    EXACT = "exact"
    PREDICTED = "predicted"


@attrs.frozen
class StreamHealth:
    """What the shell knows about one rank's KV-event stream."""

    connected: bool
    disconnected_since_ns: int | None = None  # when it last stopped (or never started) being connected
    first_unanswered_booking_ns: int | None = None  # the earliest booking on the rank since its last batch


@attrs.frozen
class RankMode:
    mode: KvMode
    reason: str | None = None  # why a rank is predicted, for operators


EXACT = RankMode(KvMode.EXACT)


def rank_mode(health: StreamHealth, now_ns: int, stale_after_secs: float) -> RankMode:
    """Exact while the stream is connected and has answered every booking older than ``stale_after_secs``;
    predicted while it has been down that long, or silent that long after a booking. 0 disables the fallback."""
    if stale_after_secs <= 0:
        return EXACT
    stale_ns = round(stale_after_secs * NS_PER_SECOND)
    if not health.connected:
        since = health.disconnected_since_ns
        if since is not None and now_ns - since >= stale_ns:
            return RankMode(KvMode.PREDICTED, f"no KV-event stream for {_seconds(now_ns - since)}")
        return EXACT
    booked = health.first_unanswered_booking_ns
    if booked is not None and now_ns - booked >= stale_ns:
        return RankMode(KvMode.PREDICTED, f"no KV events for {_seconds(now_ns - booked)} after a booking")
    return EXACT


@attrs.frozen
class StreamView:
    """What the shell knows of the KV-event streams when a selection is asked, carried by the selection: the
    ranks whose listener is not connected, each with when it was first seen so, and the ranks of the selection's
    scope whose listener is connected but has not answered a booking yet, each with the earliest such booking.
    Every other rank (connected and answered, or without a listener at all) is exact."""

    down_since: tuple[tuple[WorkerRank, int], ...] = ()
    unanswered_since: tuple[tuple[WorkerRank, int], ...] = ()
    # The scope's ranks out of selection: their stream stopped while they had traffic (``kv_liveness.py``).
    out: tuple[WorkerRank, ...] = ()


HEALTHY = StreamView()  # every stream connected and up to date: what nearly every selection carries


def predicted_ranks(
    workers: Iterable[WorkerRecord], view: StreamView, now_ns: int, stale_after_secs: float
) -> frozenset[WorkerRank]:
    """The ranks of ``workers`` to score on predicted blocks now: those whose ``rank_mode`` is predicted, given
    what ``view`` says of their streams. Every selection asks, so a healthy view costs nothing."""
    if not (view.down_since or view.unanswered_since) or stale_after_secs <= 0:
        return NO_RANKS
    down, unanswered = dict(view.down_since), dict(view.unanswered_since)
    predicted = []
    for record in workers:
        for rank in record.ranks:
            since = down.get(rank)
            if since is not None:
                health = StreamHealth(False, since)
            else:
                booked = unanswered.get(rank)
                if booked is None:
                    continue
                health = StreamHealth(True, None, booked)
            if rank_mode(health, now_ns, stale_after_secs).mode is KvMode.PREDICTED:
                predicted.append(rank)
    return frozenset(predicted) if predicted else NO_RANKS


def _seconds(ns: int) -> str:
    return f"{ns / NS_PER_SECOND:.1f} s"
