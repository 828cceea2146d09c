"""DecisionFeed: the explained selections of this process, for ``GET /ws/decisions``.

Selections are explained only while someone reads the feed (a reader's poll takes a lease of
``LEASE_SECONDS``) or the request asked for it (``"explain": true``): with nobody reading, a selection pays
one attribute check (``leased``). The actor publishes each explained, accepted selection (O(candidates):
its record is built once); readers (one hub per process, ``api/streams/decisions.py``) hold a cursor and take
what came after it.

Explaining costs about as much as selecting, so a reader's poll also says, per filter of its subscribers, how
many decisions a second it can hand out (``Want``: its fan-out budget's share): the feed explains at most that
many of the selections each filter matches (``ExplainBudget``), not every selection: 250 subscribers who get a
few decisions a second each no longer make the service explain hundreds, and filters that match nothing cost
nothing. An accepted selection the budget passes over still takes a ``seq``, so readers see it as a gap (and
count it as missed) like a decision dropped later.

Bounds: the records kept are bounded in count (``max_records``) and estimated bytes (``max_bytes``); policy:
drop oldest. A reader whose cursor fell behind the oldest kept record is told how many it missed.
Counters: ``published``, ``passed`` (accepted selections not explained: over the budget), ``by_reason``
(explained selections by reason), ``evicted``.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from typing import Any

import attrs
import trio

from kvrouter.actors.core.explanation import Explanation
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.metric_families import Family, Labels, counter
from kvrouter.actors.service_support import EVERY_SCOPE, ScopeFilter

MAX_RECORDS = 4096
MAX_BYTES = 8 * 1024 * 1024
LEASE_SECONDS = 10.0  # a reader's poll keeps selections explained this long
MAX_WAIT_SECONDS = 2.0  # a poll waits at most this long for a decision (well under a front's reply deadline)
RECORD_BYTES = 400  # estimated size of a record without its candidates
CANDIDATE_BYTES = 300  # estimated size of one candidate's terms
RATE_HOLD_SECONDS = 5.0  # a reader's explanation rate counts this long after its poll (longer than a poll takes)
BURST_SECONDS = 2.0  # the explanation budget holds at most this long of its rate (a hub's longest pause)
MAX_READERS = 64  # readers whose rates are remembered (one hub per process); policy: forget the least recent
MAX_WANTS = 1024  # filters one reader's rates name (a hub has one per subscriber at most); the rest are ignored
MAX_SCOPES = 4096  # scopes whose matching filters are remembered; policy: forget all, rebuild on use


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


UNEXPLAINED = Explanation("", 0.0, 0, 0, [])  # a selection a reader might see, not explained: over the budget


@attrs.frozen
class Want:
    """A reader's explanation rate for the selections one filter of its subscribers matches."""

    wanted: ScopeFilter
    per_second: float


EVERY_SELECTION = [Want(EVERY_SCOPE, math.inf)]  # what a reader that names no rate asks for


