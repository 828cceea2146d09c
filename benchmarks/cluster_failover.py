"""Failover time of a slot-tracker cluster: from kill -9 of a scope's owner to the first write acknowledged through a
surviving replica.

It starts its own etcd, nats-server (JetStream) and three replicas (``kvrouter slot-tracker --cluster``), all on
free loopback ports in a temporary directory, and stops each by its PID at the end. Then, ``--kills`` times: find
the scope's owner (``GET /cluster``), kill it with SIGKILL, send ``POST /add`` through a survivor every
``--probe-ms`` until one is acknowledged (201), note the time, start the killed replica again (same URL, same data
directory) and wait until it is a member again. At the end every acknowledged booking must be in ``GET /loads``.
Before the kills it also times the forwarding hop: ``--hop-writes`` adds one after another straight to the
scope's owner, then as many through a replica that forwards them to it.

    .venv/bin/python benchmarks/cluster_failover.py [--kills 10] [--ttl 2] [--probe-ms 20] [--hop-writes 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

CLUSTER = "FAILOVER_BENCH"
MODEL = "bench-model"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.02)


class Processes:
    """Everything this run started, stopped by PID (SIGTERM, then SIGKILL after 10 s)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], port: int) -> subprocess.Popen[bytes]:
        with (self.directory / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        self.started.append(process)
        wait_for_port(port, process, name)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_servers(processes: Processes, etcd: str, nats: str) -> tuple[str, str]:
    client, peer = free_port(), free_port()
    etcd_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    processes.start(
        "etcd",
        [etcd, "--name=n1", f"--data-dir={processes.directory / 'etcd'}", f"--listen-client-urls={etcd_url}",
         f"--advertise-client-urls={etcd_url}", f"--listen-peer-urls={peer_url}",
         f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=n1={peer_url}", "--log-level=error"],
        client,
    )  # fmt: skip
    nats_port = free_port()
    processes.start(
        "nats",
        [nats, "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(processes.directory / "js")],
        nats_port,
    )
    return etcd_url, f"nats://127.0.0.1:{nats_port}"


class Replica:
    def __init__(self, processes: Processes, name: str, etcd: str, nats: str, ttl: int) -> None:
        self.processes = processes
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", str(self.port),
            "--data-dir", str(processes.directory / name), "--log-level", "warning", "--cluster", CLUSTER,
            "--etcd-endpoints", etcd, "--nats-server", nats, "--advertise-url", self.url,
            "--cluster-lease-ttl", str(ttl),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = self.processes.start(self.name, self.argv, self.port)

    def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


async def members(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    view: dict[str, Any] = (await http.get(url + "/cluster")).json()
    return view


async def wait_until(condition: Any, seconds: float = 30.0) -> None:
    with trio.fail_after(seconds):
        while True:
            if await condition():
                return
            await trio.sleep(0.05)


class Bookings:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.acknowledged = 0
        self.sent = 0

    async def add(self, url: str) -> bool:
        self.sent += 1
        body = {"model_name": MODEL, "request_id": f"r{self.sent}", "worker_id": 1, "dp_rank": 0,
                "sequence_hashes": [1, 2], "new_isl_tokens": 1}  # fmt: skip
        try:
            response = await self.http.post(url + "/add", json=body)
        except httpx.TransportError:
            return False
        if response.status_code == 201:
            self.acknowledged += 1
            return True
        return False


async def settled_owner(http: httpx.AsyncClient, replicas: list[Replica]) -> str:
    """The scope's owner once one of the replicas holds it (not while it is handed over to a rejoined replica)."""
    urls = {replica.url for replica in replicas}
    while True:
        view = await members(http, replicas[0].url)
        owner = next((row["owner"] for row in view["scopes"] if row["model_name"] == MODEL), None)
        if owner in urls:
            return str(owner)
        await trio.sleep(0.05)


async def settled_loads(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """``GET /loads`` once it answers 200 (503 while the last replica to rejoin takes its scope back)."""
    with trio.fail_after(30):
        while True:
            answer = await http.get(url + "/loads", params={"model_name": MODEL})
            if answer.status_code == 200:
                rows: list[dict[str, Any]] = answer.json()
                return rows
            await trio.sleep(0.1)


async def one_kill(http: httpx.AsyncClient, replicas: list[Replica], bookings: Bookings, probe: float) -> float:
    """Kill the scope's owner; seconds until a survivor acknowledges a write; then the killed one rejoins."""
    owner = await settled_owner(http, replicas)
    victim = next(replica for replica in replicas if replica.url == owner)
    survivor = next(replica for replica in replicas if replica is not victim)
    victim.kill9()
    killed = trio.current_time()
    while True:
        if await bookings.add(survivor.url):
            break
        await trio.sleep(probe)
    elapsed = trio.current_time() - killed
    await trio.to_thread.run_sync(victim.start)

    async def rejoined() -> bool:
        return victim.url in (await members(http, survivor.url))["members"]

    await wait_until(rejoined)
    return elapsed


async def hop_cost(http: httpx.AsyncClient, replicas: list[Replica], bookings: Bookings, writes: int) -> None:
    """Sequential adds straight to the owner, then through a non-owner (one forwarding hop): latency p50/p99."""
    view = await members(http, replicas[0].url)
    owner = next(row["owner"] for row in view["scopes"] if row["model_name"] == MODEL)
    other = next(replica.url for replica in replicas if replica.url != owner)
    for name, url in (("to the owner", owner), ("through a non-owner", other)):
        latencies = []
        for _ in range(writes):
            started = time.perf_counter()
            if not await bookings.add(url):
                raise SystemExit(f"a write {name} was not acknowledged")
            latencies.append(time.perf_counter() - started)
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        print(f"add {name}: p50 {statistics.median(latencies) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms ({writes} writes)")


async def run(args: argparse.Namespace, processes: Processes) -> None:
    etcd, nats = start_servers(processes, args.etcd, args.nats_server)
    replicas = [Replica(processes, name, etcd, nats, args.ttl) for name in ("a", "b", "c")]
    for replica in replicas:
        replica.start()
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:

        async def all_members() -> bool:
            return len((await members(http, replicas[0].url))["members"]) == len(replicas)

        await wait_until(all_members)
        register = {"model_name": MODEL, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await http.post(replicas[0].url + "/register", json=register)).status_code == 201
        bookings = Bookings(http)
        if args.hop_writes:
            await hop_cost(http, replicas, bookings, args.hop_writes)
        times = []
        for kill in range(args.kills):
            for _ in range(20):
                await bookings.add(replicas[kill % len(replicas)].url)
            times.append(await one_kill(http, replicas, bookings, args.probe_ms / 1000))
            print(f"kill {kill + 1}: first acknowledged write {times[-1]:.2f} s after kill -9", flush=True)
        loads = await settled_loads(http, replicas[0].url)
    booked = sum(row["active_prefill_tokens"] for row in loads)
    print(
        f"kills {len(times)}: p50 {statistics.median(times):.2f} s, max {max(times):.2f} s, "
        f"min {min(times):.2f} s (lease TTL {args.ttl} s); acknowledged bookings {bookings.acknowledged}, "
        f"in /loads {booked}"
    )
    if booked != bookings.acknowledged:
        raise SystemExit(f"lost acknowledged bookings: {bookings.acknowledged} acknowledged, {booked} in /loads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--ttl", type=int, default=2, help="the replicas' lease TTL (seconds)")
    parser.add_argument("--probe-ms", type=float, default=20.0, help="pause between writes while waiting")
    parser.add_argument("--hop-writes", type=int, default=300, help="writes per leg of the hop's timing (0: skip)")
    parser.add_argument("--etcd", default=shutil.which("etcd") or "/usr/bin/etcd")
    parser.add_argument("--nats-server", default=shutil.which("nats-server") or "/usr/sbin/nats-server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrouter-failover-") as directory:
        processes = Processes(Path(directory))
        try:
            trio.run(run, args, processes)
        finally:
            processes.stop_all()


if __name__ == "__main__":
    main()
