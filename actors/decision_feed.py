"""DecisionFeed: the explained selections of this process, for ``GET /ws/decisions``.

Selections are explained only while someone reads the feed (a reader's poll takes a lease of
``LEASE_SECONDS``) or the request asked for it (``"explain": true``): with nobody reading, a selection pays
one attribute check (``wanted``). The actor publishes each explained, accepted selection (O(candidates):
its record is built once); readers (one hub per process, ``api/streams/decisions.py``) hold a cursor and take
what came after it.

Bounds: the records kept are bounded in count (``max_records``) and estimated bytes (``max_bytes``); policy:
drop oldest. A reader whose cursor fell behind the oldest kept record is told how many it missed.
Counters: ``published``, ``by_reason`` (explained selections by reason), ``evicted``.
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import Any

import attrs
import trio

from kvrouter.actors.core.explanation import Explanation
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.metric_families import Family, Labels, counter

MAX_RECORDS = 4096
MAX_BYTES = 8 * 1024 * 1024
LEASE_SECONDS = 10.0  # a reader's poll keeps selections explained this long
MAX_WAIT_SECONDS = 2.0  # a poll waits at most this long for a decision (well under a front's reply deadline)
RECORD_BYTES = 400  # estimated size of a record without its candidates
CANDIDATE_BYTES = 300  # estimated size of one candidate's terms


@attrs.frozen
class DecisionRecord:
    """One accepted selection and why: what ``/select`` answered, plus the explanation."""

    seq: int  # this process's decision sequence: a gap means decisions were dropped
    at: int  # the selection's clock time, ns
    scope: ScopeKey
    reserved: bool  # select_and_reserve (booked) or select
    selection_id: str | None
    reservation_id: str | None
    endpoint: str | None
    overlap: dict[str, Any]
    effective_prefill_tokens: int
    potential_decode_blocks: int
    explanation: Explanation


@attrs.frozen
class DecisionBatch:
    """What a reader gets: the records after its cursor, and how many it missed (dropped before it read)."""

    epoch: str
    cursor: int
    missed: int
    records: list[DecisionRecord]


class DecisionFeed:
    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES) -> None:
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: deque[tuple[DecisionRecord, int]] = deque()
        self._bytes = 0
        self._changed = trio.Event()
        self._leased = False
        self._lease_until = 0.0
        self.published = 0
        self.evicted = 0
        self.by_reason: dict[str, int] = {}

    @property
    def wanted(self) -> bool:
        """Whether a reader holds a lease (selections are then explained and published)."""
        if not self._leased:
            return False
        if trio.current_time() < self._lease_until:
            return True
        self._leased = False
        return False

    def lease(self, seconds: float = LEASE_SECONDS) -> None:
        self._lease_until = max(self._lease_until, trio.current_time() + seconds)
        self._leased = True

    def count(self, explanation: Explanation) -> None:
        reason = explanation.reason or "unknown"
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def publish(self, record: DecisionRecord) -> None:
        """Keep ``record`` (its ``seq`` taken from ``next_seq``); the oldest go beyond the bounds."""
        size = RECORD_BYTES + CANDIDATE_BYTES * len(record.explanation.candidates)
        self._records.append((record, size))
        self._bytes += size
        self.published += 1
        while len(self._records) > self.max_records or (self._bytes > self.max_bytes and len(self._records) > 1):
            _, dropped = self._records.popleft()
            self._bytes -= dropped
            self.evicted += 1
        self._changed.set()

    def families(self) -> list[Family]:
        """For ``GET /metrics`` (a ``SelectService.metric_sources`` entry)."""
        reasons: dict[Labels, float] = {(reason,): float(count) for reason, count in self.by_reason.items()}
        return [
            counter(
                "kvrouter_selections_explained",
                "Selections explained (while /ws/decisions is read, or explain: true), by reason",
                ("reason",),
                reasons,
            ),
            counter(
                "kvrouter_decisions_evicted",
                "Decisions the feed dropped before every reader took them",
                (),
                {(): float(self.evicted)},
            ),
        ]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def since(self, cursor: int) -> tuple[list[DecisionRecord], int]:
        """The records after ``cursor`` and how many after it are no longer kept."""
        records = [record for record, _ in self._records if record.seq > cursor]
        first = records[0].seq if records else self.seq + 1
        return records, max(0, first - cursor - 1)

    async def read(self, epoch: str, cursor: int, wait_seconds: float) -> DecisionBatch:
        """A reader's poll: takes the lease; a reader of another epoch starts from now (no history)."""
        self.lease()
        if epoch != self.epoch or not 0 <= cursor <= self.seq:
            return DecisionBatch(self.epoch, self.seq, 0, [])
        with trio.move_on_after(min(max(wait_seconds, 0.0), MAX_WAIT_SECONDS)):
            while self.seq <= cursor:
                if self._changed.is_set():
                    self._changed = trio.Event()
                await self._changed.wait()
        records, missed = self.since(cursor)
        return DecisionBatch(self.epoch, self.seq, missed, records)
