"""Dynamo's etcd layout, parsed from the values Dynamo 1.6.1 was observed writing (shared/spec: the keys under
``v1/instances``, ``v1/mdc``, ``v1/event_channels`` and ``v1/event_sources``), and the catalog workers they make."""

from __future__ import annotations

import orjson
import pytest

from kvrouter.actors.fleet.dynamo_layout import (
    EventChannel,
    EventSource,
    Instance,
    Layout,
    LayoutError,
    ModelCard,
    NatsChannel,
    Publisher,
    ZmqChannel,
    parse_entry,
)
from tests.support.dynamo_keys import (
    INSTANCE,
    NS,
    PATH,
    PUBLISHER,
    card_key,
    card_value,
    channel_key,
    instance_key,
    instance_value,
    nats_channel_value,
    source_key,
    source_value,
    zmq_channel_value,
)


def test_each_key_kind_parses_to_its_entry() -> None:
    assert parse_entry(instance_key(), instance_value()) == Instance(
        PATH, INSTANCE, f"tcp://127.0.0.1:41117/{INSTANCE:x}/{NS}/backend/generate"
    )
    card = parse_entry(card_key(), card_value(dp=2))
    assert card == ModelCard(
        PATH, INSTANCE, "tiny", 16, 2, 0, 1024, 8192, local_indexer=True, tokenizer_checksum="blake3:ab"
    )
    assert parse_entry(channel_key(), nats_channel_value()) == EventChannel(
        PATH, "kv-events", PUBLISHER, PUBLISHER, NatsChannel(f"namespace.{NS}.component.backend.endpoint.generate")
    )
    assert parse_entry(channel_key(), zmq_channel_value()).transport == ZmqChannel("tcp://127.0.0.1:39111")  # type: ignore[union-attr]
    assert parse_entry(source_key(), source_value(dp_rank=3)) == EventSource(PATH, "kv-events", PUBLISHER, INSTANCE, 3)


@pytest.mark.parametrize(
    "key",
    [
        "v1/other/thing",
        channel_key(topic="kv_metrics"),  # other topics are not read
        channel_key(topic="active_sequences_events"),
        "v1/instances/dynamo/backend/generate",  # too short
        "v1/instances/dynamo/backend/generate/ab/extra",
    ],
)
def test_keys_outside_the_layout_are_not_entries(key: str) -> None:
    assert parse_entry(key, b"{}") is None


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        (card_key(), b"not json", "not JSON"),
        (card_key(), b"[]", "not a JSON object"),
        (card_key(), orjson.dumps({"instance_id": 1}), "no card_json"),
        (card_key(), orjson.dumps({"card_json": {"kv_cache_block_size": 16}}), "no display_name"),
        (card_key(), orjson.dumps({"card_json": {"display_name": "m", "kv_cache_block_size": -1}}), "non-negative"),
        ("v1/mdc/dynamo/backend/generate/zz", card_value(), "not a hexadecimal id"),
        (instance_key(), orjson.dumps({"instance_id": "7"}), "instance_id must be a u64"),
        (source_key(), orjson.dumps({"metadata": {}}), "no metadata.worker"),
    ],
)
def test_a_value_that_cannot_be_read_says_why(key: str, value: bytes, problem: str) -> None:
    with pytest.raises(LayoutError, match=problem):
        parse_entry(key, value)


def full_layout(channel: bytes | None = None) -> Layout:
    layout = Layout(NS)
    assert layout.put(instance_key(), instance_value()) is None
    assert layout.put(card_key(), card_value()) is None
    assert layout.put(channel_key(), channel if channel is not None else nats_channel_value()) is None
    assert layout.put(source_key(), source_value()) is None
    return layout


