"""The Dynamo 1.6.1 replica-sync message, encoded and decoded exactly (docs/operations/replicas.md). Pure: no I/O.

A message is two ZMQ frames, ``[TOPIC, payload]``. The payload is what 1.6.1 writes with
``rmp_serde::to_vec_named``: a msgpack map with named fields and minimal integer encodings::

    {model_name, routing_group, block_size,
     event: {request_id, worker: {worker_id, dp_rank}, data, router_id, lora_name}}

``data`` is serde's externally tagged enum: the bare strings ``"Free"`` / ``"MarkPrefillCompleted"``, or
``{"AddRequest": {token_sequence, track_prefill_tokens, expected_output_tokens, prefill_load_hint}}``.
kvrouter's scope field ``tenant_id`` travels as ``routing_group``.

Decoding accepts what a live 1.6.1 receiver was seen to accept (struct maps *or* positional arrays,
unknown keys ignored, absent ``Option`` fields as nil, ``bin`` strings that are UTF-8, ``{"Free": nil}``)
and rejects what it rejects (no ``routing_group``, e.g. an older ``tenant_id`` payload; wrong integer
widths; signed or float integers; other topics or frame counts). It is stricter in two places where
only a broken publisher could differ: trailing bytes after the payload and duplicate map keys.

The selection service also publishes session bindings on a second topic, ``AFFINITY_TOPIC``: a named map
``{model_name, routing_group, session_id, worker_id, dp_rank|nil, sequence, writer_id}`` (captured from a
live 1.6.1 selection service), decoded by the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import attrs
import msgpack

from kvrouter.actors.core.ids import ScopeKey, WorkerRank

TOPIC: Final = b"dynamo.slot-tracker.v1"

U64_MAX: Final = (1 << 64) - 1
U32_MAX: Final = (1 << 32) - 1
NANOS_PER_SECOND: Final = 1_000_000_000

T = TypeVar("T")


class ReplicaWireError(ValueError):
    """A message that is not a valid 1.6.1 replica event (the receiver drops it)."""


@attrs.frozen
class PrefillLoadHint:
    initial_effective_prefill_tokens: int
    # Rust ``Duration`` ({secs, nanos}) as nanoseconds; 1.6.1 publishers always send nil.
    expected_prefill_duration_ns: int | None = None


@attrs.frozen
class AddRequestData:
    token_sequence: tuple[int, ...] | None  # unsigned 64-bit sequence hashes
    track_prefill_tokens: bool
    expected_output_tokens: int | None = None
    prefill_load_hint: PrefillLoadHint | None = None

    @property
    def prefill_tokens(self) -> int:
        """The prefill load a 1.6.1 receiver books: the hint's tokens, only when tracking is on."""
        if self.track_prefill_tokens and self.prefill_load_hint is not None:
            return self.prefill_load_hint.initial_effective_prefill_tokens
        return 0


@attrs.frozen
class MarkPrefillCompleted:
    pass


@attrs.frozen
class Free:
    pass


EventData = AddRequestData | MarkPrefillCompleted | Free


@attrs.frozen
class ReplicaEvent:
    """One replica message, flattened (the wire nests ``event`` and ``worker``)."""

    model_name: str
    routing_group: str
    block_size: int
    request_id: str
    worker_id: int
    dp_rank: int
    data: EventData
    router_id: int  # the publishing process's id; receivers drop their own
    lora_name: str | None = None

    @property
    def scope(self) -> ScopeKey:
        return ScopeKey(self.model_name, self.routing_group)

    @property
    def rank(self) -> WorkerRank:
        return WorkerRank(self.worker_id, self.dp_rank)


# -- encoding -------------------------------------------------------------------------------------


def encode(event: ReplicaEvent) -> list[bytes]:
    """The two frames 1.6.1 publishes for ``event``."""
    return [TOPIC, encode_payload(event)]


def encode_payload(event: ReplicaEvent) -> bytes:
    """Byte-identical to 1.6.1's ``rmp_serde::to_vec_named`` (field order is part of the format)."""
    document = {
        "model_name": event.model_name,
        "routing_group": event.routing_group,
        "block_size": event.block_size,
        "event": {
            "request_id": event.request_id,
            "worker": {"worker_id": event.worker_id, "dp_rank": event.dp_rank},
            "data": _encode_data(event.data),
            "router_id": event.router_id,
            "lora_name": event.lora_name,
        },
    }
    return msgpack.packb(document, use_bin_type=True)


def _encode_data(data: EventData) -> Any:
    if isinstance(data, Free):
        return "Free"
    if isinstance(data, MarkPrefillCompleted):
        return "MarkPrefillCompleted"
    hint = data.prefill_load_hint
    return {
        "AddRequest": {
            "token_sequence": None if data.token_sequence is None else list(data.token_sequence),
            "track_prefill_tokens": data.track_prefill_tokens,
            "expected_output_tokens": data.expected_output_tokens,
            "prefill_load_hint": None
            if hint is None
            else {
                "initial_effective_prefill_tokens": hint.initial_effective_prefill_tokens,
                "expected_prefill_duration": _encode_duration(hint.expected_prefill_duration_ns),
            },
        }
    }


