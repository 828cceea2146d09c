"""Seams for time: production stamps commands with wall-clock time, simulations with trio's clock.

``trio.current_time()`` is monotonic with a random offset, so it is never written to a journal in
production; under a MockClock it is virtual and deterministic, which is what simulations want.
"""

from __future__ import annotations

import time
from typing import Protocol

import trio


class Clock(Protocol):
    def now_ns(self) -> int:
        """Nanoseconds since the Unix epoch (or since the start of a simulation)."""


class WallClock:
    def now_ns(self) -> int:
        return time.time_ns()


class TrioClock:
    """Virtual time for simulations: ``epoch_ns`` plus trio's (mock) clock, so runs replay exactly."""

    def __init__(self, epoch_ns: int = 1_700_000_000_000_000_000) -> None:
        self._epoch_ns = epoch_ns
        self._origin = trio.current_time()

    def now_ns(self) -> int:
        return self._epoch_ns + round((trio.current_time() - self._origin) * 1e9)
