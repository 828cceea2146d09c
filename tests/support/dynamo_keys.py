"""Dynamo 1.6.1's discovery keys and values as it was observed writing them (shared/spec), for the fleet tests."""

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
            "device_type": "cpu",
            "request_plane_codec": "msgpack",
        }
    )


def card_value(instance: int = INSTANCE, *, name: str = "tiny", dp: int | None = 1, blocks: int = 1024) -> bytes:
    runtime = {
        "total_kv_blocks": blocks,
        "enable_local_indexer": False,
        "kv_event_publishing_enabled": True,
        "max_num_seqs": 256,
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
                "model_type": "Chat | Completions",
                "runtime_config": runtime,
                "tokenizer": {"hf_tokenizer_json": {"path": "/m/tokenizer.json", "checksum": "blake3:ab", "size": 9}},
                "prompt_formatter": {"hf_tokenizer_config_json": {}},
            },
        }
    )


def nats_channel_value(instance: int = INSTANCE) -> bytes:
    prefix = f"namespace.{NS}.component.backend.endpoint.generate"
    transport = {"kind": "Nats", "config": {"subject_prefix": prefix}}
    return orjson.dumps({"type": "EventChannel", "topic": "kv-events", "instance_id": instance, "transport": transport})


def zmq_channel_value(instance: int = INSTANCE, endpoint: str = "tcp://127.0.0.1:39111") -> bytes:
    transport = {"kind": "Zmq", "config": {"endpoint": endpoint}}
    return orjson.dumps({"type": "EventChannel", "topic": "kv-events", "instance_id": instance, "transport": transport})


def source_value(publisher: int = PUBLISHER, worker: int = INSTANCE, dp_rank: int = 0) -> bytes:
    return orjson.dumps(
        {
            "type": "EventSource",
            "publisher_id": publisher,
            "metadata": {
                "worker": {"worker_id": worker, "dp_rank": dp_rank},
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
        channel_key(publisher): channel if channel is not None else nats_channel_value(instance),
        source_key(publisher): source_value(publisher, instance),
    }
