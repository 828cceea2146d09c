"""Streamed lifecycle: commands/s through the client library (``kvrouter.client``) over the command stream,
with ``--durability always``, next to the reference's HTTP lifecycle rate when it is installed.

    python benchmarks/stream_bench.py [--seconds 6] [--callers 256] [--connections 1] [--format msgpack|json]
                                      [--reference-python /work/refvenv/bin/python]

Workload: the slot tracker benchmark's (8 workers x 2 DP ranks, 64-block prompts, 1024 prefill tokens);
each of ``--callers`` trio tasks loops add -> prefill_complete -> free, awaiting each result (so a
caller's commands are ordered by the service's replies), all sharing ``--connections`` streams: calls
made while a message is in flight go out together in the next one. Latency is per command, from the
call to its result (durable). The service runs as a subprocess; the load generator in this process.
``--format``: the stream's compact format (msgpack, the client's default) or JSON.
The reference is measured by ``slot_tracker_bench.Measurement`` (its own HTTP clients, same workload), its rounds
taken in turns with kvrouter's (both services run meanwhile, each idle while the other is measured): the machine's
speed drifts over tens of seconds, and the ratio compares the median rounds of each.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, reference_python, rss_bytes
from slot_tracker_bench import BLOCK_SIZE, BLOCKS, RANKS, WORKERS, Measurement, Result, Server, cpu_seconds

from kvrouter.client import StreamClient


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


async def drive(
    url: str, callers: int, connections: int, seconds: float, seed: int, compact: bool = True
) -> tuple[Result, int]:
    """(commands, seconds, per-command latencies) and the number of messages the clients sent."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(63) for _ in range(BLOCKS)] for _ in range(32)]
    latencies: list[float] = []
    count = 0
    messages = 0

    async def caller(client: StreamClient, index: int, stop_at: float) -> None:
        nonlocal count
        cycle = 0
        while trio.current_time() < stop_at:
            request_id = f"req-{seed}-{index}-{cycle}"
            shared = rng.randint(0, BLOCKS)
            hashes = rng.choice(prefixes)[:shared] + [rng.getrandbits(63) for _ in range(BLOCKS - shared)]
            worker, rank = rng.randrange(WORKERS), rng.randrange(RANKS)
            t0 = time.perf_counter()
            await client.add(request_id, worker, hashes, dp_rank=rank, new_isl_tokens=1024, model_name="bench")
            t1 = time.perf_counter()
            await client.prefill_complete(request_id, model_name="bench")
            t2 = time.perf_counter()
            await client.free(request_id, model_name="bench")
            latencies.extend((t1 - t0, t2 - t1, time.perf_counter() - t2))
            count += 3
            cycle += 1

    async def connection(index: int, stop_at: float) -> None:
        nonlocal messages
        async with StreamClient.connect(url, compact=compact) as client, trio.open_nursery() as nursery:
            for caller_index in range(index, callers, connections):
                nursery.start_soon(caller, client, caller_index, stop_at)
        messages += client.messages_sent

    started = time.perf_counter()
    stop_at = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(connection, index, stop_at)
    return Result(count, time.perf_counter() - started, latencies), messages


async def setup(url: str) -> None:
    async with StreamClient.connect(url) as client:
        for worker in range(WORKERS):
            await client.register(worker, block_size=BLOCK_SIZE, dp_size=RANKS, model_name="bench")


