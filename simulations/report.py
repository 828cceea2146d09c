"""Figures of a simulation run, per policy: what a user needs to decide whether KV-aware routing pays.

Times are virtual milliseconds. Percentiles interpolate linearly between order statistics (numpy's
default). The report holds nothing that depends on the machine (no wall time), so the same inputs and
seed give the same report, byte for byte (``to_json``).

* ``prefix_reuse``: prompt tokens found cached when the worker admitted the request / all prompt tokens.
* ``overlap`` (kv policy): the router's predicted overlap on the rank it chose vs what that worker held,
  in tokens, and why they differ. The worker always recomputes a prompt's last token, so predictions are
  capped at ``((isl - 1) // block_size) * block_size`` first. ``stale_index`` counts requests where the
  worker held something else than the router predicted at the moment of selection (KV events in flight or
  lost, or a removal that cut the router's chain below a block the worker kept); ``changed_while_queued``
  those whose worker's cache changed between selection and admission (blocks evicted, or stored by a
  request computing the same prefix).
* ``ttft_ms``: first token - arrival; ``e2e_ms``: last token - arrival; ``itl_ms``: per request, (last -
  first token) / (output tokens - 1), for requests with 2+ output tokens.
* ``imbalance``: max / mean over ranks of requests served and of busy time (1.0 is perfectly even).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from kvrouter.simulations.cluster import ClusterRun, FaultCounters

REPORT_FORMAT = 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the two nearest order statistics of sorted ``values``."""
    if not values:
        return None
    position = (len(values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def distribution(values: list[float]) -> dict[str, float | None]:
    values.sort()
    mean = math.fsum(values) / len(values) if values else None
    return {
        "mean": _round(mean),
        "p50": _round(percentile(values, 50)),
        "p90": _round(percentile(values, 90)),
        "p99": _round(percentile(values, 99)),
        "max": _round(values[-1] if values else None),
    }


def summarise(run: ClusterRun, block_size: int) -> dict[str, Any]:
    records = run.records
    served = [r for r in records if r.rejected is None]
    rejected = [r for r in records if r.rejected is not None]
    prompt_tokens = sum(r.input_tokens for r in served)
    cached = sum(r.cached_tokens or 0 for r in served)
    output_tokens = sum(r.output_tokens for r in served if r.end_ms is not None)
    duration_s = run.duration_ms / 1000.0
    ttft = [r.first_token_ms - r.arrival_ms for r in served if r.first_token_ms is not None]
    e2e = [r.end_ms - r.arrival_ms for r in served if r.end_ms is not None]
    itl = [
        (r.end_ms - r.first_token_ms) / (r.output_tokens - 1)
        for r in served
        if r.end_ms is not None and r.first_token_ms is not None and r.output_tokens > 1
    ]
    queue = [r.admit_ms - r.arrival_ms for r in served if r.admit_ms is not None]
    per_rank_requests = [w.requests for w in run.workers]
    per_rank_busy = [w.busy_ms for w in run.workers]
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": sum(1 for r in served if r.end_ms is not None),
        "rejected": len(rejected),
        "rejections": _reasons(rejected),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "prefix_reuse": _round(cached / prompt_tokens if prompt_tokens else 0.0, 4),
        "ttft_ms": distribution(ttft),
        "e2e_ms": distribution(e2e),
        "itl_ms": distribution(itl),
        "queue_ms": distribution(queue),
        "duration_ms": _round(run.duration_ms),
        "throughput": {
            "requests_per_s": _round(len(e2e) / duration_s if duration_s else 0.0),
            "output_tokens_per_s": _round(output_tokens / duration_s if duration_s else 0.0),
            "prompt_tokens_per_s": _round(prompt_tokens / duration_s if duration_s else 0.0),
        },
        "imbalance": {
            "requests": _round(_max_over_mean(per_rank_requests)),
            "busy_time": _round(_max_over_mean(per_rank_busy)),
            "requests_per_rank": {f"{w.rank.worker_id}.{w.rank.dp_rank}": w.requests for w in run.workers},
        },
        "engine": {
            "preemptions": run.preemptions,
            "kv_blocks_stored": run.kv_blocks_stored,
            "kv_blocks_evicted": run.kv_blocks_evicted,
        },
        "router": {
            "journal_records": run.journal_records,
            "journal_sha256": run.journal_digest,
            "events_processed": run.events_processed,
        },
    }
    if run.faults != FaultCounters():
        summary["faults"] = attrs.asdict(run.faults)
    overlap = overlap_report(served, block_size)
    if overlap is not None:
        summary["overlap"] = overlap
    return summary


def overlap_report(served: list[Any], block_size: int) -> dict[str, Any] | None:
    predicted = [r for r in served if r.predicted_tokens is not None and r.cached_tokens is not None]
    if not predicted:
        return None
    exact = over = under = stale = changed = 0
    over_tokens = under_tokens = 0
    predicted_sum = actual_sum = 0
    for r in predicted:
        cap = ((r.input_tokens - 1) // block_size) * block_size
        guess = min(r.predicted_tokens, cap)
        actual = r.cached_tokens
        predicted_sum += guess
        actual_sum += actual
        if guess == actual:
            exact += 1
        elif guess > actual:
            over += 1
            over_tokens += guess - actual
        else:
            under += 1
            under_tokens += actual - guess
        if r.cached_at_select is not None:
            stale += guess != r.cached_at_select
            changed += r.cached_at_select != actual
    prompt = sum(r.input_tokens for r in predicted)
    return {
        "requests": len(predicted),
        "predicted_reuse": _round(predicted_sum / prompt if prompt else 0.0, 4),
        "realised_reuse": _round(actual_sum / prompt if prompt else 0.0, 4),
        "exact": exact,
        "over_predicted": over,
        "over_predicted_tokens": over_tokens,
        "under_predicted": under,
        "under_predicted_tokens": under_tokens,
        "stale_index": stale,
        "changed_while_queued": changed,
    }


def _reasons(rejected: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r.rejected] = counts.get(r.rejected, 0) + 1
    return dict(sorted(counts.items()))


def _max_over_mean(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = math.fsum(values) / len(values)
    return max(values) / mean if mean else 0.0


def to_json(report: dict[str, Any]) -> bytes:
    """Canonical bytes: sorted keys, two-space indent, trailing newline."""
    return orjson.dumps(report, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


# -- the terminal table ----------------------------------------------------------------------------

ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("requests (rejected)", ("requests",), "count"),
    ("prefix reuse", ("prefix_reuse",), "ratio"),
    ("router-predicted reuse", ("overlap", "predicted_reuse"), "ratio"),
    ("TTFT p50 ms", ("ttft_ms", "p50"), "ms"),
    ("TTFT p90 ms", ("ttft_ms", "p90"), "ms"),
    ("TTFT p99 ms", ("ttft_ms", "p99"), "ms"),
    ("end-to-end p50 ms", ("e2e_ms", "p50"), "ms"),
    ("end-to-end p90 ms", ("e2e_ms", "p90"), "ms"),
    ("ITL mean ms", ("itl_ms", "mean"), "ms"),
    ("ITL p90 ms", ("itl_ms", "p90"), "ms"),
    ("throughput req/s", ("throughput", "requests_per_s"), "rate"),
    ("output tokens/s", ("throughput", "output_tokens_per_s"), "rate"),
    ("imbalance (busy max/mean)", ("imbalance", "busy_time"), "ratio"),
    ("imbalance (requests max/mean)", ("imbalance", "requests"), "ratio"),
    ("preemptions", ("engine", "preemptions"), "count"),
)


def _cell(summary: dict[str, Any], path: tuple[str, ...], kind: str) -> str:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return "-"
        value = value[key]
    if path == ("requests",):
        return f"{summary['requests']:,} ({summary['rejected']:,})"
    if value is None:
        return "-"
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "ms":
        return f"{value:,.1f}"
    if kind == "rate":
        return f"{value:,.2f}"
    return f"{value:,}"


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    policies = list(report["policies"])
    rows = [[label, *(_cell(report["policies"][p], path, kind) for p in policies)] for label, path, kind in ROWS]
    return ["metric", *policies], rows


def render_table(report: dict[str, Any], width: int = 100) -> str:
    """The comparison table as text (rich), as the CLI prints it."""
    from rich.console import Console
    from rich.table import Table

    header, rows = table_rows(report)
    trace = report["trace"]
    title = (
        f"{trace['requests']:,} requests, {report['options']['workers']} workers x dp {report['options']['dp_size']}, "
        f"speedup {trace['speedup']:g}, seed {report['seed']}"
    )
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
