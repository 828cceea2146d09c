"""Mock workers for tests: in-process on 127.0.0.1, free ports, a small fast engine."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from kvrouter.api.mock_worker.openai_app import AppLimits
from kvrouter.api.mock_worker.service import MockWorkerHandle, MockWorkerOptions, run_mock_worker
from kvrouter.simulations.timing import EngineParams

BLOCK = 4
# 64 blocks of 4 tokens; the dynamo-mocker timing run 1,000x faster (a pass takes ~17 us of real time).
SMALL_ENGINE = EngineParams(block_size=BLOCK, num_blocks=64, max_batched_tokens=64, max_running=8)


def options(**changes: Any) -> MockWorkerOptions:
    base = MockWorkerOptions(port=0, kv_events_port=0, replay_port=0, engine=SMALL_ENGINE, speedup=1000.0)
    return attrs.evolve(base, **changes)


async def start_mock_worker(nursery: trio.Nursery, **changes: Any) -> MockWorkerHandle:
    handle: MockWorkerHandle = await nursery.start(run_mock_worker, options(**changes))
    return handle


def limits(**changes: Any) -> AppLimits:
    return attrs.evolve(AppLimits(), **changes)
