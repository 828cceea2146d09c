"""Seeded command traces for simulations: the same seed always yields the same trace.

Every sub-generator derives its ``Random`` from the root seed and its own name, never from the
global ``random`` module, so adding a generator does not shift the others.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs

from actors.core.commands import (
    AddRequest,
    Command,
    CompletePrefill,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from actors.core.ids import ScopeKey


@attrs.frozen
class Step:
    scope: ScopeKey
    command: Command
    advance_seconds: float  # virtual time that passes before this step


@attrs.frozen
class WorkloadOptions:
    scopes: int = 3
    workers_per_scope: int = 4
    dp_size: int = 2
    block_size: int = 16
    prefix_pool: int = 32  # distinct shared prefixes, so tries share nodes
    max_blocks: int = 12
    mean_gap_seconds: float = 2.0  # long enough that expiry (300 s) happens in long runs


def trace(seed: int, steps: int, options: WorkloadOptions) -> Iterator[Step]:
    rng = random.Random(f"{seed}:workload")
    scopes = [ScopeKey(f"model-{i}", "default" if i % 2 == 0 else "tenant-b") for i in range(options.scopes)]
    registered: dict[ScopeKey, set[int]] = {s: set() for s in scopes}
    live: dict[ScopeKey, list[str]] = {s: [] for s in scopes}
    prefixes = [tuple(rng.getrandbits(64) for _ in range(options.max_blocks)) for _ in range(options.prefix_pool)]
    counter = 0
    for _ in range(steps):
        scope = rng.choice(scopes)
        gap = rng.expovariate(1 / options.mean_gap_seconds)
        workers = registered[scope]
        roll = rng.random()
        if not workers or roll < 0.03:
            worker = rng.randrange(options.workers_per_scope)
            workers.add(worker)
            command: Command = RegisterWorker(worker, options.block_size, 0, options.dp_size)
        elif roll < 0.05:
            worker = rng.choice(sorted(workers))
            workers.discard(worker)
            command = UnregisterWorker(worker)
        elif roll < 0.55 or not live[scope]:
            counter += 1
            request_id = f"req-{counter}"
            live[scope].append(request_id)
            prefix = rng.choice(prefixes)
            shared = rng.randint(0, options.max_blocks)
            tail = tuple(rng.getrandbits(64) for _ in range(rng.randint(0, 4)))
            command = AddRequest(
                request_id,
                rng.choice(sorted(workers)),
                rng.randrange(options.dp_size),
                prefix[:shared] + tail,
                rng.choice((0, rng.randint(1, 4096))),
            )
        elif roll < 0.75:
            command = CompletePrefill(rng.choice(live[scope]))
        else:
            request_id = live[scope].pop(rng.randrange(len(live[scope])))
            command = FreeRequest(request_id)
        yield Step(scope, command, gap)
