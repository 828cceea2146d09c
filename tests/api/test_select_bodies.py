"""api/select_schemas.fast_select_body against the strict converter (api/schemas.parse) on generated bodies:
whatever the fast reader accepts, the converter accepts with the very same values, and ``select_body`` answers
every body exactly as the converter does (same value, or same status and message); typical bodies are read
fast."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.actors.core.ids import U32_MAX, U64_MASK
from kvrouter.actors.core.limits import MAX_TEXT_BYTES
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import SelectBody, fast_select_body, select_body
from kvrouter.api.http import HttpError

INTS = st.sampled_from([0, 1, -1, 2, U32_MAX, U32_MAX + 1, U64_MASK, U64_MASK + 1, -(2**63)])
TEXTS = st.sampled_from(
    ["m", "", "é", "kv", "x" * MAX_TEXT_BYTES, "x" * (MAX_TEXT_BYTES + 1), "ü" * (MAX_TEXT_BYTES // 2 + 1)]
)
ODD = st.sampled_from([None, True, False, 1.5, "7", [], {}, {"worker_id": 1, "dp_rank": 0}])
TOKENS = st.lists(st.one_of(INTS, st.integers(0, U32_MAX), st.sampled_from([True, False, 1.0, "1", None])), max_size=8)
VALUE = st.one_of(INTS, TEXTS, ODD, TOKENS)

GOOD_TEXTS = st.sampled_from(["m", "", "é", "x" * MAX_TEXT_BYTES])
GOOD_TOKENS = st.lists(st.integers(0, U32_MAX), max_size=40)
FIELDS = [
    "model_name",
    "tenant_id",
    "routing_group",
    "token_ids",
    "lora_name",
    "selection_id",
    "reservation_id",
    "session_id",
    "router_mode",
    "expected_output_tokens",
    "explain",
    # fields only the converter reads, and one it ignores
    "block_hashes",
    "sequence_hashes",
    "isl_tokens",
    "pinned_worker",
    "allowed_worker_ids",
    "router_config_override",
    "priority_jump",
    "not_a_field",
]


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    """A well-formed body with some optional fields, then up to three fields set to a value of any kind or
    dropped; now and then not an object at all."""
    if draw(st.integers(0, 20)) == 0:
        return draw(VALUE)
    body: dict[str, Any] = {"model_name": draw(GOOD_TEXTS), "token_ids": draw(GOOD_TOKENS)}
    for name in ("tenant_id", "routing_group", "lora_name", "selection_id", "session_id", "router_mode"):
        if draw(st.booleans()):
            body[name] = draw(GOOD_TEXTS)
    if draw(st.booleans()):
        body["explain"] = draw(st.booleans())
    if draw(st.booleans()):
        body["expected_output_tokens"] = draw(st.sampled_from([0, 5, U32_MAX]))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELDS[:11] if draw(st.integers(0, 3)) else FIELDS[11:]))
        if draw(st.integers(0, 4)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(VALUE)
    return body


def converter(value: Any) -> tuple[str, Any]:
    try:
        return "ok", parse(SelectBody, value)
    except HttpError as exc:
        return "error", (exc.status, exc.message)


def answered(value: Any) -> tuple[str, Any]:
    try:
        return "ok", select_body(value)
    except HttpError as exc:
        return "error", (exc.status, exc.message)


@settings(max_examples=600, deadline=None)
@given(bodies())
def test_the_fast_reader_agrees_with_the_converter(body: Any) -> None:
    fast = fast_select_body(body)
    if fast is not None:
        assert converter(body) == ("ok", fast)
    assert answered(body) == converter(body)


@pytest.mark.parametrize(
    "body",
    [
        {"model_name": "m", "token_ids": list(range(1024))},
        {"model_name": "m", "tenant_id": "t", "token_ids": [7, 8], "selection_id": "s", "explain": True},
        {"routing_group": "g", "token_ids": [], "lora_name": None, "session_id": "x", "unknown": [1.5]},
        {"model_name": "m", "token_ids": [1], "reservation_id": "r", "expected_output_tokens": 10},
    ],
)
def test_typical_bodies_are_read_fast(body: dict[str, Any]) -> None:
    fast = fast_select_body(body)
    assert fast is not None
    assert fast == parse(SelectBody, body)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model_name": "m", "token_ids": [1, True]}, 422),
        ({"model_name": "m", "token_ids": [1, -1]}, 422),
        ({"model_name": None, "token_ids": [1]}, 422),
        ({"model_name": "m", "tenant_id": None}, 422),
        ({"model_name": "m", "explain": "yes"}, 422),
        ({"model_name": "m", "expected_output_tokens": U32_MAX + 1}, 422),
        ({"model_name": "m", "session_id": 5}, 422),
        ({"model_name": "x" * (MAX_TEXT_BYTES + 1)}, 413),
    ],
)
def test_what_the_fast_reader_leaves_gets_the_converters_answer(body: dict[str, Any], status: int) -> None:
    assert fast_select_body(body) is None
    with pytest.raises(HttpError) as raised:
        select_body(body)
    assert raised.value.status == status
    assert answered(body) == converter(body)
