"""Dynamo's event-plane envelope and router events, decoded into kvrouter's KV batches; and a pre-hashed store
applied by the core exactly as its pairs say."""

from __future__ import annotations

import msgpack
import pytest

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import IngestKvBatch, UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import KvIndexed, KvStoredOp
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, HashedBlocksStored, KvBatch
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.fleet.dynamo_events import (
    Envelope,
    EnvelopeError,
    decode_envelope,
    decode_zmq_message,
    encode_envelope,
    encode_router_events,
    rank_batches,
    zmq_frames,
)

WORKER = 0x694D9A7B3C2E1F05
PUBLISHER = 0x1D2C3B4A59687706

# Router events as 1.6.1's mocker published them (shared/spec): maps, hashes as u64, ``cleared`` as a string.
OBSERVED_EVENTS = [
    {
        "worker_id": WORKER,
        "dp_rank": 0,
        "storage_tier": "device",
        "event": {
            "event_id": 1,
            "data": {
                "stored": {
                    "parent_hash": None,
                    "start_position": None,
                    "blocks": [
                        {"block_hash": 0xF000000000000001, "tokens_hash": 11, "mm_extra_info": None},
                        {"block_hash": 2, "tokens_hash": 12, "mm_extra_info": None},
                    ],
                }
            },
        },
    },
    {
        "worker_id": WORKER,
        "dp_rank": 0,
        "storage_tier": "device",
        "event": {"event_id": 2, "data": {"removed": {"block_hashes": [2]}}},
    },
    {"worker_id": WORKER, "dp_rank": 1, "storage_tier": "host_pinned", "event": {"event_id": 3, "data": "cleared"}},
]


def observed_envelope(sequence: int = 5) -> bytes:
    payload = msgpack.packb(OBSERVED_EVENTS, use_bin_type=True)
    envelope = {
        "publisher_id": PUBLISHER,
        "sequence": sequence,
        "published_at": 1_750_000_000_123,
        "topic": "kv-events",
        "payload": payload,
    }
    return msgpack.packb(envelope, use_bin_type=True)


def test_an_observed_envelope_decodes() -> None:
    envelope = decode_envelope(observed_envelope())
    assert (envelope.publisher_id, envelope.sequence, envelope.topic) == (PUBLISHER, 5, "kv-events")
    assert envelope.published_at == 1_750_000_000_123


def test_router_events_become_one_batch_per_run_of_a_rank() -> None:
    batches = rank_batches(decode_envelope(observed_envelope()).payload, 1_750_000_000_123)
    assert [(b.worker_id, b.dp_rank) for b in batches] == [(WORKER, 0), (WORKER, 1)]
    first, second = batches
    assert first.batch == KvBatch(
        1_750_000_000.123,
        (HashedBlocksStored(None, ((0xF000000000000001, 11), (2, 12)), Tier.DEVICE), BlockRemoved((2,), Tier.DEVICE)),
        0,
    )
    assert second.batch.events == (AllBlocksCleared(),)
    assert second.batch.dp_rank == 1


def test_the_zmq_frames_carry_the_envelope_and_must_agree_with_it() -> None:
    body = observed_envelope(sequence=9)
    frames = zmq_frames(body, PUBLISHER, 9)
    assert decode_zmq_message(frames) == decode_envelope(body)
    with pytest.raises(EnvelopeError, match="frames name publisher"):
        decode_zmq_message(zmq_frames(body, PUBLISHER, 10))
    with pytest.raises(EnvelopeError, match="format byte"):
        decode_zmq_message([*frames[:3], b"\x02" + frames[3][1:]])
    with pytest.raises(EnvelopeError, match="says"):
        decode_zmq_message([*frames[:3], frames[3] + b"x"])
    with pytest.raises(EnvelopeError, match="expected"):
        decode_zmq_message(frames[:3])


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\xc1", "not a msgpack envelope"),
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb({"publisher_id": 1, "sequence": 0, "payload": "text"}), "no binary payload"),
        (msgpack.packb({"publisher_id": -1, "sequence": 0, "payload": b""}), "publisher_id must be a u64"),
    ],
)
def test_an_unreadable_envelope_says_why(data: bytes, problem: str) -> None:
    with pytest.raises(EnvelopeError, match=problem):
        decode_envelope(data)


