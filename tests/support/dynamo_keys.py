"""Dynamo 1.6.1's discovery keys and values, shaped as ``python -m dynamo.mocker`` was seen writing them into etcd
(every key under the worker process's lease; an event channel's ``instance_id`` is its publisher's id, and the event
source maps the publisher to its worker and dp rank), for the fleet tests."""

from __future__ import annotations

import orjson

from kvrouter.actors.fleet.dynamo_layout import EndpointPath

NS = "dynamo"
INSTANCE = 0x694D9A7B3C2E1F05
PUBLISHER = 0x1D2C3B4A59687706
PATH = EndpointPath(NS, "backend", "generate")


def instance_key(instance: int = INSTANCE, ns: str = NS) -> str:
    return f"v1/instances/{ns}/backend/generate/{instance:x}"


def card_key(instance: int = INSTANCE, ns: str = NS) -> str:
    return f"v1/mdc/{ns}/backend/generate/{instance:x}"


def channel_key(publisher: int = PUBLISHER, topic: str = "kv-events", ns: str = NS) -> str:
    return f"v1/event_channels/namespace/{ns}/component/backend/endpoint/generate/topic/{topic}/{publisher:x}"


def source_key(publisher: int = PUBLISHER) -> str:
    return f"v1/event_sources/namespace/{NS}/component/backend/endpoint/generate/topic/kv-events/{publisher:x}"


def instance_value(instance: int = INSTANCE) -> bytes:
    return orjson.dumps(
        {
            "type": "Endpoint",
            "namespace": NS,
            "component": "backend",
            "endpoint": "generate",
            "instance_id": instance,
            "transport": {"tcp": f"127.0.0.1:41117/{instance:x}/{NS}/backend/generate"},
            "device_type": "cuda",
            "request_plane_codec": "msgpack",
        }
    )


def card_value(
    instance: int = INSTANCE,
    *,
    name: str = "tiny",
    dp: int | None = 1,
    blocks: int = 1024,
    tokenizer_checksum: str = "blake3:ab",
) -> bytes:
    runtime = {
        "context_length": 0,
        "total_kv_blocks": blocks,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "data_parallel_start_rank": 0,
        "enable_local_indexer": True,
        "kv_event_publishing_enabled": True,
        "enable_eagle": False,
    }
    if dp is not None:
        runtime["data_parallel_size"] = dp
    return orjson.dumps(
        {
            "type": "Model",
            "namespace": NS,
            "component": "backend",
            "endpoint": "generate",
            "instance_id": instance,
            "card_json": {
                "display_name": name,
                "slug": name,
                "kv_cache_block_size": 16,
                "migration_limit": 0,
                "model_type": "Chat | Completions",
                "model_input": "Tokens",
                "worker_type": "aggregated",
                "runtime_config": runtime,
                "tokenizer": {
                    "hf_tokenizer_json": {"path": "/m/tokenizer.json", "checksum": tokenizer_checksum, "size": 9}
                },
                "prompt_formatter": {"hf_tokenizer_config_json": {}},
            },
        }
    )


_SCOPE = {"kind": "endpoint", "endpoint": {"namespace": NS, "component": "backend", "name": "generate"}}


def _channel(publisher: int, transport: dict[str, object]) -> bytes:
    return orjson.dumps(
        {
            "type": "EventChannel",
            "scope": _SCOPE,
            "topic": "kv-events",
            "instance_id": publisher,
            "transport": transport,
        }
    )


def nats_channel_value(publisher: int = PUBLISHER) -> bytes:
    return _channel(
        publisher, {"kind": "Nats", "config": {"subject_prefix": f"namespace.{NS}.component.backend.endpoint.generate"}}
    )


def zmq_channel_value(publisher: int = PUBLISHER, endpoint: str = "tcp://127.0.0.1:39111") -> bytes:
    return _channel(publisher, {"kind": "Zmq", "config": {"endpoint": endpoint}})


def source_value(publisher: int = PUBLISHER, worker: int = INSTANCE, dp_rank: int = 0) -> bytes:
    return orjson.dumps(
        {
            "type": "EventSource",
            "scope": _SCOPE,
            "topic": "kv-events",
            "publisher_id": publisher,
            "metadata": {
                "kv_state_endpoint": {"namespace": NS, "component": "backend", "name": "generate"},
                "worker": {"worker_id": worker, "dp_rank": dp_rank},
                "publisher_id": publisher,
                "recovery_target": {
                    "namespace": NS,
                    "component": "backend",
                    "endpoint": f"worker_kv_query_source_{publisher:x}",
                    "instance_id": worker,
                    "transport": {"tcp": "127.0.0.1:41117/x"},
                },
            },
        }
    )


def worker_keys(instance: int, publisher: int, *, name: str = "tiny", channel: bytes | None = None) -> dict[str, bytes]:
    """Every key one Dynamo worker process writes for ``instance`` (KV events on NATS unless ``channel`` says)."""
    return {
        instance_key(instance): instance_value(instance),
        card_key(instance): card_value(instance, name=name),
        channel_key(publisher): channel if channel is not None else nats_channel_value(publisher),
        source_key(publisher): source_value(publisher, instance),
    }
