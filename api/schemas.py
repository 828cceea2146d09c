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

from actors.core.ids import I64_MAX, I64_MIN, U64_MASK, ScopeKey
from api.http import HttpError
from journal.codec import U32, U64, USize, WireTypeError, _json_kind, make_converter

DEFAULT_TENANT = "default"

# Signed 64-bit hashes on the wire, reinterpreted as unsigned inside (spec §0).
SequenceHashes = NewType("SequenceHashes", tuple)


def _structure_hashes(value: Any, _: Any = None) -> tuple[int, ...]:
    if type(value) is not list:
        raise WireTypeError(f"invalid type: {_json_kind(value)}, expected an array of signed 64-bit sequence hashes")
    for index, h in enumerate(value):
        if type(h) is not int or not I64_MIN <= h <= I64_MAX:
            raise WireTypeError(
                f"invalid value at index {index}: {_json_kind(h)}, "
                "expected an array of signed 64-bit sequence hashes"
            )
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
    tenant_id: str | None = None
    routing_group: str | None = None


@attrs.frozen
class UnregisterBody(Scoped):
    worker_id: U64
    model_name: str
    tenant_id: str | None = None
    routing_group: str | None = None


@attrs.frozen
class AddBody(Scoped):
    model_name: str
    request_id: str
    worker_id: U64
    dp_rank: U32
    sequence_hashes: SequenceHashes
    new_isl_tokens: USize = 0  # type: ignore[assignment]
    tenant_id: str | None = None
    routing_group: str | None = None


@attrs.frozen
class RequestRefBody(Scoped):
    model_name: str
    request_id: str
    tenant_id: str | None = None
    routing_group: str | None = None


@attrs.frozen
class PotentialLoadsBody(Scoped):
    model_name: str
    sequence_hashes: SequenceHashes
    new_isl_tokens: USize = 0  # type: ignore[assignment]
    tenant_id: str | None = None
    routing_group: str | None = None


API_CONVERTER = make_converter(strict=True)
API_CONVERTER.register_structure_hook(SequenceHashes, _structure_hashes)

T = TypeVar("T")
_HOOKS: dict[type, Any] = {}


def parse(cls: type[T], value: Any) -> T:
    """Structure ``value`` into ``cls`` or raise a 422 with a serde-like message."""
    hook = _HOOKS.get(cls)
    if hook is None:
        hook = _HOOKS[cls] = API_CONVERTER.get_structure_hook(cls)
    if type(value) is not dict:
        raise HttpError(422, _deserialize_failed(f"invalid type: {_json_kind(value)}, expected a JSON object"))
    try:
        return hook(value, cls)  # type: ignore[no-any-return]
    except Exception as exc:  # cattrs raises ExceptionGroups; turn them into one readable line
        raise HttpError(422, _deserialize_failed(_first_problem(exc))) from None


def _deserialize_failed(detail: str) -> str:
    return f"Failed to deserialize the JSON body into the target type: {detail}"


def _format(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "missing field"
    if isinstance(exc, WireTypeError):
        return str(exc)
    if isinstance(exc, TypeError) and "NoneType" in str(exc):
        return "invalid type: null"
    return f"invalid value: {exc}"


def _first_problem(exc: BaseException) -> str:
    messages = cattrs.transform_error(exc, path="$", format_exception=_format)  # type: ignore[arg-type]
    first = messages[0] if messages else str(exc)
    message, _, path = first.rpartition(" @ ")
    field = path.removeprefix("$").removeprefix(".")
    if message == "missing field":
        return f"missing field `{field.rsplit('.', 1)[-1]}`"
    return f"{field}: {message}" if field else message
