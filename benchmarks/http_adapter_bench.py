"""What kvrouter's HTTP layers save per request: CPU time under hypercorn alone, with the hypercorn adapter
(api/hypercorn_adapter.py), and on the plain HTTP/1.1 path (api/fast_h1.py, the default).

Server (kvrouter's ``serve_http`` with a minimal ASGI app answering 2 bytes) and keep-alive clients run in
this one process and thread, so the CPU time per request counts both sides; the clients are the same in
both variants, so the difference is the server's. CPU time rather than wall time: on a shared machine
the rate moves with everyone else's load, the CPU spent per request much less. Rounds alternate.

    .venv/bin/python benchmarks/http_adapter_bench.py [--requests 20000] [--connections 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_client import Connection

from kvrouter.api import hypercorn_adapter
from kvrouter.api.hypercorn_adapter import send_whole_response
from kvrouter.api.server import hypercorn_config, serve_http


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    # As kvrouter's app sends a whole response (one write with the adapter, two ASGI sends without it).
    await send_whole_response(
        send,
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]},
        {"type": "http.response.body", "body": b"ok"},
    )


VARIANTS = (  # label, adapter active, plain path
    ("hypercorn alone", False, False),
    ("with the adapter", True, False),
    ("plain HTTP/1.1 path", True, True),
)


async def one_round(requests: int, connections: int, plain: bool) -> tuple[float, float]:
    """(CPU microseconds per request, requests per second of wall time)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = partial(serve_http, plain_fast_path=plain)
        binds = await nursery.start(serve, app, hypercorn_config("127.0.0.1", 0), stop.wait)
        port = int(binds[0].rsplit(":", 1)[1])
        clients = [await Connection.open("127.0.0.1", port) for _ in range(connections)]
        raw = clients[0].encode("GET", "/health")
        for client in clients:  # warm: each connection's first request (and its timer task)
            await client.send(raw)

        async def loop(client: Connection, count: int) -> None:
            for _ in range(count):
                status, _ = await client.send(raw)
                assert status == 200

        cpu, wall = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as driving:
            for client in clients:
                driving.start_soon(loop, client, requests // connections)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        for client in clients:
            await client.aclose()
        stop.set()
    done = requests // connections * connections
    return cpu / done * 1e6, done / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="per round")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("kvrouter.http").setLevel(logging.ERROR)  # (the adapter's warning when switched off here)
    print(
        f"hypercorn {hypercorn_adapter.INSTALLED_VERSION}, {args.connections} keep-alive connections, "
        f"{args.requests} GETs per round, {args.rounds} rounds, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    results: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in VARIANTS}
    for _ in range(args.rounds):
        for label, active, plain in VARIANTS:
            hypercorn_adapter.ACTIVE = active  # read per connection and per send
            results[label].append(trio.run(one_round, args.requests, args.connections, plain))
    hypercorn_adapter.ACTIVE = True
    medians = {}
    for label, _, _ in VARIANTS:
        cpus = [cpu for cpu, _ in results[label]]
        rates = [rate for _, rate in results[label]]
        medians[label] = statistics.median(cpus)
        print(
            f"{label:<20} CPU per request (server + client) median {medians[label]:6.1f} us "
            f"(min {min(cpus):6.1f})   wall rate median {statistics.median(rates):7.0f} req/s"
        )
    alone = medians["hypercorn alone"]
    for label, _, _ in VARIANTS[1:]:
        print(f"{label}: saves {alone - medians[label]:.1f} us of CPU per request against hypercorn alone")


if __name__ == "__main__":
    main()
