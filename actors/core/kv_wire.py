"""Worker KV-event batches (the msgpack payload of a ZMQ message, behaviour.md#kv-events): decode, encode, convert.

Engines disagree on the encoding, so the decoder takes all of them: the batch as an array
``[ts, events, dp_rank?]`` or as a map, each event as a tagged array (positional, and older
producers stop early) or as a map with ``"type"``. Hashes may arrive signed or unsigned and come
out as u64. A payload that cannot be read raises one ``WireError`` so the listener can log it and
skip the batch; an event that is readable but must not be applied (non-local locality, Eagle
bigram token ids, an unknown tag) is dropped on its own and described in ``KvBatch.dropped``.

Decisions the spec leaves open, taken here:

* ``medium`` names are matched case-insensitively: GPU/DEVICE ⇒ device; CPU/CPU_PINNED/CPU_TIER1
  ⇒ host; CPU_TIER2/DISK/NVME ⇒ disk; EXTERNAL/NETWORK/REMOTE/SHARED and **any other name** ⇒
  external (a tier we do not know is treated as the least valuable one). 1.6.1 matches the same
  names case-sensitively and drops an event whose medium it does not know.
* Eagle bigram ``token_ids`` (pairs) are dropped: the spec does not say how to flatten them.
* ``cache_salt`` is decoded (map form) but not hashed: the spec does not say how a salt enters the
  hash. 1.6.1 does change block hashes for a non-empty salt, so salted prompts will not match.
* ``extra_keys`` (vLLM) are ignored; multimodal hashes are read only from a map event's
  ``block_mm_infos``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import msgpack

from kvrouter.actors.core import kv_batch_reader
from kvrouter.actors.core.hashing import block_hashes as compute_block_hashes
from kvrouter.actors.core.hashing import stored_pairs
from kvrouter.actors.core.ids import U32_MAX, U64_MASK
from kvrouter.actors.core.kv_index import Tier, distinct_hashes

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "HashedBlocksStored",
    "KvBatch",
    "KvEvent",
    "Tier",
    "WireError",
    "decode_batch",
    "encode_batch",
    "stored_blocks",
    "stored_upper_bound",
    "tier_from_medium",
]

_I64_MIN = -(1 << 63)


class WireError(ValueError):
    """The payload is not a KV-event batch we can read; the whole batch is skipped."""


def token_array(token_ids: Sequence[int]) -> array[int]:
    """Token ids as a C array of u32: 4 bytes a token where a tuple takes ~36, and the local hash reads it
    without converting each token again. Raises OverflowError / TypeError for a value that is not a u32."""
    if type(token_ids) is array and token_ids.typecode == "I":
        return token_ids
    return array("I", token_ids)


@attrs.frozen
class BlockStored:
    """Blocks now resident on the worker. ``parent_hash`` and ``block_hashes`` are engine (external) u64 hashes."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: array[int] = attrs.field(converter=token_array)  # any sequence of u32 given; kept as array("I")
    block_size: int
    lora_name: str | None = None
    tier: Tier = Tier.DEVICE
    lora_id: int | None = None
    cache_salt: str | None = None  # decoded for completeness; not part of the hash (see module doc)
    mm_hashes: tuple[tuple[int, ...] | None, ...] | None = None  # per block, from ``block_mm_infos``


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.DEVICE


@attrs.frozen
class AllBlocksCleared:
    """Every block of the publishing (worker, dp_rank) is gone, in every tier."""


@attrs.frozen
class HashedBlocksStored:
    """Blocks now resident on the worker, already hashed by the publisher: ``blocks`` are ``(external_hash,
    local_hash)`` pairs, parent first, as Dynamo's event plane carries them (``block_hash``, ``tokens_hash``; no
    token ids travel there, so nothing is re-hashed here: the publisher's local hash is the router's)."""

    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]
    tier: Tier = Tier.DEVICE


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | HashedBlocksStored


@attrs.frozen
class KvBatch:
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None  # when set, overrides the listener's registered dp_rank for this batch
    dropped: tuple[str, ...] = ()  # why events were left out (for the listener's log), in batch order


# ------------------------------------------------------------------------------------- tiers

