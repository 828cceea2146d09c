"""Snapshot pause benchmark: how long requests wait while the selection service takes a snapshot of a
1M-block index, with the forked copy-on-write child (``fork``, today's default) and with the copy on the
event loop plus encoding in a thread (``thread``, the old mechanism and today's fallback).

    python benchmarks/snapshot_pause_bench.py [--blocks 1000000] [--rounds 3] [--interval-ms 5]

The service runs as a subprocess (this script re-run with ``--serve``): the real selection service
(``api.main.run_service``), plus two probes that cost the same under both methods: a trio Instrument that
records the longest single task step (the longest the event loop ran one task without yielding, i.e.
the longest stall anything else could see), and a heartbeat task that sleeps 1 ms and records how late
it wakes. Automatic snapshots are off; this script asks for each one on the service's stdin, and gets
one JSON line back on its stdout.

Workload: ``select_service_bench``'s: 16 workers with real ZMQ publishers, chains of 64 blocks, then
light traffic: one client sending ``POST /select`` (a 64-block prompt) every ``--interval-ms``, one
at a time, during a quiet window (the baseline) and during each snapshot (until it is installed, then
0.5 s more). Per method and round it prints the loop pause the snapshot itself measured (the fork
call, or the copy), the longest task step, the heartbeat's worst lateness, the longest and p99
request latency, the snapshot's total time and size, and memory: the child's private pages (copied
on write, or allocated) and the growth of the service's RSS while the snapshot ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port
from http_client import Connection
from select_service_bench import (
    CHAIN_BLOCKS,
    HOST,
    MODEL,
    Publishers,
    Service,
    Workload,
    ingest,
    ingest_timeout,
    prepare,
    print_ingest,
)

REPO = Path(__file__).resolve().parent.parent
GOAL_MS = 50.0  # the issue's bound on the longest request pause
SETTLE_SECONDS = 0.5  # traffic keeps running this long after the snapshot is installed
HEARTBEAT_SECONDS = 0.001


# ---------------------------------------------------------------------------- the service side


def serve(port: int, data: Path) -> None:
    """The service subprocess: the selection service plus the probes; commands on stdin."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(_serve, port, data)


class LoopProbe:
    """A trio Instrument: the longest task step since ``reset`` (and which task ran it)."""

    def __init__(self) -> None:
        self.reset()
        self._step_started = 0.0

    def reset(self) -> None:
        self.longest_step = 0.0
        self.longest_task = ""
        self.heartbeat_late = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.perf_counter() - self._step_started
        if took > self.longest_step:
            self.longest_step = took
            self.longest_task = task.name

    async def heartbeat(self) -> None:
        while True:
            started = time.perf_counter()
            await trio.sleep(HEARTBEAT_SECONDS)
            self.heartbeat_late = max(self.heartbeat_late, time.perf_counter() - started - HEARTBEAT_SECONDS)

    def stats(self) -> dict[str, Any]:
        return {
            "longest_step_ms": self.longest_step * 1e3,
            "longest_task": self.longest_task.rsplit(".", 1)[-1],
            "heartbeat_late_ms": self.heartbeat_late * 1e3,
        }


def own_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _serve(port: int, data: Path) -> None:
    from kvrouter.actors.core.router_config import RouterConfig
    from kvrouter.actors.snapshotter import SnapshotMethod, Snapshotter
    from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
    from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
    from kvrouter.journal.store import Durability

    probe = LoopProbe()
    options = ServiceOptions(
        port=port, data_dir=data, durability=Durability.ALWAYS, fresh=True, body_limit=SELECTION_BODY_LIMIT
    )
    async with trio.open_nursery() as nursery:
        handle: ServiceHandle = await nursery.start(
            run_service, "selection service", options, select_service_builder(RouterConfig())
        )
        system = handle.system
        system.snapshot_every_records = system.snapshot_every_bytes = 1 << 62  # only when asked
        trio.lowlevel.add_instrument(probe)
        nursery.start_soon(probe.heartbeat)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffer = b""
        while True:
            while b"\n" not in buffer:
                chunk = await stdin.receive_some(4096)
                if not chunk:
                    handle.stop()
                    return
                buffer += chunk
            line, buffer = buffer.split(b"\n", 1)
            command = line.decode().split()
            if command[0] == "quit":
                handle.stop()
                nursery.cancel_scope.cancel()
                return
            probe.reset()
            result: dict[str, Any] = {"rss_before": own_rss()}
            if command[0] == "window":
                await trio.sleep(float(command[1]))
            else:
                system.snapshotter = Snapshotter(system.journal, SnapshotMethod(command[1]))
                result.update(await measured_snapshot(system, result["rss_before"]))
                await trio.sleep(SETTLE_SECONDS)
            result.update(probe.stats())
            print(json.dumps(result), flush=True)


