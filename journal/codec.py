"""The one place that builds cattrs converters and turns domain values into bytes.

``make_converter(strict=True)`` is for untrusted input (HTTP bodies, peers): exact JSON types,
range-checked integers, detailed validation errors. ``make_converter(strict=False)`` is for our
own journal on the replay hot path. Both are built by this factory, never derived from one
another with ``Converter.copy()`` (ARCHITECTURE.md pitfall 3.5.1).

Journal records are JSON (orjson): ``{"scope": [model, tenant], "events": [{"type": tag, ...}]}``.
Event tags come from ``EVENT_TAGS`` so renaming a class never orphans a journal.
"""

from __future__ import annotations

import hashlib
from typing import Any, NewType

import attrs
import cattrs
import orjson
from cattrs.strategies import configure_tagged_union

from kvrouter.actors.core.events import EVENT_TAGS, KV_OP_TAGS, Event, KvOp
from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U32_MAX, U64_MASK, ScopeKey

# Wire integer types: the API checks ranges exactly as the reference's serde types do.
U64 = NewType("U64", int)
U32 = NewType("U32", int)
I64 = NewType("I64", int)
USize = NewType("USize", int)

_RANGES = {U64: (0, U64_MASK), U32: (0, U32_MAX), I64: (I64_MIN, I64_MAX), USize: (0, U64_MASK)}
_RANGE_NAMES = {U64: "u64", U32: "u32", I64: "i64", USize: "usize"}


class WireTypeError(TypeError):
    """A JSON value of the wrong type or out of range; the API answers 422."""


def _exact_int(value: Any, _: Any = None) -> int:
    if type(value) is not int:
        raise WireTypeError(f"invalid type: {_json_kind(value)}, expected an integer")
    return value


def _exact_str(value: Any, _: Any = None) -> str:
    if type(value) is not str:
        raise WireTypeError(f"invalid type: {_json_kind(value)}, expected a string")
    return value


def _exact_bool(value: Any, _: Any = None) -> bool:
    if type(value) is not bool:
        raise WireTypeError(f"invalid type: {_json_kind(value)}, expected a boolean")
    return value


def _exact_float(value: Any, _: Any = None) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    raise WireTypeError(f"invalid type: {_json_kind(value)}, expected f64")


def _ranged(kind: Any) -> Any:
    low, high = _RANGES[kind]
    name = _RANGE_NAMES[kind]

    def structure(value: Any, _: Any = None) -> int:
        if type(value) is not int:
            raise WireTypeError(f"invalid type: {_json_kind(value)}, expected {name}")
        if not low <= value <= high:
            raise WireTypeError(f"invalid value: integer `{value}`, expected {name}")
        return value

    return structure


def _json_kind(value: Any) -> str:
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


def _is_int_tuple(cls: Any) -> bool:
    return cls in (tuple[int, ...], tuple[tuple[int, int], ...])


def make_converter(*, strict: bool) -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=False, detailed_validation=strict)
    if strict:
        converter.register_structure_hook(int, _exact_int)
        converter.register_structure_hook(str, _exact_str)
        converter.register_structure_hook(bool, _exact_bool)
        converter.register_structure_hook(float, _exact_float)
        for kind in _RANGES:
            converter.register_structure_hook(kind, _ranged(kind))
    else:
        for kind in _RANGES:
            converter.register_structure_hook(kind, lambda v, _: v)
    # orjson writes tuples as arrays: hand hash tuples (the bulk of every record) over untouched
    # instead of rebuilding them element by element.
    converter.register_unstructure_hook_func(_is_int_tuple, lambda value: value)
    configure_tagged_union(KvOp, converter, tag_name="op", tag_generator=KV_OP_TAGS.__getitem__)
    configure_tagged_union(Event, converter, tag_name="type", tag_generator=EVENT_TAGS.__getitem__)
    # Warm the generated hooks so the first request does not pay for code generation.
    converter.get_structure_hook(Event)
    converter.get_unstructure_hook(Event)
    return converter


JOURNAL_CONVERTER = make_converter(strict=False)
_unstructure_event = JOURNAL_CONVERTER.get_unstructure_hook(Event)
_structure_event = JOURNAL_CONVERTER.get_structure_hook(Event)


@attrs.frozen
class JournalRecord:
    scope: ScopeKey
    events: tuple[Event, ...]


def encode_record(scope: ScopeKey, events: tuple[Event, ...]) -> bytes:
    return orjson.dumps({"scope": [scope[0], scope[1]], "events": [_unstructure_event(e) for e in events]})


def decode_record(payload: bytes) -> JournalRecord:
    data = orjson.loads(payload)
    model, tenant = data["scope"]
    return JournalRecord(ScopeKey(model, tenant), tuple(_structure_event(e, Event) for e in data["events"]))


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON (sorted keys) for hashing: equal states give equal bytes in any process."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
