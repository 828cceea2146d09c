"""Run a trace under one or more routing policies and gather the report (``kvrouter simulate``).

Each policy runs in its own ``trio.run`` from the same trace, options and seed, so their results are
independent of each other and of how many run at once: with ``jobs > 1`` they run in parallel
processes (forked), which changes nothing but the wall time (each process hashes the prompts itself,
in parallel, rather than the parent hashing them first).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import attrs

from kvrouter.simulations.cluster import LOAD_SAMPLE_MS, ClusterOptions, ClusterRun, simulate_policy
from kvrouter.simulations.prompts import PromptHasher
from kvrouter.simulations.report import REPORT_FORMAT, summarise
from kvrouter.simulations.trace import Trace


@attrs.frozen
class PolicyOutcome:
    """What the report and the plots need from one policy's run (small enough to pass between processes)."""

    summary: dict[str, Any]
    ttft_ms: list[float]  # sorted
    load_series: dict[str, list[tuple[float, int]]]  # rank label -> (virtual second, requests)


def outcome_of(run: ClusterRun, block_size: int) -> PolicyOutcome:
    ttft = sorted(r.first_token_ms - r.arrival_ms for r in run.records if r.first_token_ms is not None)
    series = {}
    for worker in run.workers:
        label = f"w{worker.rank.worker_id}" + (f".{worker.rank.dp_rank}" if worker.rank.dp_rank else "")
        series[label] = [(bucket * LOAD_SAMPLE_MS / 1000.0, load) for bucket, load in sorted(worker.samples.items())]
    return PolicyOutcome(summarise(run, block_size), ttft, series)


def run_policy(
    trace: Trace,
    options: ClusterOptions,
    progress: Callable[[int, int], None] | None = None,
    hasher: PromptHasher | None = None,
) -> PolicyOutcome:
    hasher = hasher or PromptHasher(trace.block_size, options.engine.block_size)
    run = simulate_policy(trace, options, hasher, progress)
    return outcome_of(run, options.engine.block_size)


ProgressFactory = Callable[[str, int], Callable[[int], None]]


def run_policies(
    trace: Trace,
    options: ClusterOptions,
    policies: tuple[str, ...],
    jobs: int = 1,
    on_progress: ProgressFactory | None = None,
) -> dict[str, PolicyOutcome]:
    """Every policy's outcome, in the order given."""
    jobs = max(1, min(jobs, len(policies)))
    hasher = PromptHasher(trace.block_size, options.engine.block_size)
    if jobs == 1 and len(policies) > 1:
        hasher.warm(trace.requests)  # once for every policy run in this process
    if jobs == 1 or len(policies) == 1:
        outcomes = {}
        for policy in policies:
            update = on_progress(policy, len(trace.requests)) if on_progress else None
            progress = (lambda done, total, update=update: update(done)) if update else None
            outcomes[policy] = run_policy(trace, attrs.evolve(options, policy=policy), progress, hasher)
        return outcomes
    return _run_forked(trace, options, policies, jobs, on_progress, hasher)


def _run_forked(
    trace: Trace,
    options: ClusterOptions,
    policies: tuple[str, ...],
    jobs: int,
    on_progress: ProgressFactory | None,
    hasher: PromptHasher,
) -> dict[str, PolicyOutcome]:
    context = multiprocessing.get_context("fork")
    counters = {p: context.Value("i", 0, lock=False) for p in policies}
    results = context.Queue()
    updates = {p: on_progress(p, len(trace.requests)) for p in policies} if on_progress else {}

    def child(policy: str) -> None:
        counter = counters[policy]

        def progress(done: int, total: int) -> None:
            counter.value = done

        try:
            outcome = run_policy(trace, attrs.evolve(options, policy=policy), progress, hasher)
            results.put((policy, outcome, None))
        except BaseException as exc:  # the parent reports it; a child must not die silently
            results.put((policy, None, f"{type(exc).__name__}: {exc}"))

    pending = list(policies)
    running: dict[str, Any] = {}
    outcomes: dict[str, PolicyOutcome] = {}
    failures: dict[str, str] = {}
    while pending or running:
        while pending and len(running) < jobs:
            policy = pending.pop(0)
            process = context.Process(target=child, args=(policy,), name=f"simulate-{policy}")
            process.start()
            running[policy] = process
        try:
            policy, outcome, error = results.get(timeout=0.2)
        except Exception:  # queue.Empty: refresh the progress bars and keep waiting
            for name, update in updates.items():
                update(counters[name].value)
            for name, process in list(running.items()):
                if not process.is_alive() and process.exitcode not in (0, None):
                    failures[name] = f"process exited with status {process.exitcode}"
                    del running[name]
            continue
        running.pop(policy).join()
        if error is not None:
            failures[policy] = error
        else:
            outcomes[policy] = outcome
            if policy in updates:
                updates[policy](len(trace.requests))
    if failures:
        raise SimulationFailed("; ".join(f"{p}: {e}" for p, e in failures.items()))
    return {p: outcomes[p] for p in policies}


class SimulationFailed(RuntimeError):
    pass


def build_report(
    trace: Trace, options: ClusterOptions, speedup: float, outcomes: dict[str, PolicyOutcome], engine_name: str
) -> dict[str, Any]:
    engine = attrs.asdict(options.engine)
    return {
        "format": REPORT_FORMAT,
        "seed": options.seed,
        "trace": {
            "source": os.path.basename(trace.source) if trace.source else "",
            "requests": len(trace.requests),
            "prompt_tokens": trace.prompt_tokens,
            "trace_block_size": trace.block_size,
            "speedup": speedup,
        },
        "options": {
            "workers": options.workers,
            "dp_size": options.dp_size,
            "engine": engine_name,
            "engine_params": {k: list(v) if isinstance(v, tuple) else v for k, v in engine.items()},
            "router_config": attrs.asdict(options.router),
            "kv_event_delay_ms": options.kv_event_delay_ms,
            "kv_wire": options.kv_wire,
            "replicas": options.replicas,
            "faults": repr(options.faults) if not options.faults.empty else None,
        },
        "policies": {policy: outcome.summary for policy, outcome in outcomes.items()},
    }