class Streamed:
    """kvrouter's service driven through the client library, round by round (so the reference's rounds can take
    turns with its own)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        port = free_port()
        self.data = Path(tempfile.mkdtemp(prefix="kvrouter-stream-bench-"))
        argv = [
            *(sys.executable, "-m", "kvrouter.api.slot_tracker", "--port", str(port), "--data-dir", str(self.data)),
            *("--durability", "always", "--fresh", "--log-level", os.environ.get("BENCH_LOG", "warning")),
        ]
        self.server = Server(argv, port)
        self.url = f"http://127.0.0.1:{port}"
        self.compact = args.format == "msgpack"
        self.rounds: list[Result] = []
        self.service_cpu = self.client_cpu = self.wall = 0.0
        self.fsyncs = 0.0
        self.rss = 0

    def start(self) -> None:
        self.server.wait_ready()
        trio.run(setup, self.url)
        trio.run(drive, self.url, self.args.callers, self.args.connections, 0.5, 1, self.compact)  # warm-up

    def round(self) -> Result:
        args = self.args
        index = len(self.rounds)
        fsyncs_before = journal_fsyncs(self.url)
        service_before, client_before = cpu_seconds(self.server.process.pid), own_cpu_seconds()
        result, messages = trio.run(
            drive, self.url, args.callers, args.connections, args.seconds / args.rounds, 2 + index, self.compact
        )
        service = cpu_seconds(self.server.process.pid) - service_before
        client = own_cpu_seconds() - client_before
        self.service_cpu += service
        self.client_cpu += client
        self.fsyncs += journal_fsyncs(self.url) - fsyncs_before
        self.wall += result.seconds
        self.rounds.append(result)
        print(
            f"  round {index + 1}: {result.rate:8.0f} commands/s, {result.requests / max(messages, 1):6.1f} "
            f"commands per message, CPU per command: service {1e6 * service / max(result.requests, 1):5.1f} us, "
            f"client {1e6 * client / max(result.requests, 1):5.1f} us ({load()})",
            flush=True,
        )
        return result

    def stop(self) -> None:
        try:
            if self.server.process.poll() is None:
                self.rss = rss_bytes(self.server.process.pid) // 1024
        finally:
            self.server.stop()
            shutil.rmtree(self.data, ignore_errors=True)

    def report(self) -> Result:
        """Print the median round's rate, the latencies of every round and the CPU per command."""
        args, rounds = self.args, self.rounds
        middle = sorted(rounds, key=lambda r: r.rate)[len(rounds) // 2]
        result = Result(middle.requests, middle.seconds, [latency for r in rounds for latency in r.latencies])
        print(
            f"kvrouter stream (always, {args.format})  lifecycle {result.rate:8.0f} commands/s "
            f"(p50 {result.percentile(0.5):6.0f} us, "
            f"p99 {result.percentile(0.99):6.0f} us per command)   rss {self.rss / 1024:6.1f} MiB   ({load()})",
            flush=True,
        )
        commands = sum(r.requests for r in rounds)
        print(
            f"{'':<26}CPU per command: service {1e6 * self.service_cpu / commands:5.1f} us, "
            f"client library (this process) {1e6 * self.client_cpu / commands:5.1f} us; busy: service "
            f"{100 * self.service_cpu / self.wall:3.0f} %, client {100 * self.client_cpu / self.wall:3.0f} % of the "
            "run (of a core each; over 100 % together: they overlap)",
            flush=True,
        )
        print(f"{'':<26}{commands / max(self.fsyncs, 1):.0f} commands per journal fsync", flush=True)
        return result


def journal_fsyncs(url: str) -> float:
    """The service's journal fsyncs so far (its ``kvrouter_journal_fsyncs`` counter on ``GET /metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kvrouter_journal_fsyncs_total "):
                return float(line.split()[1])
    raise RuntimeError("the service's /metrics has no kvrouter_journal_fsyncs_total")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="per measurement, split over --rounds")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement (the median round's rate)")
    parser.add_argument("--callers", type=int, default=256, help="concurrent lifecycles through the client")
    parser.add_argument("--connections", type=int, default=1, help="command streams the callers share")
    parser.add_argument("--format", choices=("msgpack", "json"), default="msgpack", help="the stream's format")
    parser.add_argument("--clients", type=int, default=4, help="HTTP connections for the reference")
    parser.add_argument("--reference-python", help="a python with ai-dynamo-runtime==1.6.1 installed")
    args = parser.parse_args()
    print(
        f"stream benchmark: {WORKERS} workers x {RANKS} ranks, {BLOCKS}-block prompts, {args.callers} callers on "
        f"{args.connections} stream(s) ({args.format}), {args.seconds:.0f} s per measurement, "
        f"cpus={os.cpu_count()} ({load()})",
        flush=True,
    )
    python = reference_python(args.reference_python, "dynamo.slot_tracker")
    reference = None
    if python is not None:
        port = free_port()
        argv = [python, "-m", "dynamo.slot_tracker", "--port", str(port)]
        reference = Measurement(argv, port, args.seconds / args.rounds, args.clients, "reference 1.6.1 (HTTP)")
    ours = Streamed(args)
    reference_rounds: list[Result] = []
    try:
        ours.start()
        if reference is not None:
            reference.start()
        for _ in range(args.rounds):  # in turns: a drift of the machine's speed meets both alike
            ours.round()
            if reference is not None:
                reference_rounds.append(reference.round())
    except BaseException:
        if reference is not None:
            reference.stop()
        raise
    finally:
        ours.stop()
    result = ours.report()
    if reference is None:
        print("reference: not installed (set KVROUTER_REFERENCE_PYTHON to a python with ai-dynamo-runtime)")
        return
    reference.finish()
    rate = sorted(r.rate for r in reference_rounds)[len(reference_rounds) // 2]
    ratio = result.rate / rate
    verdict = "meets" if ratio >= 1.0 else "misses"
    print(f"({load()})")
    print(
        f"target: streamed lifecycle (always) >= 1.0 x reference HTTP lifecycle (median rounds, taken in turns: "
        f"{result.rate:.0f} / {rate:.0f}) -> {ratio:.2f} ({verdict})"
    )


if __name__ == "__main__":
    main()
