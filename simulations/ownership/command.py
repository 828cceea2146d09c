"""``kvrouter simulate --mode ownership``: many seeds of the ownership simulation, a summary, replayable failures.

Each seed is one history; its SHA-256 is printed for a failing seed (and for a single seed), and ``--seed S
--history FILE`` writes that seed's history, the same bytes on every run and machine. ``--bug fencing-off``
runs the broken variant whose appends carry no expected sequence, to show the checker catches it.
``--racy-fence`` models nats-server before 2.9.21, whose clustered fence can let two appends on one sequence
through; ``--bug chain-off`` then runs the journal without its defence (the chain), to show what it is for.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from pathlib import Path

import attrs

from kvrouter.simulations.ownership.run import OwnershipOptions, SeedResult, run_seeds, scopes_of, simulate
from kvrouter.simulations.ownership.services import StreamOptions

BUGS = ("fencing-off", "chain-off")
FAILED = 1
BAD_OPTIONS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ownership mode")
    group.add_argument("--seeds", type=int, default=1, help="seeds to run, from --seed on")
    group.add_argument("--clients", type=int, default=4, help="concurrent clients")
    group.add_argument("--seconds", type=int, default=30, help="virtual seconds of clients and faults per seed")
    group.add_argument(
        "--racy-fence",
        type=int,
        nargs="?",
        const=StreamOptions().race_window_ms,
        metavar="MS",
        help="model nats-server before 2.9.21: an append fenced on a sequence that another append on the same one took "
        f"less than MS virtual ms ago is stored all the same (default {StreamOptions().race_window_ms})",
    )
    group.add_argument(
        "--bug",
        choices=BUGS,
        help="run a deliberately broken variant: fencing-off (appends carry no expected sequence), chain-off "
        "(with --racy-fence: readers fold every message and writers do not check theirs is on the chain)",
    )
    group.add_argument("--history", metavar="FILE", help="write the history of --seed (one seed only)")


def options_from(args: argparse.Namespace) -> OwnershipOptions:
    replicas = 3 if args.replicas is None else args.replicas
    for flag, value in (("seeds", args.seeds), ("clients", args.clients), ("seconds", args.seconds)):
        if value <= 0:
            raise ValueError(f"--{flag} must be positive, got {value}")
    if replicas <= 0:
        raise ValueError(f"--replicas must be positive, got {replicas}")
    if args.history and args.seeds != 1:
        raise ValueError("--history writes one seed's history: give --seeds 1")
    if args.racy_fence is not None and args.racy_fence <= 0:
        raise ValueError(f"--racy-fence takes a positive window in virtual ms, got {args.racy_fence}")
    if args.bug == "chain-off" and args.racy_fence is None:
        raise ValueError("--bug chain-off changes nothing unless appends can race: add --racy-fence")
    options = OwnershipOptions(replicas=replicas, clients=args.clients, seconds=args.seconds)
    if args.racy_fence is not None:
        options = attrs.evolve(options, stream=StreamOptions(racy_fence=True, race_window_ms=args.racy_fence))
    if args.bug == "fencing-off":
        options = attrs.evolve(options, replica=attrs.evolve(options.replica, fencing=False))
    elif args.bug == "chain-off":
        options = attrs.evolve(options, replica=attrs.evolve(options.replica, chain=False))
    return options


def ownership_mode(args: argparse.Namespace) -> int:
    try:
        options = options_from(args)
    except ValueError as exc:
        print(f"kvrouter simulate: {exc}", file=sys.stderr)
        return BAD_OPTIONS
    print(
        f"seeds={args.seeds} (from {args.seed}) replicas={options.replicas} clients={options.clients} "
        f"scopes={len(scopes_of(options))} seconds={options.seconds} settle_seconds={options.settle_seconds} "
        f"ttl_ms={options.replica.ttl_ns // 1_000_000} bug={args.bug or '-'}"
        + (f" racy_fence_ms={args.racy_fence}" if args.racy_fence is not None else ""),
        flush=True,
    )
    if args.history:
        result, history = simulate(args.seed, options)
        Path(args.history).parent.mkdir(parents=True, exist_ok=True)
        Path(args.history).write_bytes(history.to_bytes())
        print(f"history: {args.history} ({len(history.records)} records)")
        results = [result]
        wall = 0.0
    else:
        started = time.perf_counter()
        results = run_seeds(range(args.seed, args.seed + args.seeds), options, args.jobs, lambda _: None)
        wall = time.perf_counter() - started
    print(summary(results, options, wall), end="")
    failed = [r for r in results if r.violations]
    for result in failed[:10]:
        print(f"FAILED seed {result.seed} (history sha256 {result.digest}): {result.violations[0]}", file=sys.stderr)
    if failed:
        first = failed[0]
        replay = ["--mode", "ownership", "--seed", str(first.seed), "--history", f"seed-{first.seed}.jsonl"]
        replay += _passed_options(args)
        print(f"replay with: kvrouter simulate {shlex.join(replay)}", file=sys.stderr)
        return FAILED
    return 0


def _passed_options(args: argparse.Namespace) -> list[str]:
    extra = []
    for flag in ("replicas", "clients", "seconds", "racy_fence", "bug"):
        value = getattr(args, flag)
        if value is not None and (flag != "clients" or value != 4) and (flag != "seconds" or value != 30):
            extra += [f"--{flag.replace('_', '-')}", str(value)]
    return extra


def summary(results: list[SeedResult], options: OwnershipOptions, wall: float) -> str:
    def total(part: str, key: str) -> int:
        return sum(getattr(r, part)[key] for r in results)

    violations = sum(len(r.violations) for r in results)
    failed = sum(1 for r in results if r.violations)
    faults = results[0].faults.keys() if results else ()
    counters = results[0].counters.keys() if results else ()
    combined = hashlib.sha256("".join(r.digest for r in results).encode()).hexdigest()
    rate = f" in {wall:.1f} s ({len(results) / wall:.1f} seeds/s)" if wall > 0 else ""
    virtual = len(results) * (options.seconds + options.settle_seconds)
    lines = [
        f"seeds {len(results)}{rate}; {violations} violations in {failed} seeds",
        f"virtual time {virtual:,} s; faults injected: "
        + ", ".join(f"{kind} {total('faults', kind):,}" for kind in faults),
        f"operations: ok {total('ops', 'ok'):,}, fail (refused or 503) {total('ops', 'fail'):,}, "
        f"info (unknown) {total('ops', 'info'):,}",
        "protocol and network: " + ", ".join(f"{key} {total('counters', key):,}" for key in counters),
        f"histories sha256 {combined}" if len(results) > 1 else f"history sha256 {results[0].digest}",
    ]
    return "\n".join(lines) + "\n"
