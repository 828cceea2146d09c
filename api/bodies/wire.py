"""The API's strict JSON typing: serde-like integer types, exact JSON kinds, and their wording.

``make_strict_converter`` builds the converter for untrusted input (HTTP bodies): exact JSON types,
range-checked integers, detailed validation errors that ``api/bodies/schemas.py`` turns into serde's
messages. The journal's own converter is built separately in ``actors/persistence/codec.py``;
neither is derived from the other with ``Converter.copy()`` (docs/architecture/index.md#serialisation: a
copied converter stops structuring tagged unions), so each is built whole by its own factory.
"""

from __future__ import annotations

from typing import Any, NewType

import cattrs
import orjson

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U32_MAX, U64_MASK
from kvrouter.actors.core.limits import MAX_TEXT_BYTES, text_too_long

# Wire integer types: the API checks ranges exactly as the reference's serde types do.
U64 = NewType("U64", int)
U32 = NewType("U32", int)
I64 = NewType("I64", int)
USize = NewType("USize", int)

_RANGES = {U64: (0, U64_MASK), U32: (0, U32_MAX), I64: (I64_MIN, I64_MAX), USize: (0, U64_MASK)}
_RANGE_NAMES = {U64: "u64", U32: "u32", I64: "i64", USize: "usize"}


class WireTypeError(TypeError):
    """A JSON value of the wrong type or out of range; the API answers 422."""


class WireSizeError(WireTypeError):
    """A string or list longer than the API accepts (``actors/core/limits.py``); the API answers 413."""


def json_kind(value: Any) -> str:
    """How serde names a JSON value in "invalid type: ..., expected ..." messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {orjson.dumps(value).decode()}"
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _exact_int(value: Any, _: Any = None) -> int:
    if type(value) is not int:
        raise WireTypeError(f"invalid type: {json_kind(value)}, expected an integer")
    return value


def _exact_str(value: Any, _: Any = None) -> str:
    if type(value) is not str:
        raise WireTypeError(f"invalid type: {json_kind(value)}, expected a string")
    if text_too_long(value):
        raise WireSizeError(
            f"a string of {len(value.encode('utf-8', 'surrogatepass'))} bytes exceeds the maximum of {MAX_TEXT_BYTES}"
        )
    return value


def _exact_bool(value: Any, _: Any = None) -> bool:
    if type(value) is not bool:
        raise WireTypeError(f"invalid type: {json_kind(value)}, expected a boolean")
    return value


def _exact_float(value: Any, _: Any = None) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    raise WireTypeError(f"invalid type: {json_kind(value)}, expected f64")


def _ranged(kind: Any) -> Any:
    low, high = _RANGES[kind]
    name = _RANGE_NAMES[kind]

    def structure(value: Any, _: Any = None) -> int:
        if type(value) is not int:
            raise WireTypeError(f"invalid type: {json_kind(value)}, expected {name}")
        if not low <= value <= high:
            raise WireTypeError(f"invalid value: integer `{value}`, expected {name}")
        return value

    return structure


def make_strict_converter() -> cattrs.Converter:
    """A new converter for untrusted JSON; callers add their own hooks to the one they keep."""
    converter = cattrs.Converter(forbid_extra_keys=False, detailed_validation=True)
    converter.register_structure_hook(int, _exact_int)
    converter.register_structure_hook(str, _exact_str)
    converter.register_structure_hook(bool, _exact_bool)
    converter.register_structure_hook(float, _exact_float)
    for kind in _RANGES:
        converter.register_structure_hook(kind, _ranged(kind))
    return converter