def test_a_card_with_its_instance_and_channel_is_a_catalog_worker() -> None:
    workers, skipped = full_layout().workers(kv_events_endpoint="inproc://marker")
    assert skipped == {}
    worker = workers[INSTANCE]
    record = worker.record
    assert (record.worker_id, record.model_name, record.tenant_id) == (INSTANCE, "tiny", "default")
    assert (record.block_size, record.data_parallel_size, record.total_kv_blocks) == (16, 1, 1024)
    assert record.endpoint == f"tcp://127.0.0.1:41117/{INSTANCE:x}/{NS}/backend/generate"
    assert record.kv_events_endpoint == "inproc://marker"
    assert record.discovered_by == "etcd"
    assert worker.publishers == (
        Publisher(PUBLISHER, INSTANCE, 0, NatsChannel(f"namespace.{NS}.component.backend.endpoint.generate")),
    )


def test_a_worker_exists_only_while_both_its_card_and_instance_do() -> None:
    layout = full_layout()
    layout.delete(instance_key())  # a lease expiry deletes every key of the process; one is enough
    assert layout.workers(kv_events_endpoint=None)[0] == {}
    layout = full_layout()
    layout.delete(card_key())
    assert layout.workers(kv_events_endpoint=None)[0] == {}


def test_without_an_event_source_a_channel_belongs_to_the_instance_it_names() -> None:
    layout = full_layout(zmq_channel_value(INSTANCE))
    layout.delete(source_key())
    (worker,) = layout.workers(kv_events_endpoint=None)[0].values()
    assert worker.publishers == (Publisher(PUBLISHER, INSTANCE, 0, ZmqChannel("tcp://127.0.0.1:39111")),)
    layout = full_layout()
    layout.delete(source_key())  # the channel names its publisher's id: no worker of that id
    (worker,) = layout.workers(kv_events_endpoint=None)[0].values()
    assert worker.publishers == ()


def test_a_prefill_or_decode_card_gives_the_workers_role() -> None:
    layout = full_layout()
    value = orjson.loads(card_value())
    value["card_json"]["worker_type"] = "prefill"
    layout.put(card_key(), orjson.dumps(value))
    (worker,) = layout.workers(kv_events_endpoint=None)[0].values()
    assert worker.record.worker_role == "prefill"


def test_a_worker_without_a_kv_events_channel_has_no_events_endpoint() -> None:
    layout = full_layout()
    layout.delete(channel_key())
    (worker,) = layout.workers(kv_events_endpoint="inproc://marker")[0].values()
    assert worker.record.kv_events_endpoint is None
    assert worker.publishers == ()


def test_other_namespaces_are_ignored() -> None:
    layout = full_layout()
    other = 0x42
    layout.put(instance_key(other, ns="elsewhere"), instance_value(other))
    layout.put(card_key(other, ns="elsewhere"), card_value(other))
    assert set(layout.workers(kv_events_endpoint=None)[0]) == {INSTANCE}


def test_the_event_source_names_the_publishers_rank() -> None:
    layout = full_layout(zmq_channel_value())
    layout.put(card_key(), card_value(dp=4))
    layout.put(source_key(), source_value(dp_rank=2))
    (worker,) = layout.workers(kv_events_endpoint=None)[0].values()
    assert worker.publishers == (Publisher(PUBLISHER, INSTANCE, 2, ZmqChannel("tcp://127.0.0.1:39111")),)
    assert worker.record.dp_size == 4


def test_a_card_the_catalog_would_refuse_is_skipped_with_its_reason() -> None:
    layout = full_layout()
    layout.put(card_key(), card_value(dp=100_000))
    workers, skipped = layout.workers(kv_events_endpoint=None)
    assert workers == {}
    assert "exceeds the maximum" in skipped[INSTANCE]


def test_an_unreadable_value_replaces_the_entry_and_is_reported() -> None:
    layout = full_layout()
    problem = layout.put(card_key(), b"{broken")
    assert problem is not None and problem.startswith(card_key())
    assert layout.workers(kv_events_endpoint=None)[0] == {}
