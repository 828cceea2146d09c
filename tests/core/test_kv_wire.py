"""Decoding every KV-event encoding engines publish (behaviour.md#kv-events), and converting stores for the index."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.ids import to_i64
from kvrouter.actors.core.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    Tier,
    WireError,
    decode_batch,
    encode_batch,
    stored_blocks,
    tier_from_medium,
)

BIG = 2**64 - 1  # sent signed as -1 by some producers
TOKENS = list(range(100, 108))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj)


def stored_array(*tail: Any, hashes: list[int] | None = None, parent: int | None = None) -> list[Any]:
    return ["BlockStored", hashes or [11, 12], parent, TOKENS, 4, *tail]


def only(batch: KvBatch) -> Any:
    assert len(batch.events) == 1, batch
    return batch.events[0]


# ------------------------------------------------------------------------------------ batches


def test_array_batch_with_array_events() -> None:
    payload = pack([1.25, [stored_array(None, None, None), ["BlockRemoved", [11], None], ["AllBlocksCleared"]], None])
    batch = decode_batch(payload)
    assert batch == KvBatch(
        1.25,
        (BlockStored((11, 12), None, tuple(TOKENS), 4), BlockRemoved((11,)), AllBlocksCleared()),
        None,
    )


def test_array_batch_with_map_events() -> None:
    """What vLLM 0.33 and SGLang 0.5 send (spec Appendix)."""
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": 10,
            "token_ids": TOKENS,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": "alpha",
            "cache_salt": "s",
        },
        {"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU_PINNED"},
        {"type": "AllBlocksCleared"},
    ]
    batch = decode_batch(pack([2.0, events, 1]))
    assert batch.dp_rank == 1
    assert batch.events == (
        BlockStored((11, 12), 10, tuple(TOKENS), 4, lora_name="alpha", cache_salt="s"),
        BlockRemoved((12,), Tier.HOST),
        AllBlocksCleared(),
    )


@pytest.mark.parametrize("key", ["data_parallel_rank", "attn_dp_rank", "dp_rank"])
def test_map_batch_with_each_dp_rank_key(key: str) -> None:
    batch = decode_batch(pack({"ts": 3, key: 3, "events": [["AllBlocksCleared"]]}))
    assert batch == KvBatch(3.0, (AllBlocksCleared(),), 3)


def test_map_batch_without_dp_rank_or_ts() -> None:
    assert decode_batch(pack({"events": []})) == KvBatch(0.0, (), None)


def test_two_element_array_batch_has_no_dp_rank() -> None:
    """vLLM's EventBatch omits a nil dp rank (1.6.1 rejects this form; kvrouter accepts it)."""
    assert decode_batch(pack([0.5, [["AllBlocksCleared"]]])) == KvBatch(0.5, (AllBlocksCleared(),), None)


def test_dp_rank_in_batch_is_reported_for_override() -> None:
    """Edge case 55: the listener applies the batch to rank 3 whatever it registered."""
    assert decode_batch(encode_batch([AllBlocksCleared()], dp_rank=3)).dp_rank == 3
    assert decode_batch(encode_batch([AllBlocksCleared()], dp_rank=3, batch_as_map=True)).dp_rank == 3


# ------------------------------------------------------------------------------------- events


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ((), BlockStored((11, 12), None, tuple(TOKENS), 4)),  # stops after block_size
        ((7,), BlockStored((11, 12), None, tuple(TOKENS), 4, lora_id=7)),  # stops after lora_id
        ((None, "CPU_PINNED"), BlockStored((11, 12), None, tuple(TOKENS), 4, tier=Tier.HOST)),  # after medium
        ((None, None, "alpha"), BlockStored((11, 12), None, tuple(TOKENS), 4, lora_name="alpha")),
        ((None, None, None, None, 0, "full", None, "LOCAL", "engine"), BlockStored((11, 12), None, tuple(TOKENS), 4)),
        (
            (None, None, None, None, 0, "full", None, "LOCAL", "engine", "future"),
            BlockStored((11, 12), None, tuple(TOKENS), 4),
        ),
    ],
)
def test_older_and_newer_producers_block_stored_arrays(tail: tuple[Any, ...], expected: BlockStored) -> None:
    assert only(decode_batch(pack([0.0, [stored_array(*tail)], None]))) == expected


