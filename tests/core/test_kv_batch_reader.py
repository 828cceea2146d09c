"""The direct batch reader (actors/core/kv_batch_reader.py) against the general decoder: for every payload it
reads, it must give exactly what ``msgpack.unpackb`` + validation give; everything else it must leave alone."""

from __future__ import annotations

import math
from typing import Any

import attrs
import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.kv_batch_reader import read_batch
from kvrouter.actors.core.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    Tier,
    WireError,
    batch_from_read,
    decode_batch,
    decode_batch_generally,
    encode_batch,
)

U64 = st.integers(0, (1 << 64) - 1)
TOKENS = st.lists(st.one_of(st.integers(0, 300), st.integers(0, (1 << 32) - 1)), max_size=40)
TIERS = st.sampled_from(list(Tier))
NAMES = st.one_of(st.none(), st.text(max_size=6))


@st.composite
def events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "stored":
        return BlockStored(
            tuple(draw(st.lists(U64, max_size=5))),
            draw(st.one_of(st.none(), U64)),
            draw(TOKENS),
            draw(st.integers(0, 64)),
            lora_name=draw(NAMES) or None,
            tier=draw(TIERS),
            lora_id=draw(st.one_of(st.none(), st.integers(-(1 << 63), (1 << 64) - 1))),
        )
    if kind == "removed":
        return BlockRemoved(tuple(draw(st.lists(U64, max_size=5))), draw(TIERS))
    return AllBlocksCleared()


BATCHES = st.tuples(
    st.lists(events(), max_size=4),
    st.one_of(st.floats(allow_nan=False), st.integers(0, 10**12)),
    st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
    st.booleans(),
)


def general(payload: bytes) -> Any:
    try:
        return decode_batch_generally(payload)
    except WireError as exc:
        return WireError, str(exc)


def decoded(payload: bytes) -> Any:
    """``decode_batch``'s outcome, as ``general`` gives it."""
    try:
        return decode_batch(payload)
    except WireError as exc:
        return WireError, str(exc)


def read(payload: bytes) -> Any:
    found = read_batch(payload)
    return None if found is None else batch_from_read(found)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BATCHES)
def test_vllm_shaped_batches_are_read_directly_and_equal_the_general_decode(batch: Any) -> None:
    items, ts, dp_rank, signed = batch
    payload = encode_batch(items, ts=ts, dp_rank=dp_rank, signed_hashes=signed)
    direct = read(payload)
    assert direct is not None
    assert direct == general(payload) == decode_batch(payload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BATCHES, st.data())
def test_damaged_payloads_are_left_to_the_general_decoder(batch: Any, data: st.DataObject) -> None:
    """Cut short, a byte changed, or bytes appended: the reader gives up or agrees with the general decoder
    (which also rejects what it cannot read); it never accepts what the general decoder rejects."""
    items, ts, dp_rank, signed = batch
    payload = bytearray(encode_batch(items, ts=ts, dp_rank=dp_rank, signed_hashes=signed))
    how = data.draw(st.sampled_from(["cut", "flip", "append"]))
    if how == "cut":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    elif how == "flip":
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    else:
        payload += bytes(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=3)))
    damaged = bytes(payload)
    direct = read(damaged)
    if direct is not None:
        assert same(direct, general(damaged))
        assert same(decode_batch(damaged), direct)


def test_a_nan_timestamp_reads_the_same_both_ways() -> None:
    """Hypothesis found it by changing a byte of the float: both decoders take NaN, and NaN != NaN."""
    payload = encode_batch([BlockStored((1, 2), None, list(range(8)), 4)], ts=float("nan"))
    direct = read(payload)
    assert direct is not None and math.isnan(direct.ts)
    assert same(direct, general(payload)) and same(decode_batch(payload), direct)


def same(a: KvBatch, b: KvBatch) -> bool:
    """Equal, a NaN timestamp (a changed byte can make one; both decoders accept it) counting as itself."""
    if math.isnan(a.ts) and math.isnan(b.ts):
        return attrs.evolve(a, ts=0.0) == attrs.evolve(b, ts=0.0)
    return a == b


# Map events as vLLM 0.33 / SGLang 0.5 send them: the fields in any order, with fields neither decoder uses.
EXTRA_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(allow_nan=False),
        st.text(max_size=5),
        st.binary(max_size=5),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8,
)
EXTRA_FIELDS = st.dictionaries(
    st.sampled_from(["group_idx", "kv_cache_spec_kind", "extra_keys", "sliding_window", "ts", "x"]),
    EXTRA_VALUES,
    max_size=3,
)


