"""ScopeState: the mutable state one scope actor owns (workers, active requests, loads).

Not copied per event (a copy per event would make large states unusable); determinism comes from
single ownership and an ordered mailbox. Only ``evolve`` mutates it. Derived structures (tries,
prefill queues) are rebuilt from the requests when a snapshot is restored, so a snapshot stores
only workers and requests.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_index import KvIndex
from kvrouter.actors.core.trie import PrefixTrie


@attrs.frozen
class ActiveRequest:
    request_id: str
    rank: WorkerRank
    sequence_hashes: tuple[int, ...]
    started_at: int  # admission time, ns; expiry counts from here only


class RankState:
    """Loads of one (worker, dp_rank)."""

    __slots__ = ("outputs", "prefill", "prefill_tokens", "requests", "trie")

    def __init__(self) -> None:
        self.requests: dict[str, ActiveRequest] = {}
        self.trie = PrefixTrie()
        # FIFO of requests still prefilling (insertion order = admission order) and their sum.
        self.prefill: dict[str, int] = {}
        self.prefill_tokens = 0
        # Selection service: generated blocks per request, as (count, weight of each).
        self.outputs: dict[str, tuple[int, float]] = {}

    @property
    def active_decode_blocks(self) -> int:
        if not self.outputs and not self.trie.has_fractions:
            return self.trie.size
        total = self.trie.weighted_size() + math.fsum(count * weight for count, weight in self.outputs.values())
        return math.floor(total + 0.5)  # Rust's round(): half away from zero (totals are never negative)


class ScopeState:
    __slots__ = (
        "approx_expiry",
        "block_size",
        "catalog",
        "index",
        "kv_watermarks",
        "ranks",
        "requests",
        "schedulable_cache",
        "scope",
        "workers",
    )

    def __init__(self, scope: ScopeKey) -> None:
        self.scope = scope
        self.block_size: int | None = None  # fixed by the first registration
        self.workers: dict[int, tuple[int, int]] = {}  # worker_id -> (dp_start, dp_size)
        self.ranks: dict[WorkerRank, RankState] = {}
        self.requests: dict[str, ActiveRequest] = {}  # admission order, scope-wide index
        # Selection service only: catalog records, the KV block index, and per-rank KV-event
        # watermarks (so a restarted service resumes each stream where the journal left it).
        self.catalog: dict[int, WorkerRecord] = {}
        self.index = KvIndex()
        self.kv_watermarks: dict[WorkerRank, int] = {}
        # Approximate mode: when each booked block stops counting as cached, per rank.
        self.approx_expiry: dict[WorkerRank, dict[int, int]] = {}
        # Derived, never snapshotted: schedulable records per use_kv_events setting, dropped by
        # evolve whenever the catalog or the partition's block size changes.
        self.schedulable_cache: dict[bool, tuple[WorkerRecord, ...]] = {}

    @property
    def exists(self) -> bool:
        """A scope exists while it has a worker; the last unregistration dissolves it."""
        return bool(self.workers) or bool(self.catalog) or self.index.block_count() > 0

    def to_snapshot(self) -> dict[str, Any]:
        """Plain, JSON-ready, canonical form (dict order is part of the state's meaning)."""
        return {
            "model_name": self.scope.model_name,
            "tenant_id": self.scope.tenant_id,
            "block_size": self.block_size,
            "workers": [[w, start, size] for w, (start, size) in self.workers.items()],
            "requests": [
                [
                    r.request_id,
                    r.rank.worker_id,
                    r.rank.dp_rank,
                    list(r.sequence_hashes),
                    r.started_at,
                    self.ranks[r.rank].prefill.get(r.request_id, 0),
                    list(self.ranks[r.rank].outputs.get(r.request_id, (0, 1.0))),
                ]
                for r in self.requests.values()
            ],
            "fractions": [
                [rank_key.worker_id, rank_key.dp_rank, entries]
                for rank_key, rank in self.ranks.items()
                if (
                    entries := rank.trie.fraction_entries(
                        (request_id, request.sequence_hashes) for request_id, request in rank.requests.items()
                    )
                )
            ],
            "catalog": [record.to_plain() for record in self.catalog.values()],
            "index": self.index.to_snapshot(),
            "kv_watermarks": [[r.worker_id, r.dp_rank, seq] for r, seq in self.kv_watermarks.items()],
            "approx_expiry": [
                [r.worker_id, r.dp_rank, list(map(list, expiry.items()))] for r, expiry in self.approx_expiry.items()
            ],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> ScopeState:
        state = cls(ScopeKey(data["model_name"], data["tenant_id"]))
        state.block_size = data["block_size"]
        for worker_id, start, size in data["workers"]:
            state.workers[worker_id] = (start, size)
            for dp_rank in range(start, start + size):
                state.ranks[WorkerRank(worker_id, dp_rank)] = RankState()
        for request_id, worker_id, dp_rank, hashes, started_at, prefill, (count, weight) in data["requests"]:
            request = ActiveRequest(request_id, WorkerRank(worker_id, dp_rank), tuple(hashes), started_at)
            admit(state, request, prefill)
            if count:
                state.ranks[request.rank].outputs[request_id] = (count, weight)
        for worker_id, dp_rank, entries in data["fractions"]:
            rank = state.ranks[WorkerRank(worker_id, dp_rank)]
            for request_id, depth, fraction in entries:
                rank.trie.set_fraction(rank.requests[request_id].sequence_hashes, depth, fraction)
        for plain in data["catalog"]:
            record = WorkerRecord.from_plain(plain)
            state.catalog[record.worker_id] = record
        state.index = KvIndex.from_snapshot(data["index"])
        state.kv_watermarks = {WorkerRank(w, r): seq for w, r, seq in data["kv_watermarks"]}
        state.approx_expiry = {WorkerRank(w, r): {h: t for h, t in items} for w, r, items in data["approx_expiry"]}
        return state


def admit(state: ScopeState, request: ActiveRequest, prefill_tokens: int) -> None:
    """Book ``request`` on its rank (shared by evolve and snapshot restore)."""
    rank = state.ranks[request.rank]
    rank.requests[request.request_id] = request
    rank.trie.insert(request.sequence_hashes)
    if prefill_tokens > 0:
        rank.prefill[request.request_id] = prefill_tokens
        rank.prefill_tokens += prefill_tokens
    state.requests[request.request_id] = request
