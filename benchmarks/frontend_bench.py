"""Frontend overhead: a streamed completion through ``kvrouter frontend`` vs sent to the mock worker directly, and
the demo's kv vs round-robin figures.

    python benchmarks/frontend_bench.py [--seconds 5] [--clients 1,32] [--max-tokens 8] [--no-demo]

One mock worker (``--speedup 1000``: its engine takes microseconds, so what is measured is HTTP and routing) and
one frontend in front of it (``--workers URL=KV``, KV events on, journal in memory) run as subprocesses; the
clients are trio tasks in this process, each looping: send a streamed ``/v1/completions`` (a 64-token prompt,
``--max-tokens`` tokens, usage included), read it to ``[DONE]``, again. Latency is per request, from sending to
``[DONE]``; "added" is proxied minus direct at the same percentile. Then ``kvrouter demo``'s replay (4 workers,
400 requests, both modes at once) runs in this process and its table is printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port

from kvrouter.api.cli.demo import SPEEDUP, report, run_demo

PROMPT = list(range(1000, 1064))


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def start(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            if process.poll() is not None:
                raise SystemExit(f"{argv[2:4]} exited with {process.returncode}") from None
            time.sleep(0.05)
    raise SystemExit(f"{argv[2:4]} did not listen on port {port}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def percentile(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


async def drive(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[int, list[float], float]:
    """(requests completed, their latencies in seconds, elapsed seconds)."""
    body = orjson.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    )
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits, trust_env=False, headers=headers) as http:
        for _ in range(3):  # warm the connections and the caches
            await (await http.post("/v1/completions", content=body)).aread()
        end = trio.current_time() + seconds
        began = time.perf_counter()

        async def client() -> None:
            while trio.current_time() < end:
                sent = time.perf_counter()
                async with http.stream("POST", "/v1/completions", content=body) as response:
                    if response.status_code != 200:
                        raise SystemExit(f"{url}: {response.status_code} {(await response.aread())[:200]!r}")
                    async for _ in response.aiter_raw():
                        pass
                latencies.append(time.perf_counter() - sent)

        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(client)
        return len(latencies), latencies, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-demo", action="store_true")
    args = parser.parse_args()
    kvrouter = [sys.executable, "-m", "kvrouter.api.cli.main"]
    worker_port, kv_port, frontend_port = free_port(), free_port(), free_port()
    print(f"before: {load()} ({os.cpu_count()} cores)")
    worker_flags = ["--port", str(worker_port), "--kv-events-port", str(kv_port), "--speedup", "1000"]
    worker = start([*kvrouter, "mock-worker", *worker_flags, "--worker-id", "1", "--log-level", "warning"], worker_port)
    frontend = None
    try:
        workers = f"http://127.0.0.1:{worker_port}=tcp://127.0.0.1:{kv_port}"
        frontend = start(
            [*kvrouter, "frontend", "--port", str(frontend_port), "--workers", workers, "--log-level", "warning"],
            frontend_port,
        )
        time.sleep(0.5)  # the frontend's KV listener subscribes
        print(f"streamed /v1/completions, 64-token prompt, {args.max_tokens} tokens, {args.seconds:g} s per row")
        print(
            f"{'clients':>7} {'path':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}"
        )
        for clients in (int(c) for c in args.clients.split(",")):
            rows = {}
            for name, port in (("direct", worker_port), ("frontend", frontend_port)):
                done, latencies, elapsed = trio.run(
                    drive, f"http://127.0.0.1:{port}", clients, args.seconds, args.max_tokens
                )
                rows[name] = (done / elapsed, percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000)
            for name, (rate, p50, p99) in rows.items():
                added = ""
                if name == "frontend":
                    added = f"{p50 - rows['direct'][1]:>+9.2f} {p99 - rows['direct'][2]:>+10.2f}"
                print(f"{clients:>7} {name:>8} {rate:>8.0f} {p50:>8.2f} {p99:>8.2f} {added}")
        print(f"after the overhead runs: {load()}")
    finally:
        for process in (frontend, worker):
            if process is not None:
                stop(process)
    if not args.no_demo:
        started = time.perf_counter()
        results = trio.run(run_demo, 4, 400, SPEEDUP, 1)
        print(report(results, 4, 400), end="")
        print(f"demo replay: {time.perf_counter() - started:.1f} s; {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
