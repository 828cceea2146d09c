"""The slot-tracking part of a scope: registered DP ranges, their ranks, and the requests booked on them.

Both services book here: the slot tracker's ``/add`` and the selection service's reservations are the
same active requests with the same loads (prefill FIFO sums, decode blocks on a prefix trie). Mutated
only by ``evolve`` (and by ``from_snapshot`` while rebuilding); the tries and prefill FIFOs are derived
from the requests, so a snapshot stores only ranges, requests and decay fractions.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.trie import PrefixTrie

# Output blocks of one request: ``(decayed, weight, whole)`` = ``decayed`` blocks of ``weight`` each,
# then ``whole`` blocks of weight 1.0 appended since the last decay (1.6.1 keeps a weight per block;
# a decay sets every existing block to the same fraction, so two runs describe any history exactly).
# Canonical: ``decayed == 0`` exactly when ``weight == 1.0``, so equal loads have equal snapshots.
OutputBlocks = tuple[int, float, int]
NO_OUTPUTS: OutputBlocks = (0, 1.0, 0)


@attrs.frozen
class ActiveRequest:
    request_id: str
    rank: WorkerRank
    sequence_hashes: tuple[int, ...]
    started_at: int  # admission time, ns; expiry counts from here only
    expected_output_tokens: int | None = None  # selection service bookings that said how long they run


def output_block_count(blocks: OutputBlocks) -> int:
    decayed, _, whole = blocks
    return decayed + whole


def expected_decay(blocks_so_far: int, block_size: int, expected_output_tokens: int) -> float:
    """The decay of the next output block when the router tracks output blocks: ``1 - generated / expected``,
    never below 0 (Dynamo's frontend formula). A new block starts with its first token, so ``generated`` is
    ``blocks_so_far * block_size + 1``: exact when the prompt filled its last block; the client reports blocks,
    not tokens, so a partial last prompt block is not known here."""
    generated = blocks_so_far * block_size + 1
    return max(0.0, 1.0 - generated / max(expected_output_tokens, 1))


def add_output_block(blocks: OutputBlocks, decay_fraction: float | None) -> OutputBlocks:
    """One more output block: weight 1.0, or with a fraction ``f`` every block of the request weighs ``f``."""
    decayed, weight, whole = blocks
    if decay_fraction is None:
        return (decayed, weight, whole + 1)
    if decay_fraction == 1.0:
        return (0, 1.0, decayed + whole + 1)
    return (decayed + whole + 1, decay_fraction, 0)


class RankState:
    """Loads of one (worker, dp_rank)."""

    __slots__ = ("key", "outputs", "prefill", "prefill_tokens", "requests", "trie")

    def __init__(self, key: WorkerRank) -> None:
        # Its key in ``SlotTracking.ranks``: what its requests name as their rank (one object, not one per request).
        self.key = key
        self.requests: dict[str, ActiveRequest] = {}
        self.trie = PrefixTrie()
        # FIFO of requests still prefilling (insertion order = admission order) and their sum.
        self.prefill: dict[str, int] = {}
        self.prefill_tokens = 0
        # Selection service: generated blocks per request.
        self.outputs: dict[str, OutputBlocks] = {}

    @property
    def active_decode_blocks(self) -> int:
        if not self.outputs and not self.trie.has_fractions:
            return self.trie.size
        outputs = math.fsum(decayed * weight + whole for decayed, weight, whole in self.outputs.values())
        total = self.trie.weighted_size() + outputs
        return math.floor(total + 0.5)  # Rust's round(): half away from zero (totals are never negative)


class SlotTracking:
    """Registered DP ranges, one ``RankState`` per rank, and the scope-wide request index."""

    __slots__ = ("block_size", "prompt_blocks", "ranks", "requests", "workers")

    def __init__(self) -> None:
        self.block_size: int | None = None  # the slot tracker's, fixed by its first registration
        self.workers: dict[int, tuple[int, int]] = {}  # worker_id -> (dp_start, dp_size)
        self.ranks: dict[WorkerRank, RankState] = {}
        self.requests: dict[str, ActiveRequest] = {}  # admission order, scope-wide index
        # The sum of the active requests' ``sequence_hashes`` lengths, kept as they are admitted and released
        # (``limits.MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE`` is checked against it); derived, so not in a snapshot.
        self.prompt_blocks = 0

    @property
    def exists(self) -> bool:
        """A slot tracker exists while it has a worker; the last unregistration dissolves it."""
        return bool(self.workers)

    # -- mutations (evolve and snapshot restore only) -----------------------------------------------

    def add_range(self, worker_id: int, dp_start: int, dp_size: int) -> None:
        """Register (or re-register) ``worker_id``'s ranks; ranks that stay keep their requests."""
        self.workers[worker_id] = (dp_start, dp_size)
        for dp_rank in range(dp_start, dp_start + dp_size):
            rank = WorkerRank(worker_id, dp_rank)
            if rank not in self.ranks:
                self.ranks[rank] = RankState(rank)

    def drop_rank(self, rank_key: WorkerRank) -> None:
        """Forget one rank and every request booked on it (its range entry is the caller's)."""
        rank = self.ranks.pop(rank_key)
        released = 0
        for request_id, request in rank.requests.items():
            del self.requests[request_id]
            released += len(request.sequence_hashes)
        self.prompt_blocks -= released

    def admit(self, request: ActiveRequest, prefill_tokens: int) -> None:
        self.admit_on(self.ranks[request.rank], request, prefill_tokens)

    def admit_on(self, rank: RankState, request: ActiveRequest, prefill_tokens: int) -> None:
        """``admit`` with the request's rank already looked up (``rank.key == request.rank``)."""
        rank.requests[request.request_id] = request
        rank.trie.insert(request.sequence_hashes)
        if prefill_tokens > 0:
            rank.prefill[request.request_id] = prefill_tokens
            rank.prefill_tokens += prefill_tokens
        self.requests[request.request_id] = request
        self.prompt_blocks += len(request.sequence_hashes)

    def release(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        self.prompt_blocks -= len(request.sequence_hashes)
        rank = self.ranks[request.rank]
        del rank.requests[request_id]
        rank.trie.remove(request.sequence_hashes)
        rank.prefill_tokens -= rank.prefill.pop(request_id, 0)
        if rank.outputs:
            rank.outputs.pop(request_id, None)

    # -- snapshot ---------------------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        """Plain, JSON-ready, canonical form (request order is admission order, part of the meaning)."""
        ranks = self.ranks
        return {
            "block_size": self.block_size,
            "workers": [[w, start, size] for w, (start, size) in self.workers.items()],
            "requests": [
                [
                    r.request_id,
                    r.rank.worker_id,
                    r.rank.dp_rank,
                    list(r.sequence_hashes),
                    r.started_at,
                    ranks[r.rank].prefill.get(r.request_id, 0),
                    list(ranks[r.rank].outputs.get(r.request_id, NO_OUTPUTS)),
                    r.expected_output_tokens,
                ]
                for r in self.requests.values()
            ],
            "fractions": [
                [rank_key.worker_id, rank_key.dp_rank, entries]
                for rank_key, rank in ranks.items()
                if (
                    entries := rank.trie.fraction_entries(
                        (request_id, request.sequence_hashes) for request_id, request in rank.requests.items()
                    )
                )
            ],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> SlotTracking:
        slots = cls()
        slots.block_size = data["block_size"]
        for worker_id, start, size in data["workers"]:
            slots.add_range(worker_id, start, size)
        for request_id, worker_id, dp_rank, hashes, started_at, prefill, outputs, expected in data["requests"]:
            request = ActiveRequest(request_id, WorkerRank(worker_id, dp_rank), tuple(hashes), started_at, expected)
            slots.admit(request, prefill)  # counts its prompt blocks too
            decayed, weight, whole = outputs
            if decayed or whole:
                slots.ranks[request.rank].outputs[request_id] = (decayed, weight, whole)
        for worker_id, dp_rank, entries in data["fractions"]:
            rank = slots.ranks[WorkerRank(worker_id, dp_rank)]
            for request_id, depth, fraction in entries:
                rank.trie.set_fraction(rank.requests[request_id].sequence_hashes, depth, fraction)
        return slots

    # -- invariants -------------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Messages for every broken invariant (empty when sound)."""
        problems: list[str] = []
        expected_ranks = {(w, r) for w, (start, size) in self.workers.items() for r in range(start, start + size)}
        if set(self.ranks) != expected_ranks:
            problems.append("ranks do not match the registered DP ranges")
        seen = 0
        for rank_key, rank in self.ranks.items():
            problems.extend(f"{rank_key}: {problem}" for problem in _check_rank(rank, self.requests))
            seen += len(rank.requests)
        if seen != len(self.requests):
            problems.append(f"scope index holds {len(self.requests)} requests, ranks hold {seen}")
        held = sum(len(request.sequence_hashes) for request in self.requests.values())
        if self.prompt_blocks != held:
            problems.append(f"prompt block count {self.prompt_blocks}, active requests hold {held}")
        return problems


def _check_rank(rank: RankState, index: dict[str, ActiveRequest]) -> list[str]:
    problems = []
    if rank.prefill_tokens < 0:
        problems.append(f"negative prefill tokens {rank.prefill_tokens}")
    if rank.prefill_tokens != sum(rank.prefill.values()):
        problems.append(f"prefill sum {rank.prefill_tokens} != entries")
    if not set(rank.prefill) <= set(rank.requests):
        problems.append("prefill entry without an active request")
    if any(tokens <= 0 for tokens in rank.prefill.values()):
        problems.append("prefill entry of no tokens")
    rebuilt = PrefixTrie()
    for request in rank.requests.values():
        rebuilt.insert(request.sequence_hashes)
        if index.get(request.request_id) is not request:
            problems.append(f"request {request.request_id!r} missing from the scope index")
    if rebuilt.size != rank.trie.size:
        problems.append(f"{rank.trie.size} decode blocks, requests imply {rebuilt.size}")
    problems.extend(rank.trie.check())
    if not set(rank.outputs) <= set(rank.requests):
        problems.append("output blocks of a request that is not active")
    for request_id, (decayed, weight, whole) in rank.outputs.items():
        canonical = (decayed == 0) == (weight == 1.0)
        if decayed < 0 or whole < 0 or decayed + whole == 0 or not 0.0 <= weight <= 1.0 or not canonical:
            problems.append(f"request {request_id!r}: output blocks {(decayed, weight, whole)} are not a history")
    return problems