@pytest.mark.parametrize(
    ("events", "problem"),
    [
        ({"not": "an array"}, "not an array"),
        ([{"worker_id": 1}], "no 'event' map"),
        ([{"worker_id": 1, "dp_rank": -1, "event": {"data": "cleared"}}], "dp_rank must be a u32"),
        ([{"worker_id": 1, "event": {"data": {"stored": {"blocks": [{"block_hash": 1}]}}}}], "tokens_hash"),
        ([{"worker_id": 1, "event": {"data": {"removed": {}}}}], "no 'block_hashes'"),
    ],
)
def test_unreadable_router_events_say_why(events: object, problem: str) -> None:
    with pytest.raises(EnvelopeError, match=problem):
        rank_batches(msgpack.packb(events))


def test_an_unknown_event_kind_is_dropped_on_its_own() -> None:
    events = [{"worker_id": 1, "event": {"data": {"moved": {}}}}, {"worker_id": 1, "event": {"data": "cleared"}}]
    (batch,) = rank_batches(msgpack.packb(events))
    assert batch.batch.events == (AllBlocksCleared(),)
    assert batch.batch.dropped == ("router event 0: unknown event kind 'moved'",)


def test_the_test_encoders_write_what_the_decoders_read() -> None:
    stored = HashedBlocksStored(7, ((8, 9),), Tier.DISK)
    payload = encode_router_events([(WORKER, 2, stored), (WORKER, 2, BlockRemoved((8,)))])
    envelope = decode_envelope(encode_envelope(PUBLISHER, 3, payload))
    assert envelope == Envelope(PUBLISHER, 3, 0, "kv-events", payload)
    (batch,) = rank_batches(envelope.payload)
    assert batch.batch.events == (stored, BlockRemoved((8,)))


SCOPE = ScopeKey("tiny", "default")


def test_a_pre_hashed_store_is_indexed_under_the_publishers_local_hashes() -> None:
    """The mocker's tokens_hash is kvrouter's local block hash: a /select for the same tokens matches."""
    state = ScopeState(SCOPE)
    record = WorkerRecord(WORKER, "tiny", "default", endpoint="http://w", kv_events_endpoint="inproc://x", block_size=4)
    fold(state, decide(state, UpsertWorker(record, True)).events)  # type: ignore[union-attr]
    tokens = list(range(100, 112))
    local = block_hashes(tokens, 4)
    pairs = ((0xA1, local[0]), (0xA2, local[1]), (0xA3, local[2]))
    batch = KvBatch(0.0, (HashedBlocksStored(None, pairs),), 0)
    decision = decide(state, IngestKvBatch(WORKER, 0, 4, batch))
    assert isinstance(decision, Accepted)
    assert decision.events == (KvIndexed(WORKER, 0, 0, 4, (KvStoredOp(0, None, pairs),)),)
    fold(state, decision.events)
    assert state.selection.index.find_matches(local)[WorkerRank(WORKER, 0)].device == 3
    assert state.selection.kv_watermarks[WorkerRank(WORKER, 0)] == 4


def test_a_pre_hashed_store_naming_a_hash_twice_is_a_no_op() -> None:
    state = ScopeState(SCOPE)
    record = WorkerRecord(WORKER, "tiny", "default", endpoint="http://w", kv_events_endpoint="inproc://x", block_size=4)
    fold(state, decide(state, UpsertWorker(record, True)).events)  # type: ignore[union-attr]
    batch = KvBatch(0.0, (HashedBlocksStored(5, ((5, 1), (6, 2))),), 0)
    decision = decide(state, IngestKvBatch(WORKER, 0, 0, batch))
    assert isinstance(decision, Accepted)
    assert decision.events == (KvIndexed(WORKER, 0, 0, 0, ()),)
