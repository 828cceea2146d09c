"""Durations kept as histogram bucket counts, for metrics: one ``observe`` is a bisect and two additions.

The journal times its batch writes and segment fsyncs into these; ``GET /metrics`` reads
them at scrape time. Plain counters, so the write path gains no metrics library call and no lock.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

# Seconds: an fsync takes ~50 µs on a fast NVMe, several ms on a network disk, seconds on a stalled one.
LATENCY_BOUNDS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class BucketCounts:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)