_MEDIUM_TIERS = {
    "GPU": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST,
    "CPU_PINNED": Tier.HOST,
    "CPU_TIER1": Tier.HOST,
    "CPU_TIER2": Tier.DISK,
    "DISK": Tier.DISK,
    "NVME": Tier.DISK,
    "EXTERNAL": Tier.EXTERNAL,
    "NETWORK": Tier.EXTERNAL,
    "REMOTE": Tier.EXTERNAL,
    "SHARED": Tier.EXTERNAL,
}
_TIER_MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU_PINNED", Tier.DISK: "DISK", Tier.EXTERNAL: "EXTERNAL"}


def tier_from_medium(medium: str | None) -> Tier:
    """Storage tier of an event's ``medium``; absent or empty means the GPU (vLLM omits it there)."""
    if not medium:
        return Tier.DEVICE
    return _MEDIUM_TIERS.get(medium.upper(), Tier.EXTERNAL)


# ------------------------------------------------------------------------------------ decode


def decode_batch(payload: bytes) -> KvBatch:
    """Decode one batch payload; raises ``WireError`` if it is not a readable batch."""
    if _READ_DIRECTLY:
        read = kv_batch_reader.read_batch(payload)
        if read is not None:
            return batch_from_read(read)
    return decode_batch_generally(payload)


# The direct reader in C when it is compiled; as plain Python it is slower than msgpack's C unpacker.
_READ_DIRECTLY = kv_batch_reader.COMPILED


def batch_from_read(read: tuple[float, Any, list[tuple[Any, ...]]]) -> KvBatch:
    """The ``KvBatch`` of ``kv_batch_reader.read_batch``'s result: what ``decode_batch_generally`` gives for it."""
    ts, dp_rank, raw_events = read
    events: list[KvEvent] = []
    for raw in raw_events:
        kind = raw[0]
        if kind == kv_batch_reader.STORED:
            _, hashes, parent, tokens, block_size, lora_id, medium, lora_name, cache_salt = raw
            events.append(
                BlockStored(
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    lora_name or None,
                    tier_from_medium(medium),
                    lora_id,
                    cache_salt or None,
                )
            )
        elif kind == kv_batch_reader.REMOVED:
            events.append(BlockRemoved(raw[1], tier_from_medium(raw[2])))
        else:
            events.append(AllBlocksCleared())
    return KvBatch(ts, tuple(events), dp_rank)


