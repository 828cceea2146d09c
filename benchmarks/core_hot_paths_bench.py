"""In-process cost of the core's hot paths (no HTTP, no journal): decide of a selection,
decide + fold of an add/free cycle, and the KV index alone (storing 1M blocks, resident memory per
block, a 64-block match). Prints microseconds of CPU time per operation (best of 5 repeats; CPU
time, so other work on a shared machine moves it less than wall time).

    .venv/bin/python benchmarks/core_hot_paths_bench.py [--pure-too]

With ``--pure-too`` it measures again in a child process with ``KVROUTER_PURE_PYTHON=1`` (the compiled
core modules switched off, README "Compiled hot paths") and prints both, so one run shows what compiling buys.

The selection workload is issue #3's: 16 workers (block size 16), 64-block chains indexed on them,
64-block prompts sharing a random prefix with an indexed chain, some ranks busy. The add/free
workload is issue #2's: 64-block prompts on 16 ranks. Only ratios between runs on one machine mean
anything (read them before and after a change, and rerun).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import timeit

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    AddRequest,
    FreeRequest,
    IngestKvBatch,
    Prompt,
    RegisterWorker,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_index import KvIndex, Tier
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.compiled import status

BLOCK = 16
WORKERS = 16
CHAIN_BLOCKS = 64


def apply(state: ScopeState, command: object) -> Accepted:
    decision = decide(state, command)  # type: ignore[arg-type]
    assert isinstance(decision, Accepted), decision
    fold(state, decision.events)
    return decision


def selection_state(rng: random.Random) -> tuple[ScopeState, list[list[int]]]:
    state = ScopeState(ScopeKey("m", "default"))
    chains = [[rng.randrange(1 << 31) for _ in range(CHAIN_BLOCKS * BLOCK)] for _ in range(WORKERS)]
    for worker in range(WORKERS):
        record = WorkerRecord(
            worker, "m", "default", endpoint=f"http://w{worker}", kv_events_endpoint="tcp://w:1", block_size=BLOCK
        )
        apply(state, UpsertWorker(record))
        hashes = tuple(rng.getrandbits(64) for _ in range(CHAIN_BLOCKS))
        apply(
            state, IngestKvBatch(worker, 0, 0, KvBatch(0.0, (BlockStored(hashes, None, tuple(chains[worker]), BLOCK),)))
        )
    config = RouterConfig()
    for i in range(24):  # some ranks carry bookings, so loads and tries differ between them
        chain = chains[i % WORKERS]
        prompt = Prompt(token_ids=tuple(chain[: BLOCK * rng.randint(8, CHAIN_BLOCKS)]))
        apply(state, SelectWorker(prompt, config, reserve=True, reservation_id=f"busy-{i}", draw=rng.random()))
    return state, chains


def bench_select(repeat: int, number: int) -> float:
    rng = random.Random(1)
    state, chains = selection_state(rng)
    config = RouterConfig()
    prompts = []
    for i in range(64):
        chain = chains[i % WORKERS]
        shared = rng.randint(0, CHAIN_BLOCKS) * BLOCK
        tokens = chain[:shared] + [rng.randrange(1 << 31) for _ in range(CHAIN_BLOCKS * BLOCK - shared)]
        prompts.append(SelectWorker(Prompt(token_ids=tuple(tokens)), config, draw=rng.random()))
    position = iter(range(1 << 62))

    def one() -> None:
        decision = decide(state, prompts[next(position) % len(prompts)])
        assert isinstance(decision, Accepted)

    return min(timeit.repeat(one, repeat=repeat, number=number, timer=time.process_time)) / number * 1e6


def bench_add_free(repeat: int, number: int) -> float:
    rng = random.Random(2)
    state = ScopeState(ScopeKey("m", "default"))
    for worker in range(8):
        apply(state, RegisterWorker(worker, BLOCK, 0, 2))
    prefixes = [tuple(rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)) for _ in range(8)]
    for i in range(32):  # background requests so the tries are shared
        apply(state, AddRequest(f"bg-{i}", i % 8, i % 2, prefixes[i % 8], 1024))
    counter = iter(range(1 << 62))

    def one() -> None:
        i = next(counter)
        request_id = f"r-{i}"
        hashes = prefixes[i % 8][:48] + tuple(rng.getrandbits(64) for _ in range(16))
        apply(state, AddRequest(request_id, i % 8, i % 2, hashes, 1024))
        apply(state, FreeRequest(request_id))

    return min(timeit.repeat(one, repeat=repeat, number=number, timer=time.process_time)) / number * 1e6


def index_chains(blocks: int, seed: int = 3) -> list[tuple[WorkerRank, list[tuple[int, int]]]]:
    """The select service bench's index: 64-block chains dealt round-robin to 16 ranks, published as two stores
    (the second names the first's last block as parent); 64-bit external and local hashes, nothing shared."""
    rng = random.Random(seed)
    return [
        (WorkerRank(chain % WORKERS, 0), [(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(CHAIN_BLOCKS)])
        for chain in range(blocks // CHAIN_BLOCKS)
    ]


def bench_index(blocks: int) -> tuple[float, float, float]:
    """(CPU us per stored block, bytes of resident memory per block, CPU us per 64-block find_matches)."""
    chains = index_chains(blocks)
    half = CHAIN_BLOCKS // 2
    gc.collect()
    rss_before = rss_bytes()
    index = KvIndex()
    started = time.process_time()
    for rank, chain in chains:
        index.apply_stored(rank, Tier.DEVICE, None, chain[:half])
        index.apply_stored(rank, Tier.DEVICE, chain[half - 1][0], chain[half:])
    store_us = (time.process_time() - started) / (len(chains) * CHAIN_BLOCKS) * 1e6
    gc.collect()
    per_block = (rss_bytes() - rss_before) / (len(chains) * CHAIN_BLOCKS)
    rng = random.Random(4)
    queries = []
    for _ in range(256):
        chain = chains[rng.randrange(len(chains))][1]
        shared = rng.randint(0, CHAIN_BLOCKS)
        queries.append([local for _, local in chain[:shared]] + [rng.getrandbits(64) for _ in range(64 - shared)])
    position = iter(range(1 << 62))

    def one() -> None:
        index.find_matches(queries[next(position) % len(queries)])

    match_us = min(timeit.repeat(one, repeat=5, number=2000, timer=time.process_time)) / 2000 * 1e6
    assert index.block_count() == len(chains) * CHAIN_BLOCKS
    return store_us, per_block, match_us


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--index-blocks", type=int, default=1_000_000, help="blocks in the index benchmark (0: skip)")
    args = parser.parse_args()
    modes = sorted(set(status().values()))
    print(f"core modules: {', '.join(modes)}")
    select_us = bench_select(args.repeat, args.number)
    add_free_us = bench_add_free(args.repeat, args.number)
    print(f"decide(SelectWorker), 16 workers, 64-block prompt: {select_us:8.1f} us")
    print(f"decide+fold AddRequest then FreeRequest, 64 blocks: {add_free_us:8.1f} us")
    if args.index_blocks:
        store_us, per_block, match_us = bench_index(args.index_blocks)
        print(f"KvIndex.apply_stored, {args.index_blocks:,} blocks: {store_us:8.2f} us per block")
        print(f"KvIndex resident memory: {per_block:8.1f} B per block")
        print(f"KvIndex.find_matches, 64-block query, 16 ranks: {match_us:8.2f} us")


if __name__ == "__main__":
    main()