def _encode_duration(ns: int | None) -> dict[str, int] | None:
    if ns is None:
        return None
    secs, nanos = divmod(ns, NANOS_PER_SECOND)
    return {"secs": secs, "nanos": nanos}


# -- decoding -------------------------------------------------------------------------------------

_ABSENT: Final = object()  # a map field that is not there (distinct from an explicit nil)


def decode(frames: Sequence[bytes]) -> ReplicaEvent:
    """Decode one received message or raise ``ReplicaWireError``."""
    if len(frames) != 2:
        raise ReplicaWireError(f"expected 2 frames [topic, payload], got {len(frames)}")
    if bytes(frames[0]) != TOPIC:
        raise ReplicaWireError(f"unexpected topic {bytes(frames[0])[:64]!r}")
    return decode_payload(frames[1])


def decode_payload(payload: bytes) -> ReplicaEvent:
    try:
        document = msgpack.unpackb(
            payload, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=_map, timestamp=0
        )
    except (ValueError, TypeError, msgpack.UnpackException) as error:  # ExtraData, FormatError, bad UTF-8 …
        raise ReplicaWireError(f"not a msgpack replica payload: {type(error).__name__}: {error}") from None
    top = _struct(document, "payload", ("model_name", "routing_group", "block_size", "event"))
    event = _struct(top["event"], "event", ("request_id", "worker", "data", "router_id", "lora_name"))
    worker = _struct(event["worker"], "event.worker", ("worker_id", "dp_rank"))
    return ReplicaEvent(
        model_name=_str(top["model_name"], "model_name"),
        routing_group=_str(top["routing_group"], "routing_group"),
        block_size=_uint(top["block_size"], "block_size", U32_MAX),
        request_id=_str(event["request_id"], "event.request_id"),
        worker_id=_uint(worker["worker_id"], "event.worker.worker_id", U64_MAX),
        dp_rank=_uint(worker["dp_rank"], "event.worker.dp_rank", U32_MAX),
        data=_decode_data(event["data"]),
        router_id=_uint(event["router_id"], "event.router_id", U64_MAX),
        lora_name=_optional(event["lora_name"], "event.lora_name", _str),
    )


