"""Dynamo's discovery layout in etcd, read as plain data: keys and JSON values in, catalog workers out. Pure.

What a Dynamo 1.6.1 runtime writes (one lease per runtime process; the lease id is the instance id; key suffixes
are ids in lowercase hex)::

    v1/instances/{ns}/{component}/{endpoint}/{instance_hex}        {"type": "Endpoint", "instance_id", "transport"}
    v1/mdc/{ns}/{component}/{endpoint}/{instance_hex}              {"type": "Model", "instance_id", "card_json"}
    v1/event_channels/namespace/{ns}/component/{c}/endpoint/{e}/topic/{topic}/{publisher_hex}
                                                                   {"type": "EventChannel", "instance_id", "transport"}
    v1/event_sources/namespace/{ns}/component/{c}/endpoint/{e}/topic/{topic}/{publisher_hex}
                                                                   {"type": "EventSource", "metadata": {"worker"}}

A model card (``mdc``) with the instance of the same path is one catalog worker: the card's ``display_name`` is the
model clients name, its ``kv_cache_block_size``, ``runtime_config.data_parallel_size`` and ``total_kv_blocks`` fill
the record. A ``kv-events`` channel says where a publisher's envelopes go (NATS subject prefix or ZMQ endpoint); its
``instance_id`` is the *publisher's* id (1.6.1 was seen writing the publisher id there, under the worker's lease),
and the event source of the same publisher names the worker and dp rank it speaks for. A channel without an event
source belongs to the worker whose instance id it names, if any. Dynamo's
router ignores events of workers without a card, and so does kvrouter: a worker exists only while both its card and
its instance keys do, so a deleted key (a clean stop, or the lease expiring after kill -9) removes it.

``Layout`` holds the parsed entries by key (what a list then a watch have shown) and derives the wanted workers from
them at any time; nothing here does I/O, so the parsing and the derivation are unit-tested on the observed JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs
import orjson

from kvrouter.actors.core.catalog import WorkerRecord, record_problem
from kvrouter.actors.fleet.options import DEFAULT_NAMESPACE

INSTANCES: Final = "v1/instances/"
MODEL_CARDS: Final = "v1/mdc/"
EVENT_CHANNELS: Final = "v1/event_channels/"
EVENT_SOURCES: Final = "v1/event_sources/"
# Everything discovery reads lives under this prefix (one list, one watch).
LAYOUT_PREFIX: Final = "v1/"
KV_EVENTS_TOPIC: Final = "kv-events"
TENANT: Final = "default"  # discovered workers serve the default tenant, as Dynamo's router knows no tenants
# A value larger than this is not a discovery record (cards are a few kB): refused before it is parsed.
MAX_VALUE_BYTES: Final = 1024 * 1024


# A card's ``worker_type`` as the catalog's worker role (disaggregated serving); "aggregated" and others: none.
_ROLES: Final = {"prefill": "prefill", "decode": "decode"}


class LayoutError(ValueError):
    """A key of the layout whose value cannot be read; the entry is skipped (and the reason logged)."""


@attrs.frozen
class EndpointPath:
    namespace: str
    component: str
    endpoint: str


@attrs.frozen
class Instance:
    path: EndpointPath
    instance_id: int
    transport: str | None  # e.g. ``tcp://127.0.0.1:PORT/{hex}/{ns}/{component}/{endpoint}``


@attrs.frozen
class ModelCard:
    path: EndpointPath
    instance_id: int
    display_name: str
    block_size: int | None
    data_parallel_size: int | None
    data_parallel_start_rank: int | None
    total_kv_blocks: int | None
    max_num_batched_tokens: int | None
    local_indexer: bool
    worker_role: str | None = None  # "prefill" or "decode" from the card's worker_type; None: aggregated
    # ``tokenizer.hf_tokenizer_json.checksum`` as the card spells it ("blake3:<hex>"); None: the card names none.
    tokenizer_checksum: str | None = None


@attrs.frozen
class NatsChannel:
    subject_prefix: str

    def subject(self, topic: str) -> str:
        return f"{self.subject_prefix}.{topic}"


@attrs.frozen
class ZmqChannel:
    endpoint: str


ChannelTransport = NatsChannel | ZmqChannel


@attrs.frozen
class EventChannel:
    path: EndpointPath
    topic: str
    publisher_id: int
    instance_id: int
    transport: ChannelTransport | None  # None: a kind kvrouter does not read


@attrs.frozen
class EventSource:
    path: EndpointPath
    topic: str
    publisher_id: int
    worker_id: int
    dp_rank: int


Entry = Instance | ModelCard | EventChannel | EventSource


@attrs.frozen
class Publisher:
    """One KV-event publisher of a discovered worker: where its envelopes come from, and the rank whose watermark
    its sequence is (``stream_rank``: the event source's dp rank, else the worker's first)."""

    publisher_id: int
    worker_id: int
    stream_rank: int
    transport: ChannelTransport | None


@attrs.frozen
class DiscoveredWorker:
    record: WorkerRecord
    publishers: tuple[Publisher, ...] = ()
    tokenizer_checksum: str | None = None  # its card's (``actors/fleet/tokenizer_check.py``)


# -- parsing one key and value ---------------------------------------------------------------------------------


def parse_entry(key: str, value: bytes) -> Entry | None:
    """The entry ``key`` holds; None for a key outside the layout (another prefix, topic or shape): skipped.
    Raises LayoutError when the key is ours but its value cannot be read."""
    if key.startswith(INSTANCES):
        parts = _path_parts(key, INSTANCES)
        return None if parts is None else _instance(parts, _object(value))
    if key.startswith(MODEL_CARDS):
        parts = _path_parts(key, MODEL_CARDS)
        return None if parts is None else _model_card(parts, _object(value))
    if key.startswith(EVENT_CHANNELS) or key.startswith(EVENT_SOURCES):
        channel = key.startswith(EVENT_CHANNELS)
        named = _topic_parts(key, EVENT_CHANNELS if channel else EVENT_SOURCES)
        if named is None or named[1] != KV_EVENTS_TOPIC:
            return None  # metrics and sequence topics are not read
        path, topic, publisher_id = named
        data = _object(value)
        if channel:
            return _event_channel(path, topic, publisher_id, data)
        return _event_source(path, topic, publisher_id, data)
    return None


def _path_parts(key: str, prefix: str) -> tuple[EndpointPath, int] | None:
    parts = key[len(prefix) :].split("/")
    if len(parts) != 4 or not all(parts):
        return None
    namespace, component, endpoint, suffix = parts
    return EndpointPath(namespace, component, endpoint), _hex_id(suffix, key)


def _topic_parts(key: str, prefix: str) -> tuple[EndpointPath, str, int] | None:
    parts = key[len(prefix) :].split("/")
    if len(parts) != 9 or parts[0:7:2] != ["namespace", "component", "endpoint", "topic"] or not all(parts):
        return None
    path = EndpointPath(parts[1], parts[3], parts[5])
    return path, parts[7], _hex_id(parts[8], key)


def _hex_id(text: str, key: str) -> int:
    try:
        value = int(text, 16)
    except ValueError:
        raise LayoutError(f"{key}: the last part {text!r} is not a hexadecimal id") from None
    if not 0 <= value < 1 << 64:
        raise LayoutError(f"{key}: id {text!r} does not fit 64 bits")
    return value


def _object(value: bytes) -> dict[str, Any]:
    if len(value) > MAX_VALUE_BYTES:
        raise LayoutError(f"the value is {len(value)} bytes, over {MAX_VALUE_BYTES}")
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise LayoutError(f"the value is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LayoutError("the value is not a JSON object")
    return data


def _instance(parts: tuple[EndpointPath, int], data: dict[str, Any]) -> Instance:
    path, suffix_id = parts
    instance_id = _id(data, "instance_id", suffix_id)
    transport = data.get("transport")
    address = None
    if isinstance(transport, dict) and len(transport) == 1:
        (kind, where), *_ = transport.items()
        if isinstance(where, str) and where:
            address = f"{kind}://{where}"
    return Instance(path, instance_id, address)


def _model_card(parts: tuple[EndpointPath, int], data: dict[str, Any]) -> ModelCard:
    path, suffix_id = parts
    instance_id = _id(data, "instance_id", suffix_id)
    card = data.get("card_json")
    if isinstance(card, str):
        card = _object(card.encode())
    if not isinstance(card, dict):
        raise LayoutError("the model card has no card_json object")
    name = card.get("display_name")
    if not isinstance(name, str) or not name:
        raise LayoutError("the model card has no display_name")
    runtime = card.get("runtime_config")
    runtime = runtime if isinstance(runtime, dict) else {}
    return ModelCard(
        path,
        instance_id,
        name,
        block_size=_count(card, "kv_cache_block_size"),
        data_parallel_size=_count(runtime, "data_parallel_size"),
        data_parallel_start_rank=_count(runtime, "data_parallel_start_rank"),
        total_kv_blocks=_count(runtime, "total_kv_blocks"),
        max_num_batched_tokens=_count(runtime, "max_num_batched_tokens"),
        local_indexer=runtime.get("enable_local_indexer") is True,
        worker_role=_ROLES.get(card["worker_type"]) if isinstance(card.get("worker_type"), str) else None,
        tokenizer_checksum=_tokenizer_checksum(card),
    )


def _tokenizer_checksum(card: Mapping[str, Any]) -> str | None:
    """The card's ``tokenizer.hf_tokenizer_json.checksum``, if it is a string (cards of other tokenizer kinds: None)."""
    tokenizer = card.get("tokenizer")
    named = tokenizer.get("hf_tokenizer_json") if isinstance(tokenizer, dict) else None
    checksum = named.get("checksum") if isinstance(named, dict) else None
    return checksum if isinstance(checksum, str) and len(checksum) <= 256 else None


