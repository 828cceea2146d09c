"""Seeded command traces for simulations: the same seed always yields the same trace.

Every sub-generator derives its ``Random`` from the root seed and its own name, never from the
global ``random`` module, so adding a generator does not shift the others.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    AddRequest,
    Command,
    CompletePrefill,
    CompleteReservationPrefill,
    FreeRequest,
    IngestKvBatch,
    Prompt,
    RegisterWorker,
    ReleaseReservation,
    RemoveWorker,
    SelectWorker,
    UnregisterWorker,
    UpsertWorker,
)
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.kv_wire import BlockRemoved, BlockStored, KvBatch
from kvrouter.actors.core.router_config import RouterConfig


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
    selection_scopes: int = 2  # scopes driven like the selection service (catalog, KV events, selections)


def trace(seed: int, steps: int, options: WorkloadOptions) -> Iterator[Step]:
    """Slot-tracker and selection-service steps, interleaved by their own seeded generators."""
    mix = random.Random(f"{seed}:mix")
    slots = slot_tracker_trace(seed, options)
    selection = selection_trace(seed, options)
    for _ in range(steps):
        yield next(selection) if options.selection_scopes and mix.random() < 0.5 else next(slots)


def selection_trace(seed: int, options: WorkloadOptions) -> Iterator[Step]:
    """Workers publish KV events (stores with parent links, removals), clients select, reserve,
    stream output blocks and free, under temperatures that make the seeded draws matter. Now and then
    a worker registers with another block size (incomplete: the partition's size is fixed) or the last
    worker leaves (the partition stays)."""
    rng = random.Random(f"{seed}:selection")
    bs = options.block_size
    scopes = [ScopeKey(f"sel-model-{i}", "default") for i in range(options.selection_scopes)]
    chains = [[rng.randrange(1 << 32) for _ in range(options.max_blocks * bs)] for _ in range(options.prefix_pool)]
    catalog: dict[ScopeKey, set[int]] = {s: set() for s in scopes}
    stored: dict[tuple[ScopeKey, int], list[int]] = {}  # (scope, worker) -> external hashes it holds, in order
    seqs: dict[tuple[ScopeKey, int], int] = {}
    live: dict[ScopeKey, list[str]] = {s: [] for s in scopes}
    counter = 0
    while True:
        scope = rng.choice(scopes)
        gap = rng.expovariate(1 / options.mean_gap_seconds)
        workers = catalog[scope]
        roll = rng.random()
        command: Command
        if not workers or roll < 0.03:
            worker = rng.randrange(options.workers_per_scope)
            workers.add(worker)
            record = WorkerRecord(
                worker,
                scope.model_name,
                scope.tenant_id,
                endpoint=f"http://w{worker}",
                kv_events_endpoint=f"tcp://w{worker}:5557",
                block_size=bs if rng.random() < 0.9 else 2 * bs,
            )
            command = UpsertWorker(record)
        elif roll < 0.04:
            worker = rng.choice(sorted(workers))
            workers.discard(worker)
            stored.pop((scope, worker), None)
            command = RemoveWorker(worker)
        elif roll < 0.35:
            worker = rng.choice(sorted(workers))
            held = stored.setdefault((scope, worker), [])
            seq = seqs.get((scope, worker), -1) + 1
            seqs[(scope, worker)] = seq
            if held and rng.random() < 0.2:
                cut = rng.randrange(len(held))
                event: BlockStored | BlockRemoved = BlockRemoved((held[cut],), Tier.DEVICE)
                del held[cut:]
            else:
                chain = rng.choice(chains)
                start = len(held) if held and rng.random() < 0.5 else 0
                if start == 0:
                    held.clear()
                count = rng.randint(1, 4)
                tokens = tuple(chain[start * bs : (start + count) * bs])
                hashes = tuple(rng.getrandbits(64) for _ in range(len(tokens) // bs))
                event = BlockStored(hashes, held[-1] if held else None, tokens, bs)
                held.extend(hashes)
            command = IngestKvBatch(worker, 0, seq, KvBatch(0.0, (event,)))
        elif roll < 0.65 or not live[scope]:
            chain = rng.choice(chains)
            prompt = Prompt(token_ids=tuple(chain[: rng.randint(1, options.max_blocks * bs)]))
            config = RouterConfig(router_temperature=rng.choice((0.0, 0.0, 0.5, 2.0)))
            reserve = rng.random() < 0.7
            counter += 1
            reservation = f"sel-{counter}" if reserve else None
            if reserve:
                live[scope].append(f"sel-{counter}")
            command = SelectWorker(prompt, config, reserve=reserve, reservation_id=reservation)
        elif roll < 0.8:
            command = AddOutputBlock(rng.choice(live[scope]), rng.choice((None, 0.5, 0.0)))
        elif roll < 0.88:
            command = CompleteReservationPrefill(rng.choice(live[scope]))
        else:
            command = ReleaseReservation(live[scope].pop(rng.randrange(len(live[scope]))))
        yield Step(scope, command, gap)


def slot_tracker_trace(seed: int, options: WorkloadOptions) -> Iterator[Step]:
    rng = random.Random(f"{seed}:workload")
    scopes = [ScopeKey(f"model-{i}", "default" if i % 2 == 0 else "tenant-b") for i in range(options.scopes)]
    registered: dict[ScopeKey, set[int]] = {s: set() for s in scopes}
    live: dict[ScopeKey, list[str]] = {s: [] for s in scopes}
    prefixes = [tuple(rng.getrandbits(64) for _ in range(options.max_blocks)) for _ in range(options.prefix_pool)]
    counter = 0
    while True:
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
