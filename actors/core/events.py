"""Events: the facts the journal stores. ``evolve`` folds them into state; nothing else does.

Tags are explicit and stable (see ``EVENT_TAGS``): renaming a class must never orphan a journal.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.catalog import WorkerRecord


@attrs.frozen
class WorkerRegistered:
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int


@attrs.frozen
class WorkerUnregistered:
    worker_id: int


@attrs.frozen
class RequestAdded:
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]
    prefill_tokens: int
    at: int
    expected_output_tokens: int | None = None  # the selection service's, for output-block decay


@attrs.frozen
class PrefillCompleted:
    request_id: str


@attrs.frozen
class RequestFreed:
    request_id: str


@attrs.frozen
class RequestsExpired:
    request_ids: tuple[str, ...]
    at: int


# -- selection service ------------------------------------------------------------------------------


@attrs.frozen
class WorkerUpserted:
    """A catalog record replaced (or created); ``partition_block_size`` is the partition's after it."""

    record: WorkerRecord
    partition_block_size: int | None


@attrs.frozen
class WorkerRemoved:
    worker_id: int


@attrs.frozen
class KvStoredOp:
    tier: int
    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]  # (external hash, local hash), parent first


@attrs.frozen
class KvRemovedOp:
    tier: int
    block_hashes: tuple[int, ...]


@attrs.frozen
class KvClearedOp:
    pass


KvOp = KvStoredOp | KvRemovedOp | KvClearedOp
KV_OP_TAGS: dict[type, str] = {KvStoredOp: "stored", KvRemovedOp: "removed", KvClearedOp: "cleared"}


@attrs.frozen
class KvIndexed:
    """One worker KV-event batch, converted. ``dp_rank`` is where the blocks live (a batch may name
    it); ``stream_rank`` is the listener it came from, whose watermark becomes ``seq``."""

    worker_id: int
    dp_rank: int
    stream_rank: int
    seq: int | None
    ops: tuple[KvOp, ...]


@attrs.frozen
class KvIndexTrimmed:
    """The scope's KV index was at its block cap: this rank dropped ``blocks`` blocks, its lower-tier edges
    and its device blocks deeper than ``keep_depth`` (None: every device block kept). ``evolve`` recomputes
    the same cut from the same state; ``blocks`` is what the decision counted (``actors/core/index_bounds.py``)."""

    worker_id: int
    dp_rank: int
    keep_depth: int | None
    blocks: int


@attrs.frozen
class KvBlocksRefused:
    """Blocks of one batch (or peer dump) for this rank that did not fit under the cap even after trimming:
    not stored. Changes no state; journaled so the decision is on record and counted where it was made."""

    worker_id: int
    dp_rank: int
    blocks: int


@attrs.frozen
class KvStreamReset:
    """The rank's publisher restarted: its blocks are gone and its sequence starts again."""

    worker_id: int
    dp_rank: int


@attrs.frozen
class ApproxBlocksBooked:
    """Approximate mode (no KV events): a booking's blocks count as cached on its rank until
    ``expires_at``; ``blocks`` are (sequence hash, local hash) from the root."""

    worker_id: int
    dp_rank: int
    blocks: tuple[tuple[int, int], ...]
    expires_at: int


@attrs.frozen
class ApproxBlocksExpired:
    worker_id: int
    dp_rank: int
    block_hashes: tuple[int, ...]  # sequence hashes whose time ran out


@attrs.frozen
class SessionBound:
    """A session is pinned to a rank (created or refreshed) at ``at``; ``reservation_id`` is the booking that
    did it (None when a replica peer's binding was applied). It lasts while any of its bookings is live and
    ``ttl_ns`` after its last use. ``(sequence, writer_id)`` versions the binding across replicas."""

    session_id: str
    worker_id: int
    dp_rank: int
    reservation_id: str | None
    at: int
    ttl_ns: int
    sequence: int
    writer_id: int


@attrs.frozen
class SessionReleased:
    """A booking of the session ended at ``at``: its idle time starts counting from here."""

    session_id: str
    reservation_id: str
    at: int


@attrs.frozen
class SessionsExpired:
    session_ids: tuple[str, ...]
    at: int


@attrs.frozen
class OutputBlockAdded:
    request_id: str
    decay_fraction: float | None


Event = (
    WorkerRegistered
    | WorkerUnregistered
    | RequestAdded
    | PrefillCompleted
    | RequestFreed
    | RequestsExpired
    | WorkerUpserted
    | WorkerRemoved
    | KvIndexed
    | KvStreamReset
    | KvIndexTrimmed
    | KvBlocksRefused
    | OutputBlockAdded
    | ApproxBlocksBooked
    | ApproxBlocksExpired
    | SessionBound
    | SessionReleased
    | SessionsExpired
)

EVENT_TAGS: dict[type, str] = {
    WorkerUpserted: "worker_upserted",
    WorkerRemoved: "worker_removed",
    KvIndexed: "kv_indexed",
    KvStreamReset: "kv_stream_reset",
    KvIndexTrimmed: "kv_index_trimmed",
    KvBlocksRefused: "kv_blocks_refused",
    OutputBlockAdded: "output_block_added",
    ApproxBlocksBooked: "approx_blocks_booked",
    ApproxBlocksExpired: "approx_blocks_expired",
    SessionBound: "session_bound",
    SessionReleased: "session_released",
    SessionsExpired: "sessions_expired",
    WorkerRegistered: "worker_registered",
    WorkerUnregistered: "worker_unregistered",
    RequestAdded: "request_added",
    PrefillCompleted: "prefill_completed",
    RequestFreed: "request_freed",
    RequestsExpired: "requests_expired",
}
