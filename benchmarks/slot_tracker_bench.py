"""Slot tracker throughput: lifecycle requests/s per durability mode, next to the same server's
``/health`` rate (the HTTP stack's ceiling) and, when installed, the Dynamo reference's rate.

    python benchmarks/slot_tracker_bench.py [--seconds 5] [--clients 4] [--reference-python PATH]

Workload (issue #2): 8 workers x 2 DP ranks, block size 16; each client loops add (64-block
prompt, 1024 prefill tokens) -> prefill_complete -> free on its own keep-alive connection.
The service runs as a subprocess (one core), the load generator in this process (the other).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, reference_python, rss_bytes
from http_client import Connection

WORKERS, RANKS, BLOCKS, BLOCK_SIZE = 8, 2, 64, 16


@dataclass
class Result:
    requests: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6 if ordered else float("nan")


class Server:
    def __init__(self, argv: list[str], port: int) -> None:
        self.port = port
        # BENCH_LOG=info shows the service's log (journal batch statistics at shutdown).
        stderr = None if os.environ.get("BENCH_LOG") else subprocess.DEVNULL
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


CycleMaker = Callable[[Connection, int], list[bytes]]


async def drive(port: int, clients: int, seconds: float, make_cycle: CycleMaker) -> Result:
    latencies: list[float] = []
    count = 0
    stop_at = trio.current_time() + seconds
    started = time.perf_counter()

    async def client(index: int) -> None:
        nonlocal count
        connection = await Connection.open("127.0.0.1", port)
        try:
            cycle = 0
            while trio.current_time() < stop_at:
                for raw in make_cycle(connection, index * 1_000_000 + cycle):
                    t0 = time.perf_counter()
                    status, body = await connection.send(raw)
                    latencies.append(time.perf_counter() - t0)
                    if status >= 300 and status != 404:
                        raise RuntimeError(f"unexpected {status}: {body[:200]!r}")
                    count += 1
                cycle += 1
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(client, index)
    return Result(count, time.perf_counter() - started, latencies)


async def setup(port: int) -> None:
    connection = await Connection.open("127.0.0.1", port)
    for worker in range(WORKERS):
        body = {"worker_id": worker, "model_name": "bench", "block_size": BLOCK_SIZE, "dp_start": 0, "dp_size": RANKS}
        status, text = await connection.send(connection.encode("POST", "/register", body))
        assert status == 201, text
    await connection.aclose()


def lifecycle(seed: int) -> Callable[[Connection, int], list[bytes]]:
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(63) for _ in range(BLOCKS)] for _ in range(32)]

    def make(connection: Connection, n: int) -> list[bytes]:
        request_id = f"req-{n}"
        shared = rng.randint(0, BLOCKS)
        hashes = rng.choice(prefixes)[:shared] + [rng.getrandbits(63) for _ in range(BLOCKS - shared)]
        ref = {"model_name": "bench", "request_id": request_id}
        return [
            connection.encode(
                "POST",
                "/add",
                {
                    **ref,
                    "worker_id": rng.randrange(WORKERS),
                    "dp_rank": rng.randrange(RANKS),
                    "sequence_hashes": hashes,
                    "new_isl_tokens": 1024,
                },
            ),
            connection.encode("POST", "/prefill_complete", ref),
            connection.encode("POST", "/free", ref),
        ]

    return make


def health(connection: Connection, n: int) -> list[bytes]:
    return [connection.encode("GET", "/health")]


def merged(results: list[Result]) -> Result:
    """The median round's rate, with the latencies of every round (this 2-core machine is noisy:
    alternating short rounds and taking the median keeps one hiccup from deciding a ratio)."""
    middle = sorted(results, key=lambda r: r.rate)[len(results) // 2]
    latencies = [latency for r in results for latency in r.latencies]
    return Result(middle.requests, middle.seconds, latencies)


def measure(
    argv: list[str], port: int, seconds: float, clients: int, label: str, rounds: int
) -> dict[str, Result | int]:
    server = Server(argv, port)
    cycles, ceilings = [], []
    try:
        server.wait_ready()
        trio.run(setup, port)
        trio.run(drive, port, clients, 0.5, lifecycle(1))  # warm-up: hooks, caches, page cache
        for round_index in range(rounds):
            cycles.append(trio.run(drive, port, clients, seconds / rounds, lifecycle(2 + round_index)))
            ceilings.append(trio.run(drive, port, clients, seconds / rounds, health))
        rss = rss_bytes(server.process.pid) // 1024
    finally:
        server.stop()
    cycle, ceiling = merged(cycles), merged(ceilings)
    print(
        f"{label:<24} lifecycle {cycle.rate:8.0f} req/s (p50 {cycle.percentile(0.5):6.0f} us, "
        f"p99 {cycle.percentile(0.99):6.0f} us)   /health {ceiling.rate:8.0f} req/s   "
        f"ratio {cycle.rate / ceiling.rate:5.2f}   rss {rss / 1024:6.1f} MiB",
        flush=True,
    )
    return {"lifecycle": cycle, "health": ceiling, "rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="per measurement, split over --rounds")
    parser.add_argument("--rounds", type=int, default=3, help="alternating lifecycle and /health rounds (median)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--reference-python", help="a python with ai-dynamo-runtime==1.6.1 installed")
    parser.add_argument("--modes", default="always,batch,off")
    args = parser.parse_args()
    print(
        f"slot tracker benchmark: {WORKERS} workers x {RANKS} ranks, {BLOCKS}-block prompts, "
        f"{args.clients} clients, {args.seconds:.0f} s per measurement, cpus={os.cpu_count()}"
    )
    results = {}
    for mode in args.modes.split(","):
        port = free_port()
        data = Path(tempfile.mkdtemp(prefix="kvrouter-bench-"))
        try:
            argv = [
                sys.executable,
                "-m",
                "kvrouter.api.slot_tracker",
                "--port",
                str(port),
                "--data-dir",
                str(data),
                "--durability",
                mode,
                "--fresh",
                "--log-level",
                os.environ.get("BENCH_LOG", "warning"),
            ]
            results[mode] = measure(argv, port, args.seconds, args.clients, f"kvrouter ({mode})", args.rounds)
        finally:
            shutil.rmtree(data, ignore_errors=True)
    python = reference_python(args.reference_python, "dynamo.slot_tracker")
    if python is None:
        print("reference: not installed (set KVROUTER_REFERENCE_PYTHON to a python with ai-dynamo-runtime)")
    else:
        port = free_port()
        ref = measure(
            [python, "-m", "dynamo.slot_tracker", "--port", str(port)],
            port,
            args.seconds,
            args.clients,
            "reference 1.6.1",
            args.rounds,
        )
        for mode, result in results.items():
            ratio = result["lifecycle"].rate / ref["lifecycle"].rate  # type: ignore[union-attr]
            print(f"kvrouter ({mode}) / reference lifecycle rate: {ratio:.3f}")
    if "always" in results:
        always = results["always"]
        ratio = always["lifecycle"].rate / always["health"].rate  # type: ignore[union-attr]
        verdict = "meets" if ratio >= 0.6 else "misses"
        print(f"target: lifecycle (always) >= 0.6 x /health -> {ratio:.2f} ({verdict})")


if __name__ == "__main__":
    main()
