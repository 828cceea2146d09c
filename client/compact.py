"""The command stream's compact format: msgpack messages of positional commands (``GET /ws/commands`` with the
WebSocket subprotocol ``SUBPROTOCOL``). Shared by the client and the service, so both read one definition.

Why: in the JSON format each command is an object with a route path and a body object, which the client
builds and encodes and the service decodes, looks up and checks field by field; the slot tracker's hot
writes are the same few fields every time. Here a hot write is a short array and a reply's body travels
as the route's own JSON bytes, so neither side builds or walks per-command objects it does not need.

A client message (a binary frame) is ``[ordered, [command, ...]]``; a command is one of::

    [id, ADD, model_name, tenant_id | nil, request_id, worker_id, dp_rank, hashes, new_isl_tokens | nil]
    [id, PREFILL_COMPLETE, model_name, tenant_id | nil, request_id]
    [id, FREE, model_name, tenant_id | nil, request_id]
    [id, ROUTE, method, path]                   any route, no body
    [id, ROUTE, method, path, body]             any route; ``body``: the request's JSON body as bytes (bin)

``nil`` for ``tenant_id`` or ``new_isl_tokens`` means the field is absent (its default). ``hashes``: an array
of integers, or (what the client sends) bytes: each hash as 8 bytes, a little-endian signed 64-bit
integer (``int64s``), which the service reads without a check per hash. A hot write means
exactly the JSON command ``{"method": "POST", "path": PATHS[code], "body": json_body(code, fields)}``,
and is answered as that command would be. The service answers with binary frames
``[[id, status, body], ...]`` (``[id, status, body, {header: value}]`` where the route sends headers),
``body`` being the route's JSON body as bytes (bin), a text body as a string, or nil when empty.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from kvrouter.client.table import COMPACT, compact_code

SUBPROTOCOL = "kvrouter.commands.msgpack.v1"
ROUTE = 0
# The hot writes' codes, paths and fields: the operation table's (``Operation.compact``).
PATHS = {code: op.path for code, op in COMPACT.items()}
FIELDS = {code: op.compact.fields for code, op in COMPACT.items() if op.compact is not None}
ADD = compact_code("add")
PREFILL_COMPLETE = compact_code("prefill_complete")
FREE = compact_code("free")
OPTIONAL = frozenset(("tenant_id", "new_isl_tokens"))  # nil: the field is absent


def json_body(code: int, fields: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """The JSON body a hot write's positional ``fields`` stand for (its route's body)."""
    return {
        name: value
        for name, value in zip(FIELDS[code], fields, strict=True)
        if value is not None or name not in OPTIONAL
    }


def array_header(count: int) -> bytes:
    """msgpack's header of an array of ``count`` elements (the elements follow, each packed on its own)."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def int64s(hashes: Sequence[Any]) -> bytes | None:
    """``hashes`` as the compact format's bytes (8 per hash, little-endian signed), or None when one is not an
    ``int`` within 64 signed bits (sent as an array then, so that the service answers it as JSON would)."""
    try:
        packed = _layout(len(hashes), "q").pack(*hashes)
    except struct.error:
        return None
    if hashes and set(map(type, hashes)) != {int}:
        return None  # a bool or another integer-like value: struct takes it, JSON would not
    return packed


def from_int64s(packed: bytes, signed: bool) -> tuple[int, ...] | None:
    """The hashes of ``int64s`` bytes (as unsigned 64-bit integers unless ``signed``), or None for a length that
    is not a multiple of 8."""
    count, rest = divmod(len(packed), 8)
    if rest:
        return None
    return _layout(count, "q" if signed else "Q").unpack(packed)


# Compiled ``struct`` layouts by (count, code): prompts come in a few lengths, and building the format and
# looking it up in struct's own cache cost as much as packing. Bounded (policy when full: start over).
_LAYOUTS: dict[tuple[int, str], struct.Struct] = {}
_MAX_LAYOUTS = 256


def _layout(count: int, code: str) -> struct.Struct:
    layout = _LAYOUTS.get((count, code))
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[(count, code)] = struct.Struct(f"<{count}{code}")
    return layout