async def measured_snapshot(system: Any, rss_before: int) -> dict[str, Any]:
    """``system.snapshot()``, sampling this process's RSS every 5 ms meanwhile."""
    peak = rss_before
    async with trio.open_nursery() as nursery:

        async def sample_rss() -> None:
            nonlocal peak
            while True:
                peak = max(peak, own_rss())
                await trio.sleep(0.005)

        nursery.start_soon(sample_rss)
        report = await system.snapshot()
        nursery.cancel_scope.cancel()
    return {
        "method": report.method.value,
        "lsn": report.lsn,
        "loop_pause_ms": report.loop_pause * 1e3,
        "duration": report.duration,
        "payload_bytes": report.payload_bytes,
        "child_private_bytes": report.child_private_bytes,
        "rss_peak": peak,
    }


# ---------------------------------------------------------------------------- the driver side


class Controlled(Service):
    """The ``--serve`` subprocess, with a command pipe on stdin and JSON results on stdout."""

    def start(self, argv: list[str] | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self.started_at = time.perf_counter()
            self.process = subprocess.Popen(
                argv or self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                cwd=self.cwd,
            )

    def ask(self, command: str) -> dict[str, Any]:
        """Blocking: send one command line, read its one result line."""
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command.encode() + b"\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.check_alive()
            raise RuntimeError(f"the service answered nothing to {command!r}:\n{self.log_tail()}")
        return json.loads(line)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.close()  # EOF: the service stops
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def during(service: Controlled, command: str, requests: list[bytes], interval: float) -> tuple[dict, list[float]]:
    """Send ``command`` to the service and run the light traffic until its answer arrives."""
    latencies: list[float] = []
    result: dict[str, Any] = {}
    connection = await Connection.open(HOST, service.port)
    try:
        async with trio.open_nursery() as nursery:

            async def control() -> None:
                result.update(await trio.to_thread.run_sync(service.ask, command))
                nursery.cancel_scope.cancel()

            nursery.start_soon(control)
            n = 0
            next_at = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                status, body = await connection.send(requests[n % len(requests)])
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"unexpected {status}: {body[:300]!r}")
                n += 1
                next_at = max(next_at + interval, time.perf_counter())  # late: no burst to catch up
                await trio.sleep(max(0.0, next_at - time.perf_counter()))  # the clock moved on since
    finally:
        await connection.aclose()
    return result, latencies


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def row(label: str, result: dict[str, Any], latencies: list[float]) -> dict[str, Any]:
    rss_growth = (result["rss_peak"] - result["rss_before"]) / 2**20 if "rss_peak" in result else None
    private = result.get("child_private_bytes")
    return {
        "label": label,
        "loop_pause_ms": result.get("loop_pause_ms"),
        "longest_step_ms": result["longest_step_ms"],
        "longest_task": result["longest_task"],
        "heartbeat_late_ms": result["heartbeat_late_ms"],
        "max_request_ms": max(latencies) * 1e3,
        "p99_request_ms": p99(latencies) * 1e3,
        "requests": len(latencies),
        "duration": result.get("duration"),
        "payload_mib": result["payload_bytes"] / 2**20 if "payload_bytes" in result else None,
        "child_private_mib": private / 2**20 if private else None,
        "rss_growth_mib": rss_growth,
        "rss_mib": result["rss_before"] / 2**20,
    }


