"""``python -m kvrouter.simulations.process_faults --minutes N``: one long run on real processes, each in a network
namespace of its own (``--loopback``: all on 127.0.0.1, no partitions, etcd left alone); prints the figures
(operations ok/fail/info, faults injected, violations) and exits 1 if the checker found any, 2 if it cannot run."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import trio

from kvrouter.simulations.process_faults.network import network_missing
from kvrouter.simulations.process_faults.run import Result, RunOptions, run_faults, servers_missing


def report(result: Result, minutes: float) -> None:
    ops = result.operations
    faults = ", ".join(f"{kind} {count}" for kind, count in sorted(result.faults.items()))
    led = f"{result.led_after:.1f} s" if result.led_after is not None else "never"
    agreed = f"{result.agreed_after:.1f} s" if result.agreed_after is not None else "never"
    print(f"faults for {minutes:g} min; operations: ok {ops['ok']}, fail {ops['fail']}, info {ops['info']}")
    print(f"faults injected: {faults}")
    print(f"after the last fault: the stream had a leader within {led}, the replicas agreed after {agreed}")
    print(f"violations: {len(result.violations)}")
    for violation in result.violations[:20]:
        print(f"  {violation}")
    if result.violations:
        print(f"history: {result.history} (beside it: the processes' logs, and replicas-after.json)")


async def run_unless_terminated(directory: Path, options: RunOptions) -> Result | None:
    """The run, or None if SIGTERM ended it first (cancelled: its processes stopped and its network deleted on the
    way out, as on any failure)."""
    result: Result | None = None
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                nonlocal result
                result = await run_faults(directory, options)
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
            async for _ in signals:
                nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrouter.simulations.process_faults", description=__doc__)
    parser.add_argument("--minutes", type=float, default=1.0, help="how long the nemesis and clients run")
    parser.add_argument("--seed", type=int, default=1, help="seeds the clients' and the nemesis' choices")
    parser.add_argument("--work-dir", type=Path, help="where the processes keep their data, logs and the history")
    parser.add_argument(
        "--loopback",
        action="store_true",
        help="every process on 127.0.0.1 (no network namespaces, no root needed): kills and pauses of replicas and "
        "NATS nodes only, no partitions, etcd left alone",
    )
    args = parser.parse_args()
    missing = servers_missing() or (None if args.loopback else network_missing())
    if missing is not None:
        print(
            f"cannot run: {missing}" + ("" if args.loopback else " (--loopback runs without namespaces)"),
            file=sys.stderr,
        )
        sys.exit(2)
    if not 0 < args.minutes <= 24 * 60:
        print(f"--minutes={args.minutes:g} must be more than 0 and at most 1440", file=sys.stderr)
        sys.exit(2)
    options = RunOptions(seed=args.seed, fault_seconds=args.minutes * 60, network=not args.loopback)
    directory = args.work_dir or Path(tempfile.mkdtemp(prefix="kvrouter-faults-"))
    directory.mkdir(parents=True, exist_ok=True)
    result = trio.run(run_unless_terminated, directory, options)
    if result is None:
        print("stopped by SIGTERM: every process stopped, the network deleted", file=sys.stderr)
        sys.exit(1)
    report(result, args.minutes)
    if args.work_dir is None and not result.violations:
        shutil.rmtree(directory)  # kept, with its history and logs, when the checker found something
    sys.exit(1 if result.violations else 0)


if __name__ == "__main__":
    main()
