"""What looking for a repeated JSON key costs on the API's body paths (``api/http/json_keys.py``), next to orjson's
parse of the same body: microseconds of CPU time per call (best of 7 repeats; CPU time, so other work on a
shared machine moves it less than wall time).

    .venv/bin/python benchmarks/json_keys_bench.py

Bodies: the ``/select`` of ``select_service_bench.py`` (64 blocks of 16 tokens), the same with a router override
(a nested object), a slot tracker ``/add``, a worker registration (URLs: colons in strings), a ``POST /batch`` of
100 adds as orjson writes it (kvrouter's client) and as ``json.dumps`` does (spaces), and one body that does repeat
a key (the exact check). Only ratios on one machine mean anything.
"""

from __future__ import annotations

import json
import time
import timeit
from collections.abc import Callable
from typing import Any

import orjson

from kvrouter.api.http.json_keys import find_repeated

ADD = {"model_name": "m", "request_id": "req-1", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2, 3, 4]}
BODIES: dict[str, bytes] = {
    "/select, 1,024 token ids": orjson.dumps({"model_name": "bench", "token_ids": list(range(100_000, 101_024))}),
    "/select with router_config_override": orjson.dumps(
        {
            "model_name": "bench",
            "token_ids": list(range(100_000, 101_024)),
            "router_config_override": {"router_temperature": 0.5},
        }
    ),
    "/add": orjson.dumps({**ADD, "new_isl_tokens": 64}),
    "POST /workers (URLs)": orjson.dumps(
        {
            "worker_id": 1,
            "model_name": "m",
            "endpoint": "http://10.0.0.1:8000",
            "kv_events_endpoint": "tcp://10.0.0.1:5557",
        }
    ),
    "POST /batch of 100 /add": orjson.dumps(
        [{"method": "POST", "path": "/add", "body": {**ADD, "request_id": f"r{i}"}} for i in range(100)]
    ),
    "the same batch as json.dumps writes it": json.dumps(
        [{"method": "POST", "path": "/add", "body": {**ADD, "request_id": f"r{i}"}} for i in range(100)]
    ).encode(),
    "/add repeating request_id (exact check)": orjson.dumps(ADD)[:-1] + b',"request_id":"req-2"}',
}


def cpu_us(call: Callable[[], Any], number: int) -> float:
    timer = timeit.Timer(call, timer=time.process_time)
    return min(timer.repeat(repeat=7, number=number)) / number * 1e6


def main() -> None:
    print(f"{'body':42} {'bytes':>7} {'orjson.loads us':>16} {'find_repeated us':>17} {'ratio':>6}")
    for name, raw in BODIES.items():
        value = orjson.loads(raw)
        number = max(200, 2_000_000 // max(len(raw), 1))
        parse = cpu_us(lambda raw=raw: orjson.loads(raw), number)
        look = cpu_us(lambda raw=raw, value=value: find_repeated(raw, value), number)
        print(f"{name:42} {len(raw):7,} {parse:16.2f} {look:17.2f} {look / parse:6.2f}")


if __name__ == "__main__":
    main()
