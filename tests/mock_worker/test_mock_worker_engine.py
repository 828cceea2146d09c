"""The real-time loop makes the passes the simulator's engine model makes: same KV events, and tokens at the
model's times divided by the speedup (checked on trio's virtual clock, where sleeping is exact)."""

from __future__ import annotations

import pytest
import trio

from kvrouter.actors.core.kv_wire import KvEvent
from kvrouter.api.mock_worker.engine_loop import EngineLoop, Generation
from kvrouter.simulations.engine import WorkerEngine
from kvrouter.simulations.timing import ENGINE_PRESETS, EngineParams

PARAMS = ENGINE_PRESETS["dynamo-mocker"]
# Three prompts sharing a 2-block prefix (block size 64), of different lengths and output lengths.
SHARED = list(range(128))
PROMPTS = [(SHARED + list(range(5000, 5300)), 6), (SHARED + list(range(6000, 6100)), 3), (list(range(9000, 9700)), 4)]


def model_run(params: EngineParams) -> tuple[dict[int, list[float]], list[KvEvent]]:
    """The engine driven pass after pass on a virtual clock: token times (s) per request, and every KV event."""
    engine = WorkerEngine(params)
    loop = EngineLoop(params, lambda events: None)  # only to build identical requests
    requests = [loop.new_generation(f"r{i}", prompt, out) for i, (prompt, out) in enumerate(PROMPTS)]
    for request in requests:
        engine.submit(request)
    now, times, events = 0.0, {i: [] for i in range(len(requests))}, []
    while engine.has_work:
        result = engine.step()
        now += result.duration_ms / 1000.0
        events.extend(result.events)
        for request in result.emitted:
            times[request.index].append(now)
    return times, events


@pytest.mark.parametrize("speedup", [1.0, 4.0])
async def test_tokens_arrive_at_the_models_times_over_the_speedup(
    autojump_clock: trio.abc.Clock, speedup: float
) -> None:
    expected_times, expected_events = model_run(PARAMS)
    published: list[KvEvent] = []
    loop = EngineLoop(PARAMS, published.extend, speedup=speedup)
    arrivals: dict[int, list[float]] = {}

    async def client(generation: Generation, start: float) -> None:
        seen: list[float] = []
        while not generation.done:
            generation.changed = trio.Event()
            await generation.changed.wait()
            seen.extend([trio.current_time() - start] * (len(generation.output_tokens) - len(seen)))
        arrivals[generation.index] = seen

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop.run)
        start = trio.current_time()
        async with trio.open_nursery() as clients:
            for i, (prompt, out) in enumerate(PROMPTS):
                generation = loop.new_generation(f"r{i}", prompt, out)
                loop.submit(generation)
                clients.start_soon(client, generation, start)
        nursery.cancel_scope.cancel()
    assert published == expected_events
    for index, times in expected_times.items():
        assert arrivals[index] == pytest.approx([t / speedup for t in times], rel=1e-9)
    assert [len(arrivals[i]) for i in range(len(PROMPTS))] == [out for _, out in PROMPTS]
    assert loop.engine.cache.active == 0
