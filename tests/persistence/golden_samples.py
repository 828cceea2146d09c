"""One sample event per event tag, and a sample state, for the golden files.

Every field holds a value unlike its default and unlike its neighbours, so that a renamed, dropped or
swapped field changes the encoded bytes. ``HISTORY`` (which reuses some samples) is a valid history
per scope: the golden snapshot is its state, and ``golden/journals/history.v0.jsonl`` is that history
as version-0 records, one per line, as builds before format versions wrote them.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import (
    ApproxBlocksBooked,
    ApproxBlocksExpired,
    Event,
    KvBlocksRefused,
    KvClearedOp,
    KvIndexed,
    KvIndexTrimmed,
    KvRemovedOp,
    KvStoredOp,
    KvStreamReset,
    OutputBlockAdded,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    SessionBound,
    SessionReleased,
    SessionsExpired,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState

GOLDEN = Path(__file__).resolve().parent / "golden"
RECORDS = GOLDEN / "records"
SNAPSHOTS = GOLDEN / "snapshots"

SCOPE = ScopeKey("golden-model", "golden-tenant")
SNAPSHOT_LSN = 4242

SAMPLES: dict[str, Event] = {
    "worker_registered": WorkerRegistered(worker_id=7, block_size=16, dp_start=2, dp_size=3),
    "request_added": RequestAdded(
        request_id="req-a",
        worker_id=7,
        dp_rank=3,
        sequence_hashes=(11, 2**64 - 5, 13),
        prefill_tokens=48,
        at=1_700_000_000_000_000_001,
        expected_output_tokens=96,
    ),
    "output_block_added": OutputBlockAdded(request_id="req-a", decay_fraction=0.25),
    "prefill_completed": PrefillCompleted(request_id="req-a"),
    "request_freed": RequestFreed(request_id="req-b"),
    "requests_expired": RequestsExpired(request_ids=("req-c", "req-d"), at=1_700_000_000_000_000_002),
    "worker_unregistered": WorkerUnregistered(worker_id=8),
    "worker_upserted": WorkerUpserted(
        record=WorkerRecord(
            worker_id=9,
            model_name="golden-model",
            tenant_id="golden-tenant",
            endpoint="http://10.0.0.9:8000",
            kv_events_endpoint="tcp://10.0.0.9:5557",
            kv_events_endpoints=((0, "tcp://10.0.0.9:5557"), (1, "tcp://10.0.0.9:5558")),
            replay_endpoint="tcp://10.0.0.9:5560",
            block_size=32,
            data_parallel_start_rank=0,
            data_parallel_size=2,
            max_num_batched_tokens=8192,
            total_kv_blocks=4096,
            stable_routing_id="stable-9",
            is_eagle=True,
            taints=("gpu-old", "spot"),
            topology_domains=(("rack", "r1"), ("zone", "z2")),
            kv_transfer_domain="nvlink-a",
            kv_transfer_enforcement="prefer",
            kv_transfer_preferred_weight=0.75,
            worker_role="decode",
            discovered_by="etcd",
        ),
        partition_block_size=32,
    ),
    "kv_indexed": KvIndexed(
        worker_id=9,
        dp_rank=1,
        stream_rank=0,
        seq=17,
        ops=(
            KvStoredOp(tier=0, parent_hash=None, blocks=((101, 201), (102, 202))),
            KvStoredOp(tier=1, parent_hash=102, blocks=((103, 203),)),
            KvRemovedOp(tier=1, block_hashes=(103,)),
            KvClearedOp(),
        ),
    ),
    "kv_stream_reset": KvStreamReset(worker_id=9, dp_rank=1),
    "kv_index_trimmed": KvIndexTrimmed(worker_id=12, dp_rank=5, keep_depth=3, blocks=4097),
    "kv_blocks_refused": KvBlocksRefused(worker_id=13, dp_rank=6, blocks=65_537),
    "approx_blocks_booked": ApproxBlocksBooked(
        worker_id=9, dp_rank=0, blocks=((301, 401), (302, 402)), expires_at=1_700_000_000_000_000_003
    ),
    "approx_blocks_expired": ApproxBlocksExpired(worker_id=9, dp_rank=0, block_hashes=(302,)),
    "worker_removed": WorkerRemoved(worker_id=10),
    "session_bound": SessionBound(
        session_id="sess-a",
        worker_id=9,
        dp_rank=1,
        reservation_id="res-s",
        at=1_700_000_000_000_000_020,
        ttl_ns=30_000_000_000,
        sequence=4,
        writer_id=77,
    ),
    "session_released": SessionReleased(session_id="sess-a", reservation_id="res-s", at=1_700_000_000_000_000_021),
    "sessions_expired": SessionsExpired(session_ids=("sess-b",), at=1_700_000_000_000_000_022),
}


def sample_written_by(tag: str, record_version: int) -> Event:
    """``SAMPLES[tag]`` as the build that wrote record version ``record_version`` held it: fields added since
    then decode to their defaults (version 2 added a record's ``worker_role`` and a booking's
    ``expected_output_tokens``; version 3 a record's ``discovered_by``)."""
    event = SAMPLES[tag]
    if record_version < 3:
        event = _without_v3_fields(event)
    return _without_v2_fields(event) if record_version < 2 else event


def _without_v3_fields(event: Event) -> Event:
    if isinstance(event, WorkerUpserted):
        return attrs.evolve(event, record=attrs.evolve(event.record, discovered_by=None))
    return event


def _without_v2_fields(event: Event) -> Event:
    if isinstance(event, WorkerUpserted):
        return attrs.evolve(event, record=attrs.evolve(event.record, worker_role=None))
    if isinstance(event, RequestAdded):
        return attrs.evolve(event, expected_output_tokens=None)
    return event


def record_path(tag: str, version: int) -> Path:
    return RECORDS / f"{tag}.v{version}.json"


def snapshot_path(version: int) -> Path:
    return SNAPSHOTS / f"snapshot.v{version}.json"


SELECTION_SCOPE = ScopeKey("golden-model", "selection-tenant")
_AT = 1_700_000_000_000_000_000
_WORKER_9 = SAMPLES["worker_upserted"].record  # type: ignore[attr-defined]

# A valid history per scope (slot tracker and selection service), folded into the golden snapshot's state.
HISTORY: dict[ScopeKey, tuple[Event, ...]] = {
    SCOPE: (
        WorkerRegistered(worker_id=7, block_size=16, dp_start=2, dp_size=3),
        WorkerRegistered(worker_id=8, block_size=16, dp_start=0, dp_size=1),
        SAMPLES["request_added"],
        RequestAdded("req-b", worker_id=7, dp_rank=2, sequence_hashes=(11, 12), prefill_tokens=20, at=_AT + 5),
        RequestAdded("req-c", worker_id=8, dp_rank=0, sequence_hashes=(21,), prefill_tokens=5, at=_AT + 6),
        RequestAdded("req-d", worker_id=7, dp_rank=4, sequence_hashes=(31, 32), prefill_tokens=9, at=_AT + 7),
        SAMPLES["output_block_added"],
        OutputBlockAdded(request_id="req-a", decay_fraction=None),
        PrefillCompleted(request_id="req-b"),
        RequestFreed(request_id="req-d"),
        RequestsExpired(request_ids=("req-c",), at=_AT + 9),
        WorkerUnregistered(worker_id=8),
    ),
    SELECTION_SCOPE: (
        WorkerUpserted(record=attrs.evolve(_WORKER_9, tenant_id="selection-tenant"), partition_block_size=32),
        SAMPLES["kv_indexed"],
        KvIndexed(
            worker_id=9,
            dp_rank=1,
            stream_rank=1,
            seq=18,
            ops=(KvStoredOp(tier=0, parent_hash=None, blocks=((501, 601), (502, 602))),),
        ),
        SAMPLES["approx_blocks_booked"],
        ApproxBlocksBooked(worker_id=9, dp_rank=0, blocks=((303, 403),), expires_at=_AT + 11),
        SAMPLES["approx_blocks_expired"],
        WorkerUpserted(
            record=WorkerRecord(worker_id=10, tenant_id="selection-tenant", block_size=32), partition_block_size=32
        ),
        SAMPLES["worker_removed"],
    ),
}


# Events that exist since snapshot format 3 (session affinity), folded after ``HISTORY``. Kept apart because
# ``golden/journals/history.v0.jsonl`` is ``HISTORY`` as builds before record versions wrote it.
LATER_HISTORY: dict[ScopeKey, tuple[Event, ...]] = {
    SELECTION_SCOPE: (
        RequestAdded("res-s", worker_id=9, dp_rank=1, sequence_hashes=(71, 72), prefill_tokens=64, at=_AT + 19),
        SAMPLES["session_bound"],
        SessionBound(
            "sess-b", worker_id=9, dp_rank=0, reservation_id=None, at=_AT + 12, ttl_ns=5, sequence=1, writer_id=3
        ),
        SessionBound(
            "sess-c", worker_id=9, dp_rank=0, reservation_id=None, at=_AT + 13, ttl_ns=9, sequence=2, writer_id=5
        ),
        SAMPLES["sessions_expired"],
        RequestAdded("res-t", worker_id=9, dp_rank=0, sequence_hashes=(81,), prefill_tokens=32, at=_AT + 23),
        SessionBound(
            "sess-a", worker_id=9, dp_rank=1, reservation_id="res-t", at=_AT + 24, ttl_ns=7, sequence=5, writer_id=77
        ),
        RequestFreed(request_id="res-s"),
        SAMPLES["session_released"],
    ),
}


def history_states() -> list[ScopeState]:
    """``HISTORY`` folded, one state per scope, sorted by scope: what builds before snapshot format 3 held."""
    return sorted((fold(ScopeState(scope), events) for scope, events in HISTORY.items()), key=lambda s: s.scope)


def sample_states() -> list[ScopeState]:
    """``HISTORY`` then ``LATER_HISTORY`` folded, one state per scope, sorted by scope (the order snapshots use)."""
    states = history_states()
    for state in states:
        fold(state, LATER_HISTORY.get(state.scope, ()))
    return states


def sample_states_written_by(snapshot_version: int) -> list[ScopeState]:
    """The sample states as the build that wrote ``snapshot.v<snapshot_version>.json`` held them.

    Before snapshot version 4 records had no worker_role and bookings no expected_output_tokens (record
    version 2 added them). Before snapshot version 3 there were no sessions (``LATER_HISTORY``). Before
    snapshot version 2, every output block of a request weighed the request's latest decay fraction; since then
    each block keeps its own weight (1.6.1's rule), so ``HISTORY``'s ``req-a`` (a block at 0.25, then one at
    1.0) held 2 x 0.25 then and holds 0.25 + 1.0 now. Restoring an old snapshot keeps the loads it recorded,
    so the old golden restores to the old weights.
    """
    events = {
        scope: HISTORY[scope] + (LATER_HISTORY.get(scope, ()) if snapshot_version >= 3 else ()) for scope in HISTORY
    }
    if snapshot_version < 5:  # v5 added discovered_by: it restores as None
        events = {scope: tuple(map(_without_v3_fields, history)) for scope, history in events.items()}
    if snapshot_version < 4:  # v4 added worker_role and expected_output_tokens: they restore as defaults
        events = {scope: tuple(map(_without_v2_fields, history)) for scope, history in events.items()}
    states = sorted((fold(ScopeState(scope), history) for scope, history in events.items()), key=lambda s: s.scope)
    if snapshot_version < 2:
        for state in states:
            for rank in state.slots.ranks.values():
                for request_id, (decayed, weight, whole) in rank.outputs.items():
                    if decayed:
                        rank.outputs[request_id] = (decayed + whole, weight, 0)
    return states
