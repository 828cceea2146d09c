"""The selection part of a scope: the partition's catalog, KV block index and what feeds it.

A partition's block size is fixed by its first schedulable worker and then kept for the life of the
partition, even after its last worker leaves (1.6.1 keeps listing such a partition in ``/loads`` and
``/dump`` and reconciles later workers against that size). Mutated only by ``evolve``; the
schedulable cache is derived and never snapshotted.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import KvIndex


class SelectionState:
    __slots__ = ("approx_expiry", "catalog", "index", "kv_watermarks", "partition_block_size", "schedulable_cache")

    def __init__(self) -> None:
        self.partition_block_size: int | None = None
        self.catalog: dict[int, WorkerRecord] = {}
        self.index = KvIndex()
        # Per rank, the last KV-event sequence number applied (a restarted service resumes each stream there).
        self.kv_watermarks: dict[WorkerRank, int] = {}
        # Approximate mode: when each booked block stops counting as cached, per rank.
        self.approx_expiry: dict[WorkerRank, dict[int, int]] = {}
        # Derived: schedulable records per use_kv_events setting, dropped by evolve whenever the catalog
        # or the partition's block size changes.
        self.schedulable_cache: dict[bool, tuple[WorkerRecord, ...]] = {}

    @property
    def exists(self) -> bool:
        """Once a partition has a block size it stays; before that it lives while it has records or blocks
        (blocks can arrive from a peer's ``/dump`` before any worker registers)."""
        return bool(self.catalog) or self.partition_block_size is not None or not self.index.is_empty()

    @property
    def listed(self) -> bool:
        """Whether ``/loads`` shows the partition: once a schedulable worker fixed its block size."""
        return self.partition_block_size is not None

    def schedulable(self, use_kv_events: bool) -> tuple[WorkerRecord, ...]:
        """Records that can take requests, in catalog order (cached until the catalog or block size changes)."""
        cached = self.schedulable_cache.get(use_kv_events)
        if cached is None:
            cached = self.schedulable_cache[use_kv_events] = self._schedulable(use_kv_events)
        return cached

    def _schedulable(self, use_kv_events: bool) -> tuple[WorkerRecord, ...]:
        block_size = self.partition_block_size
        return tuple(
            record
            for record in self.catalog.values()
            if not not_schedulable_reasons(record, use_kv_events=use_kv_events, partition_block_size=block_size)
        )

    # -- mutations (evolve only) ------------------------------------------------------------------------

    def put_record(self, record: WorkerRecord, partition_block_size: int | None) -> None:
        self.schedulable_cache.clear()
        self.catalog[record.worker_id] = record
        self.partition_block_size = partition_block_size

    def remove_record(self, worker_id: int) -> None:
        self.schedulable_cache.clear()
        del self.catalog[worker_id]

    def forget_stream(self, rank: WorkerRank) -> None:
        """Another publisher speaks for the rank (or its own restarted): what it said no longer holds."""
        self.index.apply_cleared(rank)
        self.kv_watermarks.pop(rank, None)

    def forget_rank(self, rank: WorkerRank) -> None:
        self.index.remove_rank(rank)
        self.kv_watermarks.pop(rank, None)
        self.approx_expiry.pop(rank, None)

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
        for use_kv_events, cached in self.schedulable_cache.items():
            if cached != self._schedulable(use_kv_events):
                problems.append(f"stale schedulable cache (use_kv_events={use_kv_events})")
        for rank, expiry in self.approx_expiry.items():
            if not expiry:
                problems.append(f"{rank}: empty approximate-mode expiry kept")
        return problems
