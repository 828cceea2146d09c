"""api/bodies/write_bodies.py against the strict converter (api/schemas.parse) on generated bodies: whatever the fast
reader accepts, the converter accepts with the very same values; typical bodies are accepted fast."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U32_MAX, U64_MASK
from kvrouter.actors.core.limits import MAX_TEXT_BYTES
from kvrouter.api.bodies.schemas import AddBody, RequestRefBody, parse
from kvrouter.api.bodies.write_bodies import add_request, request_ref
from kvrouter.api.http import HttpError

# Values around every boundary the converter checks, and of every JSON kind.
INTS = st.sampled_from([0, 1, -1, U32_MAX, U32_MAX + 1, U64_MASK, U64_MASK + 1, I64_MIN, I64_MAX, I64_MIN - 1])
TEXTS = st.sampled_from(
    ["m", "", "é", "x" * MAX_TEXT_BYTES, "x" * (MAX_TEXT_BYTES + 1), "ü" * (MAX_TEXT_BYTES // 2 + 1)]
)
ODD = st.sampled_from([None, True, False, 1.5, "7", [], {}])
HASHES = st.lists(st.one_of(INTS, st.integers(), st.sampled_from([True, 1.0, "1", None])), max_size=6)
VALUE = st.one_of(INTS, TEXTS, ODD, HASHES)


GOOD_INTS = st.sampled_from([0, 1, 7, U32_MAX])
GOOD_TEXTS = st.sampled_from(["m", "", "é", "x" * MAX_TEXT_BYTES])
GOOD_HASHES = st.lists(st.sampled_from([0, 1, -1, I64_MIN, I64_MAX]), max_size=6)


@st.composite
def bodies(draw: st.DrawFn, add: bool) -> Any:
    """A well-formed body (tenant fields present or not), then up to two fields replaced by a value of any
    kind or dropped; now and then not an object at all."""
    body: dict[str, Any] = {"model_name": draw(GOOD_TEXTS), "request_id": draw(GOOD_TEXTS)}
    for name in ("tenant_id", "routing_group"):
        if draw(st.booleans()):
            body[name] = draw(GOOD_TEXTS)
    if add:
        body |= {"worker_id": draw(GOOD_INTS), "dp_rank": draw(GOOD_INTS), "sequence_hashes": draw(GOOD_HASHES)}
        if draw(st.booleans()):
            body["new_isl_tokens"] = draw(GOOD_INTS)
    names = [*sorted(body), "tenant_id", "routing_group", "new_isl_tokens"]
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(names))
        replacement = draw(st.one_of(VALUE, st.just(...)))
        if replacement is ...:
            body.pop(name, None)
        else:
            body[name] = replacement
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), VALUE))


def slow_add(body: Any) -> Any:
    try:
        parsed = parse(AddBody, body)
    except HttpError as refused:
        return refused.status
    scope = parsed.scope()
    return (
        scope.model_name,
        scope.tenant_id,
        parsed.request_id,
        parsed.worker_id,
        parsed.dp_rank,
        parsed.sequence_hashes,
        parsed.new_isl_tokens,
    )


def slow_ref(body: Any) -> Any:
    try:
        parsed = parse(RequestRefBody, body)
    except HttpError as refused:
        return refused.status
    scope = parsed.scope()
    return scope.model_name, scope.tenant_id, parsed.request_id


@settings(max_examples=500, deadline=None)
@given(bodies(add=True))
def test_an_add_body_read_fast_is_what_the_converter_reads(body: Any) -> None:
    fast = add_request(body)
    if fast is not None:
        assert fast == slow_add(body)


@settings(max_examples=300, deadline=None)
@given(bodies(add=False))
def test_a_request_reference_read_fast_is_what_the_converter_reads(body: Any) -> None:
    fast = request_ref(body)
    if fast is not None:
        assert fast == slow_ref(body)


def test_typical_bodies_are_read_fast() -> None:
    add = {"model_name": "m", "request_id": "r", "worker_id": 3, "dp_rank": 1, "sequence_hashes": [-1, 2, I64_MAX]}
    assert add_request(add) == ("m", "default", "r", 3, 1, (U64_MASK, 2, I64_MAX), 0)
    assert add_request({**add, "new_isl_tokens": 64, "routing_group": "g"}) == slow_add(
        {**add, "new_isl_tokens": 64, "routing_group": "g"}
    )
    assert add_request({**add, "tenant_id": "t", "routing_group": "g"})[:2] == ("m", "t")  # type: ignore[index]
    assert request_ref({"model_name": "m", "request_id": "r", "tenant_id": "t"}) == ("m", "t", "r")
    assert add_request({**add, "tenant_id": None}) is None and slow_add({**add, "tenant_id": None}) == 422
