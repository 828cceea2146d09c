"""Generated ``/select`` request bodies as bytes, for ``api/select_body_reader`` against ``orjson.loads``: mostly
the common shape (which the reader takes), written in JSON's every spacing, with odd values and damaged bytes
mixed in (which it must leave to orjson)."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import strategies as st

from kvrouter.actors.core.ids import U32_MAX

NUMBERS = st.one_of(
    st.integers(0, 10**18 + 5),
    st.sampled_from([0, 1, U32_MAX, U32_MAX + 1, 10**18 - 1, 10**18, -1, -(2**63), 2**64, 1.5, 0.0, -0.0, 1e300]),
)
TOKENS = st.one_of(
    st.lists(st.integers(0, U32_MAX), max_size=40),
    st.lists(st.one_of(st.integers(0, U32_MAX), st.integers(U32_MAX + 1, 10**12), st.integers(-5, -1)), max_size=6),
    st.lists(st.one_of(st.integers(0, 9), st.sampled_from([True, None, 1.0, "1", [], {}])), max_size=4),
)
TEXTS = st.one_of(st.sampled_from(["m", "", "é", "bench", 'a"b', "a\\b", "\x01", "\u2028", "😀"]), st.text(max_size=6))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS)
KEYS = st.one_of(
    st.sampled_from(
        [
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
            "priority_jump",
            "pinned_worker",
            "allowed_worker_ids",
        ]
    ),
    TEXTS,
)


@st.composite
def body_values(draw: st.DrawFn) -> Any:
    """A body's JSON value: an object of typical fields, some odd ones; now and then something else."""
    if draw(st.integers(0, 25)) == 0:
        return draw(st.one_of(SCALARS, TOKENS))
    body: dict[str, Any] = {"model_name": "m", "token_ids": draw(TOKENS)}
    for _ in range(draw(st.integers(0, 5))):
        key = draw(KEYS)
        kind = draw(st.integers(0, 9))
        if kind < 6:
            body[key] = draw(SCALARS)
        elif kind < 8:
            body[key] = draw(TOKENS)
        elif kind == 8:
            body[key] = {"worker_id": 1, "dp_rank": draw(NUMBERS)}
        else:
            body.pop(key, None)
    return body


def _written(value: Any, style: int) -> bytes:
    """``value`` as JSON text in one of several spellings (compact, spaced, indented, escaped, orjson's)."""
    try:
        if style == 0:
            return orjson.dumps(value)
        if style == 1:
            return json.dumps(value, ensure_ascii=False).encode()
        if style == 2:
            return json.dumps(value, ensure_ascii=False, indent=1).encode().replace(b"\n", b"\r\n")
        if style == 3:
            return json.dumps(value, ensure_ascii=False, separators=(" ,\t", " : ")).encode()
        return json.dumps(value).encode()  # non-ASCII as \u escapes
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return json.dumps(value, allow_nan=True).encode()  # e.g. a float out of JSON's range: Infinity


@st.composite
def body_bytes(draw: st.DrawFn) -> bytes:
    """A body as sent: written one way or another, sometimes with a duplicated key, cut short, a byte changed,
    or something added around it."""
    data = _written(draw(body_values()), draw(st.integers(0, 4)))
    how = draw(st.integers(0, 9))
    if how == 1 and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == 2 and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    elif how == 3:
        data = draw(st.sampled_from([b" ", b"\n", b"\t", b"\x00", b"\xef\xbb\xbf", b"x"])) + data
        data += draw(st.sampled_from([b"", b" ", b"\r\n", b"}", b",", b"0"]))
    elif how == 4 and data.endswith(b"}") and len(data) > 2:
        data = data[:-1] + b',"token_ids":' + _written(draw(TOKENS), 0) + b"}"  # a repeated key: the last wins
    return data
