"""Journal records: the domain's events as bytes, versioned, and read back from any older version.

A record is JSON (orjson)::

    {"v": 1, "scope": [model, tenant], "events": [{"type": tag, ...fields}, ...]}

``v`` is the record format version (``RECORD_VERSION``); records written before versions existed
have no ``v`` and are version 0 (the same layout otherwise). Event tags come from ``EVENT_TAGS``, so
renaming a class never orphans a journal; renaming a *field* changes the format, and the golden files
in ``tests/persistence/golden`` fail until the change is made deliberately, like this:

1. bump ``RECORD_VERSION`` to N+1;
2. register one upcaster per event whose shape changed, turning its version-N fields into N+1::

       @event_upcaster("request_added", from_version=N)
       def _request_added_vN_to_vN1(fields: dict[str, Any]) -> dict[str, Any]:
           fields["prompt_tokens"] = fields.pop("prefill_tokens")
           return fields

   (events without an upcaster for a step are unchanged by it);
3. write the new golden files (``python tests/persistence/make_goldens.py``). The old ones stay: they
   are how the tests prove old journals still decode.

The journal converter is built whole by ``make_journal_converter`` (never derived from the API's with
``Converter.copy()``, docs/architecture/index.md#serialisation) with ``detailed_validation=False``: replay is the
hot path and the data is our own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Final

import attrs
import cattrs
import orjson
from cattrs.strategies import configure_tagged_union

from kvrouter.actors.core.events import (
    EVENT_TAGS,
    KV_OP_TAGS,
    Event,
    KvClearedOp,
    KvIndexed,
    KvOp,
    KvRemovedOp,
    KvStoredOp,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
)
from kvrouter.actors.core.ids import ScopeKey

RECORD_VERSION: Final = 3

EventUpcaster = Callable[[dict[str, Any]], dict[str, Any]]
# (event tag, version it reads) -> a function turning that event's fields into the next version's.
EVENT_UPCASTERS: dict[tuple[str, int], EventUpcaster] = {}
_KNOWN_TAGS: Final = frozenset(EVENT_TAGS.values())


def event_upcaster(tag: str, *, from_version: int) -> Callable[[EventUpcaster], EventUpcaster]:
    """Register ``fn`` as the step from ``from_version`` to ``from_version + 1`` for events tagged ``tag``."""

    def register(fn: EventUpcaster) -> EventUpcaster:
        if not 0 <= from_version < RECORD_VERSION:
            raise ValueError(f"an upcaster from version {from_version} must read a version below {RECORD_VERSION}")
        if (tag, from_version) in EVENT_UPCASTERS:
            raise ValueError(f"two upcasters for {tag!r} from version {from_version}")
        EVENT_UPCASTERS[(tag, from_version)] = fn
        return fn

    return register


class RecordFormatError(ValueError):
    """A record this build cannot decode; the message says what is wrong with it."""


# Version 2: a catalog record has a worker_role (prefill / decode / both; none before, which means both), and
# a booking its expected_output_tokens (output-block decay; none before).
@event_upcaster("worker_upserted", from_version=1)
def _worker_upserted_v1_to_v2(fields: dict[str, Any]) -> dict[str, Any]:
    fields["record"]["worker_role"] = None
    return fields


@event_upcaster("worker_upserted", from_version=2)
def _worker_upserted_v2_to_v3(fields: dict[str, Any]) -> dict[str, Any]:
    fields["record"]["discovered_by"] = None  # every record before v3 was registered over HTTP
    return fields


@event_upcaster("request_added", from_version=1)
def _request_added_v1_to_v2(fields: dict[str, Any]) -> dict[str, Any]:
    fields["expected_output_tokens"] = None
    return fields


def _is_int_tuple(cls: Any) -> bool:
    return cls in (tuple[int, ...], tuple[tuple[int, int], ...])


def make_journal_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=False, detailed_validation=False)
    # orjson writes tuples as arrays: hand hash tuples (the bulk of every record) over untouched
    # instead of rebuilding them element by element.
    converter.register_unstructure_hook_func(_is_int_tuple, lambda value: value)
    configure_tagged_union(KvOp, converter, tag_name="op", tag_generator=KV_OP_TAGS.__getitem__)
    configure_tagged_union(Event, converter, tag_name="type", tag_generator=EVENT_TAGS.__getitem__)
    # Warm the generated hooks so the first request does not pay for code generation.
    converter.get_structure_hook(Event)
    converter.get_unstructure_hook(Event)
    return converter


JOURNAL_CONVERTER: Final = make_journal_converter()
_unstructure_event = JOURNAL_CONVERTER.get_unstructure_hook(Event)
_structure_event = JOURNAL_CONVERTER.get_structure_hook(Event)


@attrs.frozen
class JournalRecord:
    scope: ScopeKey
    events: tuple[Event, ...]


def encode_record(scope: ScopeKey, events: tuple[Event, ...]) -> bytes:
    if len(events) == 1:
        encode = _AS_BYTES.get(type(events[0]))
        if encode is not None:
            encoded = encode(_record_head(scope), events[0])
            if encoded is not None:
                return encoded
    return orjson.dumps(
        {"v": RECORD_VERSION, "scope": [scope[0], scope[1]], "events": [_unstructure(e) for e in events]}
    )


# A record of one hot event, written as bytes in one formatting step: the head (version and scope, the same for
# every record of a scope), the event exactly as orjson writes the converter's dict, and the record's end
# (``tests/persistence`` compares both). Heads are kept per scope; the cache is bounded (policy when full: start
# over).
_HEADS: dict[ScopeKey, bytes] = {}
_MAX_HEADS = 1024


def _record_head(scope: ScopeKey) -> bytes:
    head = _HEADS.get(scope)
    if head is None:
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        head = _HEADS[scope] = b'{"v":%d,"scope":%s,"events":[' % (RECORD_VERSION, orjson.dumps([scope[0], scope[1]]))
    return head


def _request_added_bytes(head: bytes, event: RequestAdded) -> bytes | None:
    """None unless every integer field is exactly an ``int`` (``%d`` would write a bool or an int subclass as a
    number where orjson writes ``true``, or refuses it): then the generic encoder answers."""
    expected = event.expected_output_tokens
    if not (
        type(event.worker_id) is int
        and type(event.dp_rank) is int
        and type(event.prefill_tokens) is int
        and type(event.at) is int
        and (expected is None or type(expected) is int)
        and type(event.request_id) is str
    ):
        return None
    return (
        b'%s{"request_id":%s,"worker_id":%d,"dp_rank":%d,"sequence_hashes":%s,"prefill_tokens":%d,"at":%d,'
        b'"expected_output_tokens":%s,"type":"request_added"}]}'
        % (
            head,
            orjson.dumps(event.request_id),
            event.worker_id,
            event.dp_rank,
            orjson.dumps(event.sequence_hashes),
            event.prefill_tokens,
            event.at,
            b"null" if expected is None else b"%d" % expected,
        )
    )


def _prefill_completed_bytes(head: bytes, event: PrefillCompleted) -> bytes | None:
    if type(event.request_id) is not str:
        return None
    return b'%s{"request_id":%s,"type":"prefill_completed"}]}' % (head, orjson.dumps(event.request_id))


def _request_freed_bytes(head: bytes, event: RequestFreed) -> bytes | None:
    if type(event.request_id) is not str:
        return None
    return b'%s{"request_id":%s,"type":"request_freed"}]}' % (head, orjson.dumps(event.request_id))


_AS_BYTES: Final[dict[type, Callable[[bytes, Any], bytes | None]]] = {
    RequestAdded: _request_added_bytes,
    PrefillCompleted: _prefill_completed_bytes,
    RequestFreed: _request_freed_bytes,
}


# The slot tracker's every-request events, unstructured by hand: the same dict (same keys, same order, the tag
# last) the journal converter makes, at a fraction of its cost (``tests/persistence`` compares both).
def _request_added(event: RequestAdded) -> dict[str, Any]:
    return {
        "request_id": event.request_id,
        "worker_id": event.worker_id,
        "dp_rank": event.dp_rank,
        "sequence_hashes": event.sequence_hashes,
        "prefill_tokens": event.prefill_tokens,
        "at": event.at,
        "expected_output_tokens": event.expected_output_tokens,
        "type": "request_added",
    }


def _prefill_completed(event: PrefillCompleted) -> dict[str, Any]:
    return {"request_id": event.request_id, "type": "prefill_completed"}


def _request_freed(event: RequestFreed) -> dict[str, Any]:
    return {"request_id": event.request_id, "type": "request_freed"}


# KV ingest's one record per run of batches: its ops' block tuples go to orjson as they are.
def _kv_indexed(event: KvIndexed) -> dict[str, Any]:
    return {
        "worker_id": event.worker_id,
        "dp_rank": event.dp_rank,
        "stream_rank": event.stream_rank,
        "seq": event.seq,
        "ops": [_kv_op(op) for op in event.ops],
        "type": "kv_indexed",
    }


def _kv_op(op: KvOp) -> dict[str, Any]:
    kind = type(op)
    if kind is KvStoredOp:
        return {"tier": op.tier, "parent_hash": op.parent_hash, "blocks": op.blocks, "op": "stored"}  # type: ignore[union-attr]
    if kind is KvRemovedOp:
        return {"tier": op.tier, "block_hashes": op.block_hashes, "op": "removed"}  # type: ignore[union-attr]
    if kind is KvClearedOp:
        return {"op": "cleared"}
    return JOURNAL_CONVERTER.unstructure(op, KvOp)  # type: ignore[no-any-return]


_BY_HAND: Final[dict[type, Callable[[Any], dict[str, Any]]]] = {
    RequestAdded: _request_added,
    PrefillCompleted: _prefill_completed,
    RequestFreed: _request_freed,
    KvIndexed: _kv_indexed,
}


def _unstructure(event: Event) -> Any:
    by_hand = _BY_HAND.get(type(event))
    return by_hand(event) if by_hand is not None else _unstructure_event(event)


def decode_record(payload: bytes) -> JournalRecord:
    """Decode a record of any version up to ``RECORD_VERSION``; ``RecordFormatError`` says why not."""
    try:
        data = orjson.loads(payload)
        version = data.get("v", 0)
        model, tenant = data["scope"]
        raw_events = data["events"]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise RecordFormatError(f"not a journal record ({_summary(exc)}): {_head(payload)}") from exc
    if version != RECORD_VERSION:
        raw_events = _upcast_events(raw_events, version)
    try:
        events = tuple([_structure_event(fields, Event) for fields in raw_events])
    except Exception:
        _raise_first_bad_event(raw_events)
        raise
    return JournalRecord(ScopeKey(model, tenant), events)


def upcast_event(fields: dict[str, Any], version: int) -> dict[str, Any]:
    """Bring one event's raw fields from ``version`` to ``RECORD_VERSION``, step by step."""
    for step in range(version, RECORD_VERSION):
        upcaster = EVENT_UPCASTERS.get((fields.get("type"), step))  # type: ignore[arg-type]
        if upcaster is not None:
            fields = upcaster(fields)
    return fields


