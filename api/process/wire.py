"""The wire between front processes and the actor process: service-object calls as plain data.

A call is ``[call_id, target, method, args]``: ``target`` names a service object (``service``, ``peers``),
``method`` one of its public async methods, ``args`` every parameter in order, unstructured by cattrs for
the parameter's annotated type (the front and the actor process run the same code, so both read the same
annotations). A reply is ``[call_id, ok, payload]``: the unstructured result, or the failure as data
(``encode_failure``) that the front raises again as the same exception with the same message, so the
routes answer exactly as in one process. Batches of either are one msgpack message.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
import msgpack

from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.service_support import (  # noqa: F401  (the wire's failure encoding, re-exported)
    INTERNAL,
    INTERNAL_ERROR,
    ActorProcessBug,
    decode_failure,
    encode_failure,
)

CONVERTER = cattrs.Converter()
# ``object`` fields (listener statistics) hold plain values already. (A hook on ``object`` itself would be
# inherited by every class through singledispatch; this predicate matches the annotation only.)
CONVERTER.register_structure_hook_func(lambda kind: kind is object, lambda value, _: value)
CONVERTER.register_structure_hook_func(lambda kind: kind is type(None), lambda value, _: None)  # "-> None" methods

# The NamedTuples in service signatures travel as arrays of plain fields.
for _named in (ScopeKey, WorkerRank):
    CONVERTER.register_structure_hook(_named, lambda value, kind: kind(*value))


# Values of these types travel as they are: no converter call on the hot path.
PLAIN = (int, str, bool, float, bytes, type(None), int | None, str | None, bool | None, float | None, list[Any])
# Sequences of plain values: a list becomes the tuple again without a per-element check (both ends are ours).
PLAIN_TUPLES = (tuple[int, ...], tuple[str, ...])


def _same(value: Any) -> Any:
    return value


def _unstructurer(kind: Any) -> Callable[[Any], Any]:
    if kind in PLAIN or kind in PLAIN_TUPLES:
        return _same
    hook = CONVERTER.get_unstructure_hook(kind)
    return lambda value: hook(value)


def _structurer(kind: Any) -> Callable[[Any], Any]:
    if kind in PLAIN:
        return _same
    if kind in PLAIN_TUPLES:
        return tuple
    hook = CONVERTER.get_structure_hook(kind)
    return lambda value: hook(value, kind)


@attrs.frozen
class MethodSpec:
    """One callable method of a service object: its parameters' names and types, and its result type,
    with the converter hooks for each looked up once."""

    name: str
    parameters: tuple[inspect.Parameter, ...]
    types: tuple[Any, ...]
    result: Any
    unstructure_args: tuple[Callable[[Any], Any], ...] = attrs.field(init=False)
    structure_args: tuple[Callable[[Any], Any], ...] = attrs.field(init=False)
    unstructure_result: Callable[[Any], Any] = attrs.field(init=False)
    structure_result: Callable[[Any], Any] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "unstructure_args", tuple(map(_unstructurer, self.types)))
        object.__setattr__(self, "structure_args", tuple(map(_structurer, self.types)))
        object.__setattr__(self, "unstructure_result", _unstructurer(self.result))
        object.__setattr__(self, "structure_result", _structurer(self.result))


def method_table(service_class: type) -> dict[str, MethodSpec]:
    """The public async methods of ``service_class`` (``run`` excluded: it is the owner's, not a call)."""
    table = {}
    for name, function in inspect.getmembers(service_class, inspect.iscoroutinefunction):
        if name.startswith("_") or name == "run":
            continue
        hints = typing.get_type_hints(function)
        parameters = tuple(inspect.signature(function).parameters.values())[1:]  # without self
        types = tuple(hints[parameter.name] for parameter in parameters)
        table[name] = MethodSpec(name, parameters, types, hints.get("return", Any))
    return table


def encode_args(spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every parameter in order (defaults filled in), each unstructured for its type."""
    values = list(args)
    for parameter in spec.parameters[len(args) :]:
        if parameter.name in kwargs:
            values.append(kwargs[parameter.name])
        elif parameter.default is not inspect.Parameter.empty:
            values.append(parameter.default)
        else:
            raise TypeError(f"{spec.name}() missing argument {parameter.name!r}")
    return [convert(value) for convert, value in zip(spec.unstructure_args, values, strict=True)]


def decode_args(spec: MethodSpec, raw: list[Any]) -> list[Any]:
    return [convert(value) for convert, value in zip(spec.structure_args, raw, strict=True)]


def encode_result(spec: MethodSpec, result: Any) -> Any:
    return spec.unstructure_result(result)


def decode_result(spec: MethodSpec, raw: Any) -> Any:
    return spec.structure_result(raw)


# -- messages ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)  # cattrs structures it back into the annotated set type
    raise TypeError(f"cannot send {type(value).__name__} between processes")


pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True, default=_plain).pack


def pack_array(packed: list[bytes]) -> bytes:
    """A msgpack array of already packed items: each call or reply is packed alone (a value that cannot be
    packed fails its own request, not the batch), and a batch is their concatenation under this header."""
    count = len(packed)
    if count < 16:
        header = bytes([0x90 | count])
    elif count < 1 << 16:
        header = b"\xdc" + count.to_bytes(2, "big")
    else:
        header = b"\xdd" + count.to_bytes(4, "big")
    return header + b"".join(packed)


def pack_message(*fields: Any, items: list[bytes]) -> bytes:
    """``[*fields, [items...]]`` as one msgpack message, the items already packed."""
    return pack_array([*(pack(field) for field in fields), pack_array(items)])


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
