"""The journal codec's hand-written encoders of the slot tracker's hot events make exactly the bytes the journal
converter makes (and so exactly what old builds wrote and recovery reads)."""

from __future__ import annotations

import attrs
import orjson
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.events import EVENT_TAGS, Event, PrefillCompleted, RequestAdded, RequestFreed
from kvrouter.actors.core.ids import U64_MASK, ScopeKey
from kvrouter.actors.persistence.codec import _BY_HAND, JOURNAL_CONVERTER, decode_record, encode_record

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
        sample = kind(*[() if field.type == "tuple[int, ...]" else 0 for field in attrs.fields(kind)])
        assert list(encode(sample)) == [field.name for field in attrs.fields(kind)] + ["type"]
        assert encode(sample)["type"] == EVENT_TAGS[kind]
