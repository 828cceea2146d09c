"""Per-rank KV mode: score a rank on its KV-event index (exact) or on its predicted (booked) blocks.

Pure; the shell keeps each rank's stream timestamps and passes them in with the current time. In
approximate mode (``--no-use-kv-events``) every rank is predicted. With KV events, kvrouter goes beyond the
reference: a rank whose stream is absent, or silent for ``kv_events_stale_secs`` after a request was booked on
it (an engine that serves a request stores blocks and says so), is scored on what was booked on it until its
events resume; the next batch it sends makes it exact again.
"""

from __future__ import annotations

import enum

import attrs

NS_PER_SECOND = 1_000_000_000


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


def _seconds(ns: int) -> str:
    return f"{ns / NS_PER_SECOND:.1f} s"