def test_block_removed_array_lengths() -> None:
    for event in (
        ["BlockRemoved", [5]],
        ["BlockRemoved", [5], None],
        ["BlockRemoved", [5], "DISK", 0, None, None, "LOCAL", "x"],
    ):
        assert only(decode_batch(pack([0.0, [event], None]))).block_hashes == (5,)


def test_signed_and_unsigned_hashes_mean_the_same_block() -> None:
    signed = decode_batch(pack([0.0, [stored_array(hashes=[-1, 12], parent=to_i64(2**63))], None]))
    unsigned = decode_batch(pack([0.0, [stored_array(hashes=[BIG, 12], parent=2**63)], None]))
    assert signed == unsigned
    assert only(signed).block_hashes == (BIG, 12)
    assert only(signed).parent_hash == 2**63
    removed = decode_batch(pack([0.0, [["BlockRemoved", [-2], None]], None]))
    assert only(removed).block_hashes == (BIG - 1,)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.DEVICE),
        ("", Tier.DEVICE),
        ("GPU", Tier.DEVICE),
        ("DEVICE", Tier.DEVICE),
        ("CPU_PINNED", Tier.HOST),
        ("CPU", Tier.HOST),
        ("CPU_TIER1", Tier.HOST),
        ("cpu_pinned", Tier.HOST),
        ("DISK", Tier.DISK),
        ("NVME", Tier.DISK),
        ("CPU_TIER2", Tier.DISK),
        ("EXTERNAL", Tier.EXTERNAL),
        ("SHARED", Tier.EXTERNAL),
        ("NETWORK", Tier.EXTERNAL),
        ("REMOTE", Tier.EXTERNAL),
        ("SOMETHING_NEW", Tier.EXTERNAL),
    ],
)
def test_medium_tiers(medium: str | None, tier: Tier) -> None:
    assert tier_from_medium(medium) is tier
    stored = decode_batch(pack([0.0, [stored_array(None, medium)], None]))
    assert only(stored).tier is tier
    removed = decode_batch(pack([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": medium}], None]))
    assert only(removed).tier is tier


@pytest.mark.parametrize("locality", ["REMOTE", "WEIRD"])
def test_non_local_events_are_dropped(locality: str) -> None:
    """Edge case 58 (second half): REMOTE (and unknown) locality never reaches the index."""
    tail = (None, None, None, None, 0, "full", None, locality)
    events = [
        stored_array(*tail),
        ["BlockRemoved", [1], None, 0, None, None, locality],
        {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "block_size": 4, "locality": locality},
        {"type": "BlockRemoved", "block_hashes": [1], "locality": locality},
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(pack([0.0, events, None]))
    assert batch.events == (AllBlocksCleared(),)
    assert len(batch.dropped) == 4
    assert all(locality in why for why in batch.dropped)


def test_local_locality_is_kept_in_any_case() -> None:
    tail = (None, None, None, None, 0, "full", None)
    batch = decode_batch(pack([0.0, [stored_array(*tail, "LOCAL"), stored_array(*tail, "local")], None]))
    assert len(batch.events) == 2
    assert batch.dropped == ()


def test_ignored_is_skipped_silently_and_unknown_tags_are_dropped_with_a_reason() -> None:
    batch = decode_batch(pack([0.0, [["Ignored", 1, 2], {"type": "Ignored"}, ["BlockTransferred", [1]]], None]))
    assert batch.events == ()
    assert batch.dropped == ("event 2: unknown event type 'BlockTransferred'",)


def test_eagle_bigram_token_ids_are_dropped() -> None:
    """The spec does not say how to flatten bigrams, so such a store is not applied."""
    event = ["BlockStored", [1], None, [[1, 2], [2, 3], [3, 4], [4, 5]], 4, None]
    batch = decode_batch(pack([0.0, [event, ["AllBlocksCleared"]], None]))
    assert batch.events == (AllBlocksCleared(),)
    assert batch.dropped == ("event 0: Eagle bigram token_ids are not supported",)


def test_map_event_multimodal_infos() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "token_ids": TOKENS,
        "block_size": 4,
        "block_mm_infos": [{"mm_objects": [{"mm_hash": -1, "offsets": [[0, 2]]}]}, None],
    }
    assert only(decode_batch(pack([0.0, [event], None]))).mm_hashes == ((BIG,), None)


def test_empty_lora_name_and_cache_salt_are_absent() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": TOKENS[:4],
        "block_size": 4,
        "lora_name": "",
        "cache_salt": "",
    }
    decoded = only(decode_batch(pack([0.0, [event], None])))
    assert decoded.lora_name is None
    assert decoded.cache_salt is None


MALFORMED: list[tuple[str, bytes]] = [
    ("not msgpack", b"\xc1"),
    ("truncated", pack([0.0, [["AllBlocksCleared"]], None])[:-2]),
    ("trailing bytes", pack([0.0, [], None]) + b"\x00"),
    ("empty", b""),
    ("scalar batch", pack(5)),
    ("short array batch", pack([0.0])),
    ("ts not a number", pack(["now", [], None])),
    ("ts bool", pack([True, [], None])),
    ("events not a list", pack([0.0, {"a": 1}, None])),
    ("map without events", pack({"ts": 0.0})),
    ("negative dp rank", pack([0.0, [], -1])),
    ("dp rank too big", pack([0.0, [], 2**32])),
    ("dp rank text", pack([0.0, [], "0"])),
    ("event scalar", pack([0.0, [7], None])),
    ("event empty array", pack([0.0, [[]], None])),
    ("event tag not text", pack([0.0, [[1, 2]], None])),
    ("map event without type", pack([0.0, [{"block_hashes": []}], None])),
    ("stored too short", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4]]], None])),
    ("stored hashes not a list", pack([0.0, [["BlockStored", 1, None, [1, 2, 3, 4], 4]], None])),
    ("stored hash text", pack([0.0, [["BlockStored", ["1"], None, [1, 2, 3, 4], 4]], None])),
    ("stored hash bool", pack([0.0, [["BlockStored", [True], None, [1, 2, 3, 4], 4]], None])),
    ("stored parent text", pack([0.0, [["BlockStored", [1], "p", [1, 2, 3, 4], 4]], None])),
    ("stored tokens not a list", pack([0.0, [["BlockStored", [1], None, "abcd", 4]], None])),
    ("stored token negative", pack([0.0, [["BlockStored", [1], None, [-1, 2, 3, 4], 4]], None])),
    ("stored token too big", pack([0.0, [["BlockStored", [1], None, [2**32, 2, 3, 4], 4]], None])),
    ("stored token float", pack([0.0, [["BlockStored", [1], None, [1.5, 2, 3, 4], 4]], None])),
    ("stored block size text", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], "4"]], None])),
    ("stored block size negative", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], -4]], None])),
    ("stored medium int", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, 3]], None])),
    ("stored lora name int", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, None, 3]], None])),
    ("stored lora id text", pack([0.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, "x"]], None])),
    ("map stored without tokens", pack([0.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 4}], None])),
    (
        "map stored bad mm",
        pack(
            [
                0.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "token_ids": [1, 2, 3, 4],
                        "block_size": 4,
                        "block_mm_infos": [{"mm": 1}],
                    }
                ],
                None,
            ]
        ),
    ),
    ("removed without hashes", pack([0.0, [["BlockRemoved"]], None])),
    ("map removed without hashes", pack([0.0, [{"type": "BlockRemoved"}], None])),
    ("invalid utf-8", b"\x93\xcb" + b"\x00" * 8 + b"\x91\x91\xa2\xff\xfe\xc0"),
]


