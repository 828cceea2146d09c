"""Slot tracker lifecycle throughput with 0 and with N connected ``GET /ws/loads`` subscribers, in one run.

    python benchmarks/ws_loads_bench.py [--subscribers 100] [--seconds 12] [--rounds 3] [--durability off]
        [--fronts 0]

The workload of ``slot_tracker_bench.py`` (8 workers x 2 ranks; each client loops add -> prefill_complete ->
free). One service runs for the whole run; rounds alternate between no subscriber and N subscribers (the
median of each is reported), so both rates come from the same process in the same conditions. The
subscribers run in a child process of their own (so reading their messages does not slow the load
generator), each reading every message as it comes; the child reports how many messages and updates they
received. Target (issue 11): the rate with N subscribers stays >= 0.9 x the rate with none.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port
from slot_tracker_bench import Result, Server, drive, lifecycle, load_average, merged, setup


async def subscribers(url: str, count: int) -> None:
    """The child: ``count`` subscribers reading until stdin closes; prints their message counts."""
    from kvrouter.api.stream_client import open_stream

    messages = updates = 0
    ready = 0
    all_ready = trio.Event()

    async def subscriber() -> None:
        nonlocal messages, updates, ready
        async with open_stream(url) as ws:
            await ws.get_message()  # the snapshot
            ready += 1
            if ready == count:
                all_ready.set()
            while True:
                message = orjson.loads(await ws.get_message())
                messages += 1
                updates += message["type"] == "update"

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(subscriber)
        await all_ready.wait()
        print("ready", flush=True)
        started = time.perf_counter()
        await trio.to_thread.run_sync(sys.stdin.read)  # the parent closes it when the round ends
        seconds = time.perf_counter() - started
        print(orjson.dumps({"messages": messages, "updates": updates, "seconds": seconds}).decode(), flush=True)
        nursery.cancel_scope.cancel()


def start_subscribers(port: int, count: int) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", f"ws://127.0.0.1:{port}/ws/loads", str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "ready":
        child.kill()
        raise RuntimeError(f"subscribers did not start: {line!r}")
    return child


def stop_subscribers(child: subprocess.Popen[str]) -> dict[str, float]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    report = orjson.loads(child.stdout.readline())
    child.wait(timeout=10)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=12.0, help="per measurement, split over --rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--durability", choices=["always", "batch", "off"], default="off")
    parser.add_argument("--fronts", type=int, default=0)
    parser.add_argument("--profile", metavar="FILE", help="run the service under cProfile, writing FILE")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trio.run(subscribers, args.child[0], int(args.child[1]))
        return
    port = free_port()
    data = Path(f"/tmp/kvrouter-ws-bench-{port}")
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    argv = [sys.executable, *profile, "-m", "kvrouter.api.cli", "slot-tracker", "--port", str(port), "--fresh"]
    argv += ["--data-dir", str(data), "--durability", args.durability, "--log-level", "warning"]
    argv += ["--fronts", str(args.fronts)]
    server = Server(argv, port, fronts=args.fronts)
    alone: list[Result] = []
    watched: list[Result] = []
    received: list[dict[str, float]] = []
    cpu = {"alone": 0.0, "watched": 0.0}  # the service's CPU seconds in each kind of round
    try:
        server.wait_ready()
        trio.run(setup, port)
        trio.run(drive, port, args.clients, 1.0, lifecycle(1))  # warm-up
        per_round = args.seconds / args.rounds
        for round_index in range(args.rounds):
            before = sum(server.cpu().values())
            alone.append(trio.run(drive, port, args.clients, per_round, lifecycle(10 + round_index)))
            cpu["alone"] += sum(server.cpu().values()) - before
            child = start_subscribers(port, args.subscribers)
            try:
                before = sum(server.cpu().values())
                watched.append(trio.run(drive, port, args.clients, per_round, lifecycle(20 + round_index)))
                cpu["watched"] += sum(server.cpu().values()) - before
            finally:
                received.append(stop_subscribers(child))
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(data)], check=False)
    none, some = merged(alone), merged(watched)
    updates = sum(r["updates"] for r in received)
    seconds = sum(r["seconds"] for r in received)
    layout = f"--fronts {args.fronts}" if args.fronts else "one process"
    print(f"slot tracker, {layout}, durability {args.durability}, {args.clients} clients, {args.rounds} rounds")
    print(
        f"lifecycle with 0 subscribers   {none.rate:8.0f} req/s (p50 {none.percentile(0.5):5.0f} us, "
        f"p99 {none.percentile(0.99):6.0f} us)"
    )
    print(
        f"lifecycle with {args.subscribers:3d} subscribers {some.rate:8.0f} req/s (p50 {some.percentile(0.5):5.0f} us, "
        f"p99 {some.percentile(0.99):6.0f} us)"
    )
    alone_cpu = cpu["alone"] / sum(r.requests for r in alone) * 1e6
    watched_cpu = cpu["watched"] / sum(r.requests for r in watched) * 1e6
    print(
        f"service CPU per lifecycle request: {alone_cpu:.0f} us alone, {watched_cpu:.0f} us with subscribers "
        f"(ratio {alone_cpu / watched_cpu:.3f}: the rate a dedicated core would allow, with / without)"
    )
    print(
        f"ratio {some.rate / none.rate:.3f} (target >= 0.9); subscribers received {updates / seconds:.0f} updates/s "
        f"in all ({updates / seconds / args.subscribers:.1f} per subscriber per s, conflated by the service); "
        f"load average {load_average()}"
    )


if __name__ == "__main__":
    main()
