"""One cluster replica serving many scopes at once: its rate, its latency, and what it holds (threads, memory).

For each scope count, a fresh stack on free loopback ports (one etcd, one nats-server with JetStream and its
monitoring port, one ``kvrouter slot-tracker --cluster`` replica on R=1), stopped by PID after. Each scope (a model
of its own) gets a worker; then ``max(scopes, --clients)`` keep-alive HTTP clients, spread evenly over the scopes,
loop ``POST /add`` -> ``/prefill_complete`` -> ``/free`` for ``--seconds``, so every scope appends at once.

Printed per scope count: lifecycles/s, p50/p99 per request, the replica's CPU per lifecycle, its threads
(``/proc/PID/status`` ``Threads``, the most seen while it ran) and RSS at the end, the NATS connections it holds
(nats-server's ``/connz``), the journal messages published during the run (the stream's last sequence, from
nats-server's ``/jsz``) and the chain check's requests among them (the replica's
``kvrouter_cluster_chain_check_requests_total``; "n/a" on code without it): a group commit that finds another
scope's message between its fence and its own asks the stream once more (``journal/jetstream_link``).

    .venv/bin/python benchmarks/cluster_scopes.py [--scopes 1,16,64,200] [--seconds 5] [--clients 32]
        [--code PATH]

``--code PATH`` runs the replica on the kvrouter found at PATH (a directory holding a checkout as ``kvrouter``),
to compare two versions back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_throughput import Service, load
from http_client import Connection
from slot_tracker_bench import Result, cpu_seconds

from kvrouter.simulations.process_faults.servers import NatsNode, binary, etcd_server, nats_cluster, stop

WORKER = 1


def status_field(pid: int, field: str) -> int:
    """A number of ``/proc/PID/status`` (``Threads``, ``VmRSS`` in kB)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def monitor(node: NatsNode, path: str) -> Any:
    with urllib.request.urlopen(f"http://{node.place.address}:{node.monitor_port}{path}", timeout=5) as answer:
        return json.load(answer)


def last_sequence(node: NatsNode, stream: str) -> int:
    """The cluster stream's last sequence: the journal messages published so far."""
    jsz = monitor(node, "/jsz?accounts=true&streams=true")
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail["name"] == stream:
                return int(detail["state"]["last_seq"])
    return 0