def decode_batch_generally(payload: bytes) -> KvBatch:
    """``decode_batch`` through ``msgpack.unpackb``: every encoding, and the wording of every error."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # msgpack raises ValueError subclasses mostly
        raise WireError(f"not a msgpack document: {exc}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise WireError(f"batch array must be [ts, events, dp_rank?], got {len(raw)} element(s)")
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise WireError("batch map has no 'events'")
        ts, events = raw.get("ts", 0.0), raw["events"]
        dp_rank = next(
            (raw[k] for k in ("data_parallel_rank", "attn_dp_rank", "dp_rank") if raw.get(k) is not None), None
        )
    else:
        raise WireError(f"batch must be an array or a map, got {_kind(raw)}")
    if not _is_number(ts):
        raise WireError(f"batch ts must be a number, got {_kind(ts)}")
    if not isinstance(events, list):
        raise WireError(f"batch events must be an array, got {_kind(events)}")
    if dp_rank is not None and not (_is_int(dp_rank) and 0 <= dp_rank <= U32_MAX):
        raise WireError(f"batch dp_rank must be a u32 or nil, got {dp_rank!r}")
    decoded: list[KvEvent] = []
    dropped: list[str] = []
    for i, event in enumerate(events):
        try:
            result = _decode_event(event)
        except WireError as exc:
            raise WireError(f"event {i}: {exc}") from None
        if isinstance(result, str):
            if result:
                dropped.append(f"event {i}: {result}")
        else:
            decoded.append(result)
    return KvBatch(float(ts), tuple(decoded), dp_rank, tuple(dropped))


# BlockStored array slots (behaviour.md#kv-events), after the tag at 0.
_S_HASHES, _S_PARENT, _S_TOKENS, _S_BLOCK_SIZE, _S_LORA_ID, _S_MEDIUM, _S_LORA_NAME = 1, 2, 3, 4, 5, 6, 7
_S_LOCALITY = 12  # after extra_keys(8), group_idx(9), kv_cache_spec_kind(10), kv_cache_spec_sliding_window(11)
# BlockRemoved array slots.
_R_HASHES, _R_MEDIUM, _R_LOCALITY = 1, 2, 6  # group_idx(3), kind(4), sliding_window(5) in between


def _decode_event(event: Any) -> KvEvent | str:
    """The event, or why it is dropped (``""`` for a silent skip)."""
    if isinstance(event, list):
        if not event or not isinstance(event[0], str):
            raise WireError("array event must start with its tag string")
        tag = event[0]
        if tag == "BlockStored":
            if len(event) <= _S_BLOCK_SIZE:
                raise WireError(f"BlockStored array needs at least 5 elements, got {len(event)}")
            return _stored(
                hashes=event[_S_HASHES],
                parent=event[_S_PARENT],
                tokens=event[_S_TOKENS],
                block_size=event[_S_BLOCK_SIZE],
                lora_id=_at(event, _S_LORA_ID),
                medium=_at(event, _S_MEDIUM),
                lora_name=_at(event, _S_LORA_NAME),
                locality=_at(event, _S_LOCALITY),
                cache_salt=None,
                mm_infos=None,
            )
        if tag == "BlockRemoved":
            if len(event) <= _R_HASHES:
                raise WireError("BlockRemoved array has no block_hashes")
            return _removed(event[_R_HASHES], _at(event, _R_MEDIUM), _at(event, _R_LOCALITY))
    elif isinstance(event, dict):
        type_field = event.get("type")
        if not isinstance(type_field, str):
            raise WireError("map event has no string 'type'")
        tag = type_field
        if tag == "BlockStored":
            for key in ("block_hashes", "token_ids", "block_size"):
                if key not in event:
                    raise WireError(f"BlockStored map has no '{key}'")
            return _stored(
                hashes=event["block_hashes"],
                parent=event.get("parent_block_hash", event.get("parent_hash")),
                tokens=event["token_ids"],
                block_size=event["block_size"],
                lora_id=event.get("lora_id"),
                medium=event.get("medium"),
                lora_name=event.get("lora_name"),
                locality=event.get("locality"),
                cache_salt=event.get("cache_salt"),
                mm_infos=event.get("block_mm_infos"),
            )
        if tag == "BlockRemoved":
            if "block_hashes" not in event:
                raise WireError("BlockRemoved map has no 'block_hashes'")
            return _removed(event["block_hashes"], event.get("medium"), event.get("locality"))
    else:
        raise WireError(f"event must be an array or a map, got {_kind(event)}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "Ignored":
        return ""
    return f"unknown event type {tag!r}"


def _stored(
    *,
    hashes: Any,
    parent: Any,
    tokens: Any,
    block_size: Any,
    lora_id: Any,
    medium: Any,
    lora_name: Any,
    locality: Any,
    cache_salt: Any,
    mm_infos: Any,
) -> BlockStored | str:
    ext = _hashes(hashes, "block_hashes")
    if parent is not None and not _is_int(parent):
        raise WireError(f"parent_block_hash must be an integer or nil, got {_kind(parent)}")
    if not _is_int(block_size) or block_size < 0:
        raise WireError(f"block_size must be a non-negative integer, got {block_size!r}")
    if lora_id is not None and not _is_int(lora_id):
        raise WireError(f"lora_id must be an integer or nil, got {_kind(lora_id)}")
    lora = _opt_str(lora_name, "lora_name")
    salt = _opt_str(cache_salt, "cache_salt")
    tier = tier_from_medium(_opt_str(medium, "medium"))
    why = _non_local(locality)
    if why:
        return why
    if not isinstance(tokens, list):
        raise WireError(f"token_ids must be an array, got {_kind(tokens)}")
    try:
        packed = array("I", tokens)  # C-speed check that every token is an int in [0, 2**32)
    except (TypeError, OverflowError):
        if tokens and all(isinstance(t, list) and len(t) == 2 for t in tokens):
            return "Eagle bigram token_ids are not supported"
        raise WireError("token_ids must be integers in [0, 2**32)") from None
    return BlockStored(
        block_hashes=ext,
        parent_hash=None if parent is None else _u64(parent),
        token_ids=packed,
        block_size=block_size,
        lora_name=lora or None,
        tier=tier,
        lora_id=lora_id,
        cache_salt=salt or None,
        mm_hashes=_mm_hashes(mm_infos),
    )


def _removed(hashes: Any, medium: Any, locality: Any) -> BlockRemoved | str:
    ext = _hashes(hashes, "block_hashes")
    tier = tier_from_medium(_opt_str(medium, "medium"))
    why = _non_local(locality)
    return why or BlockRemoved(ext, tier)


def _non_local(locality: Any) -> str:
    """Why an event with this ``locality`` is dropped; only absent (or non-text legacy slots) and LOCAL stay."""
    if not isinstance(locality, str) or locality.upper() == "LOCAL":
        return ""
    return f"locality {locality!r} is not LOCAL"


def _hashes(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"{name} must be an array, got {_kind(value)}")
    # The common case checked with C-level passes; walk one by one only to name the bad value.
    if value and (set(map(type, value)) != {int} or min(value) < _I64_MIN or max(value) > U64_MASK):
        for h in value:
            if not _is_int(h) or not _I64_MIN <= h <= U64_MASK:
                raise WireError(f"{name} must hold 64-bit integers, got {h!r}")
    return tuple([h & U64_MASK for h in value])


def _mm_hashes(value: Any) -> tuple[tuple[int, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise WireError(f"block_mm_infos must be an array or nil, got {_kind(value)}")
    out: list[tuple[int, ...] | None] = []
    for info in value:
        if info is None:
            out.append(None)
            continue
        objects = info.get("mm_objects") if isinstance(info, dict) else None
        if not isinstance(objects, list) or not all(isinstance(o, dict) for o in objects):
            raise WireError("block_mm_infos entries must be nil or {'mm_objects': [{'mm_hash': int}, ...]}")
        out.append(_hashes([o.get("mm_hash") for o in objects], "mm_hash"))
    return tuple(out)


def _u64(value: int) -> int:
    if not _I64_MIN <= value <= U64_MASK:
        raise WireError(f"hash {value} does not fit 64 bits")
    return value & U64_MASK


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{name} must be a string or nil, got {_kind(value)}")


def _at(seq: list[Any], index: int) -> Any:
    return seq[index] if len(seq) > index else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


# ----------------------------------------------------------------------------------- convert


def stored_upper_bound(batch: KvBatch) -> int:
    """At most how many blocks the batch stores (what its stores name; conversion may keep fewer)."""
    stored = 0
    for event in batch.events:
        kind = type(event)
        if kind is BlockStored:
            stored += len(event.block_hashes)  # type: ignore[union-attr]
        elif kind is HashedBlocksStored:
            stored += len(event.blocks)  # type: ignore[union-attr]
    return stored


def named_blocks(batch: KvBatch) -> int:
    """How many blocks the batch's stores and removals name: the measure of the work of applying it (at least 1)."""
    named = 0
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved):
            named += len(event.block_hashes)
        elif isinstance(event, HashedBlocksStored):
            named += len(event.blocks)
    return max(1, named)


