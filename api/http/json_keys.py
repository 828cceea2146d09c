"""Repeated keys in a JSON body: refused where 1.6.1's serde refuses them, the last one kept elsewhere, as there.

``orjson`` keeps the last of a repeated key and says nothing, so ``{"worker_id": 7, "worker_id": 8}`` used to
register worker 8. 1.6.1 answers 422 ``duplicate field `worker_id```: serde refuses a repeated *field of a
struct*, at any depth (``router_config_override: duplicate field `router_temperature```). It keeps the last
value of a repeated key of a map (``topology_domains``, ``kv_events_endpoints``, ``preferred_taints``) and of an
unknown field, which it ignores. kvrouter does the same: a body class's fields are its struct's fields
(``refuse_repeated_fields``); everything else is a map or unknown.

Finding repeated keys costs nothing where there are none, which is nearly always (``find_repeated``): every key
is followed by a colon, and the parsed value holds each distinct key once. A flat object (a ``/select``, an
``/add``) whose colons are as many as its keys has none twice: a few ``find`` calls. A body with a few nested
objects has their keys counted. Any other body without a backslash is written again by orjson (its strings are
then the sent ones): the very bytes sent, or the same number of colons, means no key was dropped. With escapes,
a walk over all the parsed containers counts their keys instead. Only a body that
fails these (one with a repeated key, or with escapes and colons in its strings) is parsed a second time, by the
standard library with a hook that notes each object's repeated keys (``RepeatedKeys``).
"""

from __future__ import annotations

import functools
import json
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any, Final, Union

import attrs
import orjson

Path = tuple[str | int, ...]

ORJSON_MAX_DEPTH: Final = 1024  # the deepest nesting orjson.loads accepts
# Containers a walk counts keys in before the body is written again instead (see ``find_repeated``): a body with
# a few nested objects is counted at once, a batch of many commands at C speed.
WALK_BUDGET: Final = 16
SHORT_BODY: Final = 2048  # bytes: counting every colon of a body this short costs less than looking for each
FEW_COLONS: Final = 16  # in a longer body, colons looked for one by one up to this many, then counted
_CONTAINERS: Final = (dict, list)


class _Repeated(dict[str, Any]):
    """An object that had a key more than once (the last value kept, as orjson keeps it)."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        repeated: dict[str, None] = {}
        for key, _ in pairs:
            if key in seen:
                repeated[key] = None
            seen.add(key)
        self.repeated = tuple(repeated)


def _note(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    return value if len(value) == len(pairs) else _Repeated(pairs)


class RepeatedKeys:
    """Which objects of one JSON document had a key more than once, addressed by their path in it."""

    def __init__(self, tree: Any) -> None:
        self._tree = tree

    def at(self, path: Path) -> tuple[str, ...]:
        """The keys the object at ``path`` (keys and list indexes from the document's top) had more than once."""
        node = self.value_at(path)
        return node.repeated if isinstance(node, _Repeated) else ()

    def under(self, path: Path) -> RepeatedKeys:
        """The same, for the value at ``path`` as a document of its own (a command's body within a batch)."""
        return RepeatedKeys(self.value_at(path))

    def value_at(self, path: Path) -> Any:
        """The document's value at ``path``, or None where it has none."""
        node = self._tree
        for step in path:
            if type(step) is int:
                if not isinstance(node, list) or not 0 <= step < len(node):
                    return None
                node = node[step]
            elif isinstance(node, dict):
                node = node.get(step)
            else:
                return None
        return node


def find_repeated(data: bytes | str, value: Any) -> RepeatedKeys | None:
    """The repeated keys of ``data`` (which ``orjson.loads`` read as ``value``), or None when none repeats."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if type(value) is dict:  # one request's body: a few keys, maybe a long list of numbers
        # A short body's colons are counted; a long one's looked for one by one (memchr) while there are few, so
        # its numbers are not looked at a byte at a time.
        colons = raw.count(b":") if len(raw) <= SHORT_BODY else _colons_up_to(raw, FEW_COLONS)
        if colons == len(value):
            return None  # a flat object with every key it was sent: the hot path (/select, /add)
        if colons <= FEW_COLONS and _distinct_keys(value, colons, WALK_BUDGET) == colons:
            return None  # a few nested objects: their keys counted
    if b"\\" not in raw:
        # Without escapes the parsed strings are the sent ones: written again, the value is the body itself when it
        # was sent as orjson writes (kvrouter's client does), or has as many colons unless a key was dropped (with
        # its repeat's text and value). C speed, for big bodies: a batch, a stream message.
        try:
            written = orjson.dumps(value)
        except orjson.JSONEncodeError:  # (not from orjson.loads's values; the exact check below then decides)
            written = b""
        if written == raw or written.count(b":") == raw.count(b":"):
            return None
    elif _distinct_keys(value, colons := raw.count(b":")) == colons:
        return None
    tree = _parse_noting_repeats(raw)
    return RepeatedKeys(tree) if _any_repeated(tree) else None


def _colons_up_to(raw: bytes, most: int) -> int:
    """The colons in ``raw``, counted up to ``most + 1``: one ``find`` (memchr) per colon, so a body with a few
    keys costs a few calls however long its lists of numbers are (``count`` would look at every byte)."""
    count = 0
    at = raw.find(b":")
    while at != -1 and count <= most:
        count += 1
        at = raw.find(b":", at + 1)
    return count


def _parse_noting_repeats(raw: bytes) -> Any:
    """The standard library's parse, each object with repeated keys a ``_Repeated``. Its decoder recurses once
    per level of nesting, and orjson takes up to ``ORJSON_MAX_DEPTH`` levels, past Python's default limit: a
    body that deep is parsed with the limit raised for the call (the loop's thread, no await in between)."""
    try:
        return json.loads(raw, object_pairs_hook=_note)
    except RecursionError:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + 2 * ORJSON_MAX_DEPTH)
        try:
            return json.loads(raw, object_pairs_hook=_note)
        finally:
            sys.setrecursionlimit(limit)


def _distinct_keys(value: Any, bound: int, budget: int = -1) -> int:
    """The keys of every object in ``value``, counted up to ``bound``; -1 once more than ``budget`` containers
    (if given) would be looked at. Iterative: a body may nest deep.

    A list is looked into only if its first element is an object or a list (a list of numbers is the bulk of
    a body: looking at each element would cost more than the parse); what that misses only sends the body to
    the next check."""
    count = 0
    stack = [value]
    while stack:
        node = stack.pop()
        budget -= 1
        if budget == -1:
            return -1
        if type(node) is dict:
            count += len(node)
            if count >= bound:
                return count
            for child in node.values():
                kind = type(child)
                if kind is dict or (kind is list and child and type(child[0]) in _CONTAINERS):
                    stack.append(child)
        elif type(node) is list:
            if len(node) > budget >= 0:
                return -1
            for child in node:
                kind = type(child)
                if kind is dict or (kind is list and child and type(child[0]) in _CONTAINERS):
                    stack.append(child)
    return count


def _any_repeated(tree: Any) -> bool:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _Repeated):
            return True
        if isinstance(node, dict):
            stack.extend(child for child in node.values() if isinstance(child, dict | list))
        elif isinstance(node, list):
            stack.extend(child for child in node if isinstance(child, dict | list))
    return False