def chain_requests(url: str) -> int | None:
    """The replica's chain-check requests so far (its /metrics), None if it does not count them."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("kvrouter_cluster_chain_check_requests_total "):
                return int(float(line.split()[1]))
    return None


def kvrouter_connections(node: NatsNode) -> int:
    connz = monitor(node, "/connz?limit=4096")
    return sum(1 for c in connz.get("connections") or [] if str(c.get("name", "")).startswith("kvrouter-"))


@contextlib.contextmanager
def replica_stack(root: Path, args: argparse.Namespace, name: str) -> Iterator[tuple[Service, NatsNode, str]]:
    directory = root / name
    directory.mkdir(parents=True)
    stream = name.upper().replace("-", "_")
    with (
        etcd_server(args.etcd, directory / "etcd") as etcd,
        nats_cluster(args.nats_server, directory / "nats", 1) as nodes,
    ):
        [node] = nodes
        tail = ["--cluster", stream, "--etcd-endpoints", etcd.url, "--nats-server", node.url]
        tail += ["--cluster-lease-ttl", str(args.lease_ttl)]
        service = Service(directory, "replica", tail, args.code)
        try:
            trio.run(service.wait_healthy)
            yield service, node, stream
        finally:
            stop(service.process)


async def register(url: str, scopes: int) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        for n in range(scopes):
            body = {"model_name": f"m{n}", "worker_id": WORKER, "block_size": 16, "dp_start": 0, "dp_size": 1}
            answer = await http.post(url + "/register", json=body)
            if answer.status_code not in (200, 201):
                raise SystemExit(f"register m{n}: {answer.status_code} {answer.text}")


async def lifecycles(url: str, scopes: int, clients: int, seconds: float, tag: str, pid: int) -> tuple[Result, int]:
    """Each client loops add -> prefill_complete -> free on scope ``index % scopes``; also the most threads seen."""
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    done = 0
    most_threads = 0

    async def client(index: int, stop_at: float) -> None:
        nonlocal done
        model = f"m{index % scopes}"
        connection = await Connection.open("127.0.0.1", port)
        try:
            cycle = 0
            while trio.current_time() < stop_at:
                request_id = f"{tag}-{index}-{cycle}"
                add = {"model_name": model, "request_id": request_id, "worker_id": WORKER, "dp_rank": 0,
                       "sequence_hashes": list(range(cycle, cycle + 16)), "new_isl_tokens": 256}  # fmt: skip
                ref = {"model_name": model, "request_id": request_id}
                for path, body, wanted in (("/add", add, 201), ("/prefill_complete", ref, 200), ("/free", ref, 200)):
                    started = time.perf_counter()
                    status, answer = await connection.send(connection.encode("POST", path, body))
                    latencies.append(time.perf_counter() - started)
                    if status != wanted:
                        raise SystemExit(f"{path} on {model}: {status} {answer[:200]!r}")
                done += 1
                cycle += 1
        finally:
            await connection.aclose()

    async def watch_threads(stop_at: float) -> None:
        nonlocal most_threads
        while trio.current_time() < stop_at:
            most_threads = max(most_threads, status_field(pid, "Threads"))
            await trio.sleep(0.25)

    started = time.perf_counter()
    stop_at = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_threads, stop_at)
        for index in range(clients):
            nursery.start_soon(client, index, stop_at)
    return Result(done, time.perf_counter() - started, latencies), most_threads


def run(root: Path, args: argparse.Namespace, scopes: int) -> None:
    clients = max(scopes, args.clients)
    with replica_stack(root, args, f"scopes-{scopes}") as (service, node, stream):
        pid = service.process.pid
        trio.run(register, service.url, scopes)
        trio.run(lifecycles, service.url, scopes, clients, 1.0, "warm", pid)
        seq_before, chain_before = last_sequence(node, stream), chain_requests(service.url)
        cpu_before = cpu_seconds(pid)
        result, most_threads = trio.run(lifecycles, service.url, scopes, clients, args.seconds, "run", pid)
        cpu = (cpu_seconds(pid) - cpu_before) / max(result.requests, 1)
        messages = last_sequence(node, stream) - seq_before
        chain_after = chain_requests(service.url)
        checked = "n/a" if chain_before is None or chain_after is None else str(chain_after - chain_before)
        threads, rss = status_field(pid, "Threads"), status_field(pid, "VmRSS")
        print(
            f"{scopes:>4} scopes, {clients:>3} clients: {result.rate:6.0f} lifecycles/s  request p50 "
            f"{result.percentile(0.5) / 1e3:6.2f} ms, p99 {result.percentile(0.99) / 1e3:7.2f} ms  "
            f"CPU {1e6 * cpu:5.0f} us/lifecycle  threads {threads} (most {most_threads})  RSS {rss / 1024:.0f} MiB  "
            f"NATS connections {kvrouter_connections(node)}  {messages} journal messages "
            f"({result.requests * 3 / max(messages, 1):.1f} writes each), chain-check requests {checked}  ({load()})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scopes", default="1,16,64,200")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP lifecycles (at least one per scope)")
    parser.add_argument(
        "--lease-ttl",
        type=int,
        default=10,
        help="the replica's --cluster-lease-ttl: long, so that a starved "
        "replica on a busy machine keeps its lease (its writes are refused with 503 once it lapses)",
    )
    parser.add_argument("--code", help="a directory holding the kvrouter checkout to run as kvrouter/")
    parser.add_argument("--etcd", default=binary("etcd", "/usr/bin/etcd"))
    parser.add_argument("--nats-server", default=binary("nats-server", "/usr/sbin/nats-server"))
    args = parser.parse_args()
    if args.etcd is None or args.nats_server is None:
        raise SystemExit("cluster_scopes: etcd and nats-server must be installed (or named by --etcd, --nats-server)")
    code = args.code or os.environ.get("PYTHONPATH") or "the installed kvrouter"
    print(f"cluster scopes: one replica, R=1, {args.seconds:g} s per count, code {code}, cpus={os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="kvrouter-cluster-scopes-") as directory:
        for scopes in (int(n) for n in args.scopes.split(",")):
            run(Path(directory), args, scopes)


if __name__ == "__main__":
    main()
