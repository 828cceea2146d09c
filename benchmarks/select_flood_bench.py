"""/select latency while a KV-event flood is ingested, for kvrouter and (when installed) the Dynamo reference.

    python benchmarks/select_flood_bench.py [--reference-python PATH] [--flood-blocks 320000] [--rounds 3]

Issue 10's target: ``/select`` p99 during a 320k-block KV-event flood <= 5 ms. The workload is
``select_service_bench.py``'s (16 workers with a real ZMQ publisher each in this process, block size 16,
chains of 64 blocks published as one batch of two BlockStored events, 64-block prompts sharing a random
prefix with an indexed chain). Per service: a base set is indexed first (``--base-blocks``), then one client
sends ``/select`` in a loop: for ``--seconds`` without a flood, then during each of ``--rounds`` floods, each
publishing ``--flood-blocks`` new blocks from a thread as fast as the publishers take them. A flood lasts
from its first publish until every worker's last flood chain is indexed (polled as the ingest measurement
polls it, one probe at a time on its own connection). Printed: p50/p99/max and the count of ``/select``
answers without and during the floods, and the blocks/s each flood was ingested at.

``--breakdown`` runs kvrouter under ``loop_trace.py`` (a record of every task step over 0.3 ms and every GC pass
in the service) and prints what the slow answers during the floods waited behind: the time each kind of task step
overlapped their windows, GC inside those steps, and what no long step covers. The record costs the service a
little per step: take latency figures from runs without it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, reference_python, repo_env, select_service_argv
from http_client import Connection
from select_service_bench import (
    BLOCK_SIZE,
    CHAIN_BLOCKS,
    HOST,
    MODEL,
    REPO,
    WORKERS,
    Latencies,
    Publishers,
    Service,
    Workload,
    chain_payload,
    chain_tokens,
    device_blocks,
    prepare,
)


@dataclass
class Timed(Latencies):
    """Latencies with each request's start (``time.perf_counter``), to line them up with the service's record."""

    starts: list[float] = field(default_factory=list)


async def indexed(connection: Connection, chain: int) -> bool:
    status, raw = await connection.send(
        connection.encode("POST", "/overlap_scores", {"model_name": MODEL, "token_ids": chain_tokens(chain)})
    )
    return status == 200 and device_blocks(orjson.loads(raw), Workload.owner(chain)) == CHAIN_BLOCKS


class Flood:
    """The messages publishing ``chains`` and each worker's last chain (what completion waits for). Built before
    any measured request: encoding 5,000 chains holds this process's loop for ~0.5 s, which the client would
    otherwise count as /select latency."""

    def __init__(self, chains: range) -> None:
        self.messages = [(Workload.owner(chain), chain_payload(chain)) for chain in chains]
        last = {}
        for chain in chains:
            last[Workload.owner(chain)] = chain
        self.last_chains = sorted(last.values(), reverse=True)


async def publish_and_wait(service: Service, publishers: Publishers, flood: Flood, limit: float) -> float:
    """Publish the flood from a thread; returns seconds until every worker's last chain is indexed."""
    messages = flood.messages
    pending = list(flood.last_chains)
    connection = await Connection.open(HOST, service.port)
    started = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, publishers.publish, messages)
            while pending:
                if time.perf_counter() - started > limit:
                    raise TimeoutError(f"{service.label}: {len(pending)} workers not indexed after {limit:.0f} s")
                t0 = time.perf_counter()
                if await indexed(connection, pending[0]):
                    pending.pop(0)
                    continue
                service.check_alive()
                await trio.sleep(min(0.02, max(0.005, 10 * (time.perf_counter() - t0))))
    finally:
        await connection.aclose()
    return time.perf_counter() - started


async def select_loop(port: int, requests: list[bytes], result: Timed, stop: trio.Event) -> None:
    """One client, one /select at a time, until ``stop``."""
    connection = await Connection.open(HOST, port)
    try:
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            status, body = await connection.send(requests[n % len(requests)])
            result.samples.append(time.perf_counter() - t0)
            result.starts.append(t0)
            if status != 200:
                raise RuntimeError(f"/select answered {status}: {body[:300]!r}")
            n += 1
    finally:
        await connection.aclose()


