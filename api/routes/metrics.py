"""``GET /metrics``: the service's figures in Prometheus's text format (prometheus-client renders them).

Two halves. The **actor side's** figures (mailboxes, journal, snapshots, KV index, listeners, replica sync,
cache-hit accuracy) are read at scrape time from counters the components already keep, through the service
objects' ``metrics()`` (plain ``Family`` data, so a front process gets them over the wire like any other
call). The **front's** figures are the HTTP requests it answered, per method, route template and status,
and their latency; and whatever a front-side component registers (``FrontMetrics.counter``/``gauge``).

HTTP counting is the only per-request work. With one process it is plain counters (a dict addition and a
bisect, no lock), rendered by a collector at scrape time. With ``--fronts N`` each front answers only its
share of the requests, and any front may answer the scrape, so the fronts count with prometheus-client's
multiprocess mode: every front writes its values into memory-mapped files in a directory the supervisor
gives them (``PROMETHEUS_MULTIPROC_DIR``), and the scraped front sums every front's files, live. That is
the library's maintained way; shipping counters over the wire would have left every front but the scraped
one as stale as its last push.

Label bounds: ``route`` is the route table's template (``/reservations/{reservation_id}``, never a raw path)
or ``unmatched`` for requests refused before a route was chosen (bad token, unknown path, wrong method);
``method`` is one of the HTTP methods the table uses or ``other``; ``status`` is what the service answers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from kvrouter.actors.mailbox import JournalUnavailable, OutcomeUnknown
from kvrouter.actors.metric_families import Family
from kvrouter.actors.service_support import Refused
from kvrouter.api.http import Request, Response, Route
from kvrouter.api.routes.operations import route as operation_route
from kvrouter.journal.latency import BucketCounts

log = logging.getLogger("kvrouter.api")

METRICS_PATH = "/metrics"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4.encode()
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
UNMATCHED = "unmatched"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Seconds to produce a response: ~50 µs for a cached read, milliseconds for a durable write, up to the
# reply deadline (10 s) for a command stuck behind a full journal.
REQUEST_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0)
REQUESTS = "kvrouter_http_requests"
REQUESTS_HELP = "HTTP requests answered, by method, route template and status"
LATENCY = "kvrouter_http_request_duration_seconds"
LATENCY_HELP = "Time to produce the response (body read and handler, not the send), by method and route template"


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


class PlainRequests:
    """One process: plain counters, rendered at scrape time."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}
        self.latency: dict[tuple[str, str], BucketCounts] = {}

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        self.counts[key] = self.counts.get(key, 0) + 1
        buckets = self.latency.get((method, route))
        if buckets is None:
            buckets = self.latency[(method, route)] = BucketCounts(REQUEST_BOUNDS)
        buckets.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(REQUESTS, REQUESTS_HELP, labels=("method", "route", "status"))
        for (method, route, status), count in sorted(self.counts.items()):
            requests.add_metric((method, route, str(status)), count)
        latency = HistogramMetricFamily(LATENCY, LATENCY_HELP, labels=("method", "route"))
        for (method, route), buckets in sorted(self.latency.items()):
            latency.add_metric((method, route), cumulative(buckets.bounds, buckets.counts), buckets.total)
        yield requests
        yield latency


class SharedRequests:
    """``--fronts N``: prometheus-client metrics in multiprocess mode (the label children are kept, so a
    request costs one counter and one histogram update on memory-mapped files)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(REQUESTS, REQUESTS_HELP, ("method", "route", "status"), registry=registry)
        self.latency = Histogram(LATENCY, LATENCY_HELP, ("method", "route"), registry=registry, buckets=REQUEST_BOUNDS)
        self.children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        children = self.children.get(key)
        if children is None:
            children = self.children[key] = (
                self.requests.labels(method, route, str(status)),
                self.latency.labels(method, route),
            )
        children[0].inc()
        children[1].observe(seconds)


class FrontMetrics:
    """This front's own figures: HTTP requests, and what front-side components register here.

    ``counter``/``gauge`` return prometheus-client metrics that add up across fronts (gauges as the sum
    over live fronts); use them for figures that live in the process serving a connection (WebSocket
    subscribers, say). Figures that live on the actor side belong in the service's ``metric_sources``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_ENV) or None
        self.requests: PlainRequests | SharedRequests
        if self.multiprocess_dir is None:
            self.requests = PlainRequests()
            self.registry.register(self.requests)  # a collector by its collect()
        else:
            self.requests = SharedRequests(self.registry)

    def counter(self, name: str, documentation: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, documentation, tuple(labels), registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, documentation, tuple(labels), registry=self.registry, multiprocess_mode="livesum")

    def collect(self) -> Iterable[Metric]:
        if self.multiprocess_dir is not None:
            return MultiProcessCollector(None, path=self.multiprocess_dir).collect()
        return self.registry.collect()


def cumulative(bounds: Iterable[float], counts: Iterable[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as Prometheus's cumulative ``le`` buckets (the last is +Inf)."""
    out = []
    running = 0
    labels = [*(_bound(b) for b in bounds), "+Inf"]
    for label, count in zip(labels, counts, strict=True):
        running += count
        out.append((label, float(running)))
    return out


def _bound(value: float) -> str:
    return repr(float(value))


def to_metric(family: Family) -> Metric:
    """A plain ``Family`` as prometheus-client's metric family (counters gain ``_total`` on rendering)."""
    labels = family.label_names
    metric: Metric
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=labels)
        for series in family.series:
            metric.add_metric(series.labels, series.value)
    elif family.kind == "gauge":
        metric = GaugeMetricFamily(family.name, family.help, labels=labels)
        for series in family.series:
            metric.add_metric(series.labels, series.value)
    else:
        metric = HistogramMetricFamily(family.name, family.help, labels=labels)
        for series in family.series:
            metric.add_metric(series.labels, cumulative(family.bounds, series.bucket_counts), series.sum)
    return metric


class _Exposition:
    """What ``generate_latest`` reads: anything with ``collect``."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


class MetricsEndpoint:
    """The ``GET /metrics`` handler; the app counts its requests into ``front.requests`` (``api/http/app.py``)."""

    def __init__(self, front: FrontMetrics, sources: Iterable[Any]) -> None:
        self.front = front
        self.sources = tuple(sources)  # service objects with ``async metrics() -> list[Family]``

    async def __call__(self, request: Request) -> Response:
        families: list[Family] = []
        available = 1.0
        for source in self.sources:
            try:
                families.extend(await source.metrics())
            except (OutcomeUnknown, JournalUnavailable, Refused) as exc:
                log.warning("GET /metrics: the actor side's figures are missing: %s", exc)
                available = 0.0
        metrics = [to_metric(family) for family in families]
        left_out = GaugeMetricFamily(
            "kvrouter_metrics_series_left_out",
            "Series a family did not list (over its bound of label sets); 0 everywhere normally",
            labels=("family",),
        )
        for family in families:
            if family.left_out:
                left_out.add_metric((family.name,), family.left_out)
        up = GaugeMetricFamily(
            "kvrouter_metrics_actor_side_up", "1 if the actor side's figures are in this scrape", value=available
        )
        metrics += [left_out, up, *self.front.collect()]
        return Response(200, generate_latest(_Exposition(metrics)), CONTENT_TYPE)


def metrics_route(objects: Any) -> Route:
    """``GET /metrics`` of a service's ``ServiceObjects``: its front's figures and its service objects'."""
    return operation_route("metrics", MetricsEndpoint(objects.front, (objects.service, objects.peers)))
