"""The selection part of a scope: the partition's catalog, KV block index and what feeds it.

A partition's block size is fixed by its first schedulable worker and then kept for the life of the
partition, even after its last worker leaves (1.6.1 keeps listing such a partition in ``/loads`` and
``/dump`` and reconciles later workers against that size). Mutated only by ``evolve``; the
schedulable cache is derived and never snapshotted.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.constraints import can_decode
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import KvIndex, Tier
from kvrouter.actors.core.sessions import SessionBinding


class SelectionState:
    __slots__ = (
        "approx_count",
        "approx_expiry",
        "catalog",
        "decoders_cache",
        "index",
        "kv_watermarks",
        "partition_block_size",
        "predicted",
        "schedulable_cache",
        "session_of",
        "sessions",
    )

    def __init__(self) -> None:
        self.partition_block_size: int | None = None
        self.catalog: dict[int, WorkerRecord] = {}
        # What the workers' KV events (and peers' dumps) say is cached.
        self.index = KvIndex()
        # Per rank, the last KV-event sequence number applied (a restarted service resumes each stream there).
        self.kv_watermarks: dict[WorkerRank, int] = {}
        # Predicted blocks (behaviour.md#approximate-mode): what was booked on a rank scored without KV events, kept
        # apart from the
        # event-fed index so that the two never rename each other's blocks.
        self.predicted = KvIndex()
        # When each predicted block stops counting as cached, per rank, in booking order (a re-booked block
        # moves to the end), which is expiry order while the TTL is fixed: pruning takes the oldest first.
        self.approx_expiry: dict[WorkerRank, dict[int, int]] = {}
        self.approx_count = 0  # derived: entries in approx_expiry
        # Session affinity, least recently used first; ``session_of`` (derived) maps a booking to its session.
        self.sessions: dict[str, SessionBinding] = {}
        self.session_of: dict[str, str] = {}
        # Derived: schedulable records per (use_kv_events, queueing), dropped by evolve whenever the catalog
        # or the partition's block size changes.
        self.schedulable_cache: dict[tuple[bool, bool], tuple[WorkerRecord, ...]] = {}
        # Derived as schedulable_cache is (dropped with it): those of them that can decode.
        self.decoders_cache: dict[tuple[bool, bool], tuple[WorkerRecord, ...]] = {}

    @property
    def exists(self) -> bool:
        """Once a partition has a block size it stays; before that it lives while it has records or blocks
        (blocks can arrive from a peer's ``/dump`` before any worker registers)."""
        return (
            bool(self.catalog)
            or self.partition_block_size is not None
            or not self.index.is_empty()
            or not self.predicted.is_empty()
        )

    @property
    def listed(self) -> bool:
        """Whether ``/loads`` shows the partition: once a schedulable worker fixed its block size."""
        return self.partition_block_size is not None

    def schedulable(self, use_kv_events: bool, queueing: bool = False) -> tuple[WorkerRecord, ...]:
        """Records that can take requests, in catalog order (cached until the catalog or block size changes)."""
        key = (use_kv_events, queueing)
        cached = self.schedulable_cache.get(key)
        if cached is None:
            cached = self.schedulable_cache[key] = self._schedulable(use_kv_events, queueing)
        return cached

    def schedulable_decoders(self, use_kv_events: bool, queueing: bool = False) -> tuple[WorkerRecord, ...]:
        """The schedulable records that can decode (all but prefill-only workers), in catalog order; cached as
        ``schedulable`` is (every aggregated selection asks)."""
        key = (use_kv_events, queueing)
        cached = self.decoders_cache.get(key)
        if cached is None:
            workers = self.schedulable(use_kv_events, queueing)
            decoders = tuple(record for record in workers if can_decode(record))
            cached = self.decoders_cache[key] = workers if len(decoders) == len(workers) else decoders
        return cached

    def _schedulable(self, use_kv_events: bool, queueing: bool = False) -> tuple[WorkerRecord, ...]:
        block_size = self.partition_block_size
        return tuple(
            record
            for record in self.catalog.values()
            if not not_schedulable_reasons(
                record, use_kv_events=use_kv_events, partition_block_size=block_size, queueing=queueing
            )
        )

    # -- mutations (evolve only) ------------------------------------------------------------------------

    def put_record(self, record: WorkerRecord, partition_block_size: int | None) -> None:
        self.schedulable_cache.clear()
        self.decoders_cache.clear()
        self.catalog[record.worker_id] = record
        self.partition_block_size = partition_block_size

    def remove_record(self, worker_id: int) -> None:
        self.schedulable_cache.clear()
        self.decoders_cache.clear()
        del self.catalog[worker_id]

    def forget_stream(self, rank: WorkerRank) -> None:
        """Another publisher speaks for the rank (or its own restarted): what it said no longer holds."""
        self.index.apply_cleared(rank)
        self.kv_watermarks.pop(rank, None)

    def forget_rank(self, rank: WorkerRank) -> None:
        self.index.remove_rank(rank)
        self.kv_watermarks.pop(rank, None)
        self.predicted.remove_rank(rank)
        self.approx_count -= len(self.approx_expiry.pop(rank, {}))

    def rewind_streams(self, before: dict[WorkerRank, int]) -> int:
        """Recovery only, after it skipped a damaged KV record it cannot read: move each KV-event watermark back
        to where ``before`` (the watermarks just before that record) had it, or drop it if ``before`` had none,
        so the rank's listener asks its worker to replay from there and the lost batches come back. A watermark
        below ``before``'s belongs to a stream that restarted since (the skipped batches died with the old one):
        it stays. Returns how many moved."""
        moved = 0
        for rank, seq in list(self.kv_watermarks.items()):
            earlier = before.get(rank)
            if earlier is None:
                del self.kv_watermarks[rank]
            elif earlier < seq:
                self.kv_watermarks[rank] = earlier
            else:
                continue
            moved += 1
        return moved

    def book_predicted(self, rank: WorkerRank, blocks: tuple[tuple[int, int], ...], expires_at: int) -> None:
        self.predicted.apply_stored(rank, Tier.DEVICE, None, blocks)
        expiry = self.approx_expiry.setdefault(rank, {})
        for seq_hash, _ in blocks:
            if expiry.pop(seq_hash, None) is None:
                self.approx_count += 1
            expiry[seq_hash] = expires_at  # to the young end

    def expire_predicted(self, rank: WorkerRank, block_hashes: tuple[int, ...]) -> None:
        self.predicted.apply_removed(rank, Tier.DEVICE, block_hashes)
        expiry = self.approx_expiry.get(rank, {})
        for seq_hash in block_hashes:
            if expiry.pop(seq_hash, None) is not None:
                self.approx_count -= 1
        if not expiry:
            self.approx_expiry.pop(rank, None)

    def bind_session(self, session_id: str, binding: SessionBinding) -> None:
        old = self.sessions.pop(session_id, None)  # to the recently used end
        if old is not None:
            for request_id in old.requests - binding.requests:
                self.session_of.pop(request_id, None)
        self.sessions[session_id] = binding
        for request_id in binding.requests:
            self.session_of[request_id] = session_id

    def drop_session(self, session_id: str) -> None:
        binding = self.sessions.pop(session_id, None)
        if binding is not None:
            for request_id in binding.requests:
                self.session_of.pop(request_id, None)

    # -- snapshot ---------------------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "partition_block_size": self.partition_block_size,
            "catalog": [record.to_plain() for record in self.catalog.values()],
            "index": self.index.to_snapshot(),
            "kv_watermarks": [[r.worker_id, r.dp_rank, seq] for r, seq in self.kv_watermarks.items()],
            "approx_expiry": [
                [r.worker_id, r.dp_rank, list(map(list, expiry.items()))] for r, expiry in self.approx_expiry.items()
            ],
            "predicted": self.predicted.to_snapshot(),
            "sessions": [[session_id, binding.to_plain()] for session_id, binding in self.sessions.items()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> SelectionState:
        selection = cls()
        selection.partition_block_size = data["partition_block_size"]
        for plain in data["catalog"]:
            record = WorkerRecord.from_plain(plain)
            selection.catalog[record.worker_id] = record
        selection.index = KvIndex.from_snapshot(data["index"])
        selection.kv_watermarks = {WorkerRank(w, r): seq for w, r, seq in data["kv_watermarks"]}
        selection.approx_expiry = {WorkerRank(w, r): {h: t for h, t in items} for w, r, items in data["approx_expiry"]}
        selection.approx_count = sum(map(len, selection.approx_expiry.values()))
        selection.predicted = KvIndex.from_snapshot(data["predicted"])
        for session_id, plain in data["sessions"]:
            selection.bind_session(session_id, SessionBinding.from_plain(plain))
        return selection

    # -- invariants -------------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Messages for every broken invariant (empty when sound), the KV index's own included."""
        problems = [f"KV index: {problem}" for problem in self.index.check()]
        for worker_id, record in self.catalog.items():
            if record.worker_id != worker_id:
                problems.append(f"catalog entry {worker_id} holds worker {record.worker_id}")
        if self.partition_block_size is not None and self.partition_block_size <= 0:
            problems.append(f"partition block size {self.partition_block_size}")
        problems.extend(f"predicted index: {problem}" for problem in self.predicted.check())
        for (use_kv_events, queueing), cached in self.schedulable_cache.items():
            if cached != self._schedulable(use_kv_events, queueing):
                with_queue = ", queueing=True" if queueing else ""
                problems.append(f"stale schedulable cache (use_kv_events={use_kv_events}{with_queue})")
        for (use_kv_events, queueing), cached in self.decoders_cache.items():
            if cached != tuple(r for r in self._schedulable(use_kv_events, queueing) if can_decode(r)):
                with_queue = ", queueing=True" if queueing else ""
                problems.append(f"stale schedulable decoders cache (use_kv_events={use_kv_events}{with_queue})")
        for rank, expiry in self.approx_expiry.items():
            if not expiry:
                problems.append(f"{rank}: empty approximate-mode expiry kept")
        if self.approx_count != sum(map(len, self.approx_expiry.values())):
            problems.append(f"predicted block count {self.approx_count} does not match the expiry entries")
        if self.approx_count < self.predicted.block_count():
            problems.append("a predicted block has no expiry")
        expected = {r: s for s, b in self.sessions.items() for r in b.requests}
        if self.session_of != expected:
            problems.append("the booking-to-session map does not match the sessions' bookings")
        return problems