def _map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """msgpack map hook: keys as text (serde also reads ``bin`` field names), duplicates refused."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        name = key.decode("utf-8") if isinstance(key, bytes) else key
        if name in out:
            raise ReplicaWireError(f"duplicate map key {name!r}")
        out[name] = value
    return out


def _struct(value: Any, path: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """A serde struct from a named map (unknown keys ignored) or a positional array (exact length)."""
    if isinstance(value, dict):
        return {name: value.get(name, _ABSENT) for name in fields}
    if isinstance(value, list):
        if len(value) != len(fields):
            raise ReplicaWireError(f"{path}: expected an array of {len(fields)} fields, got {len(value)}")
        return dict(zip(fields, value, strict=True))
    if value is _ABSENT:
        raise ReplicaWireError(f"{path}: missing field")
    raise ReplicaWireError(f"{path}: expected a map, got {_kind(value)}")


def _decode_data(value: Any) -> EventData:
    path = "event.data"
    if value is _ABSENT:
        raise ReplicaWireError(f"{path}: missing field")
    if isinstance(value, (str, bytes)):
        name, content, has_content = _str(value, path), None, False
    elif isinstance(value, dict) and len(value) == 1:
        ((name, content),) = value.items()
        has_content = True
    else:
        raise ReplicaWireError(f"{path}: expected a variant name or a 1-entry map, got {_kind(value)}")
    if name in ("Free", "MarkPrefillCompleted"):
        if content is not None:
            raise ReplicaWireError(f"{path}: unit variant {name} carries {_kind(content)}")
        return Free() if name == "Free" else MarkPrefillCompleted()
    if name == "AddRequest":
        if not has_content:
            raise ReplicaWireError(f"{path}: AddRequest needs its fields")
        return _decode_add(content, f"{path}.AddRequest")
    raise ReplicaWireError(f"{path}: unknown variant {name!r}")


def _decode_add(value: Any, path: str) -> AddRequestData:
    fields = _struct(
        value, path, ("token_sequence", "track_prefill_tokens", "expected_output_tokens", "prefill_load_hint")
    )
    tokens = _optional(fields["token_sequence"], f"{path}.token_sequence", _hashes)
    track = fields["track_prefill_tokens"]
    return AddRequestData(
        token_sequence=tokens,
        # serde default: an absent flag is false (1.6.1 accepts it); an explicit nil is not a bool.
        track_prefill_tokens=False if track is _ABSENT else _bool(track, f"{path}.track_prefill_tokens"),
        expected_output_tokens=_optional(
            fields["expected_output_tokens"], f"{path}.expected_output_tokens", lambda v, p: _uint(v, p, U32_MAX)
        ),
        prefill_load_hint=_optional(fields["prefill_load_hint"], f"{path}.prefill_load_hint", _hint),
    )


def _hint(value: Any, path: str) -> PrefillLoadHint:
    fields = _struct(value, path, ("initial_effective_prefill_tokens", "expected_prefill_duration"))
    return PrefillLoadHint(
        _uint(fields["initial_effective_prefill_tokens"], f"{path}.initial_effective_prefill_tokens", U64_MAX),
        _optional(fields["expected_prefill_duration"], f"{path}.expected_prefill_duration", _duration),
    )


def _duration(value: Any, path: str) -> int:
    fields = _struct(value, path, ("secs", "nanos"))
    secs = _uint(fields["secs"], f"{path}.secs", U64_MAX)
    nanos = _uint(fields["nanos"], f"{path}.nanos", U32_MAX)  # serde carries nanos >= 1e9 into secs
    if secs + nanos // NANOS_PER_SECOND > U64_MAX:
        raise ReplicaWireError(f"{path}: overflow")
    return secs * NANOS_PER_SECOND + nanos


def _hashes(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ReplicaWireError(f"{path}: expected an array, got {_kind(value)}")
    return tuple(_uint(item, f"{path}[{i}]", U64_MAX) for i, item in enumerate(value))


def _optional(value: Any, path: str, parse: Callable[[Any, str], T]) -> T | None:
    return None if value is None or value is _ABSENT else parse(value, path)


def _str(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):  # rmp_serde reads a UTF-8 ``bin`` as a string
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ReplicaWireError(f"{path}: bytes are not UTF-8") from None
    if value is _ABSENT:
        raise ReplicaWireError(f"{path}: missing field")
    raise ReplicaWireError(f"{path}: expected a string, got {_kind(value)}")


def _uint(value: Any, path: str, maximum: int) -> int:
    if type(value) is int and 0 <= value <= maximum:  # bool is an int subclass: refused
        return value
    if value is _ABSENT:
        raise ReplicaWireError(f"{path}: missing field")
    bits = 64 if maximum == U64_MAX else 32
    raise ReplicaWireError(f"{path}: expected an unsigned {bits}-bit integer, got {_kind(value)}")


def _bool(value: Any, path: str) -> bool:
    if type(value) is bool:
        return value
    raise ReplicaWireError(f"{path}: expected a boolean, got {_kind(value)}")


def _kind(value: Any) -> str:
    if value is _ABSENT:
        return "nothing"
    if value is None:
        return "nil"
    if type(value) is int:
        return f"integer {value}"
    return type(value).__name__


# -- session affinity (the selection service's second topic) --------------------------------------

AFFINITY_TOPIC: Final = b"dynamo.session-affinity.v1"


@attrs.frozen
class SessionAffinity:
    """A session binding as 1.6.1's selection service publishes it (probed: one per booking of a session and
    one when such a booking ends, the version unchanged while the binding is). ``dp_rank`` None binds the
    worker without a rank. The TTL is not on the wire: each receiver applies its own."""

    model_name: str
    routing_group: str
    session_id: str
    worker_id: int
    dp_rank: int | None
    sequence: int
    writer_id: int  # the publishing process's router id

    @property
    def scope(self) -> ScopeKey:
        return ScopeKey(self.model_name, self.routing_group)


def encode_affinity(binding: SessionAffinity) -> list[bytes]:
    """The two frames 1.6.1 publishes for ``binding`` (named map, its field order)."""
    document = {
        "model_name": binding.model_name,
        "routing_group": binding.routing_group,
        "session_id": binding.session_id,
        "worker_id": binding.worker_id,
        "dp_rank": binding.dp_rank,
        "sequence": binding.sequence,
        "writer_id": binding.writer_id,
    }
    return [AFFINITY_TOPIC, msgpack.packb(document, use_bin_type=True)]


def decode_message(frames: Sequence[bytes]) -> ReplicaEvent | SessionAffinity:
    """Either topic's message, or ``ReplicaWireError`` (the same rules as ``decode``)."""
    if len(frames) == 2 and bytes(frames[0]) == AFFINITY_TOPIC:
        return decode_affinity_payload(frames[1])
    return decode(frames)


def decode_affinity_payload(payload: bytes) -> SessionAffinity:
    try:
        document = msgpack.unpackb(
            payload, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=_map, timestamp=0
        )
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise ReplicaWireError(f"not a msgpack affinity payload: {type(error).__name__}: {error}") from None
    fields = _struct(
        document,
        "affinity",
        ("model_name", "routing_group", "session_id", "worker_id", "dp_rank", "sequence", "writer_id"),
    )
    return SessionAffinity(
        model_name=_str(fields["model_name"], "model_name"),
        routing_group=_str(fields["routing_group"], "routing_group"),
        session_id=_str(fields["session_id"], "session_id"),
        worker_id=_uint(fields["worker_id"], "worker_id", U64_MAX),
        dp_rank=_optional(fields["dp_rank"], "dp_rank", lambda v, p: _uint(v, p, U32_MAX)),
        sequence=_uint(fields["sequence"], "sequence", U64_MAX),
        writer_id=_uint(fields["writer_id"], "writer_id", U64_MAX),
    )