@pytest.mark.parametrize(("why", "payload"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_payloads_raise_one_wire_error(why: str, payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_wire_error_names_the_event() -> None:
    with pytest.raises(WireError, match=r"event 1: .*block_hashes"):
        decode_batch(pack([0.0, [["AllBlocksCleared"], ["BlockRemoved", "x"]], None]))


# ------------------------------------------------------------------------------------- encode

EVENTS = [
    BlockStored((1, BIG), None, tuple(TOKENS), 4, lora_name="alpha", tier=Tier.HOST, lora_id=3),
    BlockStored((5,), BIG, tuple(TOKENS[:4]), 4, cache_salt="salt", mm_hashes=((BIG, 2),)),
    BlockRemoved((5, BIG), Tier.DISK),
    BlockRemoved((6,)),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("batch_as_map", [False, True])
@pytest.mark.parametrize("events_as_maps", [False, True])
@pytest.mark.parametrize("signed_hashes", [False, True])
def test_encode_decode_round_trip(batch_as_map: bool, events_as_maps: bool, signed_hashes: bool) -> None:
    payload = encode_batch(
        EVENTS,
        ts=9.5,
        dp_rank=2,
        batch_as_map=batch_as_map,
        events_as_maps=events_as_maps,
        signed_hashes=signed_hashes,
    )
    decoded = decode_batch(payload)
    assert decoded.ts == 9.5
    assert decoded.dp_rank == 2
    if events_as_maps:
        assert decoded.events == tuple(EVENTS)
    else:  # the array form has no slot for cache_salt or multimodal infos
        assert decoded.events[1] == BlockStored((5,), BIG, tuple(TOKENS[:4]), 4)
        assert decoded.events[:1] + decoded.events[2:] == tuple(EVENTS[:1] + EVENTS[2:])


def test_encoded_forms() -> None:
    """The array batch always carries the dp-rank slot: 1.6.1 rejects a two-element batch."""
    assert msgpack.unpackb(encode_batch([])) == [0.0, [], None]
    assert msgpack.unpackb(encode_batch([], batch_as_map=True)) == {"ts": 0.0, "events": []}
    raw = msgpack.unpackb(encode_batch(EVENTS[:1] + EVENTS[2:3], signed_hashes=True))
    assert raw[1] == [
        ["BlockStored", [1, -1], None, TOKENS, 4, 3, "CPU_PINNED", "alpha"],
        ["BlockRemoved", [5, -1], "DISK"],
    ]


def test_raw_events_pass_through_for_tests() -> None:
    remote = ["BlockRemoved", [1], None, 0, None, None, "REMOTE"]
    batch = decode_batch(encode_batch([remote, {"type": "AllBlocksCleared"}]))
    assert batch.events == (AllBlocksCleared(),)
    assert len(batch.dropped) == 1
    with pytest.raises(TypeError):
        encode_batch([object()])  # type: ignore[list-item]


# ------------------------------------------------------------------------------------ convert


def test_stored_blocks_recomputes_local_hashes() -> None:
    event = BlockStored((11, 12), None, tuple(TOKENS), 4)
    assert stored_blocks(event, 4) == tuple(zip((11, 12), block_hashes(TOKENS, 4), strict=True))


def test_stored_blocks_uses_the_lora_name() -> None:
    event = BlockStored((11, 12), None, tuple(TOKENS), 4, lora_name="alpha")
    assert [local for _, local in stored_blocks(event, 4)] == block_hashes(TOKENS, 4, lora_name="alpha")
    unnamed = BlockStored((11, 12), None, tuple(TOKENS), 4)
    assert stored_blocks(unnamed, 4, lora_name="alpha") == stored_blocks(event, 4)
    assert stored_blocks(event, 4, lora_name="beta") == stored_blocks(event, 4)  # the event's own name wins


def test_stored_blocks_uses_multimodal_hashes() -> None:
    event = BlockStored((11, 12), None, tuple(TOKENS), 4, mm_hashes=((7,), None))
    assert [local for _, local in stored_blocks(event, 4)] == block_hashes(TOKENS, 4, mm_hashes_per_block=[[7], None])


def test_block_size_mismatch_stores_nothing() -> None:
    """Edge case 52: the first block already mismatches."""
    assert stored_blocks(BlockStored((11,), None, tuple(TOKENS), 8), 4) == ()
    assert stored_blocks(BlockStored((11, 12), None, tuple(TOKENS), 4), 8) == ()


def test_short_tokens_keep_the_earlier_blocks() -> None:
    event = BlockStored((11, 12, 13), None, (*TOKENS, 1), 4)
    assert [ext for ext, _ in stored_blocks(event, 4)] == [11, 12]
    assert stored_blocks(BlockStored((11,), None, (1, 2, 3), 4), 4) == ()


def test_extra_tokens_beyond_the_listed_blocks_are_ignored() -> None:
    event = BlockStored((11,), None, tuple(TOKENS), 4)
    assert stored_blocks(event, 4) == ((11, block_hashes(TOKENS[:4], 4)[0]),)


@pytest.mark.parametrize(("hashes", "parent"), [((11, 11), None), ((11, 12, 11), None), ((11, 12), 12), ((11,), 11)])
def test_duplicate_hashes_make_the_store_a_no_op(hashes: tuple[int, ...], parent: int | None) -> None:
    """Edge case 51: a repeated hash, or the parent inside the block list."""
    tokens = tuple(range(4 * len(hashes)))
    assert stored_blocks(BlockStored(hashes, parent, tokens, 4), 4) == ()
