"""Commands: what a client (or the clock) asks a scope actor to do.

Every command carries ``at`` (wall-clock nanoseconds stamped by the shell) so that the core never
reads a clock and a journal replays to the same state whenever it is replayed. The scope a command
belongs to travels beside it in the mailbox envelope, not inside it.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_modes import HEALTHY, StreamView
from kvrouter.actors.core.kv_wire import KvBatch
from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.ttft_model import TtftView
from kvrouter.actors.core.worker_endpoints import EndpointAllowList


@attrs.frozen
class RegisterWorker:
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int
    at: int = 0
    # Ranks the service holds in its other scopes (limits.MAX_RANKS_PER_SERVICE), filled in by the scope's desk.
    ranks_elsewhere: int = 0


@attrs.frozen
class UnregisterWorker:
    worker_id: int
    at: int = 0


@attrs.frozen
class AddRequest:
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]  # unsigned 64-bit chained hashes, one per prompt block
    isl_tokens: int  # new prompt tokens to account as prefill load; 0 = no prefill tracking
    at: int = 0
    remote: bool = False  # came from a replica peer: applied and journaled, never re-broadcast


@attrs.frozen
class CompletePrefill:
    """A slot-tracker request finished its prefill; an unknown request is not found."""

    request_id: str
    at: int = 0
    remote: bool = False


@attrs.frozen
class FreeRequest:
    """A slot-tracker (or replica peer's) request is done; freeing an unknown request changes nothing.
    (A selection-service reservation is released with ``ReleaseReservation``, which answers not found.)"""

    request_id: str
    at: int = 0
    remote: bool = False


@attrs.frozen
class ExpireStale:
    """A clock tick: drop requests admitted more than ``max_age_ns`` before ``at``."""

    max_age_ns: int
    at: int = 0


# -- selection service ------------------------------------------------------------------------------


@attrs.frozen
class UpsertWorker:
    record: WorkerRecord
    use_kv_events: bool = True
    at: int = 0
    ranks_elsewhere: int = 0  # as RegisterWorker's
    # The hosts the record's endpoints may name (--worker-endpoint-allow); None: any. Never journaled: a record
    # already in the journal is recovered whatever the list says now.
    endpoint_allow: EndpointAllowList | None = None


@attrs.frozen
class RemoveWorker:
    worker_id: int
    at: int = 0


@attrs.frozen
class IngestKvBatch:
    """One batch from a worker rank's KV-event stream (``seq`` is its sequence number), and the batches that
    followed it when the listener read several at once (``following``: ``(seq, batch)`` in stream order),
    decided together: one decision and one journal record for the lot."""

    worker_id: int
    dp_rank: int
    seq: int | None
    batch: KvBatch
    at: int = 0
    max_index_blocks: int = MAX_INDEX_BLOCKS_PER_SCOPE  # the scope's index cap (actors/core/index_bounds.py)
    following: tuple[tuple[int, KvBatch], ...] = ()


@attrs.frozen
class RecoveredRun:
    """One stored run from a peer's ``/dump``: blocks of (external hash, local hash), parent first."""

    worker_id: int
    dp_rank: int
    tier: int
    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]


@attrs.frozen
class RecoverKv:
    """Seed the index from a peer (``--indexer-peers``): applied whether or not the workers are in
    the catalog yet, since a new replica learns its catalog after it starts."""

    runs: tuple[RecoveredRun, ...]
    at: int = 0
    max_index_blocks: int = MAX_INDEX_BLOCKS_PER_SCOPE


@attrs.frozen
class ResetKvStream:
    worker_id: int
    dp_rank: int
    at: int = 0


@attrs.frozen
class Prompt:
    """Either ``token_ids`` (hashed here) or precomputed hashes with ``isl_tokens`` (behaviour.md#prompt-inputs)."""

    token_ids: tuple[int, ...] | None = None
    lora_name: str | None = None
    block_hashes: tuple[int, ...] | None = None  # unsigned
    sequence_hashes: tuple[int, ...] | None = None  # unsigned
    isl_tokens: int | None = None


@attrs.frozen
class SelectionOptions:
    allowed_worker_ids: frozenset[int] | None = None
    required_taints: frozenset[str] = frozenset()
    preferred_taints: tuple[tuple[str, float], ...] = ()
    pinned_worker: tuple[int, int] | None = None
    expected_output_tokens: int | None = None
    session_id: str | None = None  # with session affinity on, a booking pins the session (actors/core/sessions.py)
    affinity_target: tuple[int, int | None] | None = None  # (worker_id, dp_rank or None): see choose_rank
    priority_jump: float = 0.0  # seconds ahead in the queue (fcfs/lcfs), extra weight (wspt)


