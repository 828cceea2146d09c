"""Slot tracker lifecycle throughput with 0 and with N connected ``GET /ws/loads`` subscribers, in one run.

    python benchmarks/ws_loads_bench.py [--subscribers 100] [--seconds 12] [--rounds 3] [--durability off]
        [--fronts 0] [--delivery-seconds 12]

The workload of ``slot_tracker_bench.py`` (8 workers x 2 ranks; each client loops add -> prefill_complete ->
free). One service runs for the whole run; rounds alternate between no subscriber and N subscribers (the
median of each is reported), so both rates come from the same process in the same conditions. The
subscribers run in a child process of their own (so reading their messages does not slow the load
generator), each reading every message as it comes; the child reports how many messages and updates they
received. Target (issue 11): the rate with N subscribers stays >= 0.9 x the rate with none.

Then (``--delivery-seconds``, 0 to skip) the cost of delivering itself, which the rates above show only through
the noise of a shared machine: a paced load (``--paced`` lifecycles/s, the same scope changing all the time, so
the hub sends its capped ~200 updates/s in all), rounds alternating between no subscriber and N; the service's
extra CPU with subscribers divided by the updates they received is its CPU per delivered update.
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
from http_client import Connection
from slot_tracker_bench import CycleMaker, Result, Server, drive, lifecycle, load_average, merged, setup


async def subscribers(url: str, count: int) -> None:
    """The child: ``count`` subscribers reading until stdin closes; prints their message counts."""
    from kvrouter.client.live import open_stream

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


async def paced(port: int, seconds: float, make_cycle: CycleMaker, per_second: float) -> int:
    """One client running ``per_second`` lifecycles a second for ``seconds``; returns the requests sent."""
    connection = await Connection.open("127.0.0.1", port)
    started = trio.current_time()
    cycles = requests = 0
    try:
        while trio.current_time() - started < seconds:
            for raw in make_cycle(connection, cycles):
                status, body = await connection.send(raw)
                if status >= 300 and status != 404:
                    raise RuntimeError(f"unexpected {status}: {body[:200]!r}")
                requests += 1
            cycles += 1
            await trio.sleep_until(started + cycles / per_second)
    finally:
        await connection.aclose()
    return requests


def delivery_cost(server: Server, port: int, subscribers: int, seconds: float, rounds: int, per_second: float) -> str:
    """Paced rounds without and with subscribers: the service's CPU per delivered update (see the module doc)."""
    cpu = {"alone": 0.0, "watched": 0.0}
    updates = 0.0
    per_round = seconds / rounds
    for round_index in range(rounds):
        before = sum(server.cpu().values())
        trio.run(paced, port, per_round, lifecycle(30 + round_index), per_second)
        cpu["alone"] += sum(server.cpu().values()) - before
        child = start_subscribers(port, subscribers)
        try:
            before = sum(server.cpu().values())
            trio.run(paced, port, per_round, lifecycle(40 + round_index), per_second)
            cpu["watched"] += sum(server.cpu().values()) - before
        finally:
            updates += stop_subscribers(child)["updates"]
    extra = (cpu["watched"] - cpu["alone"]) / seconds
    return (
        f"paced at {per_second * 3:.0f} req/s: service CPU {cpu['alone'] / seconds * 1e3:.1f} ms/s alone, "
        f"{cpu['watched'] / seconds * 1e3:.1f} ms/s with {subscribers} subscribers receiving {updates / seconds:.0f} "
        f"updates/s: {extra / max(updates / seconds, 1e-9) * 1e6:.0f} us of service CPU per delivered update; "
        f"load average {load_average()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=12.0, help="per measurement, split over --rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--durability", choices=["always", "batch", "off"], default="off")
    parser.add_argument("--fronts", type=int, default=0)
    parser.add_argument("--profile", metavar="FILE", help="run the service under cProfile, writing FILE")
    parser.add_argument("--delivery-seconds", type=float, default=12.0, help="paced measurement, 0: skip")
    parser.add_argument("--paced", type=float, default=4.0, help="lifecycles per second in the paced measurement")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trio.run(subscribers, args.child[0], int(args.child[1]))
        return
    port = free_port()
    data = Path(f"/tmp/kvrouter-ws-bench-{port}")
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    argv = [sys.executable, *profile, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", str(port), "--fresh"]
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
        delivery = None
        if args.delivery_seconds > 0:
            delivery = delivery_cost(server, port, args.subscribers, args.delivery_seconds, args.rounds, args.paced)
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
    if delivery is not None:
        print(delivery)


if __name__ == "__main__":
    main()