def _upcast_events(raw_events: Any, version: Any) -> list[dict[str, Any]]:
    if type(version) is not int or version < 0:
        raise RecordFormatError(f"invalid record format version {version!r}")
    if version > RECORD_VERSION:
        raise RecordFormatError(
            f"record format version {version} is newer than this build reads (up to {RECORD_VERSION}): "
            "run the kvrouter version that wrote it, or a newer one"
        )
    if type(raw_events) is not list or not all(type(e) is dict for e in raw_events):
        raise RecordFormatError("the record's events are not a list of JSON objects")
    upcast = []
    for index, fields in enumerate(raw_events):
        try:
            upcast.append(upcast_event(fields, version))
        except Exception as exc:
            tag = fields.get("type")
            raise RecordFormatError(
                f"event {index} ({tag}) fails its upcast from version {version}: {_summary(exc)}"
            ) from exc
    return upcast


def _raise_first_bad_event(raw_events: Any) -> None:
    """Structuring failed somewhere: name the first event that does not decode, and why."""
    if type(raw_events) is not list:
        raise RecordFormatError("the record's events are not a list")
    for index, fields in enumerate(raw_events):
        if type(fields) is not dict:
            raise RecordFormatError(f"event {index} is not a JSON object")
        tag = fields.get("type")
        if tag is None:
            raise RecordFormatError(f'event {index} has no "type" tag')
        if tag not in _KNOWN_TAGS:
            raise RecordFormatError(f"event {index} has an unknown event tag {tag!r}")
        try:
            _structure_event(fields, Event)
        except KeyError as exc:
            raise RecordFormatError(f"event {index} ({tag}): missing field or unknown tag {exc.args[0]!r}") from exc
        except Exception as exc:
            raise RecordFormatError(f"event {index} ({tag}): {_summary(exc)}") from exc


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _head(payload: bytes, limit: int = 48) -> str:
    return repr(bytes(payload[:limit])) + ("..." if len(payload) > limit else "")


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON (sorted keys) for hashing: equal states give equal bytes in any process."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
