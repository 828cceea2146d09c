"""Dynamo's event plane on the wire, decoded into kvrouter's KV batches. Pure.

Every message on Dynamo 1.6.1's event plane is an envelope (msgpack map)::

    {"publisher_id": u64, "sequence": u64 (per publisher, from 0), "published_at": ms, "topic": str,
     "payload": bin}

On NATS it is the message body (subject ``{subject_prefix}.kv-events``, no headers); on ZMQ it is the last of four
frames ``[topic, publisher_id u64 BE, sequence u64 BE, 0x01 + u32 BE length + envelope]``. A ``kv-events`` payload
is a msgpack array of router events::

    {"worker_id", "dp_rank", "storage_tier": "device", "event": {"event_id",
     "data": {"stored": {"parent_hash", "start_position", "blocks": [{"block_hash", "tokens_hash", ...}]}}}}

with ``{"removed": {"block_hashes": [...]}}`` and ``"cleared"`` as the other kinds of ``data``. Token ids do not
travel: ``tokens_hash`` is already the router's local block hash (xxh3-64 of the block's tokens, seed 1337), so a
store becomes a ``HashedBlocksStored`` of ``(block_hash, tokens_hash)`` pairs. Consecutive events of one
(worker, dp rank) make one ``KvBatch``; the shell checks the worker and rank against the live catalog.

Decisions taken where the observation left room: ``dp_rank`` is read from the router event or, failing that, from
its ``event`` (where ``/dump`` writes it); ``cleared`` may come as a string or as a one-key map; a storage tier
kvrouter does not know counts as the least valuable one (external), as for engine events; an event kind it does
not know is dropped on its own and named in ``KvBatch.dropped``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs
import msgpack

from kvrouter.actors.core.ids import U64_MASK
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, HashedBlocksStored, KvBatch, KvEvent

# The one envelope framing 1.6.1's ZMQ plane was seen to use (the byte before the length).
ZMQ_ENVELOPE_FORMAT: Final = 0x01
_I64_MIN: Final = -(1 << 63)
_TIERS: Final = {
    "device": Tier.DEVICE,
    "gpu": Tier.DEVICE,
    "host_pinned": Tier.HOST,
    "host": Tier.HOST,
    "cpu": Tier.HOST,
    "disk": Tier.DISK,
    "external": Tier.EXTERNAL,
}


class EnvelopeError(ValueError):
    """A message that is not a readable event-plane envelope (or KV payload); it is skipped and counted."""


@attrs.frozen
class Envelope:
    publisher_id: int
    sequence: int
    published_at: int  # ms since the epoch, as the publisher stamped it
    topic: str
    payload: bytes


@attrs.frozen
class RankBatch:
    """The router events of one envelope for one worker rank, in order, as a batch the index takes."""

    worker_id: int
    dp_rank: int
    batch: KvBatch


def decode_envelope(data: bytes) -> Envelope:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EnvelopeError(f"not a msgpack envelope: {exc}") from None
    if not isinstance(raw, dict):
        raise EnvelopeError(f"the envelope is a {type(raw).__name__}, not a map")
    payload = raw.get("payload")
    if isinstance(payload, list) and all(_is_int(b) and 0 <= b < 256 for b in payload):
        payload = bytes(payload)  # a serializer that writes bytes as an array of u8
    if not isinstance(payload, bytes):
        raise EnvelopeError("the envelope has no binary payload")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise EnvelopeError("the envelope's topic is not a string")
    return Envelope(
        _u64(raw.get("publisher_id"), "publisher_id"),
        _u64(raw.get("sequence"), "sequence"),
        _u64(raw.get("published_at", 0), "published_at"),
        topic,
        payload,
    )


def decode_zmq_message(frames: Sequence[bytes]) -> Envelope:
    """The envelope of one ZMQ event-plane message; its frames must agree with it."""
    if len(frames) != 4 or len(frames[1]) != 8 or len(frames[2]) != 8:
        shape = [len(frame) for frame in frames]
        raise EnvelopeError(f"expected [topic, publisher u64, sequence u64, envelope], got frames of {shape} bytes")
    body = frames[3]
    if len(body) < 5 or body[0] != ZMQ_ENVELOPE_FORMAT:
        raise EnvelopeError(f"the envelope frame does not start with format byte {ZMQ_ENVELOPE_FORMAT:#04x}")
    length = int.from_bytes(body[1:5], "big")
    if length != len(body) - 5:
        raise EnvelopeError(f"the envelope frame says {length} bytes and holds {len(body) - 5}")
    envelope = decode_envelope(body[5:])
    publisher, sequence = int.from_bytes(frames[1], "big"), int.from_bytes(frames[2], "big")
    if (envelope.publisher_id, envelope.sequence) != (publisher, sequence):
        raise EnvelopeError(
            f"frames name publisher {publisher:x} seq {sequence}, the envelope {envelope.publisher_id:x} "
            f"seq {envelope.sequence}"
        )
    return envelope


def encode_envelope(publisher_id: int, sequence: int, payload: bytes, *, topic: str = "kv-events") -> bytes:
    """An envelope as 1.6.1 publishes it (for test publishers)."""
    packed: bytes = msgpack.packb(
        {"publisher_id": publisher_id, "sequence": sequence, "published_at": 0, "topic": topic, "payload": payload},
        use_bin_type=True,
    )
    return packed


def zmq_frames(envelope: bytes, publisher_id: int, sequence: int, topic: str = "kv-events") -> list[bytes]:
    """The four ZMQ frames of an encoded envelope (for test publishers)."""
    body = bytes([ZMQ_ENVELOPE_FORMAT]) + len(envelope).to_bytes(4, "big") + envelope
    return [topic.encode(), publisher_id.to_bytes(8, "big"), sequence.to_bytes(8, "big"), body]


# -- the KV payload ----------------------------------------------------------------------------------------------


def rank_batches(payload: bytes, published_at_ms: int = 0) -> list[RankBatch]:
    """The payload's router events as batches, one per run of consecutive events of one (worker, dp rank)."""
    try:
        events = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EnvelopeError(f"the payload is not msgpack: {exc}") from None
    if not isinstance(events, list):
        raise EnvelopeError(f"the payload is a {type(events).__name__}, not an array of router events")
    ts = published_at_ms / 1000.0
    batches: list[RankBatch] = []
    run: list[KvEvent] = []
    dropped: list[str] = []
    rank: tuple[int, int] | None = None
    for i, raw in enumerate(events):
        try:
            worker_id, dp_rank, event = _router_event(raw)
        except EnvelopeError as exc:
            raise EnvelopeError(f"router event {i}: {exc}") from None
        if rank is not None and rank != (worker_id, dp_rank):
            batches.append(RankBatch(*rank, KvBatch(ts, tuple(run), rank[1], tuple(dropped))))
            run, dropped = [], []
        rank = (worker_id, dp_rank)
        if isinstance(event, str):
            dropped.append(f"router event {i}: {event}")
        else:
            run.append(event)
    if rank is not None:
        batches.append(RankBatch(*rank, KvBatch(ts, tuple(run), rank[1], tuple(dropped))))
    return batches


