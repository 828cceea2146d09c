"""CPU instructions a service spends per HTTP request, counted by valgrind's callgrind: a figure that does not move
with the machine's load, for comparing two builds on a busy 2-core machine (wall-clock rates there move by ±15 %).

    python benchmarks/instructions_per_request.py [--python PY ...] [--workload lifecycle|select]
        [--connections 16] [--requests 1500] [--runs 3]

Each ``--python`` is an interpreter with kvrouter installed (another checkout's venv: the build to compare);
without it, this one. The service runs under callgrind with counting off; the workload warms it up, counting
is switched on (``callgrind_control``) for ``--requests`` requests over ``--connections`` connections, then off.
What is counted is every instruction of the service's process (all threads: the journal's fsync thread too) per
request. Runs of the builds alternate; the median of ``--runs`` is printed with each build's ratio to the first.

Workloads: ``lifecycle`` is the slot tracker's add / prefill_complete / free (``slot_tracker_bench.py``'s, under
``--durability always``); ``select`` is the selection service's ``POST /select`` of 512 tokens among 8 workers with
an empty KV index (the HTTP, body, decide and cost path; the index probe is ``core_hot_paths_bench.py``'s).
The count varies by a few percent between runs of one build: how requests group per fsync and per scheduling
turn depends on timing.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import trio
from common import free_port
from http_client import Connection
from slot_tracker_bench import lifecycle, setup

MODEL = "m"
Make = Callable[[Connection, int], list[bytes]]


def select_requests(connection: Connection, n: int) -> list[bytes]:
    rng = random.Random(n % 64)
    body = {"model_name": MODEL, "token_ids": [rng.randrange(50_000) for _ in range(512)]}
    return [connection.encode("POST", "/select", body)]


async def register_workers(port: int) -> None:
    connection = await Connection.open("127.0.0.1", port)
    for worker in range(8):
        body = {
            "worker_id": worker,
            "model_name": MODEL,
            "endpoint": f"http://127.0.0.1:{9000 + worker}/v1",
            "block_size": 16,
            "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody publishes: an empty index
        }
        status, text = await connection.send(connection.encode("POST", "/workers", body))
        assert status in (200, 201), text
    await connection.aclose()


async def drive(port: int, connections: int, count: int, make: Make) -> int:
    """``count`` requests (at least) over ``connections`` connections; how many were sent."""
    done = 0

    async def client(index: int) -> None:
        nonlocal done
        connection = await Connection.open("127.0.0.1", port)
        cycle = 0
        while done < count:
            for raw in make(connection, index * 10_000_000 + cycle):
                status, body = await connection.send(raw)
                if status >= 300:
                    raise RuntimeError(f"unexpected {status}: {body[:200]!r}")
                done += 1
            cycle += 1
        await connection.aclose()

    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(client, index)
    return done


async def wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    with trio.fail_after(120):
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the service exited ({process.returncode}) before listening")
            try:
                connection = await Connection.open("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.1)
                continue
            await connection.aclose()
            return


def count_once(python: str, workload: str, connections: int, requests: int) -> float:
    """Instructions per request of one run of ``python``'s kvrouter under callgrind."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-instructions-"))
    out = workdir / "callgrind.out"
    module, make = (
        ("kvrouter.api.slot_tracker", lifecycle(7))
        if workload == "lifecycle"
        else ("kvrouter.api.select_service", select_requests)
    )
    service = [python, "-m", module, "--port", str(port), "--data-dir", str(workdir / "data"), "--fresh"]
    service += ["--durability", "always", "--log-level", "warning"]
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    process = subprocess.Popen([*valgrind, *service], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def counting(on: bool) -> None:
        subprocess.run(
            ["callgrind_control", "-i", "on" if on else "off", str(process.pid)], check=True, capture_output=True
        )

    async def measure() -> int:
        await wait_listening(port, process)
        await (setup(port) if workload == "lifecycle" else register_workers(port))
        await drive(port, connections, 300, make)  # warm-up, not counted
        counting(True)
        done = await drive(port, connections, requests, make)
        counting(False)
        return done

    try:
        done = trio.run(measure)
    finally:
        process.terminate()
        process.wait()
    total = max(
        int(line.split()[1])
        for dump in workdir.glob("callgrind.out*")
        for line in dump.read_text(errors="replace").splitlines()
        if line.startswith(("summary:", "totals:"))
    )
    shutil.rmtree(workdir, ignore_errors=True)
    return total / done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="a kvrouter interpreter (repeat to compare builds)")
    parser.add_argument("--workload", choices=("lifecycle", "select"), default="lifecycle")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind (with callgrind_control) is not installed: apt-get install valgrind")
    pythons = args.python or [sys.executable]
    counts: dict[str, list[float]] = {python: [] for python in pythons}
    for run in range(args.runs):
        for python in pythons:
            counts[python].append(count_once(python, args.workload, args.connections, args.requests))
            print(f"run {run + 1}: {python}: {counts[python][-1]:,.0f} instructions per request", flush=True)
    first = statistics.median(counts[pythons[0]])
    print(f"{args.workload}, {args.connections} connections, {args.requests} requests, median of {args.runs}:")
    for python in pythons:
        median = statistics.median(counts[python])
        print(f"  {python}: {median:,.0f} instructions per request ({median / first:.3f} of the first)")


if __name__ == "__main__":
    main()