async def measure(service: Service, publishers: Publishers, args: argparse.Namespace) -> dict[str, object]:
    await prepare(service, publishers)
    base = Workload(args.base_blocks // CHAIN_BLOCKS)
    base_seconds = await publish_and_wait(service, publishers, Flood(range(base.chains)), 300.0)
    rng = random.Random(11)
    encoder = Connection(None, f"{HOST}:{service.port}")  # type: ignore[arg-type]  # encoding only
    selects = [
        encoder.encode("POST", "/select", {"model_name": MODEL, "token_ids": base.prompt(rng)[0]}) for _ in range(256)
    ]

    async def selecting(seconds: float | None, flood: Flood | None) -> tuple[Timed, float | None]:
        result, stop = Timed(), trio.Event()
        took = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(select_loop, service.port, selects, result, stop)
            if flood is None:
                await trio.sleep(seconds or 0.0)
            else:
                took = await publish_and_wait(service, publishers, flood, 300.0)
            stop.set()
        return result, took

    await selecting(0.5, None)  # warm-up
    quiet, _ = await selecting(args.seconds, None)
    flooded = Timed()
    rates = []
    per_flood = args.flood_blocks // CHAIN_BLOCKS
    for round_ in range(args.rounds):
        first = base.chains + round_ * per_flood
        during, took = await selecting(None, Flood(range(first, first + per_flood)))
        flooded.samples.extend(during.samples)
        flooded.starts.extend(during.starts)
        rates.append(per_flood * CHAIN_BLOCKS / took if took else 0.0)
        print(
            f"  flood {round_ + 1}: {per_flood * CHAIN_BLOCKS:,} blocks indexed in {took:.2f} s; /select p50 "
            f"{during.percentile(0.5):,.0f} us p99 {during.percentile(0.99):,.0f} us max "
            f"{max(during.samples) * 1e6:,.0f} us ({len(during.samples)} answers)",
            flush=True,
        )
    return {
        "base_seconds": base_seconds,
        "quiet": quiet,
        "flooded": flooded,
        "rates": rates,
    }


# What each kind of service task does in a step, by the end of its task name.
STEP_KINDS = {
    "ScopeActor.run": "actor turns (KV runs applied, commands)",
    "KvIngest._run_listener": "KV listeners (reading, decoding runs)",
    "_Server._serve": "HTTP connections (requests, probes)",
    "run_journal": "journal writer",
}
LONGEST_STEP = 1.0  # seconds: a step that started this long before a request cannot overlap it (none is near)


def step_kind(task_name: str) -> str:
    for suffix, kind in STEP_KINDS.items():
        if task_name.endswith(suffix):
            return kind
    return task_name.rsplit(".", 2)[-1] if "." in task_name else task_name


def print_breakdown(trace_path: Path, flooded: Timed, over_us: float) -> None:
    """What the flood's answers slower than ``over_us`` waited behind, from the service's loop record."""
    try:
        trace = json.loads(trace_path.read_text())
    except (OSError, ValueError) as exc:
        print(f"  breakdown: no loop record ({exc})", flush=True)
        return
    steps = sorted(trace["steps"])
    starts = [step[0] for step in steps]
    slow = [(t0, took) for t0, took in zip(flooded.starts, flooded.samples, strict=True) if took * 1e6 > over_us]
    overlap: Counter[str] = Counter()
    on_cpu: Counter[str] = Counter()  # the overlap scaled by the step's CPU / wall (the rest: the OS ran others)
    count: Counter[str] = Counter()
    longest: dict[str, float] = {}
    in_gc = uncovered = 0.0
    for t0, took in slow:
        covered = 0.0
        i = bisect.bisect_left(starts, t0 - LONGEST_STEP)
        while i < len(steps) and steps[i][0] < t0 + took:
            start, wall, cpu, name, gc_inside = steps[i]
            shared = min(start + wall, t0 + took) - max(start, t0)
            if shared > 0:
                kind = step_kind(name)
                overlap[kind] += shared
                on_cpu[kind] += shared * min(1.0, cpu / wall)
                count[kind] += 1
                longest[kind] = max(longest.get(kind, 0.0), wall)
                in_gc += min(gc_inside, shared)
                covered += shared
            i += 1
        uncovered += max(0.0, took - covered)
    total = sum(took for _, took in slow)
    print(
        f"  breakdown: {len(slow)} of {len(flooded.samples)} answers during the floods took over {over_us:,.0f} us "
        f"({total * 1e3:,.1f} ms in all); in their windows ran (task steps over 0.3 ms, service's loop record; "
        "wall ms, of which on the service's CPU):",
        flush=True,
    )
    for kind, seconds in overlap.most_common():
        print(
            f"    {kind:44} {seconds * 1e3:9,.1f} ms ({on_cpu[kind] * 1e3:,.1f} on CPU) in {count[kind]:5} steps "
            f"(longest {longest[kind] * 1e3:,.2f} ms)"
        )
    print(f"    {'of which cyclic GC inside those steps':44} {in_gc * 1e3:9,.1f} ms")
    print(f"    {'no step over 0.3 ms (own work, scheduling, OS)':44} {uncovered * 1e3:9,.1f} ms")
    if flooded.starts:
        first, last = min(flooded.starts), max(t + d for t, d in zip(flooded.starts, flooded.samples, strict=True))
        passes = [(took, gen) for start, took, gen in trace["gcs"] if first <= start <= last]
        by_gen = Counter(gen for _, gen in passes)
        worst = max((took for took, _ in passes), default=0.0)
        shown = ", ".join(f"gen{gen}: {n}" for gen, n in sorted(by_gen.items())) or "none"
        print(
            f"    cyclic GC passes from the first flood's start to the last's end: {shown} "
            f"(longest {worst * 1e3:.2f} ms; thresholds {tuple(trace['gc_threshold'])})",
            flush=True,
        )


def run(label: str, argv: list[str], env: dict[str, str], cwd: Path, port: int, args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-flood-bench-"))
    trace_path = workdir / "loop-trace.json"
    if args.breakdown and label.startswith("kvrouter"):
        argv = [argv[0], str(Path(__file__).resolve().parent / "loop_trace.py"), str(trace_path), *argv[1:]]
    publishers = Publishers()
    service = Service(label, argv, port, workdir, env, cwd)
    print(f"{label}:", flush=True)
    try:
        service.start()
        result = trio.run(measure, service, publishers, args)
        service.stop()
        flooded: Timed = result["flooded"]
        if args.breakdown and label.startswith("kvrouter"):
            print_breakdown(trace_path, flooded, args.breakdown_over_us)
    finally:
        service.stop()
        publishers.close()
        shutil.rmtree(workdir, ignore_errors=True)
    quiet: Latencies = result["quiet"]
    print(
        f"  without a flood: /select p50 {quiet.percentile(0.5):,.0f} us p99 {quiet.percentile(0.99):,.0f} us "
        f"({len(quiet.samples)} answers); during the floods: p50 {flooded.percentile(0.5):,.0f} us p99 "
        f"{flooded.percentile(0.99):,.0f} us max {max(flooded.samples) * 1e6:,.0f} us ({len(flooded.samples)} answers)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-python", help="a python with ai-dynamo-runtime==1.6.1 (default: found)")
    parser.add_argument("--no-reference", action="store_true", help="measure kvrouter only")
    parser.add_argument("--durability", choices=["always", "batch", "off"], default="always")
    parser.add_argument("--base-blocks", type=int, default=64_000, help="indexed before measuring")
    parser.add_argument("--flood-blocks", type=int, default=320_000, help="blocks published per flood")
    parser.add_argument("--rounds", type=int, default=3, help="floods per service")
    parser.add_argument("--seconds", type=float, default=5.0, help="the measurement without a flood")
    parser.add_argument("--breakdown", action="store_true", help="what slow answers waited behind (loop_trace.py)")
    parser.add_argument("--breakdown-over-us", type=float, default=1000.0, help="slow, for --breakdown")
    args = parser.parse_args()
    for name in ("base_blocks", "flood_blocks"):
        if getattr(args, name) < WORKERS * CHAIN_BLOCKS:
            parser.error(f"--{name.replace('_', '-')} must be at least {WORKERS * CHAIN_BLOCKS}")
    python = None if args.no_reference else reference_python(args.reference_python, "dynamo.select_service")
    print(
        f"/select during KV-event floods: {WORKERS} workers, block size {BLOCK_SIZE}, {args.base_blocks:,} blocks "
        f"indexed first, {args.rounds} floods of {args.flood_blocks:,} blocks; machine: cpus={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.2f}; kvrouter --durability {args.durability}; reference: "
        f"{python or 'not installed'}",
        flush=True,
    )
    env = repo_env()
    results = {}
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="kvrouter-flood-data-"))
    try:
        argv = select_service_argv(port, data, durability=args.durability)
        results["kvrouter"] = run(f"kvrouter ({args.durability})", argv, env, REPO, port, args)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    if python is not None:
        ref_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DYN_LOG", "RUST_LOG")}
        ref_env["DYN_LOG"] = "warn"
        port = free_port()
        argv = [python, "-m", "dynamo.select_service", "--port", str(port)]
        results["reference"] = run("reference 1.6.1", argv, ref_env, Path(tempfile.gettempdir()), port, args)
    print()
    print(f"{'':44} {'kvrouter':>12} {'reference':>12}")
    rows = [
        ("/select p50 without a flood (us)", lambda r: r["quiet"].percentile(0.5)),
        ("/select p99 without a flood (us)", lambda r: r["quiet"].percentile(0.99)),
        ("/select p50 during the floods (us)", lambda r: r["flooded"].percentile(0.5)),
        ("/select p99 during the floods (us)", lambda r: r["flooded"].percentile(0.99)),
        ("/select max during the floods (us)", lambda r: max(r["flooded"].samples) * 1e6),
        ("flood ingest, mean of rounds (blocks/s)", lambda r: sum(r["rates"]) / len(r["rates"])),
    ]
    for label, value in rows:
        shown = [f"{value(results[k]):,.0f}" if k in results else "-" for k in ("kvrouter", "reference")]
        print(f"{label:44} {shown[0]:>12} {shown[1]:>12}")
    p99 = results["kvrouter"]["flooded"].percentile(0.99)
    verdict = "meets" if p99 <= 5000 else "MISSES"
    print(f"target (issue 10): kvrouter /select p99 during a {args.flood_blocks:,}-block flood <= 5 ms: {verdict}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
