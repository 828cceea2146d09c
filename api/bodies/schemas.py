"""Wire DTOs (what clients send), distinct from domain commands, and their strict parsing.

Types mirror the reference's serde types so a body it rejects with 422 is rejected here too:
exact JSON types, u64/u32/i64/usize ranges, required fields, ``null`` only where optional.
Unknown fields are ignored, as the reference ignores them. ``tenant_id`` is the scope field;
``routing_group`` (the 1.6.1 name) is accepted as an alias.
"""

from __future__ import annotations

from typing import Any, NewType, TypeVar

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, IterableValidationNote

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U64_MASK, ScopeKey
from kvrouter.actors.core.limits import MAX_PROMPT_BLOCKS
from kvrouter.api.bodies.wire import U32, U64, USize, WireSizeError, WireTypeError, json_kind, make_strict_converter
from kvrouter.api.http import HttpError

DEFAULT_TENANT = "default"

# Signed 64-bit hashes on the wire, reinterpreted as unsigned inside (behaviour.md#hashing).
SequenceHashes = NewType("SequenceHashes", tuple)


class HashListError(WireTypeError):
    """A bad element of a hash list; serde names it ``field[index]``."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def _structure_hashes(value: Any, _: Any = None) -> tuple[int, ...]:
    if type(value) is not list:
        raise WireTypeError(f"invalid type: {json_kind(value)}, expected an array of signed 64-bit sequence hashes")
    if len(value) > MAX_PROMPT_BLOCKS:
        raise WireSizeError(f"{len(value)} hashes exceed the maximum of {MAX_PROMPT_BLOCKS} per prompt")
    if value and (set(map(type, value)) != {int} or min(value) < I64_MIN or max(value) > I64_MAX):
        for index, h in enumerate(value):  # name the first bad element, as serde does
            if type(h) is not int:
                raise HashListError(index, f"invalid type: {json_kind(h)}, expected i64")
            if not I64_MIN <= h <= I64_MAX:
                raise HashListError(index, f"invalid value: {json_kind(h)}, expected i64")
    return tuple([h & U64_MASK for h in value])


@attrs.frozen
class Scoped:
    """Mixin for bodies naming a scope: ``model_name`` plus ``tenant_id``/``routing_group``."""

    def scope(self) -> ScopeKey:
        tenant = self.tenant_id if self.tenant_id is not None else self.routing_group  # type: ignore[attr-defined]
        return ScopeKey(self.model_name, DEFAULT_TENANT if tenant is None else tenant)  # type: ignore[attr-defined]


@attrs.frozen
class RegisterBody(Scoped):
    worker_id: U64
    model_name: str
    block_size: U32
    dp_start: U32
    dp_size: U32
    # Absent means "default"; an explicit null is a 422, as in the reference (hence not Optional).
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)


@attrs.frozen
class UnregisterBody(Scoped):
    worker_id: U64
    model_name: str
    # Absent means "default"; an explicit null is a 422, as in the reference (hence not Optional).
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)


@attrs.frozen
class AddBody(Scoped):
    model_name: str
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: SequenceHashes
    new_isl_tokens: USize = 0  # type: ignore[assignment]
    # Absent means "default"; an explicit null is a 422, as in the reference (hence not Optional).
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)


@attrs.frozen
class RequestRefBody(Scoped):
    model_name: str
    request_id: str
    # Absent means "default"; an explicit null is a 422, as in the reference (hence not Optional).
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)


@attrs.frozen
class PotentialLoadsBody(Scoped):
    model_name: str
    sequence_hashes: SequenceHashes
    new_isl_tokens: USize = 0  # type: ignore[assignment]
    # Absent means "default"; an explicit null is a 422, as in the reference (hence not Optional).
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)


API_CONVERTER = make_strict_converter()
API_CONVERTER.register_structure_hook(SequenceHashes, _structure_hashes)

T = TypeVar("T")
_HOOKS: dict[type, Any] = {}


def parse(cls: type[T], value: Any) -> T:
    """Structure ``value`` into ``cls`` or raise a 422 with a serde-like message."""
    hook = _HOOKS.get(cls)
    if hook is None:
        hook = _HOOKS[cls] = API_CONVERTER.get_structure_hook(cls)
    if type(value) is not dict:
        raise HttpError(422, _deserialize_failed(f"invalid type: {json_kind(value)}, expected a JSON object"))
    try:
        return hook(value, cls)
    except Exception as exc:  # cattrs raises ExceptionGroups; turn them into one readable line
        message, cause = _first_problem(exc)
        if isinstance(cause, WireSizeError):
            raise HttpError(413, message) from None
        raise HttpError(422, _deserialize_failed(message)) from None


def _deserialize_failed(detail: str) -> str:
    return f"Failed to deserialize the JSON body into the target type: {detail}"


def _first_problem(exc: BaseException, path: str = "") -> tuple[str, BaseException]:
    """serde's wording for the error a client would see first, and that error.

    serde stops at the first bad value in document order and reports missing fields only at the
    end of the object; cattrs collects every problem, so prefer a bad value over a missing field.
    """
    if isinstance(exc, cattrs.ClassValidationError):
        located = []
        for sub in exc.exceptions:
            notes = [n for n in getattr(sub, "__notes__", ()) if isinstance(n, AttributeValidationNote)]
            located.append((notes[0].name if notes else "", sub))
        located.sort(key=lambda item: isinstance(item[1], KeyError))
        name, first = located[0]
        if isinstance(first, KeyError):
            return (f"{path}: missing field `{name}`" if path else f"missing field `{name}`"), first
        return _first_problem(first, f"{path}.{name}" if path else name)
    if isinstance(exc, cattrs.BaseValidationError) and exc.exceptions:
        element = exc.exceptions[0]  # a list's or map's first bad element
        where = [n for n in getattr(element, "__notes__", ()) if isinstance(n, IterableValidationNote)]
        return _first_problem(element, f"{path}[{where[0].index}]" if where else path)
    if isinstance(exc, HashListError):
        return f"{path}[{exc.index}]: {exc}", exc
    message = str(exc) if isinstance(exc, WireTypeError) else f"invalid value: {exc}"
    return (f"{path}: {message}" if path else message), exc


@attrs.frozen
class PeerBody:
    """A replica peer's endpoint (``/replica_sync/register_peer`` and ``deregister_peer``)."""

    endpoint: str
