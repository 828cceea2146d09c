"""What the forwarding hop costs the selection service's cluster: clients to a scope's owner, then through a replica
that does not own it.

Three ``kvrouter select-service --cluster`` replicas on JetStream R=1 (one nats-server, one etcd, free loopback
ports, each process stopped by its PID), ``--no-use-kv-events`` (the index follows the bookings: no worker has to
publish KV events). Four workers of one scope. Each of ``--clients`` keep-alive HTTP connections loops a booking's
lifecycle, awaiting each answer: ``POST /select_and_reserve`` (a prompt of 64 tokens, one of 16 prefixes) ->
``POST /reservations/{id}/prefill_complete`` -> ``DELETE /reservations/{id}``. Through a non-owner the selection is
forwarded to the owner in a shared batch; the two reservation commands name no scope, so the non-owner asks the
other members which holds it. With ``--before PATH`` the same on replicas running the kvrouter found at PATH (a
directory holding an earlier checkout as ``kvrouter``), in the same run.

    .venv/bin/python benchmarks/select_cluster_hop.py [--seconds 5] [--clients 32] [--before PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_throughput import MODEL, Leg, forward_figures, load, measure, owner_of, stack
from http_client import Connection
from slot_tracker_bench import Result

from kvrouter.simulations.process_faults.servers import binary

WORKERS, PROMPT_TOKENS, PREFIXES = 4, 64, 16


async def register(url: str) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        for worker in range(WORKERS):
            body = {"worker_id": worker, "model_name": MODEL, "endpoint": f"http://w{worker}", "block_size": 16}
            answer = await http.post(url + "/workers", json=body)
            if answer.status_code not in (200, 201):
                raise SystemExit(f"POST /workers through {url}: {answer.status_code} {answer.text}")


async def lifecycles(url: str, clients: int, seconds: float, tag: str) -> Result:
    """Each client loops select_and_reserve -> prefill_complete -> release on its own connection; ``requests``
    counts lifecycles, ``latencies`` one per request."""
    port = int(url.rsplit(":", 1)[1])
    latencies: list[float] = []
    done = 0

    async def client(index: int, stop_at: float) -> None:
        nonlocal done
        connection = await Connection.open("127.0.0.1", port)
        try:
            cycle = 0
            while trio.current_time() < stop_at:
                reservation = f"{tag}-{index}-{cycle}"
                prefix = (index + cycle) % PREFIXES
                tokens = [prefix * 1000 + n for n in range(PROMPT_TOKENS // 2)] + [cycle] * (PROMPT_TOKENS // 2)
                steps = (
                    ("POST", "/select_and_reserve", {"model_name": MODEL, "token_ids": tokens,
                                                     "reservation_id": reservation}),
                    ("POST", f"/reservations/{reservation}/prefill_complete", None),
                    ("DELETE", f"/reservations/{reservation}", None),
                )  # fmt: skip
                for method, path, body in steps:
                    started = time.perf_counter()
                    status, answer = await connection.send(connection.encode(method, path, body))
                    latencies.append(time.perf_counter() - started)
                    if status != 200:
                        raise SystemExit(f"{method} {path} through {url}: {status} {answer[:200]!r}")
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


def hop(root: Path, args: argparse.Namespace, code: str | None, label: str) -> dict[str, Leg]:
    print(f"{label}: 3 selection-service replicas, R=1, {args.clients} HTTP clients, {args.seconds:.0f} s each")
    legs: dict[str, Leg] = {}
    extra = ("--no-use-kv-events",)
    with stack(root / label.split()[0], args, replicas=3, pythonpath=code, kind="select-service", extra=extra) as up:
        owner, other = owner_of(up.services)
        trio.run(register, owner.url)
        for where, url in (("to the owner", owner.url), ("through a non-owner", other.url)):
            trio.run(lifecycles, url, args.clients, 1.0, f"warm-{where[0]}")
            third = next(s for s in up.services if s not in (owner, other))
            roles = {"owner": owner.cpu, "non-owner": other.cpu, "third": third.cpu, "nats-server": up.nats_cpu}
            drive = lambda url=url, tag=where[0]: lifecycles(url, args.clients, args.seconds, tag)  # noqa: E731
            legs[where] = measure(f"{label}: {where}", drive, roles)
        batching = trio.run(forward_figures, other.url)
    direct, through = legs["to the owner"], legs["through a non-owner"]
    print(
        f"   through a non-owner / to the owner: rate {through.result.rate / direct.result.rate:.2f}, "
        f"request p50 +{(through.result.percentile(0.5) - direct.result.percentile(0.5)) / 1e3:.2f} ms"
        f"{batching.replace('writes', 'commands')}",
        flush=True,
    )
    return legs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP lifecycles")
    parser.add_argument("--before", help="a directory holding an earlier kvrouter checkout as kvrouter/")
    parser.add_argument("--etcd", default=binary("etcd", "/usr/bin/etcd"))
    parser.add_argument("--nats-server", default=binary("nats-server", "/usr/sbin/nats-server"))
    args = parser.parse_args()
    if args.etcd is None or args.nats_server is None:
        raise SystemExit(
            "select_cluster_hop: etcd and nats-server must be installed (or named by --etcd, --nats-server)"
        )
    if args.seconds <= 0 or args.clients <= 0:
        raise SystemExit("select_cluster_hop: --seconds and --clients must be positive")
    print(f"selection-service cluster hop: cpus={os.cpu_count()} ({load()})", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvrouter-select-hop-") as directory:
        hop(Path(directory), args, None, "batched forwarding")
        if args.before:
            hop(Path(directory), args, args.before, "before (the --before code)")
    print(f"({load()})")


if __name__ == "__main__":
    main()