def _event_channel(path: EndpointPath, topic: str, publisher_id: int, data: dict[str, Any]) -> EventChannel:
    instance_id = _id(data, "instance_id", None)
    transport = data.get("transport")
    kind = transport.get("kind") if isinstance(transport, dict) else None
    config = transport.get("config") if isinstance(transport, dict) else None
    config = config if isinstance(config, dict) else {}
    found: ChannelTransport | None = None
    if kind == "Nats" and isinstance(config.get("subject_prefix"), str) and config["subject_prefix"]:
        found = NatsChannel(config["subject_prefix"])
    elif kind == "Zmq" and isinstance(config.get("endpoint"), str) and config["endpoint"]:
        found = ZmqChannel(config["endpoint"])
    return EventChannel(path, topic, publisher_id, instance_id, found)


def _event_source(path: EndpointPath, topic: str, publisher_id: int, data: dict[str, Any]) -> EventSource:
    metadata = data.get("metadata")
    worker = metadata.get("worker") if isinstance(metadata, dict) else None
    if not isinstance(worker, dict):
        raise LayoutError("the event source has no metadata.worker")
    dp_rank = worker.get("dp_rank", 0)
    if not _is_int(dp_rank) or not 0 <= dp_rank < 1 << 32:
        raise LayoutError(f"the event source's dp_rank {dp_rank!r} is not a u32")
    return EventSource(path, topic, publisher_id, _id(worker, "worker_id", None), dp_rank)