@attrs.frozen
class SelectWorker:
    """Pick a rank for a prompt; with ``reserve`` also book it under ``reservation_id``.

    ``draw`` is a uniform number in [0, 1) from the scope's seeded random source, ``turn`` its round-robin
    position and ``predicted_ranks`` the ranks scored on predicted blocks: the scope's desk fills them in right
    before deciding (``actors/core/desk.py``), so the core stays deterministic and reads no other task's view.
    """

    prompt: Prompt
    config: RouterConfig
    options: SelectionOptions = SelectionOptions()
    reserve: bool = False
    reservation_id: str | None = None
    selection_id: str | None = None
    draw: float = 0.0
    at: int = 0
    # Ranks scored on predicted (booked) blocks although KV events are on: their stream is absent or stale
    # (actors/core/kv_modes.py), as ``streams`` says and the scope's state decides. Bookings on them are predicted.
    predicted_ranks: frozenset[WorkerRank] = frozenset()
    writer_id: int = 0  # this replica's id, the version of the session bindings it writes
    turn: int = 0  # round-robin position, counted per scope by its desk (round-robin selections only)
    explain: bool = False  # the reply carries why (actors/core/explain.py); derived data, never journaled
    # kv_ttft only: the shell's prefill-time model of the scope's ranks (actors/core/ttft_model.py); None: prior.
    ttft: TtftView | None = None
    # What the shell knows of the KV-event streams when the selection was asked (stamped with ``at``).
    streams: StreamView = HEALTHY
    # Ranks left out of this selection: their KV-event stream stopped while they had traffic (``streams.out``,
    # filled in by the desk: ``kv_liveness.excluded_ranks``). An explicit pinned_worker still reaches them.
    out_ranks: frozenset[WorkerRank] = frozenset()


@attrs.frozen
class SelectDisaggregated:
    """Pick a prefill rank (KV-aware) and then a decode rank (load only) and book both, atomically, as the two
    parts ``<reservation_id>:prefill`` and ``<reservation_id>:decode``; decode only when no prefill rank is
    eligible (see ``actors/core/disaggregation.py``). ``draw`` and ``decode_draw`` (one per stage) and ``turn``
    (both stages' round-robin position) come from the scope's desk, as for :class:`SelectWorker`."""

    prompt: Prompt
    config: RouterConfig
    reservation_id: str | None = None  # None: the desk generates one from the scope's random source
    options: SelectionOptions = SelectionOptions()
    draw: float = 0.0
    decode_draw: float = 0.0
    turn: int = 0
    at: int = 0
    predicted_ranks: frozenset[WorkerRank] = frozenset()  # as for SelectWorker
    ttft: TtftView | None = None  # as for SelectWorker (the prefill stage uses it)
    streams: StreamView = HEALTHY  # as for SelectWorker
    out_ranks: frozenset[WorkerRank] = frozenset()  # as for SelectWorker


@attrs.frozen
class Reserve:
    """The seed's explicit reservation: book a prompt on a chosen rank."""

    reservation_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]
    isl_tokens: int
    effective_prefill_tokens: int | None = None
    track_prefill_tokens: bool | None = None
    config_tracks_prefill: bool = True
    at: int = 0
    # Approximate mode: the prompt's local hashes, assumed cached on the rank for this long.
    local_hashes: tuple[int, ...] = ()
    approx_ttl_ns: int = 0
    # Session affinity of a replayed selection: the booking pins the session (0: affinity off).
    session_id: str | None = None
    session_ttl_ns: int = 0
    writer_id: int = 0
    max_predicted_blocks: int = 2**20
    predicted_prune_target: int = 838_860
    expected_output_tokens: int | None = None  # kept for output-block decay (router_track_output_blocks)
    track_active_blocks: bool = True  # False: the booking holds no decode blocks


@attrs.frozen
class ReserveSelection:
    """The 1.6.1 replay form: book exactly what an earlier ``/select`` with this id captured."""

    selection_id: str
    at: int = 0


@attrs.frozen
class AddOutputBlock:
    request_id: str
    decay_fraction: float | None = None
    at: int = 0


@attrs.frozen
class CompleteReservationPrefill:
    """A reservation finished its prefill; an unknown reservation is not found (unlike a slot-tracker
    request, the scope is the one holding the reservation, so there is no "no tracker" case)."""

    reservation_id: str
    at: int = 0


@attrs.frozen
class ReleaseReservation:
    """A reservation is done; releasing an unknown (or already released) one is not found, not a no-op."""

    reservation_id: str
    at: int = 0


@attrs.frozen
class BindSession:
    """A replica peer's session binding; applied when its ``(sequence, writer_id)`` is newer than ours."""

    session_id: str
    worker_id: int
    dp_rank: int
    sequence: int
    writer_id: int
    ttl_ns: int
    at: int = 0


@attrs.frozen
class FreeRankBookings:
    """The rank's KV-event stream stopped while it had traffic and the rank is taken out of selection
    (``actors/core/kv_liveness.py``): free every booking on it. Journaled as the frees it makes."""

    worker_id: int
    dp_rank: int
    at: int = 0


Command = (
    RegisterWorker
    | UnregisterWorker
    | AddRequest
    | CompletePrefill
    | FreeRequest
    | ExpireStale
    | UpsertWorker
    | RemoveWorker
    | IngestKvBatch
    | ResetKvStream
    | SelectWorker
    | SelectDisaggregated
    | Reserve
    | ReserveSelection
    | AddOutputBlock
    | CompleteReservationPrefill
    | ReleaseReservation
    | RecoverKv
    | BindSession
    | FreeRankBookings
)

# Commands that may bring a scope into existence; every other command to a missing scope is
# answered by the core from an empty state (a "not found" rejection or a no-op).
SCOPE_CREATING = (RegisterWorker, UpsertWorker, RecoverKv)
