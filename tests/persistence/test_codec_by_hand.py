"""The journal codec's hand-written encoders of the slot tracker's hot events make exactly the bytes the journal
converter makes (and so exactly what old builds wrote and recovery reads)."""

from __future__ import annotations

import attrs
import orjson
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.events import (
    EVENT_TAGS,
    Event,
    KvClearedOp,
    KvIndexed,
    KvRemovedOp,
    KvStoredOp,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
)
from kvrouter.actors.core.ids import U64_MASK, ScopeKey
from kvrouter.actors.persistence.codec import (
    _BY_HAND,
    _HEADS,
    _MAX_HEADS,
    JOURNAL_CONVERTER,
    RECORD_VERSION,
    decode_record,
    encode_record,
)

TEXT = st.text(max_size=8)
U64 = st.integers(0, U64_MASK)


def by_converter(event: object) -> bytes:
    return orjson.dumps(JOURNAL_CONVERTER.unstructure(event, Event))


@given(TEXT, U64, U64, st.lists(U64, max_size=5), U64, U64, st.one_of(st.none(), U64))
def test_a_request_added_encodes_as_the_converter_encodes_it(
    request_id: str, worker: int, rank: int, hashes: list[int], tokens: int, at: int, output: int | None
) -> None:
    event = RequestAdded(request_id, worker, rank, tuple(hashes), tokens, at, output)
    assert orjson.dumps(_BY_HAND[RequestAdded](event)) == by_converter(event)
    record = encode_record(ScopeKey("m", "t"), (event, PrefillCompleted(request_id), RequestFreed(request_id)))
    assert decode_record(record).events == (event, PrefillCompleted(request_id), RequestFreed(request_id))


@given(TEXT)
def test_request_references_encode_as_the_converter_encodes_them(request_id: str) -> None:
    for kind in (PrefillCompleted, RequestFreed):
        assert orjson.dumps(_BY_HAND[kind](kind(request_id))) == by_converter(kind(request_id))


def test_every_field_and_the_tag_are_written() -> None:
    for kind, encode in _BY_HAND.items():
        sample = kind(*[() if str(field.type).startswith("tuple[") else 0 for field in attrs.fields(kind)])
        assert list(encode(sample)) == [field.name for field in attrs.fields(kind)] + ["type"]
        assert encode(sample)["type"] == EVENT_TAGS[kind]


def by_the_generic_encoder(scope: ScopeKey, events: tuple[Event, ...]) -> bytes:
    """A record as orjson writes it from the converter's dicts (what ``encode_record`` wrote before it wrote the
    records of one hot event as bytes)."""
    unstructured = [JOURNAL_CONVERTER.unstructure(event, Event) for event in events]
    return orjson.dumps({"v": RECORD_VERSION, "scope": [scope[0], scope[1]], "events": unstructured})


ANY_TEXT = st.text(max_size=12)  # quotes, backslashes, control characters, non-ASCII, surrogates' neighbours
INT = st.one_of(U64, st.integers(-(2**63), 2**63 - 1), st.booleans())


@given(ANY_TEXT, ANY_TEXT, ANY_TEXT, INT, INT, st.lists(U64, max_size=5), INT, INT, st.one_of(st.none(), INT))
def test_a_record_of_one_hot_event_is_the_generic_encoders_bytes(
    model: str,
    tenant: str,
    request_id: str,
    worker: int,
    rank: int,
    hashes: list[int],
    tokens: int,
    at: int,
    output: int | None,
) -> None:
    """Byte for byte (bools where ints belong, as a caller could pass them, take the generic encoder's way)."""
    scope = ScopeKey(model, tenant)
    events: list[Event] = [
        RequestAdded(request_id, worker, rank, tuple(hashes), tokens, at, output),
        PrefillCompleted(request_id),
        RequestFreed(request_id),
    ]
    for event in events:
        assert encode_record(scope, (event,)) == by_the_generic_encoder(scope, (event,))
        assert decode_record(encode_record(scope, (event,))).events == (event,)


def test_record_heads_are_kept_for_a_bounded_number_of_scopes() -> None:
    for index in range(3 * _MAX_HEADS):
        scope = ScopeKey(f"m{index}", "t")
        assert encode_record(scope, (RequestFreed("r"),)) == by_the_generic_encoder(scope, (RequestFreed("r"),))
        assert len(_HEADS) <= _MAX_HEADS


KV_OPS = st.lists(
    st.one_of(
        st.builds(
            KvStoredOp,
            st.integers(0, 3),
            st.one_of(st.none(), U64),
            st.lists(st.tuples(U64, U64), max_size=4).map(tuple),
        ),
        st.builds(KvRemovedOp, st.integers(0, 3), st.lists(U64, max_size=4).map(tuple)),
        st.just(KvClearedOp()),
    ),
    max_size=5,
).map(tuple)


@given(U64, U64, U64, st.one_of(st.none(), U64), KV_OPS)
def test_a_kv_run_encodes_as_the_converter_encodes_it(
    worker: int, rank: int, stream: int, seq: int | None, ops: tuple[object, ...]
) -> None:
    event = KvIndexed(worker, rank, stream, seq, ops)  # type: ignore[arg-type]
    assert orjson.dumps(_BY_HAND[KvIndexed](event)) == by_converter(event)
    assert decode_record(encode_record(ScopeKey("m", "t"), (event,))).events == (event,)