def _router_event(raw: Any) -> tuple[int, int, KvEvent | str]:
    if not isinstance(raw, dict):
        raise EnvelopeError(f"a {type(raw).__name__}, not a map")
    event = raw.get("event")
    if not isinstance(event, dict):
        raise EnvelopeError("no 'event' map")
    worker_id = _u64(raw.get("worker_id"), "worker_id")
    dp_rank = raw.get("dp_rank", event.get("dp_rank", 0))
    if dp_rank is None:
        dp_rank = 0
    if not _is_int(dp_rank) or not 0 <= dp_rank < 1 << 32:
        raise EnvelopeError(f"dp_rank must be a u32, got {dp_rank!r}")
    tier = raw.get("storage_tier")
    tier = _TIERS.get(tier.lower(), Tier.EXTERNAL) if isinstance(tier, str) else Tier.DEVICE
    return worker_id, dp_rank, _data(event.get("data"), tier)


def _data(data: Any, tier: Tier) -> KvEvent | str:
    if data == "cleared" or (isinstance(data, dict) and data.keys() == {"cleared"}):
        return AllBlocksCleared()
    if not isinstance(data, dict) or len(data) != 1:
        return f"unknown event data {_shape(data)}"
    (kind, body), *_ = data.items()
    if kind == "stored":
        if not isinstance(body, dict) or not isinstance(body.get("blocks"), list):
            raise EnvelopeError("'stored' has no 'blocks' array")
        parent = body.get("parent_hash")
        pairs = tuple(_block(block) for block in body["blocks"])
        return HashedBlocksStored(None if parent is None else _hash(parent, "parent_hash"), pairs, tier)
    if kind == "removed":
        hashes = body.get("block_hashes") if isinstance(body, dict) else None
        if not isinstance(hashes, list):
            raise EnvelopeError("'removed' has no 'block_hashes' array")
        return BlockRemoved(tuple(_hash(h, "block_hashes") for h in hashes), tier)
    return f"unknown event kind {kind!r}"


def _block(block: Any) -> tuple[int, int]:
    if isinstance(block, dict):
        return _hash(block.get("block_hash"), "block_hash"), _hash(block.get("tokens_hash"), "tokens_hash")
    if isinstance(block, list) and len(block) >= 2:
        return _hash(block[0], "block_hash"), _hash(block[1], "tokens_hash")
    raise EnvelopeError(f"a stored block must be a map with block_hash and tokens_hash, got {_shape(block)}")


def _hash(value: Any, name: str) -> int:
    if not _is_int(value) or not _I64_MIN <= value <= U64_MASK:
        raise EnvelopeError(f"{name} must be a 64-bit integer, got {value!r}")
    return int(value) & U64_MASK


def _u64(value: Any, name: str) -> int:
    if not _is_int(value) or not 0 <= value <= U64_MASK:
        raise EnvelopeError(f"{name} must be a u64, got {value!r}")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(map(str, value))) + "}"
    return type(value).__name__


def encode_router_events(events: Sequence[tuple[int, int, KvEvent]], *, first_event_id: int = 1) -> bytes:
    """A ``kv-events`` payload as 1.6.1 publishes it, from ``(worker_id, dp_rank, event)`` (for test publishers)."""
    out = []
    for offset, (worker_id, dp_rank, event) in enumerate(events):
        data: Any
        tier = "device"
        if isinstance(event, HashedBlocksStored):
            blocks = [{"block_hash": ext, "tokens_hash": local, "mm_extra_info": None} for ext, local in event.blocks]
            data = {"stored": {"parent_hash": event.parent_hash, "start_position": None, "blocks": blocks}}
            tier = event.tier.label
        elif isinstance(event, BlockRemoved):
            data = {"removed": {"block_hashes": list(event.block_hashes)}}
            tier = event.tier.label
        elif isinstance(event, AllBlocksCleared):
            data = "cleared"
        else:
            raise TypeError(f"cannot encode {type(event).__name__} as a router event")
        out.append(
            {
                "worker_id": worker_id,
                "dp_rank": dp_rank,
                "storage_tier": tier,
                "event": {"event_id": first_event_id + offset, "data": data},
            }
        )
    packed: bytes = msgpack.packb(out, use_bin_type=True)
    return packed