def repeated_field(cls: type, keys: RepeatedKeys, path: Path = ()) -> str | None:
    """serde's words for the first repeated field of ``cls`` (an attrs body class) or of a struct within it
    (``router_config_override: duplicate field `router_temperature```), or None: only a struct's fields count,
    not a map's keys nor unknown fields. ``path`` is where ``cls``'s object sits in ``keys``'s document."""
    for found_path, name in _repeated_fields(cls, keys, path, path):
        where = _spell(found_path)
        return f"{where}: duplicate field `{name}`" if where else f"duplicate field `{name}`"
    return None


def _repeated_fields(cls: type, keys: RepeatedKeys, at: Path, base: Path) -> Iterator[tuple[Path, str]]:
    fields = _struct_fields(cls)
    for name in keys.at(at):
        if name in fields:
            yield at[len(base) :], name
    for name, kind in fields.items():
        if _holds_structs(kind):
            for path, struct in _structs_within(kind, keys, (*at, name)):
                yield from _repeated_fields(struct, keys, path, base)


def _structs_within(kind: Any, keys: RepeatedKeys, path: Path) -> Iterator[tuple[Path, type]]:
    """(path, struct class) of each struct a value of type ``kind`` at ``path`` holds, where the document has one."""
    value = keys.value_at(path)
    if value is None:
        return
    for option in _options(kind):
        if attrs.has(option):
            if isinstance(value, dict):
                yield path, option
            return
        origin = typing.get_origin(option)
        args = typing.get_args(option)
        if origin in (list, tuple) and args and isinstance(value, list):
            for index in range(len(value)):
                yield from _structs_within(args[0], keys, (*path, index))
            return
        if origin is dict and len(args) == 2 and isinstance(value, dict):
            for key in value:
                yield from _structs_within(args[1], keys, (*path, key))
            return


@functools.cache
def _holds_structs(kind: Any) -> bool:
    """Whether a value of type ``kind`` may hold a struct (a list of numbers need not be looked into)."""
    for option in _options(kind):
        if attrs.has(option) or any(_holds_structs(arg) for arg in typing.get_args(option)):
            return True
    return False


def _options(kind: Any) -> tuple[Any, ...]:
    """A type's alternatives (``X | None`` is X and None), with NewTypes seen through."""
    while hasattr(kind, "__supertype__"):
        kind = kind.__supertype__
    if typing.get_origin(kind) in (Union, types.UnionType):
        return tuple(option for option in typing.get_args(kind) if option is not type(None))
    return (kind,)


@functools.cache
def _struct_fields(cls: type) -> dict[str, Any]:
    """An attrs body class's fields and their (resolved) types."""
    hints = typing.get_type_hints(cls)
    return {field.name: hints.get(field.name, Any) for field in attrs.fields(cls)}


def _spell(path: Path) -> str:
    """``a.b[2].c``, as ``api/bodies/schemas.py`` names where a value is."""
    text = ""
    for step in path:
        text += f"[{step}]" if type(step) is int else (f".{step}" if text else str(step))
    return text