def _id(data: Mapping[str, Any], field: str, default: int | None) -> int:
    value = data.get(field, default)
    if not _is_int(value) or not 0 <= value < 1 << 64:
        raise LayoutError(f"{field} must be a u64, got {value!r}")
    return int(value)


def _count(data: Mapping[str, Any], field: str) -> int | None:
    value = data.get(field)
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < 1 << 64:
        raise LayoutError(f"{field} must be a non-negative integer, got {value!r}")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the layout: entries by key, and the workers they make ---------------------------------------------------------


class Layout:
    """The discovery entries of one namespace by key, as a list and then a watch showed them."""

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.namespace = namespace
        self.entries: dict[str, Entry] = {}

    def put(self, key: str, value: bytes) -> str | None:
        """Take ``key``'s new value; returns why it was skipped (it then counts as absent), or None."""
        try:
            entry = parse_entry(key, value)
        except LayoutError as exc:
            self.entries.pop(key, None)
            return f"{key}: {exc}"
        if entry is None or entry.path.namespace != self.namespace:
            self.entries.pop(key, None)
            return None
        self.entries[key] = entry
        return None

    def delete(self, key: str) -> None:
        self.entries.pop(key, None)

    def workers(
        self, *, kv_events_endpoint: str | None, source: str = "etcd"
    ) -> tuple[dict[int, DiscoveredWorker], dict[int, str]]:
        """The catalog workers the entries make, by worker id: every card whose instance is live; and the cards
        left out, with why (a record the catalog would refuse).

        ``kv_events_endpoint``: what a worker with a KV-event channel gets as its record's endpoint (the marker of
        events handed over in process); a worker without one gets none, and is not schedulable while KV events
        are in use (as in Dynamo, whose router drops events of workers it cannot place)."""
        instances: dict[tuple[EndpointPath, int], Instance] = {}
        cards: list[ModelCard] = []
        channels: list[EventChannel] = []
        sources: dict[int, EventSource] = {}
        for entry in self.entries.values():
            if isinstance(entry, Instance):
                instances[(entry.path, entry.instance_id)] = entry
            elif isinstance(entry, ModelCard):
                cards.append(entry)
            elif isinstance(entry, EventChannel):
                channels.append(entry)
            else:
                sources[entry.publisher_id] = entry
        # Each publisher's worker and dp rank: its event source's, else the instance its channel names.
        by_worker: dict[int, list[tuple[EventChannel, int | None]]] = {}
        for channel in channels:
            named = sources.get(channel.publisher_id)
            if named is not None:
                by_worker.setdefault(named.worker_id, []).append((channel, named.dp_rank))
            else:
                by_worker.setdefault(channel.instance_id, []).append((channel, None))
        found: dict[int, DiscoveredWorker] = {}
        skipped: dict[int, str] = {}
        for card in sorted(cards, key=lambda c: (c.instance_id, c.path.component, c.path.endpoint)):
            instance = instances.get((card.path, card.instance_id))
            if instance is None or card.instance_id in found:
                continue
            worker = _worker(card, instance, by_worker.get(card.instance_id, []), kv_events_endpoint, source)
            if isinstance(worker, str):
                skipped[card.instance_id] = worker
            else:
                found[card.instance_id] = worker
        return found, skipped


def _worker(
    card: ModelCard,
    instance: Instance,
    channels: list[tuple[EventChannel, int | None]],
    kv_events_endpoint: str | None,
    source: str,
) -> DiscoveredWorker | str:
    start = card.data_parallel_start_rank or 0
    publishers = []
    for channel, dp_rank in sorted(channels, key=lambda item: item[0].publisher_id):
        rank = start if dp_rank is None else dp_rank
        publishers.append(Publisher(channel.publisher_id, card.instance_id, rank, channel.transport))
    record = WorkerRecord(
        worker_id=card.instance_id,
        model_name=card.display_name,
        tenant_id=TENANT,
        endpoint=instance.transport,
        kv_events_endpoint=kv_events_endpoint if publishers else None,
        block_size=card.block_size,
        data_parallel_start_rank=card.data_parallel_start_rank,
        data_parallel_size=card.data_parallel_size,
        max_num_batched_tokens=card.max_num_batched_tokens,
        total_kv_blocks=card.total_kv_blocks,
        worker_role=card.worker_role,
        discovered_by=source,
    )
    problem = record_problem(record)
    if problem is not None:
        return problem
    return DiscoveredWorker(record, tuple(publishers), card.tokenizer_checksum)