def hashed_blocks(event: HashedBlocksStored) -> tuple[tuple[int, int], ...]:
    """The pairs of a pre-hashed store as the index takes them: u64, and none at all (a no-op, as for
    ``stored_blocks``) when an external hash is named twice, the parent included."""
    blocks = event.blocks
    if not blocks or not distinct_hashes(event.parent_hash, [ext for ext, _ in blocks]):
        return ()
    return tuple((ext & U64_MASK, local & U64_MASK) for ext, local in blocks)


def stored_blocks(
    event: BlockStored, registered_block_size: int, lora_name: str | None = None
) -> tuple[tuple[int, int], ...]:
    """``(external_hash, local_hash)`` pairs of a store, as the index takes them (behaviour.md#kv-events "Conversion").

    Block ``i`` takes the next ``block_size`` tokens and is re-hashed locally (behaviour.md#hashing). Nothing is kept
    from the first block the registered block size cannot describe: an event ``block_size`` other
    than the registered one stops at block 0, too few tokens stops at the first short block.
    Any external hash named twice (including the parent) makes the whole event a no-op (``()``),
    as in the reference. ``lora_name`` is used only when the event names no adapter.
    """
    hashes = event.block_hashes
    if not hashes or event.block_size != registered_block_size or registered_block_size <= 0:
        return ()
    if not distinct_hashes(event.parent_hash, hashes):
        return ()
    tokens = event.token_ids
    count = min(len(hashes), len(tokens) // registered_block_size)
    if count == 0:
        return ()
    name = event.lora_name or lora_name
    if not event.mm_hashes:
        return stored_pairs(hashes, tokens, registered_block_size, count, lora_name=name)
    local = compute_block_hashes(
        tokens[: count * registered_block_size],
        registered_block_size,
        lora_name=name,
        mm_hashes_per_block=event.mm_hashes,
    )
    return tuple(zip(hashes[:count], local, strict=True))


# ------------------------------------------------------------------------------------ encode


def encode_batch(
    events: Iterable[KvEvent | Sequence[Any] | dict[str, Any]],
    *,
    ts: float = 0.0,
    dp_rank: int | None = None,
    batch_as_map: bool = False,
    events_as_maps: bool = False,
    signed_hashes: bool = False,
) -> bytes:
    """Encode a batch the way engines publish it, for test publishers and conformance checks.

    * ``batch_as_map=False`` gives ``[ts, events, dp_rank]``, always with the third slot (1.6.1
      rejects a two-element batch); ``True`` gives ``{"ts", "events", "data_parallel_rank"?}``.
    * ``events_as_maps=False`` gives vLLM's tagged arrays (``["BlockStored", hashes, parent,
      token_ids, block_size, lora_id, medium, lora_name]``); ``True`` gives ``{"type": ...}`` maps
      (vLLM 0.33 / SGLang style). Tiers are written as GPU / CPU_PINNED / DISK / EXTERNAL.
    * ``signed_hashes=True`` writes hashes ≥ 2**63 as negative i64, as some producers do.
    * Items that are lists, tuples or dicts are written verbatim, so tests can send malformed,
      remote-locality or future events.
    """
    encoded = [_encode_event(e, events_as_maps, signed_hashes) for e in events]
    batch: Any
    if batch_as_map:
        batch = {"ts": float(ts), "events": encoded}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
    else:
        batch = [float(ts), encoded, dp_rank]
    packed: bytes = msgpack.packb(batch)  # msgpack is untyped
    return packed


def _encode_event(event: Any, as_map: bool, signed: bool) -> Any:
    def h(values: Iterable[int]) -> list[int]:
        return [_to_wire_hash(v, signed) for v in values]

    if isinstance(event, BlockStored):
        parent = None if event.parent_hash is None else _to_wire_hash(event.parent_hash, signed)
        medium = _TIER_MEDIUM[event.tier]
        if not as_map:
            return [
                "BlockStored",
                h(event.block_hashes),
                parent,
                list(event.token_ids),
                event.block_size,
                event.lora_id,
                medium,
                event.lora_name,
            ]
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": h(event.block_hashes),
            "parent_block_hash": parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": medium,
            "lora_name": event.lora_name,
        }
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        if event.mm_hashes is not None:
            out["block_mm_infos"] = [
                None if mm is None else {"mm_objects": [{"mm_hash": x, "offsets": []} for x in h(mm)]}
                for mm in event.mm_hashes
            ]
        return out
    if isinstance(event, BlockRemoved):
        medium = _TIER_MEDIUM[event.tier]
        if not as_map:
            return ["BlockRemoved", h(event.block_hashes), medium]
        return {"type": "BlockRemoved", "block_hashes": h(event.block_hashes), "medium": medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]
    if isinstance(event, list | tuple | dict):
        return event
    raise TypeError(f"cannot encode {type(event).__name__} as a KV event")


def _to_wire_hash(value: int, signed: bool) -> int:
    value &= U64_MASK
    return value - (1 << 64) if signed and value >> 63 else value