@st.composite
def map_events(draw: st.DrawFn) -> dict[str, Any]:
    event = draw(events())
    fields = encode_events_as_maps(event)
    if isinstance(event, BlockStored):
        if draw(st.booleans()):
            fields["cache_salt"] = draw(st.text(max_size=4))
        if draw(st.booleans()):
            fields["parent_hash"] = fields.pop("parent_block_hash")  # the older key
        if draw(st.booleans()):
            fields["locality"] = None
    fields.update(draw(EXTRA_FIELDS))
    order = draw(st.permutations(list(fields)))
    return {key: fields[key] for key in order}


def encode_events_as_maps(event: Any) -> dict[str, Any]:
    (encoded,) = msgpack.unpackb(encode_batch([event], events_as_maps=True), raw=False)[1]
    return dict(encoded)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(map_events(), max_size=4),
    st.one_of(st.floats(allow_nan=False), st.integers(0, 10**12)),
    st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
)
def test_map_events_are_read_directly_and_equal_the_general_decode(
    items: list[dict[str, Any]], ts: Any, dp_rank: Any
) -> None:
    """vLLM 0.33 and SGLang 0.5 send each event as a map: read directly (not through msgpack.unpackb and a Python
    int per token), to what the general decoder gives, whatever the fields' order and whatever else they carry."""
    payload = encode_batch(items, ts=ts, dp_rank=dp_rank)
    direct = read(payload)
    assert direct is not None
    assert direct == general(payload) == decode_batch(payload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(map_events(), min_size=1, max_size=3), st.data())
def test_damaged_map_events_are_left_to_the_general_decoder(items: list[dict[str, Any]], data: st.DataObject) -> None:
    payload = bytearray(encode_batch(items))
    how = data.draw(st.sampled_from(["cut", "flip"]))
    if how == "cut":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    else:
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    damaged = bytes(payload)
    direct = read(damaged)
    if direct is not None:
        assert same(direct, general(damaged))
        assert same(decode_batch(damaged), direct)


def test_map_events_the_reader_leaves_to_the_general_decoder() -> None:
    """A remote locality or multimodal infos (the general decoder's cases), a key named twice, an extension type or
    invalid UTF-8 in a field neither uses, a missing required field: not read directly, decoded as before."""
    stored = encode_events_as_maps(BlockStored((1, 2), None, list(range(8)), 4))
    mm = {"mm_objects": [{"mm_hash": 7, "offsets": []}]}
    for event in (
        {**stored, "locality": "REMOTE"},
        {**stored, "locality": "LOCAL"},
        {**stored, "block_mm_infos": [mm, None]},
        {**stored, "x": msgpack.ExtType(5, b"ab")},
        {**stored, "block_size": -1},
        {key: value for key, value in stored.items() if key != "token_ids"},
        {"type": "Ignored"},
    ):
        payload = encode_batch([event])
        assert read_batch(payload) is None, event
        assert decoded(payload) == general(payload)
    # "type" named twice (a dict cannot hold it; written by hand): the general decoder's dict keeps the last.
    twice_payload = (
        msgpack.packb([0.0, [], None])[:-2] + b"\x91\x82\xa4type\xacBlockRemoved\xa4type\xb0AllBlocksCleared\xc0"
    )
    bad_utf8 = msgpack.packb([0.0, [], None])[:-2] + b"\x91\x82\xa4type\xb0AllBlocksCleared\xa1x\xa2\xff\xfe\xc0"
    for payload in (twice_payload, bad_utf8):
        assert read_batch(payload) is None
    assert decode_batch(twice_payload) == KvBatch(0.0, (AllBlocksCleared(),), None)
    assert general(bad_utf8)[0] is WireError


def test_other_shapes_are_left_to_the_general_decoder() -> None:
    store = BlockStored((1, 2), None, list(range(8)), 4)
    for payload in (
        encode_batch([store], batch_as_map=True),
        encode_batch([["BlockStored", [1], None, list(range(4)), 4, None, None, None, None, 0, None, None, "LOCAL"]]),
        encode_batch([["BlockStored", [1], None, [[1, 2], [3, 4]], 4]]),  # Eagle bigrams
        encode_batch([["Ignored"]]),
        msgpack.packb([0.0, [], None, "extra"]),
    ):
        assert read_batch(payload) is None
        assert decode_batch(payload) == decode_batch_generally(payload)
