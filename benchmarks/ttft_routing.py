"""``kv_ttft`` against ``kv`` in the deterministic simulator: the figures of ``docs/routing.md``.

Every run is ``kvrouter simulate`` with ``--engine dynamo-mocker`` (the default) and seed 0; the script prints
the equivalent command line of each table's runs, then markdown tables:

* ``shared``: the shared Mooncake synthetic trace, 8 workers, speedup 4: ``kv`` and ``kv_ttft`` (TTFT p50/p90/p99,
  prefix reuse).
* ``generated``: the three generated workloads (``shared-prefix``, ``chat``, ``agentic``) at 4 and 16 workers, at
  60 % and 90 % of the cluster's capacity. Capacity is measured first, per workload and cluster size: the
  completion rate (requests/s) of ``kv`` when the whole workload arrives at once (``--speedup 1000``), which is
  the most the cluster sustains. A load level then sets the generator's ``rate`` so that requests arrive at that
  fraction of it (chat: ``rate`` new sessions/s of 4 turns; agentic: agents/s of 8 steps). Sizes: 1,000
  requests per 4 workers (``requests=``, ``sessions=``, ``agents=`` scaled to match).
* ``ablation``: ``kv_ttft`` without the queue term, without the throughput fit (the prior's rates), without the
  drift discount, without the load term, on the shared trace, on the generated matrix's six 4-worker cells (geometric
  mean of p90 / kv's p90), and on a drift scenario: chat sessions that come back after their blocks were
  evicted (1,024 KV blocks per worker), with worker 1 publishing no evictions (``kv-no-removals``), so the router
  predicts hits there that the worker no longer has.
* ``holdout``: a public trace the policy was not tuned on (``--holdout FILE``, e.g. Mooncake's FAST'25
  ``conversation_trace.jsonl``), 8 workers, at the speedup that offers the same uncached prompt tokens per second
  as the shared trace at speedup 4 (chosen by that rule before the run).
* ``determinism``: ``kv_ttft`` on the shared trace twice: the JSON reports must be equal, byte for byte.
* ``wall``: the wall time ``kvrouter simulate --compare kv,kv_ttft`` reports for the full shared trace (both
  policies at once, one process each; run every time, since it measures the machine).

Results are kept in ``--cache`` (default ``benchmarks/results/ttft``) under a key of the run and a digest of the
simulator's and router's source, so a second invocation re-renders the tables without simulating again unless
the code changed.

    python benchmarks/ttft_routing.py [--parts shared,generated,ablation,holdout,determinism]
        [--trace FILE] [--holdout FILE] [--jobs N] [--cache DIR]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvrouter.simulations.cluster import ClusterOptions
from kvrouter.simulations.faults import parse_faults
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.report import to_json
from kvrouter.simulations.simulate import build_report, run_policies
from kvrouter.simulations.timing import ENGINE_PRESETS
from kvrouter.simulations.trace import Trace, load_mooncake

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = next(
    (
        found
        for parent in REPO.parents
        if (found := parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl").exists()
    ),
    Path("mooncake_synthetic_trace.jsonl"),
)
WORKLOADS = ("shared-prefix", "chat", "agentic")
# Generator size per 4 workers (1,000 requests), and requests per unit of its ``rate``.
SIZE = {"shared-prefix": ("requests", 1000, 1), "chat": ("sessions", 250, 4), "agentic": ("agents", 125, 8)}
CLUSTERS = (4, 16)
LOADS = (0.6, 0.9)
BURST = 1000.0  # speedup that makes a whole workload arrive at once (capacity runs)
ABLATIONS = ("kv_ttft_no_queue", "kv_ttft_no_fit", "kv_ttft_no_drift", "kv_ttft_no_load")
# Drift: a chat workload whose sessions come back after their blocks were evicted (small caches), and worker 1
# publishing no evictions, so the router predicts hits there that the worker no longer has.
DRIFT = {
    "workload": "synthetic:chat:sessions=300,rate=3,think_s=20",
    "workers": 4,
    "speedup": 1.0,
    "kv_blocks": 1024,
    "faults": "kv-no-removals@0s:worker=1",
}
SHARED = {"workers": 8, "speedup": 4.0}

Run = dict[str, Any]  # workload (trace path or synthetic spec), workers, speedup, policy, extra options


def source_digest() -> str:
    """What the figures depend on: the router's and the simulator's code (docstrings and comments aside)."""
    digest = hashlib.sha256()
    for folder in ("actors", "simulations", "journal"):
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode())
            digest.update(ast.dump(_without_docstrings(ast.parse(path.read_bytes()))).encode())
    return digest.hexdigest()[:16]


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return tree


def run_key(run: Run, code: str) -> str:
    return hashlib.sha256(json.dumps([run, code], sort_keys=True).encode()).hexdigest()[:24]


def load_trace(run: Run) -> Trace:
    workload = run["workload"]
    if workload.startswith("synthetic:"):
        trace = synthetic(workload.removeprefix("synthetic:"), 0)
    else:
        trace = load_mooncake(workload)
    return trace.sped_up(run["speedup"])


def simulate(run: Run) -> dict[str, Any]:
    """One policy's summary (and its JSON report's digest), from a fresh process state."""
    trace = load_trace(run)
    engine = ENGINE_PRESETS["dynamo-mocker"]
    if "kv_blocks" in run:
        import attrs

        engine = attrs.evolve(engine, num_blocks=run["kv_blocks"])
    options = ClusterOptions(
        workers=run["workers"], policy=run["policy"], engine=engine, faults=parse_faults(run.get("faults"))
    )
    started = time.perf_counter()
    outcomes = run_policies(trace, options, (run["policy"],))
    report = to_json(build_report(trace, options, run["speedup"], outcomes, "dynamo-mocker"))
    summary = outcomes[run["policy"]].summary
    return {
        "summary": summary,
        "report_sha256": hashlib.sha256(report).hexdigest(),
        "wall_s": time.perf_counter() - started,
    }


class Runner:
    """Runs what is not cached yet, ``jobs`` at a time, each in its own process."""

    def __init__(self, cache: Path, jobs: int) -> None:
        self.cache = cache
        self.jobs = jobs
        self.code = source_digest()
        cache.mkdir(parents=True, exist_ok=True)

    def results(self, runs: list[Run]) -> list[dict[str, Any]]:
        keys = [run_key(run, self.code) for run in runs]
        missing = [(k, r) for k, r in zip(keys, runs, strict=True) if not (self.cache / f"{k}.json").exists()]
        unique = list(dict(missing).items())
        if unique:
            print(f"simulating {len(unique)} run(s), {self.jobs} at a time ...", file=sys.stderr, flush=True)
            with multiprocessing.get_context("fork").Pool(max(1, self.jobs)) as pool:
                for key, result in zip(
                    [k for k, _ in unique], pool.imap(simulate, [r for _, r in unique], chunksize=1), strict=True
                ):
                    (self.cache / f"{key}.json").write_text(json.dumps(result))
        return [json.loads((self.cache / f"{k}.json").read_text()) for k in keys]


def figures(result: dict[str, Any]) -> dict[str, float]:
    s = result["summary"]
    return {
        "reuse": s["prefix_reuse"],
        "p50": s["ttft_ms"]["p50"],
        "p90": s["ttft_ms"]["p90"],
        "p99": s["ttft_ms"]["p99"],
        "throughput": s["throughput"]["requests_per_s"],
    }


# -- parts ---------------------------------------------------------------------------------------------------


def shared_part(runner: Runner, trace: Path) -> None:
    policies = ("kv", "kv_ttft")
    runs = [{"workload": str(trace), **SHARED, "policy": p} for p in policies]
    rows = [figures(r) for r in runner.results(runs)]
    print("## Shared trace (8 workers, speedup 4)\n")
    print(f"    kvrouter simulate --trace {trace.name} --workers 8 --speedup 4 --compare kv,kv_ttft\n")
    print("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prefix reuse |")
    print("|---|---:|---:|---:|---:|")
    for policy, row in zip(policies, rows, strict=True):
        print(f"| {policy} | {row['p50']:,.1f} | {row['p90']:,.1f} | {row['p99']:,.1f} | {row['reuse']:.3f} |")
    kv, ttft = rows
    print(
        f"\nkv_ttft / kv: TTFT p90 {ttft['p90'] / kv['p90']:.3f} (target <= 0.90), "
        f"prefix reuse {ttft['reuse'] / kv['reuse']:.3f} (target >= 0.97)\n"
    )


def wall_part(trace: Path) -> None:
    wall = compare_wall_time(trace)
    print("## Wall time\n")
    print(f"`kvrouter simulate --trace {trace.name} --workers 8 --speedup 4 --compare kv,kv_ttft` (one process per")
    print(f"policy) on this machine: {wall:.1f} s (target <= 60 s)\n")


def compare_wall_time(trace: Path) -> float:
    """The CLI's own figure for ``--compare kv,kv_ttft`` (run every time: it measures this machine)."""
    argv = [sys.executable, "-m", "kvrouter.simulations", "--trace", str(trace), "--workers", "8", "--speedup", "4"]
    argv += ["--compare", "kv,kv_ttft", "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("wall time"))
    return float(line.split()[2])


def workload_spec(workload: str, workers: int, rate: float | None = None) -> str:
    field, size, _ = SIZE[workload]
    spec = f"{workload}:{field}={size * workers // 4}"
    return spec if rate is None else f"{spec},rate={rate:.4g}"


def capacities(runner: Runner) -> dict[tuple[str, int], float]:
    runs = [
        {"workload": f"synthetic:{workload_spec(w, n)}", "workers": n, "speedup": BURST, "policy": "kv"}
        for w in WORKLOADS
        for n in CLUSTERS
    ]
    results = runner.results(runs)
    return {
        (r["workload"].split(":")[1], r["workers"]): figures(x)["throughput"]
        for r, x in zip(runs, results, strict=True)
    }


def generated_runs(capacity: dict[tuple[str, int], float], policy: str) -> list[Run]:
    runs = []
    for w in WORKLOADS:
        for n in CLUSTERS:
            for load in LOADS:
                rate = load * capacity[(w, n)] / SIZE[w][2]
                runs.append(
                    {
                        "workload": f"synthetic:{workload_spec(w, n, rate)}",
                        "workers": n,
                        "speedup": 1.0,
                        "policy": policy,
                        "load": load,
                    }
                )
    return runs


def generated_part(runner: Runner) -> dict[tuple[str, int], float]:
    capacity = capacities(runner)
    kv = runner.results(generated_runs(capacity, "kv"))
    ttft = runner.results(generated_runs(capacity, "kv_ttft"))
    print("## Generated workloads\n")
    print("Capacity (requests/s; kv, whole workload at once):\n")
    print("| workload | 4 workers | 16 workers |")
    print("|---|---:|---:|")
    for w in WORKLOADS:
        print(f"| {w} | {capacity[(w, 4)]:.1f} | {capacity[(w, 16)]:.1f} |")
    print("\n    kvrouter simulate --synthetic <workload>:<size>,rate=<rate> --workers <n> --compare kv,kv_ttft\n")
    print("| workload | workers | load | rate | kv p90 ms | kv_ttft p90 ms | ratio | kv reuse | kv_ttft reuse |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for run, a, b in zip(generated_runs(capacity, "kv"), kv, ttft, strict=True):
        fa, fb = figures(a), figures(b)
        ratio = fb["p90"] / fa["p90"]
        ratios.append(ratio)
        rate = run["workload"].rsplit("rate=", 1)[1]
        size = run["workload"].split(":")[2].split(",")[0]
        print(
            f"| {run['workload'].split(':')[1]} ({size}) | {run['workers']} | {run['load']:.0%} | {rate} | "
            f"{fa['p90']:,.1f} | {fb['p90']:,.1f} | {ratio:.3f} | {fa['reuse']:.3f} | {fb['reuse']:.3f} |"
        )
    better = sum(1 for r in ratios if r <= 0.90)
    print(
        f"\nworst p90 ratio {max(ratios):.3f} (target <= 1.02); {better} of {len(ratios)} cells at <= 0.90 "
        f"(target: at least half); geometric mean {geomean(ratios):.3f}\n"
    )
    return capacity


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def small_cells(runs: list[Run]) -> list[Run]:
    """The 4-worker cells of the generated matrix (the ablation's share of it: a quarter of the CPU time)."""
    return [run for run in runs if run["workers"] == 4]


def ablation_part(runner: Runner, trace: Path) -> None:
    policies = ("kv", "kv_ttft", *ABLATIONS)
    shared = [figures(r) for r in runner.results([{"workload": str(trace), **SHARED, "policy": p} for p in policies])]
    drift_runs = [{**DRIFT, "policy": p} for p in policies]
    drift = [figures(r) for r in runner.results(drift_runs)]
    capacity = capacities(runner)
    kv_cells = [figures(r)["p90"] for r in runner.results(small_cells(generated_runs(capacity, "kv")))]
    print("## Ablation\n")
    print(
        f"Drift scenario: `--synthetic {DRIFT['workload'].removeprefix('synthetic:')} --workers {DRIFT['workers']} "
        f"--kv-blocks {DRIFT['kv_blocks']} --faults '{DRIFT['faults']}'`.\n"
    )
    print(
        "| policy | shared p90 ms | shared reuse | generated, 4 workers: p90 / kv (geo. mean) "
        "| drift p90 ms | drift reuse |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for policy, s, d in zip(policies, shared, drift, strict=True):
        cells = [figures(r)["p90"] for r in runner.results(small_cells(generated_runs(capacity, policy)))]
        ratio = geomean([c / k for c, k in zip(cells, kv_cells, strict=True)])
        print(f"| {policy} | {s['p90']:,.1f} | {s['reuse']:.3f} | {ratio:.3f} | {d['p90']:,.1f} | {d['reuse']:.3f} |")
    print()


def holdout_part(runner: Runner, trace: Path, holdout: Path) -> None:
    speedup = matched_speedup(trace, holdout)
    policies = ("kv", "kv_ttft")
    runs = [{"workload": str(holdout), "workers": 8, "speedup": speedup, "policy": p} for p in policies]
    rows = [figures(r) for r in runner.results(runs)]
    print(f"## Held-back trace: {holdout.name}\n")
    print(f"    kvrouter simulate --trace {holdout.name} --workers 8 --speedup {speedup} --compare kv,kv_ttft\n")
    print("| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prefix reuse |")
    print("|---|---:|---:|---:|---:|")
    for policy, row in zip(policies, rows, strict=True):
        print(f"| {policy} | {row['p50']:,.1f} | {row['p90']:,.1f} | {row['p99']:,.1f} | {row['reuse']:.3f} |")
    kv, ttft = rows
    print(f"\nkv_ttft / kv: TTFT p90 {ttft['p90'] / kv['p90']:.3f}, prefix reuse {ttft['reuse'] / kv['reuse']:.3f}\n")


def matched_speedup(trace: Path, holdout: Path) -> float:
    """The holdout's speedup offering the uncached prompt tokens/s of the shared trace at speedup 4 (tokens of
    blocks never seen before in the trace, over its span), rounded to one decimal."""
    return round(SHARED["speedup"] * new_tokens_per_s(trace) / new_tokens_per_s(holdout), 1)


def new_tokens_per_s(path: Path) -> float:
    trace = load_mooncake(path)
    seen: set[int] = set()
    new = 0
    for request in trace.requests:
        fresh = [h for h in request.hash_ids if h not in seen]
        seen.update(fresh)
        new += min(request.input_length, len(fresh) * trace.block_size)
    span = (trace.requests[-1].arrival_ms - trace.requests[0].arrival_ms) / 1000.0
    return new / span


def determinism_part(runner: Runner, trace: Path) -> None:
    run = {"workload": str(trace), **SHARED, "policy": "kv_ttft"}
    first = simulate(run)["report_sha256"]
    second = simulate(run)["report_sha256"]
    cached = runner.results([run])[0]["report_sha256"]
    same = first == second == cached
    print("## Determinism\n")
    print(
        f"kv_ttft on the shared trace, three runs: report sha256 {first[:16]}... {'identical' if same else 'DIFFER'}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="shared,generated,ablation,holdout,determinism,wall")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--holdout", type=Path, help="a public Mooncake-format trace not used for tuning")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=REPO / "benchmarks" / "results" / "ttft")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    runner = Runner(args.cache, args.jobs)
    if "shared" in parts:
        shared_part(runner, args.trace)
    if "generated" in parts:
        generated_part(runner)
    if "ablation" in parts:
        ablation_part(runner, args.trace)
    if "holdout" in parts:
        if args.holdout is None:
            print("## Held-back trace\n\nnot run: give --holdout FILE\n")
        else:
            holdout_part(runner, args.trace, args.holdout)
    if "determinism" in parts:
        determinism_part(runner, args.trace)
    if "wall" in parts:
        wall_part(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
