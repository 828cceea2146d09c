"""KV-event ingest alone: the select service benchmark's ingest phase (same workload, same publishers, same
completion probes), repeated, with the service's CPU time per block, and the reference's in alternating rounds.

    python benchmarks/kv_ingest_bench.py [--blocks 1000000] [--rounds 3] [--reference-python PATH]
        [--durability always] [--events arrays|engine-maps] [--profile-dir DIR [--native | --nonblocking | --perf]]

Each round starts a fresh service, registers the 16 workers, publishes the chains and waits until every
worker's last chain is indexed (``select_service_bench.ingest``). Printed per round: blocks/s, the
service's CPU time (user + system, from /proc) per block during the ingest (all threads, and its main thread alone:
the event loop, which bounds the rate), and RSS per indexed block.
``--events``: ``arrays`` (the default, older vLLM's array events with small block hashes, as every figure in README
so far) or ``engine-maps`` (what vLLM 0.33 and SGLang 0.5 publish: each event a map, 64-bit block hashes).
``--profile-dir`` records kvrouter's ingest with py-spy (if installed) into DIR/round-N.txt (collapsed stacks;
C frames too with ``--native``; ``--nonblocking`` samples at 997 Hz without stopping the service), or with
``perf record`` into DIR/round-N.perf (``--perf``: every thread, the kernel).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, reference_python, repo_env, select_service_argv
from select_service_bench import (
    CHAIN_BLOCKS,
    PAYLOADS,
    REPO,
    Publishers,
    Service,
    Workload,
    chain_payload,
    ingest,
    prepare,
)

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its reaped children so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS  # utime stime cutime cstime


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid``'s main thread alone (the event loop: where ingest is bound)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return sum(int(fields[i]) for i in (11, 12)) / TICKS  # utime stime


def kvrouter_argv(port: int, data: Path, durability: str) -> list[str]:
    return select_service_argv(port, data, durability=durability)


def one_round(
    label: str,
    argv: list[str],
    port: int,
    env: dict[str, str],
    cwd: Path,
    workdir: Path,
    blocks: int,
    profile: Path | None,
    native: bool = False,
    nonblocking: bool = False,
    payload: Callable[[int], bytes] = chain_payload,
) -> str:
    publishers = Publishers()
    service = Service(label, argv, port, workdir, env, cwd)
    spy = None
    try:
        service.start()
        trio.run(prepare, service, publishers)
        if profile is not None and profile.suffix == ".perf":
            spy = subprocess.Popen(
                [
                    "perf",
                    "record",
                    "-F",
                    "999",
                    "--call-graph",
                    "dwarf,16384",
                    "-p",
                    str(service.pid),
                    "-o",
                    str(profile),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        elif profile is not None:
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(service.pid),
                    "--rate",
                    "997" if nonblocking else "250",
                    "--format",
                    "raw",
                    "-o",
                    str(profile),
                    *(["--native"] if native else []),
                    *(["--nonblocking"] if nonblocking else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # py-spy attaches
        before, main_before = cpu_seconds(service.pid), main_thread_cpu_seconds(service.pid)
        result = trio.run(
            ingest, service, publishers, Workload(blocks // CHAIN_BLOCKS, payload), max(30.0, blocks / 20_000)
        )
        cpu = cpu_seconds(service.pid) - before
        main_cpu = main_thread_cpu_seconds(service.pid) - main_before
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait()
        service.stop()
        publishers.close()
    if result.seconds is None:
        return f"{label}: TIMED OUT ({result.workers_done}/16 workers complete)"
    return (
        f"{label}: {result.blocks:,} blocks in {result.seconds:.2f} s = {result.rate:,.0f} blocks/s; "
        f"service CPU {cpu / result.blocks * 1e6:.2f} us/block (main thread {main_cpu / result.blocks * 1e6:.2f}); "
        f"RSS {result.bytes_per_block:.0f} B/block"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--durability", choices=["always", "batch", "off"], default="always")
    parser.add_argument("--events", choices=sorted(PAYLOADS), default="arrays", help="what the publishers send")
    parser.add_argument("--reference-python", default=None)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames of compiled modules too")
    parser.add_argument(
        "--nonblocking",
        action="store_true",
        help="py-spy --nonblocking at 997 Hz: samples without stopping the service (its rate stays what it was)",
    )
    parser.add_argument("--perf", action="store_true", help="profile with perf record (DIR/round-N.perf) instead")
    args = parser.parse_args()
    python = None if args.no_reference else reference_python(args.reference_python, "dynamo.select_service")
    env = repo_env()
    ref_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DYN_LOG", "RUST_LOG")}
    ref_env["DYN_LOG"] = "warn"
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-ingest-bench-"))
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    payload = PAYLOADS[args.events]
    print(
        f"KV ingest: {args.blocks:,} blocks, 16 workers, durability {args.durability}, events {args.events}; "
        f"load {os.getloadavg()}"
    )
    try:
        for n in range(1, args.rounds + 1):
            data = Path(tempfile.mkdtemp(prefix="data-", dir=workdir))
            suffix = ".perf" if args.perf else ".txt"
            profile = None if args.profile_dir is None else args.profile_dir / f"round-{n}{suffix}"
            port = free_port()
            print(
                one_round(
                    "kvrouter",
                    kvrouter_argv(port, data, args.durability),
                    port,
                    env,
                    REPO,
                    workdir,
                    args.blocks,
                    profile,
                    args.native,
                    args.nonblocking,
                    payload,
                ),
                flush=True,
            )
            shutil.rmtree(data, ignore_errors=True)
            if python is not None:
                port = free_port()
                argv = [python, "-m", "dynamo.select_service", "--port", str(port)]
                print(
                    one_round("reference", argv, port, ref_env, workdir, workdir, args.blocks, None, payload=payload),
                    flush=True,
                )
        print(f"load average at the end: {os.getloadavg()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
