"""Metrics as plain data: what the actor side hands ``GET /metrics`` (over the fronts' wire if need be).

The actor side keeps its figures in the counters it already has (mailboxes, journal, KV index, listeners,
replicator); at scrape time they are read into ``Family`` values here, which are plain attrs (cattrs
round-trips them), and the API renders them in Prometheus's text format. Nothing here runs per request.

A ``FamilySource`` is any function returning families: the way other components plug their own counters
in (``SelectService.metric_sources``, ``SlotService.metric_sources``). Label sets are bounded: a family
built with ``counter``/``gauge``/``histogram`` keeps at most ``MAX_SERIES_PER_FAMILY`` series (the first in
sorted label order) and reports how many it left out, so one family can never flood a scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs

from kvrouter.journal.latency import BucketCounts

# Per family. Scopes are capped at 10,000 and ranks at 65,536 per service: a family per rank could hold
# 65,536 series, more than a scrape should carry; past this the rest are counted, not listed.
MAX_SERIES_PER_FAMILY = 4096

Labels = tuple[str, ...]


@attrs.frozen
class Series:
    """One label set's value; a histogram's carries its per-bucket counts (not cumulative) and sum."""

    labels: Labels
    value: float = 0.0
    bucket_counts: tuple[int, ...] = ()
    sum: float = 0.0


@attrs.frozen
class Family:
    name: str  # without the ``_total`` suffix for counters (the renderer adds it)
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    label_names: Labels = ()
    series: tuple[Series, ...] = ()
    bounds: tuple[float, ...] = ()  # a histogram's bucket upper bounds (+Inf implied)
    left_out: int = 0  # series over MAX_SERIES_PER_FAMILY, not listed


FamilySource = Callable[[], Iterable[Family]]


def _bounded(values: Mapping[Labels, object]) -> tuple[list[Labels], int]:
    keys = sorted(values)
    return keys[:MAX_SERIES_PER_FAMILY], max(0, len(keys) - MAX_SERIES_PER_FAMILY)


def counter(name: str, help: str, label_names: Labels, values: Mapping[Labels, float]) -> Family:
    keys, left_out = _bounded(values)
    return Family(name, "counter", help, label_names, tuple(Series(k, values[k]) for k in keys), left_out=left_out)


def gauge(name: str, help: str, label_names: Labels, values: Mapping[Labels, float]) -> Family:
    keys, left_out = _bounded(values)
    return Family(name, "gauge", help, label_names, tuple(Series(k, values[k]) for k in keys), left_out=left_out)


def histogram(name: str, help: str, label_names: Labels, values: Mapping[Labels, BucketCounts]) -> Family:
    keys, left_out = _bounded(values)
    bounds = next(iter(values.values())).bounds if values else ()
    series = tuple(Series(k, 0.0, tuple(values[k].counts), values[k].total) for k in keys)
    return Family(name, "histogram", help, label_names, series, bounds, left_out)
