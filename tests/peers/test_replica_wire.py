"""The 1.6.1 replica message: golden bytes captured from a live reference, and what its receiver
accepts or rejects (each case below was sent to a 1.6.1 slot tracker and its verdict observed)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.peers.replica_wire import (
    AFFINITY_TOPIC,
    TOPIC,
    AddRequestData,
    Free,
    MarkPrefillCompleted,
    PrefillLoadHint,
    ReplicaEvent,
    ReplicaWireError,
    SessionAffinity,
    decode,
    decode_message,
    decode_payload,
    encode,
    encode_affinity,
    encode_payload,
)

# Captured with a plain zmq SUB on `python -m dynamo.slot_tracker --replica-sync-port` (ai-dynamo-runtime
# 1.6.1) while driving it over HTTP with model_name "m", routing_group "g", worker 7 (block_size 16):
#   /add r1 on rank 1, sequence_hashes [1, 2, -1], new_isl_tokens 40
#   /add r2 on rank 0, sequence_hashes [], no new_isl_tokens
#   /prefill_complete r1
#   /free r1
# Integers use msgpack's smallest encoding (fixint for 7, 16, 40; uint64 0xcf only for values that need
# it: the hash -1 as 2**64-1 and the router id); strings are str8/fixstr; nil is 0xc0.
REFERENCE_ROUTER_ID = 3523025605425901446
GOLDEN_ADD = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a167aa626c6f636b5f73697a6510a56576656e7485aa7265"
    "71756573745f6964a27231a6776f726b657282a9776f726b65725f696407a764705f72616e6b01a46461746181aa416464526571"
    "7565737484ae746f6b656e5f73657175656e6365930102cfffffffffffffffffb4747261636b5f70726566696c6c5f746f6b656e"
    "73c3b665787065637465645f6f75747075745f746f6b656e73c0b170726566696c6c5f6c6f61645f68696e7482d920696e697469"
    "616c5f6566666563746976655f70726566696c6c5f746f6b656e7328b965787065637465645f70726566696c6c5f647572617469"
    "6f6ec0a9726f757465725f6964cf30e44d1f52042f86a96c6f72615f6e616d65c0"
)
GOLDEN_ADD_NO_PREFILL = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a167aa626c6f636b5f73697a6510a56576656e7485aa7265"
    "71756573745f6964a27232a6776f726b657282a9776f726b65725f696407a764705f72616e6b00a46461746181aa416464526571"
    "7565737484ae746f6b656e5f73657175656e636590b4747261636b5f70726566696c6c5f746f6b656e73c2b66578706563746564"
    "5f6f75747075745f746f6b656e73c0b170726566696c6c5f6c6f61645f68696e74c0a9726f757465725f6964cf30e44d1f52042f"
    "86a96c6f72615f6e616d65c0"
)
GOLDEN_PREFILL_COMPLETE = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a167aa626c6f636b5f73697a6510a56576656e7485aa7265"
    "71756573745f6964a27231a6776f726b657282a9776f726b65725f696407a764705f72616e6b01a464617461b44d61726b507265"
    "66696c6c436f6d706c65746564a9726f757465725f6964cf30e44d1f52042f86a96c6f72615f6e616d65c0"
)
GOLDEN_FREE = bytes.fromhex(
    "84aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a167aa626c6f636b5f73697a6510a56576656e7485aa7265"
    "71756573745f6964a27231a6776f726b657282a9776f726b65725f696407a764705f72616e6b01a464617461a446726565a9726f"
    "757465725f6964cf30e44d1f52042f86a96c6f72615f6e616d65c0"
)


def event(request_id: str, dp_rank: int, data: Any) -> ReplicaEvent:
    return ReplicaEvent("m", "g", 16, request_id, 7, dp_rank, data, REFERENCE_ROUTER_ID)


GOLDEN = [
    (GOLDEN_ADD, event("r1", 1, AddRequestData((1, 2, 2**64 - 1), True, None, PrefillLoadHint(40)))),
    (GOLDEN_ADD_NO_PREFILL, event("r2", 0, AddRequestData((), False))),
    (GOLDEN_PREFILL_COMPLETE, event("r1", 1, MarkPrefillCompleted())),
    (GOLDEN_FREE, event("r1", 1, Free())),
]


@pytest.mark.parametrize(("payload", "expected"), GOLDEN, ids=["add", "add-no-prefill", "prefill-complete", "free"])
def test_golden_round_trip(payload: bytes, expected: ReplicaEvent) -> None:
    assert decode([TOPIC, payload]) == expected
    assert encode(expected) == [TOPIC, payload]  # byte-identical to what 1.6.1 publishes


def test_event_helpers() -> None:
    decoded = decode_payload(GOLDEN_ADD)
    assert decoded.scope == ScopeKey("m", "g")  # routing_group is kvrouter's tenant_id
    assert decoded.rank == WorkerRank(7, 1)
    assert isinstance(decoded.data, AddRequestData) and decoded.data.prefill_tokens == 40
    # A 1.6.1 receiver books the hint only when tracking is on (probed: either alone books 0).
    assert AddRequestData((), True, None, None).prefill_tokens == 0
    assert AddRequestData((), False, None, PrefillLoadHint(10)).prefill_tokens == 0


def doc(payload: bytes = GOLDEN_ADD) -> dict[str, Any]:
    return msgpack.unpackb(payload)


def pack(document: Any) -> bytes:
    return msgpack.packb(document)


def test_tenant_id_instead_of_routing_group_is_rejected() -> None:
    document = doc()
    document["tenant_id"] = document.pop("routing_group")
    with pytest.raises(ReplicaWireError, match="routing_group: missing field"):
        decode_payload(pack(document))
    document["routing_group"] = "g"  # both present: 1.6.1 ignores the unknown tenant_id
    assert decode_payload(pack(document)).routing_group == "g"


def test_accepted_like_1_6_1() -> None:
    # Unknown keys ignored; absent Option fields are nil; an absent track flag is false (serde default).
    document = doc()
    document["zzz"] = 1
    document["event"]["yyy"] = [1]
    del document["event"]["lora_name"]
    add = document["event"]["data"]["AddRequest"]
    del add["expected_output_tokens"], add["track_prefill_tokens"]
    decoded = decode_payload(pack(document))
    assert decoded.lora_name is None
    assert decoded.data == AddRequestData((1, 2, 2**64 - 1), False, None, PrefillLoadHint(40))
    # Positional arrays (rmp_serde's unnamed form) for any struct, and the worker as [id, rank].
    array = ["m", "g", 16, ["a", [7, 0], {"AddRequest": [[1, 2, 3], True, None, [10, None]]}, 99, None]]
    assert decode_payload(pack(array)) == ReplicaEvent(
        "m", "g", 16, "a", 7, 0, AddRequestData((1, 2, 3), True, None, PrefillLoadHint(10)), 99
    )
    # Unit variants also as a one-entry map with nil; strings also as UTF-8 bin; lora as text.
    document = doc(GOLDEN_FREE)
    document["event"]["data"] = {"Free": None}
    document["event"]["lora_name"] = "alpha"
    decoded = decode_payload(msgpack.packb(document).replace(b"\xa2r1", b"\xc4\x02r1"))
    assert (decoded.data, decoded.request_id, decoded.lora_name) == (Free(), "r1", "alpha")
    document["event"]["data"] = {"MarkPrefillCompleted": None}
    assert decode_payload(pack(document)).data == MarkPrefillCompleted()
    # Small integers in the widest encoding; a token sequence of nil; durations as map or array.
    wide = GOLDEN_FREE.replace(b"\xa9worker_id\x07", b"\xa9worker_id\xcf" + (7).to_bytes(8, "big"))
    assert decode_payload(wide) == GOLDEN[3][1]
    document = doc()
    add = document["event"]["data"]["AddRequest"]
    add["token_sequence"] = None
    add["prefill_load_hint"]["expected_prefill_duration"] = {"secs": 1, "nanos": 2_000_000_000}
    decoded = decode_payload(pack(document))
    assert decoded.data == AddRequestData(None, True, None, PrefillLoadHint(40, 3_000_000_000))
    add["prefill_load_hint"]["expected_prefill_duration"] = [3, 5]
    assert decode_payload(pack(document)).data.prefill_load_hint == PrefillLoadHint(40, 3_000_000_005)
    # The empty request id is a request id.
    document["event"]["request_id"] = ""
    assert decode_payload(pack(document)).request_id == ""


def test_duration_and_hint_encode() -> None:
    original = event("x", 0, AddRequestData(None, True, 50, PrefillLoadHint(8, 2_500_000_001)))
    wire = doc(encode_payload(original))["event"]["data"]["AddRequest"]
    assert wire["prefill_load_hint"]["expected_prefill_duration"] == {"secs": 2, "nanos": 500_000_001}
    assert wire["token_sequence"] is None and wire["expected_output_tokens"] == 50
    assert decode_payload(encode_payload(original)) == original


def mutate(path: tuple[Any, ...], value: Any, payload: bytes = GOLDEN_ADD) -> bytes:
    document = doc(payload)
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return pack(document)


ADD = ("event", "data", "AddRequest")
MALFORMED = {
    "not-msgpack": b"\xc1",
    "truncated": GOLDEN_ADD[:-3],
    "trailing-bytes": GOLDEN_ADD + b"\x00",  # 1.6.1 ignores trailing bytes; kvrouter does not
    "not-a-map": pack("hello"),
    "array-too-short": pack(["m", "g", 16, ["a", [7, 0], "Free", 99]]),
    "array-too-long": pack(["m", "g", 16, ["a", [7, 0], "Free", 99, None, "extra"]]),
    "worker-array-too-long": mutate(("event", "worker"), [7, 0, 1]),
    "missing-router-id": pack(doc() | {"event": {k: v for k, v in doc()["event"].items() if k != "router_id"}}),
    "missing-event": pack({k: v for k, v in doc().items() if k != "event"}),
    "negative-worker": mutate(("event", "worker", "worker_id"), -1),
    "dp-rank-over-u32": mutate(("event", "worker", "dp_rank"), 2**32),
    "block-size-over-u32": mutate(("block_size",), 2**32 + 16),
    "block-size-float": mutate(("block_size",), 16.0),
    "block-size-bool": mutate(("block_size",), True),
    "request-id-nil": mutate(("event", "request_id"), None),
    "request-id-int": mutate(("event", "request_id"), 5),
    "model-name-bad-utf8": GOLDEN_ADD.replace(b"\xa1m", b"\xc4\x01\xff"),
    "lora-int": mutate(("event", "lora_name"), 3),
    "unknown-variant": mutate(("event", "data"), "free"),
    "unit-variant-with-content": mutate(("event", "data"), {"Free": []}),
    "variant-in-array": mutate(("event", "data"), ["Free"]),
    "variant-index": mutate(("event", "data"), 2),
    "add-without-content": mutate(("event", "data"), "AddRequest"),
    "two-entry-variant-map": mutate(("event", "data"), {"Free": None, "MarkPrefillCompleted": None}),
    "track-as-int": mutate((*ADD, "track_prefill_tokens"), 1),
    "track-nil": mutate((*ADD, "track_prefill_tokens"), None),
    "negative-hash": mutate((*ADD, "token_sequence"), [-1]),
    "float-hash": mutate((*ADD, "token_sequence"), [1.0]),
    "hash-as-int64": GOLDEN_ADD.replace(b"\x93\x01\x02\xcf", b"\x93\x01\x02\xd3"),  # int64 -1, not a u64
    "tokens-not-array": mutate((*ADD, "token_sequence"), 5),
    "output-tokens-over-u32": mutate((*ADD, "expected_output_tokens"), 2**32),
    "hint-without-tokens": mutate((*ADD, "prefill_load_hint"), {"expected_prefill_duration": None}),
    "duration-nanos-over-u32": mutate(
        (*ADD, "prefill_load_hint", "expected_prefill_duration"), {"secs": 1, "nanos": 2**32}
    ),
    "duplicate-key": GOLDEN_FREE.replace(b"\x84\xaamodel_name", b"\x85\xaamodel_name\xa1m\xaamodel_name"),
    "int-key": pack({1: 2}),
    "ext-type": mutate(("event", "request_id"), msgpack.ExtType(5, b"x")),
}


@pytest.mark.parametrize("payload", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_is_rejected(payload: bytes) -> None:
    with pytest.raises(ReplicaWireError):
        decode([TOPIC, payload])


@pytest.mark.parametrize(
    "frames",
    [
        [TOPIC + b"x", GOLDEN_FREE],  # passes a SUB prefix filter, but 1.6.1 drops it
        [b"dynamo.slot-tracker.v", GOLDEN_FREE],
        [TOPIC + GOLDEN_FREE],
        [TOPIC, GOLDEN_FREE, b"extra"],
        [],
    ],
    ids=["longer-topic", "shorter-topic", "one-frame", "three-frames", "no-frames"],
)
def test_bad_framing_is_rejected(frames: list[bytes]) -> None:
    with pytest.raises(ReplicaWireError):
        decode(frames)


def test_errors_name_the_field() -> None:
    with pytest.raises(ReplicaWireError, match=r"event\.worker\.dp_rank: expected an unsigned 32-bit integer"):
        decode_payload(MALFORMED["dp-rank-over-u32"])
    with pytest.raises(ReplicaWireError, match=r"event\.router_id: missing field"):
        decode_payload(MALFORMED["missing-router-id"])
    with pytest.raises(ReplicaWireError, match="unknown variant 'free'"):
        decode_payload(MALFORMED["unknown-variant"])


# -- session affinity topic ---------------------------------------------------------------------------

# Captured from a live 1.6.1 selection service (--session-affinity-ttl-secs 60) after a /select_and_reserve
# with session_id "s1" booked worker 2, rank 1.
GOLDEN_AFFINITY = bytes.fromhex(
    "87aa6d6f64656c5f6e616d65a16dad726f7574696e675f67726f7570a764656661756c74aa73657373696f6e5f6964a27331a977"
    "6f726b65725f696402a764705f72616e6b01a873657175656e6365cf18eaa9d1f7519d85a97772697465725f6964cfa9dd7522"
    "71e95653"
)
GOLDEN_BINDING = SessionAffinity("m", "default", "s1", 2, 1, 1795434120723144069, 12240068153063331411)


def test_affinity_golden_round_trip() -> None:
    assert encode_affinity(GOLDEN_BINDING) == [AFFINITY_TOPIC, GOLDEN_AFFINITY]
    assert decode_message([AFFINITY_TOPIC, GOLDEN_AFFINITY]) == GOLDEN_BINDING
    assert GOLDEN_BINDING.scope == ScopeKey("m", "default")


def test_affinity_without_a_rank_and_as_an_array() -> None:
    fields = ["m", "g", "s", 7, None, 5, 9]
    assert decode_message([AFFINITY_TOPIC, msgpack.packb(fields)]) == SessionAffinity("m", "g", "s", 7, None, 5, 9)
    named = {"model_name": "m", "routing_group": "g", "session_id": "s", "worker_id": 7, "sequence": 5, "writer_id": 9}
    assert decode_message([AFFINITY_TOPIC, msgpack.packb(named)]).dp_rank is None  # absent Option: nil


@pytest.mark.parametrize(
    "document",
    [
        {"model_name": "m", "routing_group": "g", "worker_id": 1, "dp_rank": 0, "sequence": 1, "writer_id": 1},
        {"model_name": "m", "routing_group": "g", "session_id": "s", "worker_id": -1, "sequence": 1, "writer_id": 1},
        {
            "model_name": "m",
            "routing_group": "g",
            "session_id": "s",
            "worker_id": 1,
            "dp_rank": 1 << 32,
            "sequence": 1,
            "writer_id": 1,
        },
        {"model_name": "m", "routing_group": "g", "session_id": 5, "worker_id": 1, "sequence": 1, "writer_id": 1},
        ["m", "g", "s", 1, 0, 1],
    ],
)
def test_malformed_affinity_is_rejected(document: Any) -> None:
    with pytest.raises(ReplicaWireError):
        decode_message([AFFINITY_TOPIC, msgpack.packb(document)])


def test_affinity_with_trailing_bytes_is_rejected() -> None:
    with pytest.raises(ReplicaWireError):
        decode_message([AFFINITY_TOPIC, GOLDEN_AFFINITY + b"\x00"])
