"""``kvrouter simulate`` / ``python -m kvrouter.simulations``: deterministic cluster simulations.

Two modes:

* ``trace`` (when ``--trace`` or ``--synthetic`` is given): replay a workload through simulated workers
  and kvrouter under one or more routing policies; print a comparison table, write ``--report`` (JSON)
  and ``--plots`` (PNG). Exit 0, or 1 if an invariant broke (the seed and step that reproduce it are
  printed), or 2 for bad options.
* ``crash`` (otherwise, or ``--mode crash``): random commands against the actors with crashes and
  recoveries, checking invariants and replay (``--steps``, ``--crash-probability``).
* ``ownership`` (``--mode ownership``): a cluster of replicas owning scopes under leases, with fenced appends,
  against a nemesis, over ``--seeds`` seeds (``simulations/ownership/command.py``).

The first line printed names the seed and every derived option, so any run can be repeated exactly.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.simulations.cluster import ClusterOptions, InvariantViolation
from kvrouter.simulations.faults import CacheReset, KvLoss, KvNoRemovals, RouterCrash, WorkerCrash, parse_faults
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.harness import SimulationOptions, simulate
from kvrouter.simulations.ownership import command as ownership
from kvrouter.simulations.policies import POLICIES
from kvrouter.simulations.report import render_table, to_json
from kvrouter.simulations.simulate import SimulationFailed, build_report, run_policies
from kvrouter.simulations.timing import ENGINE_PRESETS
from kvrouter.simulations.trace import MOONCAKE_BLOCK_SIZE, Trace, TraceError, load_mooncake

BAD_OPTIONS = 2
FAILED = 1


class OptionError(ValueError):
    pass


def build_parser(prog: str = "kvrouter simulate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Deterministic simulations of a cluster routed by kvrouter (virtual time, one seed).",
    )
    parser.add_argument(
        "--mode", choices=("trace", "crash", "ownership"), help="default: trace if a workload is given, else crash"
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace")
    workload.add_argument("--synthetic", metavar="NAME[:k=v,...]", help="shared-prefix, chat or agentic")
    workload.add_argument("--trace-block-size", type=int, default=MOONCAKE_BLOCK_SIZE, help="tokens per hash_id")
    workload.add_argument("--requests", type=int, help="replay only the first N requests")
    workload.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by X")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--workers", type=int, default=8)
    cluster.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per worker")
    cluster.add_argument("--policy", default="kv", help=f"one of {', '.join(POLICIES)}")
    cluster.add_argument("--compare", metavar="P1,P2,...", help="run several policies on the same trace")
    cluster.add_argument("--seed", type=int, default=0)
    cluster.add_argument("--engine", default="dynamo-mocker", choices=sorted(ENGINE_PRESETS))
    cluster.add_argument("--kv-blocks", type=int, help="KV capacity per worker rank, in blocks")
    cluster.add_argument("--engine-block-size", type=int, help="tokens per KV block")
    cluster.add_argument("--max-batched-tokens", type=int, help="chunked-prefill budget per pass")
    cluster.add_argument("--max-running", type=int, help="running sequences per worker rank")
    cluster.add_argument("--kv-event-delay-ms", type=float, default=0.0, help="KV event publish-to-index latency")
    cluster.add_argument("--kv-wire", action="store_true", help="carry KV batches in vLLM's msgpack wire format")
    cluster.add_argument("--router-temperature", type=float, help="selection softmax temperature (default 0)")
    cluster.add_argument("--prefill-load-scale", type=float, help="weight of prefill load in the cost (default 1)")
    cluster.add_argument("--overlap-score-credit", type=float, help="credit per cached block (default 1)")
    cluster.add_argument(
        "--replicas", type=int, help="router replicas kept in step by replica sync (default 1; ownership mode: 3)"
    )
    cluster.add_argument("--faults", metavar="SPEC", help="e.g. 'worker-crash@60s:worker=3;sync-drop=0.1'")
    output = parser.add_argument_group("output")
    output.add_argument("--report", metavar="FILE", help="write the report as JSON")
    output.add_argument("--plots", metavar="DIR", help="write ttft_cdf.png, reuse.png, worker_load.png")
    output.add_argument("--jobs", type=int, help="policies run in parallel processes (default: one per CPU)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    crash = parser.add_argument_group("crash mode")
    crash.add_argument("--steps", type=int, default=2000)
    crash.add_argument("--crash-probability", type=float, default=0.002)
    ownership.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "kvrouter simulate") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    mode = args.mode or ("trace" if args.trace or args.synthetic else "crash")
    if mode == "crash":
        return crash_mode(args)
    if mode == "ownership":
        return ownership.ownership_mode(args)
    try:
        trace, options, policies, speedup = configure(args)
    except (OptionError, TraceError, ValueError) as exc:
        print(f"kvrouter simulate: {exc}", file=sys.stderr)
        return BAD_OPTIONS
    return trace_mode(args, trace, options, policies, speedup)


def configure(args: argparse.Namespace) -> tuple[Trace, ClusterOptions, tuple[str, ...], float]:
    if args.replicas is None:
        args.replicas = 1
    if bool(args.trace) == bool(args.synthetic):
        raise OptionError("give one workload: --trace FILE or --synthetic NAME")
    if args.trace_block_size <= 0:
        raise OptionError(f"--trace-block-size must be positive, got {args.trace_block_size}")
    for name in ("workers", "dp_size", "replicas"):
        if getattr(args, name) <= 0:
            raise OptionError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.requests is not None and args.requests <= 0:
        raise OptionError(f"--requests must be positive, got {args.requests}")
    if not (args.kv_event_delay_ms >= 0):
        raise OptionError(f"--kv-event-delay-ms must be >= 0, got {args.kv_event_delay_ms}")
    policies = tuple(p.strip() for p in (args.compare or args.policy).split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise OptionError(f"unknown policy {', '.join(unknown) or '(none)'} (choose from {', '.join(POLICIES)})")
    if len(set(policies)) != len(policies):
        raise OptionError("a policy is named twice in --compare")
    engine = ENGINE_PRESETS[args.engine]
    overrides: dict[str, Any] = {
        "num_blocks": args.kv_blocks,
        "block_size": args.engine_block_size,
        "max_batched_tokens": args.max_batched_tokens,
        "max_running": args.max_running,
    }
    engine = attrs.evolve(engine, **{k: v for k, v in overrides.items() if v is not None})
    router = RouterConfig()
    for flag, field in (
        ("router_temperature", "router_temperature"),
        ("prefill_load_scale", "prefill_load_scale"),
        ("overlap_score_credit", "overlap_score_credit"),
    ):
        value = getattr(args, flag)
        if value is not None:
            if not (value >= 0 and math.isfinite(value)):
                raise OptionError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
            router = attrs.evolve(router, **{field: value})
    faults = parse_faults(args.faults)
    if faults.sync.active and args.replicas < 2:
        raise OptionError("sync-* faults need --replicas 2 or more")
    for fault in faults.timed:
        if isinstance(fault, RouterCrash) and fault.router >= args.replicas:
            raise OptionError(f"router-crash names router {fault.router}; routers are 0..{args.replicas - 1}")
        if isinstance(fault, WorkerCrash | CacheReset | KvLoss | KvNoRemovals) and fault.worker > args.workers:
            raise OptionError(f"a fault names worker {fault.worker}; workers are 1..{args.workers}")
    if args.trace:
        trace = load_mooncake(args.trace, args.trace_block_size)
    else:
        trace = synthetic(args.synthetic, args.seed, args.trace_block_size)
    trace = trace.head(args.requests).sped_up(args.speedup)
    options = ClusterOptions(
        workers=args.workers,
        dp_size=args.dp_size,
        policy=policies[0],
        seed=args.seed,
        engine=engine,
        router=router,
        kv_event_delay_ms=args.kv_event_delay_ms,
        kv_wire=args.kv_wire,
        replicas=args.replicas,
        faults=faults,
    )
    return trace, options, policies, args.speedup


def describe(args: argparse.Namespace, trace: Trace, options: ClusterOptions, policies: tuple[str, ...]) -> str:
    e = options.engine
    return (
        f"seed={options.seed} workload={trace.source or '-'} requests={len(trace.requests)} speedup={args.speedup:g} "
        f"workers={options.workers} dp_size={options.dp_size} policies={','.join(policies)} engine={args.engine} "
        f"(blocks={e.num_blocks}x{e.block_size} batch_tokens={e.max_batched_tokens} max_running={e.max_running}) "
        f"kv_event_delay_ms={options.kv_event_delay_ms:g} router_temperature={options.router.router_temperature:g} "
        f"prefill_load_scale={options.router.prefill_load_scale:g} "
        f"overlap_score_credit={options.router.overlap_score_credit:g} "
        f"replicas={options.replicas} faults={args.faults or '-'!r}"
    )


def trace_mode(
    args: argparse.Namespace, trace: Trace, options: ClusterOptions, policies: tuple[str, ...], speedup: float
) -> int:
    print(describe(args, trace, options, policies), flush=True)
    jobs = args.jobs if args.jobs is not None else min(len(policies), os.cpu_count() or 1)
    started = time.perf_counter()
    try:
        with _progress(not args.no_progress) as on_progress:
            outcomes = run_policies(trace, options, policies, jobs, on_progress)
    except (InvariantViolation, SimulationFailed) as exc:
        print(f"FAILED (seed {options.seed}): {exc}", file=sys.stderr)
        print(f"reproduce with: kvrouter simulate {shlex.join(args.argv)}", file=sys.stderr)
        return FAILED
    wall = time.perf_counter() - started
    report = build_report(trace, options, speedup, outcomes, args.engine)
    print(render_table(report), end="")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_bytes(to_json(report))
        print(f"report: {args.report}")
    if args.plots:
        from kvrouter.simulations.plots import write_plots

        title = f"{os.path.basename(trace.source)}, {options.workers} workers, speedup {speedup:g}, seed {options.seed}"
        for path in write_plots(args.plots, outcomes, title):
            print(f"plot: {path}")
    print(f"wall time {wall:.1f} s ({jobs} process{'es' if jobs > 1 else ''})")
    return 0


class _progress:
    """A rich progress bar per policy on a terminal; nothing otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
        )
        self.bar.start()

        def factory(policy: str, total: int) -> Any:
            task = self.bar.add_task(policy, total=total)
            return lambda done: self.bar.update(task, completed=done)

        return factory

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def crash_mode(args: argparse.Namespace) -> int:
    options = SimulationOptions(steps=args.steps, crash_probability=args.crash_probability)
    print(f"seed={args.seed} options={options}", flush=True)
    clock = trio.testing.MockClock(autojump_threshold=0)
    result = trio.run(partial(simulate, args.seed, options), clock=clock)
    print(
        f"steps={result.steps} accepted={result.accepted} rejected={result.rejected} "
        f"crashes={result.crashes} snapshots={result.snapshots} journal_records={result.journal_records}"
    )
    print(f"journal_digest={result.journal_digest}")
    print(f"state_digest={result.state_digest}")
    for failure in result.failures:
        print(f"FAILED: {failure}")
    return 1 if result.failures else 0