def show(value: float | None, fmt: str) -> str:
    return "-".rjust(int(fmt.split(".")[0])) if value is None else format(value, fmt)


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = (
        f"  {'':<22} {'loop held':>9} {'longest':>8} {'heartbeat':>9} {'request':>8} {'request':>8} "
        f"{'snapshot':>8} {'payload':>7} {'child':>7} {'RSS':>7}"
    )
    print(head)
    print(
        f"  {'':<22} {'(ms)':>9} {'step ms':>8} {'late ms':>9} {'max ms':>8} {'p99 ms':>8} "
        f"{'total s':>8} {'MiB':>7} {'priv MiB':>7} {'+MiB':>7}"
    )
    for r in rows:
        print(
            f"  {r['label']:<22} {show(r['loop_pause_ms'], '9.1f')} {r['longest_step_ms']:8.1f} "
            f"{r['heartbeat_late_ms']:9.1f} {r['max_request_ms']:8.1f} {r['p99_request_ms']:8.1f} "
            f"{show(r['duration'], '8.2f')} {show(r['payload_mib'], '7.1f')} "
            f"{show(r['child_private_mib'], '7.0f')} {show(r['rss_growth_mib'], '7.0f')}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval-ms", type=float, default=5.0, help="between /select requests")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "DATA_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), Path(args.serve[1]))
        return

    workload = Workload(args.blocks // CHAIN_BLOCKS)
    with tempfile.TemporaryDirectory(prefix="snapshot-pause-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port), str(workdir / "data")]
        service = Controlled("kvrouter snapshot-bench", argv, port, workdir, dict(os.environ), REPO)
        publishers = Publishers()
        try:
            service.start()
            trio.run(prepare, service, publishers)
            result = trio.run(ingest, service, publishers, workload, ingest_timeout(workload.blocks))
            print_ingest(f"{workload.blocks:,} blocks", result)
            if result.seconds is None:
                raise SystemExit("ingest did not complete; no measurement")
            encoder = Connection(None, f"{HOST}:{port}")  # type: ignore[arg-type]  # encoding only
            rng = random.Random(5)
            requests = [
                encoder.encode("POST", "/select", {"model_name": MODEL, "token_ids": workload.prompt(rng)[0]})
                for _ in range(64)
            ]
            interval = args.interval_ms / 1e3
            trio.run(during, service, "window 1", requests, interval)  # warm-up
            rows = []
            for round_ in range(1, args.rounds + 1):
                for command, label in (
                    ("window 3", "no snapshot"),
                    ("snapshot thread", "thread (old: copy)"),
                    ("snapshot fork", "fork (new: COW child)"),
                ):
                    answer, latencies = trio.run(during, service, command, requests, interval)
                    rows.append(row(f"{label} #{round_}", answer, latencies))
            print(
                f"\nlight traffic: one /select every {args.interval_ms:g} ms on one connection; service RSS "
                f"{rows[-1]['rss_mib']:.0f} MiB; {os.cpu_count()} CPUs"
            )
            print_rows(rows)
            print()
            for prefix in ("no snapshot", "thread", "fork"):
                mine = [r for r in rows if r["label"].startswith(prefix)]
                worst = max(r["max_request_ms"] for r in mine)
                stall = max(r["longest_step_ms"] for r in mine)
                median = statistics.median(r["max_request_ms"] for r in mine)
                print(
                    f"  {prefix:<12} longest request pause {worst:7.1f} ms (median of rounds {median:6.1f} ms), "
                    f"longest loop stall {stall:7.1f} ms"
                )
            worst_fork = max(r["max_request_ms"] for r in rows if r["label"].startswith("fork"))
            verdict = "meets" if worst_fork <= GOAL_MS else "MISSES"
            print(f"\n  fork {verdict} the goal: longest request pause {worst_fork:.1f} ms (goal <= {GOAL_MS:g} ms)")
        finally:
            service.stop()
            publishers.close()


if __name__ == "__main__":
    main()