class _Bucket:
    """One filter's explanation budget: a token bucket filled at ``rate`` a second, holding ``BURST_SECONDS``
    of it (at least one); it starts full (a new subscriber's first decisions are explained)."""

    __slots__ = ("filled_at", "rate", "tokens")

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.tokens = self.burst
        self.filled_at = now

    @property
    def burst(self) -> float:
        return max(self.rate * BURST_SECONDS, 1.0)

    def _fill(self, now: float) -> None:
        if self.rate == math.inf:
            self.tokens = math.inf
        elif self.rate > 0:
            self.tokens = min(self.tokens + (now - self.filled_at) * self.rate, self.burst)
        self.filled_at = now

    def retune(self, rate: float, now: float) -> None:
        self._fill(now)
        self.rate = rate
        self.tokens = min(self.tokens, self.burst)

    def take(self, now: float) -> bool:
        if self.rate == math.inf:
            return True
        self._fill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class ExplainBudget:
    """Which selections may be explained: one bucket per filter the readers' subscribers use, filled at the
    highest rate a reader asked for it in its last ``RATE_HOLD_SECONDS`` (readers are the hubs of the front
    processes: each gets every record, so the highest, not the sum). A selection is explained when a bucket
    of a filter matching its scope has a token (each such bucket with one pays: its subscribers get it); a
    filter that matches nothing costs nothing. Times are trio's clock, passed in."""

    def __init__(self) -> None:
        self._asked: dict[str, tuple[list[Want], float]] = {}  # reader -> (its wants, until)
        self._buckets: dict[ScopeFilter, _Bucket] = {}
        self._by_scope: dict[ScopeKey, list[_Bucket]] = {}  # the buckets matching a scope (cleared on changes)

    def ask(self, reader: str, wants: list[Want], now: float) -> None:
        asked = self._asked
        asked.pop(reader, None)
        asked[reader] = (wants[:MAX_WANTS], now + RATE_HOLD_SECONDS)
        for name in [name for name, (_, until) in asked.items() if until <= now]:
            del asked[name]
        while len(asked) > MAX_READERS:
            del asked[next(iter(asked))]
        rates: dict[ScopeFilter, float] = {}
        for reader_wants, _ in asked.values():
            for want in reader_wants:
                rates[want.wanted] = max(rates.get(want.wanted, 0.0), want.per_second)
        buckets = self._buckets
        if rates.keys() != buckets.keys():
            self._by_scope.clear()
            for gone in buckets.keys() - rates.keys():
                del buckets[gone]
        for wanted, rate in rates.items():
            bucket = buckets.get(wanted)
            if bucket is None:
                buckets[wanted] = _Bucket(rate, now)
            elif bucket.rate != rate:
                bucket.retune(rate, now)

    def take(self, scope: ScopeKey, now: float) -> bool:
        """Whether a selection of ``scope`` may be explained now (and count it)."""
        buckets = self._by_scope.get(scope)
        if buckets is None:
            if len(self._by_scope) >= MAX_SCOPES:
                self._by_scope.clear()
            buckets = self._by_scope[scope] = [bucket for wanted, bucket in self._buckets.items() if wanted(scope)]
        taken = False
        for bucket in buckets:
            if bucket.take(now):
                taken = True
        return taken


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
        self.leased = False  # a reader holds a lease (checked on every selection: a plain attribute)
        self._lease_until = 0.0
        self.budget = ExplainBudget()
        self.published = 0
        self.passed = 0
        self.evicted = 0
        self.by_reason: dict[str, int] = {}

    @property
    def wanted(self) -> bool:
        """Whether a reader holds a lease (explained selections are then published)."""
        if not self.leased:
            return False
        if trio.current_time() < self._lease_until:
            return True
        self.leased = False
        return False

    def lease(self, seconds: float = LEASE_SECONDS, wants: list[Want] | None = None, reader: str = "") -> None:
        """Keep selections published ``seconds``, explaining at most what ``wants`` asks (None: every one) for
        ``reader`` (see ``ExplainBudget``)."""
        now = trio.current_time()
        self.budget.ask(reader, EVERY_SELECTION if wants is None else wants, now)
        self._lease_until = max(self._lease_until, now + seconds)
        self.leased = True

    def take(self, scope: ScopeKey) -> bool:
        """Whether to explain this selection of ``scope`` (a reader holds a lease): within the budget. If not,
        and it is accepted, ``skip`` numbers it."""
        now = trio.current_time()
        if now >= self._lease_until:
            self.leased = False
            return False
        return self.budget.take(scope, now)

    def skip(self) -> None:
        """An accepted selection that was not explained: it takes a ``seq`` (a gap readers count as missed)."""
        self.seq += 1
        self.passed += 1

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
                "kvrouter_decisions_not_explained",
                "Selections made while /ws/decisions is read that were not explained: over its explanation budget",
                (),
                {(): float(self.passed)},
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
        """The records after ``cursor`` and how many numbers after it have none: dropped, or not explained."""
        records = [record for record, _ in self._records if record.seq > cursor]
        return records, max(0, self.seq - cursor - len(records))

    async def read(
        self, epoch: str, cursor: int, wait_seconds: float, wants: list[Want] | None = None, reader: str = ""
    ) -> DecisionBatch:
        """A reader's poll: takes the lease (explaining at most what ``wants`` asks); a reader of another epoch
        starts from now (no history)."""
        self.lease(wants=wants, reader=reader)
        if epoch != self.epoch or not 0 <= cursor <= self.seq:
            return DecisionBatch(self.epoch, self.seq, 0, [])
        with trio.move_on_after(min(max(wait_seconds, 0.0), MAX_WAIT_SECONDS)):
            while self.seq <= cursor:
                if self._changed.is_set():
                    self._changed = trio.Event()
                await self._changed.wait()
        records, missed = self.since(cursor)
        return DecisionBatch(self.epoch, self.seq, missed, records)
