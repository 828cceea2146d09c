"""Throughput of a slot-tracker cluster replica, and what the forwarding hop costs.

Every part starts its own servers on free loopback ports (etcd, nats-servers with JetStream, ``kvrouter
slot-tracker`` processes) in a temporary directory and stops each by its PID. The workload is the lifecycle: each
of ``--clients`` keep-alive HTTP connections loops ``POST /add`` -> ``/prefill_complete`` -> ``/free`` on one
scope, awaiting each answer, for ``--seconds``. CPU is each process's user + system time from ``/proc``.

1. **One replica, three journals** (same run): a single slot tracker on the file journal under
   ``--durability always``; one ``--cluster`` replica on JetStream R=1 (one nats-server); one ``--cluster`` replica
   on JetStream R=3 (three nats-servers routed as one cluster, ``--jetstream-replicas 3``). Lifecycles/s, latency
   per request, service CPU per lifecycle, and the rates as ratios of the file journal's.
2. **The forwarding hop** (three replicas, R=1): the same clients straight to the scope's owner, then through a
   replica that forwards every write to it; with ``--before PATH`` also on replicas running the kvrouter found at
   PATH (a directory holding an earlier checkout as ``kvrouter``, e.g. one without batched forwarding).
3. **The command stream** (``/ws/commands``, the client library): ``--callers`` lifecycles at once on one stream,
   to the owner, then through a non-owner.
4. **A projection to N machines** from the CPU per lifecycle measured in 2 (see ``project``).

    .venv/bin/python benchmarks/cluster_throughput.py [--seconds 5] [--clients 32] [--callers 256]
        [--machines 3,5,10] [--before PATH] [--parts journals,hop,stream]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_client import Connection
from slot_tracker_bench import Result, cpu_seconds

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.placement import preferred_owner
from kvrouter.client import StreamClient
from kvrouter.simulations.process_faults.servers import binary, etcd_server, free_port, nats_cluster, stop

WORKERS, RANKS, BLOCKS = 4, 2, 16
MODEL = "bench"


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


class Service:
    """One ``kvrouter slot-tracker`` (or ``kind``) process on a free port (``--advertise-url`` its own URL when
    clustered)."""

    def __init__(
        self, directory: Path, name: str, tail: list[str], pythonpath: str | None = None, kind: str = "slot-tracker"
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvrouter.api.cli.main", kind, "--port", str(self.port)]
        argv += ["--data-dir", str(directory / name), "--log-level", "warning", "--durability", "always", *tail]
        if "--cluster" in tail:
            argv += ["--advertise-url", self.url]
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        with (directory / f"{name}.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)

    def cpu(self) -> float:
        return cpu_seconds(self.process.pid)

    async def wait_healthy(self) -> None:
        async with httpx.AsyncClient(trust_env=False) as http:
            with trio.fail_after(60):
                while True:
                    if self.process.poll() is not None:
                        raise SystemExit(f"a service exited at start (exit {self.process.returncode})")
                    with contextlib.suppress(httpx.TransportError):
                        if (await http.get(self.url + "/health", timeout=1)).status_code == 200:
                            return
                    await trio.sleep(0.1)


@dataclass
class Stack:
    """The slot trackers of one configuration and the nats-servers under them (CPU read by PID)."""

    services: list[Service]
    nats: list[subprocess.Popen[bytes]]

    def nats_cpu(self) -> float:
        return sum(cpu_seconds(process.pid) for process in self.nats)


async def _wait_members(url: str, count: int) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        with trio.fail_after(30):
            while True:
                if len((await http.get(url + "/cluster")).json()["members"]) >= count:
                    return
                await trio.sleep(0.05)


@contextlib.contextmanager
def stack(
    directory: Path,
    args: argparse.Namespace,
    *,
    replicas: int,
    nats_nodes: int = 1,
    pythonpath: str | None = None,
    kind: str = "slot-tracker",
    extra: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """``replicas`` cluster replicas of ``kind`` (with ``extra`` flags) on one etcd and ``nats_nodes``
    nats-servers (the stream's R); 0 replicas: one service on the file journal, no servers. Everything stopped by
    PID on the way out."""
    directory.mkdir(parents=True)
    started: list[Service] = []
    try:
        if replicas == 0:
            started.append(Service(directory, "single", [*extra], kind=kind))
            trio.run(started[0].wait_healthy)
            yield Stack(started, [])
            return
        with (
            etcd_server(args.etcd, directory / "etcd") as etcd,
            nats_cluster(args.nats_server, directory / "nats", nats_nodes) as nodes,
        ):
            tail = ["--cluster", directory.name.upper().replace("-", "_"), "--etcd-endpoints", etcd.url]
            tail += ["--nats-server", ",".join(node.url for node in nodes), "--jetstream-replicas", str(nats_nodes)]
            tail += extra
            started.extend(Service(directory, f"replica-{i}", tail, pythonpath, kind) for i in range(replicas))
            for service in started:
                trio.run(service.wait_healthy)
            trio.run(_wait_members, started[0].url, replicas)
            yield Stack(started, [node.process for node in nodes if node.process is not None])
    finally:
        for service in started:
            stop(service.process)


def owner_of(services: list[Service], model: str = MODEL) -> tuple[Service, Service]:
    """The replica placement gives ``model``'s scope, and another one."""
    owner_url = preferred_owner(scope_token(ScopeKey(model, "default")), sorted(s.url for s in services))
    owner = next(s for s in services if s.url == owner_url)
    return owner, next(s for s in services if s is not owner)


# -- the HTTP lifecycle ---------------------------------------------------------------------------------


async def register(url: str) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        for worker in range(WORKERS):
            body = {"model_name": MODEL, "worker_id": worker, "block_size": 16, "dp_start": 0, "dp_size": RANKS}
            answer = await http.post(url + "/register", json=body)
            if answer.status_code not in (200, 201):
                raise SystemExit(f"register through {url}: {answer.status_code} {answer.text}")


async def lifecycles(url: str, clients: int, seconds: float, tag: str) -> Result:
    """Each client loops add -> prefill_complete -> free on its own connection; ``requests`` counts lifecycles,
    ``latencies`` one per request."""
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    done = 0

    async def client(index: int, stop_at: float) -> None:
        nonlocal done
        connection = await Connection.open("127.0.0.1", port)
        try:
            cycle = 0
            while trio.current_time() < stop_at:
                request_id = f"{tag}-{index}-{cycle}"
                add = {"model_name": MODEL, "request_id": request_id, "worker_id": cycle % WORKERS,
                       "dp_rank": index % RANKS, "sequence_hashes": list(range(cycle, cycle + BLOCKS)),
                       "new_isl_tokens": 256}  # fmt: skip
                ref = {"model_name": MODEL, "request_id": request_id}
                for path, body, wanted in (("/add", add, 201), ("/prefill_complete", ref, 200), ("/free", ref, 200)):
                    started = time.perf_counter()
                    status, answer = await connection.send(connection.encode("POST", path, body))
                    latencies.append(time.perf_counter() - started)
                    if status != wanted:
                        raise SystemExit(f"{path} through {url}: {status} {answer[:200]!r}")
                done += 1
                cycle += 1
        finally:
            await connection.aclose()

    started = time.perf_counter()
    stop_at = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(client, index, stop_at)
    return Result(done, time.perf_counter() - started, latencies)


async def streamed(url: str, callers: int, seconds: float, tag: str) -> Result:
    """``callers`` lifecycles at once on one command stream (the client library)."""
    latencies: list[float] = []
    done = 0

    async def caller(client: StreamClient, index: int, stop_at: float) -> None:
        nonlocal done
        cycle = 0
        while trio.current_time() < stop_at:
            request_id = f"{tag}-{index}-{cycle}"
            hashes = list(range(cycle, cycle + BLOCKS))
            started = time.perf_counter()
            await client.add(request_id, cycle % WORKERS, hashes, dp_rank=index % RANKS, new_isl_tokens=256,
                             model_name=MODEL)  # fmt: skip
            added = time.perf_counter()
            await client.prefill_complete(request_id, model_name=MODEL)
            completed = time.perf_counter()
            await client.free(request_id, model_name=MODEL)
            latencies.extend((added - started, completed - added, time.perf_counter() - completed))
            done += 1
            cycle += 1

    started = time.perf_counter()
    stop_at = trio.current_time() + seconds
    async with StreamClient.connect(url) as client, trio.open_nursery() as nursery:
        for index in range(callers):
            nursery.start_soon(caller, client, index, stop_at)
    return Result(done, time.perf_counter() - started, latencies)


@dataclass
class Leg:
    name: str
    result: Result
    cpu: dict[str, float]  # CPU seconds per lifecycle, by process role

    def line(self) -> str:
        r = self.result
        cpus = ", ".join(f"{role} {1e6 * seconds:.0f} us" for role, seconds in self.cpu.items())
        return (
            f"{self.name:<44} {r.rate:7.0f} lifecycles/s  request p50 {r.percentile(0.5) / 1e3:5.2f} ms, "
            f"p99 {r.percentile(0.99) / 1e3:6.2f} ms  CPU per lifecycle: {cpus}  ({load()})"
        )


def measure(name: str, drive: Callable[[], Awaitable[Result]], roles: dict[str, Callable[[], float]]) -> Leg:
    before = {role: read() for role, read in roles.items()}
    result = trio.run(drive)
    spent = {role: (read() - before[role]) / max(result.requests, 1) for role, read in roles.items()}
    leg = Leg(name, result, spent)
    print(leg.line(), flush=True)
    return leg


# -- the parts ---------------------------------------------------------------------------------------------


def journals(root: Path, args: argparse.Namespace) -> None:
    print(f"1. one replica, {args.clients} HTTP clients, lifecycles on one scope, {args.seconds:.0f} s each")
    legs = []
    for name, replicas, nodes in (
        ("file journal, --durability always", 0, 1),
        ("--cluster, JetStream R=1 (1 nats-server)", 1, 1),
        ("--cluster, JetStream R=3 (3 nats-servers)", 1, 3),
    ):
        with stack(root / f"one-{len(legs)}", args, replicas=replicas, nats_nodes=nodes) as running:
            [service] = running.services
            trio.run(register, service.url)
            trio.run(lifecycles, service.url, args.clients, 1.0, "warm")
            roles = {"service": service.cpu}
            if running.nats:
                roles["nats-servers"] = running.nats_cpu
            drive = lambda url=service.url: lifecycles(url, args.clients, args.seconds, "run")  # noqa: E731
            legs.append(measure(name, drive, roles))
    base = legs[0].result.rate
    print("   ratios to the file journal: " + ", ".join(f"{leg.result.rate / base:.2f}" for leg in legs[1:]))


def hop(root: Path, args: argparse.Namespace, code: str | None, label: str) -> dict[str, Leg]:
    """Clients to the owner, then through a non-owner: the CPU of each replica per lifecycle."""
    print(f"2. the forwarding hop ({label}): 3 replicas, R=1, {args.clients} HTTP clients")
    legs: dict[str, Leg] = {}
    with stack(root / f"hop-{label.split()[0]}", args, replicas=3, pythonpath=code) as running:
        owner, other = owner_of(running.services)
        trio.run(register, owner.url)
        for where, url in (("to the owner", owner.url), ("through a non-owner", other.url)):
            trio.run(lifecycles, url, args.clients, 1.0, f"warm-{where[0]}")
            roles = {"owner": owner.cpu, "non-owner": other.cpu, "nats-server": running.nats_cpu}
            drive = lambda url=url, tag=where[0]: lifecycles(url, args.clients, args.seconds, tag)  # noqa: E731
            legs[where] = measure(f"{label}: {where}", drive, roles)
        batching = trio.run(forward_figures, other.url)
    direct, hop_leg = legs["to the owner"], legs["through a non-owner"]
    print(
        f"   through a non-owner / to the owner: rate {hop_leg.result.rate / direct.result.rate:.2f}, "
        f"request p50 +{(hop_leg.result.percentile(0.5) - direct.result.percentile(0.5)) / 1e3:.2f} ms{batching}"
    )
    return legs


async def forward_figures(url: str) -> str:
    """The non-owner's forwarded writes per batch request (its /metrics), if it batches."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(url + "/metrics")).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    batches = float(samples.get("kvrouter_cluster_forward_batches_total", 0))
    if not batches:
        return ""
    writes = float(samples["kvrouter_cluster_forward_batched_writes_total"])
    return f"; {writes / batches:.1f} writes per forwarded batch ({writes:.0f} in {batches:.0f})"


def stream(root: Path, args: argparse.Namespace) -> None:
    print(f"3. the command stream: 3 replicas, R=1, {args.callers} lifecycles at once on one stream")
    with stack(root / "stream", args, replicas=3) as running:
        owner, other = owner_of(running.services)
        trio.run(register, owner.url)
        rates = {}
        for where, url in (("to the owner", owner.url), ("through a non-owner", other.url)):
            trio.run(streamed, url, args.callers, 1.0, f"warm-{where[0]}")
            roles = {"owner": owner.cpu, "non-owner": other.cpu, "nats-server": running.nats_cpu}
            drive = lambda url=url, tag=where[0]: streamed(url, args.callers, args.seconds, tag)  # noqa: E731
            rates[where] = measure(f"stream: {where}", drive, roles).result.rate
    print(f"   through a non-owner / to the owner: {rates['through a non-owner'] / rates['to the owner']:.2f}")


def project(legs: dict[str, Leg], machines: list[int]) -> None:
    """Lifecycles/s of N machines, each running one replica that can use one core (a replica is one Python
    process; its journal's NATS threads are counted in its CPU), the scopes spread evenly over them, clients
    sending each request to a random replica (so (N-1)/N of them take the hop), nats-servers and etcd on other
    machines. Per lifecycle the cluster spends ``direct`` on an owner a client reached itself, or ``forwarded``
    on the non-owner plus ``at owner`` on the owner; its capacity is N cores over the average."""
    direct = legs["to the owner"].cpu["owner"]
    forwarded = legs["through a non-owner"].cpu["non-owner"]
    at_owner = legs["through a non-owner"].cpu["owner"]
    print(
        f"4. projection from CPU per lifecycle: to the owner {1e6 * direct:.0f} us; through a non-owner "
        f"{1e6 * forwarded:.0f} us there + {1e6 * at_owner:.0f} us on the owner"
    )
    for count in machines:
        average = direct / count + (count - 1) / count * (forwarded + at_owner)
        owner_aware = count / direct
        print(
            f"   {count:>2} machines: {count / average:8.0f} lifecycles/s with clients sending anywhere, "
            f"{owner_aware:8.0f} with clients sending to each scope's owner"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP lifecycles")
    parser.add_argument("--callers", type=int, default=256, help="concurrent lifecycles on the command stream")
    parser.add_argument("--machines", default="3,5,10")
    parser.add_argument("--before", help="a directory holding an earlier kvrouter checkout as kvrouter/")
    parser.add_argument("--parts", default="journals,hop,stream")
    parser.add_argument("--etcd", default=binary("etcd", "/usr/bin/etcd"))
    parser.add_argument("--nats-server", default=binary("nats-server", "/usr/sbin/nats-server"))
    args = parser.parse_args()
    if args.etcd is None or args.nats_server is None:
        raise SystemExit(
            "cluster_throughput: etcd and nats-server must be installed (or named by --etcd, --nats-server)"
        )
    parts = set(args.parts.split(","))
    print(f"cluster throughput: cpus={os.cpu_count()} ({load()})", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvrouter-cluster-bench-") as directory:
        root = Path(directory)
        if "journals" in parts:
            journals(root, args)
        if "hop" in parts:
            legs = hop(root, args, None, "batched forwarding")
            if args.before:
                hop(root, args, args.before, "before (the --before code)")
            project(legs, [int(n) for n in args.machines.split(",")])
        if "stream" in parts:
            stream(root, args)
    print(f"({load()})")


if __name__ == "__main__":
    main()
