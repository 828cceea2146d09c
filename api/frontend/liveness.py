"""Dead workers stop getting traffic: the frontend's per-worker circuit breakers (``actors/core/breakers.py``)
on the real clock, their probes, and what ``/frontend/stats`` and ``/metrics`` show of them.

A request whose worker fails (connection refused, connect timeout, the connection dropped before any answer, a
5xx other than 503) reports it here: the worker's endpoint is out of selection at once (the proxy books with
that worker left out of ``allowed_worker_ids``), so the requests after it do not pay a retry for it. After the
cool-down a probe (``GET <endpoint>/health``, within the connect timeout) is the half-open trial: any answer
below 500 puts the worker back, anything else keeps it out for a doubled cool-down (up to the cap). A probe
costs the worker one cheap request per cool-down while it is out, and no client request is sent to a worker
that might still be dead. ``docs/frontend.md#dead-workers`` has the figures.

Bounded: one breaker per failing endpoint in the catalog (those of removed workers are dropped before the
next trial), at most one probe in flight per breaker.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import httpx
import trio

from kvrouter.actors.core.breakers import BreakerPolicy, Breakers, Cause
from kvrouter.actors.core.worker_endpoints import parse_http_endpoint
from kvrouter.actors.metric_families import Family, Labels, counter, gauge
from kvrouter.api.frontend.selection_calls import SelectionCalls

log = logging.getLogger("kvrouter.frontend")
PROBE_ROUTE = "/health"  # served by the mock worker, vLLM and SGLang; a 404 still says the server is up


def worker_route_url(endpoint: str, route: str) -> httpx.URL:
    """``route`` under the worker's endpoint (its base path kept); ``InvalidEndpoint`` if it is not one."""
    parsed = parse_http_endpoint(endpoint)
    return httpx.URL(scheme=parsed.scheme, host=parsed.host, port=parsed.port, path=parsed.joined(route))


class Liveness:
    """The breakers of one frontend, shared by every request; ``run`` is its prober task."""

    def __init__(self, routing: SelectionCalls, client: httpx.AsyncClient, policy: BreakerPolicy, probe_timeout: float):
        self.routing = routing
        self.client = client
        self.breakers = Breakers(policy)
        self.probe_timeout = probe_timeout
        self.retried = 0  # requests booked again elsewhere because their worker failed
        self._wake = trio.Event()

    def failed(self, endpoint: str, cause: Cause, error: str) -> None:
        """A request to ``endpoint`` failed: out of selection now (the prober schedules its trial)."""
        if self.breakers.failed(endpoint, cause, error, trio.current_time()):
            log.warning(
                "worker %s is out of selection (%s: %s); trial in %g s",
                endpoint,
                cause.value,
                error,
                self.breakers.policy.cool_down,
            )
            self._wake.set()

    def allowed(self, model: str) -> list[int] | None:
        """The worker ids a request for ``model`` may be booked on; None when no breaker is open (all may)."""
        out = self.breakers.out()
        if not out:
            return None
        return self.routing.worker_ids(model, excluded_endpoints=out)

    def out_text(self, model: str) -> str:
        """Why no worker of ``model`` is available, when every one is out (for the 503)."""
        now = trio.current_time()
        views = {view.endpoint: view for view in self.breakers.views(now)}
        names = [
            f"{worker_id} ({endpoint}): {views[endpoint].last_error}"
            for worker_id, endpoint in self.routing.workers(model)
            if endpoint in views
        ]
        waits = [v.next_trial_in_secs for v in views.values() if v.state == "open"]
        when = f"the next trial is in {min(waits):.1f} s" if waits else "a trial is under way"
        return f"worker {'; '.join(names)} cannot be reached and no other worker of this model is available; {when}"

    def retry_after(self) -> int:
        """Seconds until the earliest trial, for ``Retry-After`` (at least 1)."""
        due = self.breakers.next_trial()
        return 1 if due is None else max(1, math.ceil(due - trio.current_time()))

    # -- the prober ---------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start each due trial; sleep until the next one is due or a breaker opens."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                if self.breakers.out():
                    self.breakers.forget(self.routing.endpoints())
                for endpoint in self.breakers.due(trio.current_time()):
                    nursery.start_soon(self._trial, endpoint)
                wake_at = self.breakers.next_trial()
                with trio.move_on_at(math.inf if wake_at is None else wake_at):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _trial(self, endpoint: str) -> None:
        problem = await self.probe(endpoint)
        if problem is None:
            self.breakers.trial_passed(endpoint)
            log.info("worker %s answered its trial: back in selection", endpoint)
        else:
            self.breakers.trial_failed(endpoint, problem, trio.current_time())
            log.info("worker %s failed its trial (%s): out for another %s", endpoint, problem, self._wait(endpoint))
        self._wake.set()

    def _wait(self, endpoint: str) -> str:
        for view in self.breakers.views(trio.current_time()):
            if view.endpoint == endpoint:
                return f"{view.next_trial_in_secs:g} s"
        return "a while"

    async def probe(self, endpoint: str) -> str | None:
        """None when the worker answers ``GET /health`` below 500 within the probe timeout, else why not."""
        try:
            url = worker_route_url(endpoint, PROBE_ROUTE)
        except ValueError as exc:
            return f"endpoint: {exc}"
        with trio.move_on_after(self.probe_timeout):
            try:
                response = await self.client.get(url, timeout=self.probe_timeout)
            except httpx.HTTPError as exc:
                return f"probe failed: {str(exc) or type(exc).__name__}"
            return None if response.status_code < 500 else f"probe answered {response.status_code}"
        return f"probe timed out after {self.probe_timeout:g} s"

    # -- what operators see -------------------------------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        """``/frontend/stats``'s ``workers``: each worker of the catalog, its breaker and, when out, why."""
        views = {view.endpoint: view for view in self.breakers.views(trio.current_time())}
        rows = []
        for model, worker_id, endpoint in self.routing.catalog_workers():
            row: dict[str, Any] = {"model": model, "worker_id": worker_id, "endpoint": endpoint, "breaker": "closed"}
            view = views.get(endpoint) if endpoint is not None else None
            if view is not None:
                row.update(attrs.asdict(view))
                row["breaker"] = row.pop("state")
            rows.append(row)
        return rows

    def families(self) -> list[Family]:
        """For ``GET /metrics`` (a ``SelectService.metric_sources`` entry)."""
        counts = self.breakers.counts
        openings: dict[Labels, float] = {(cause.value,): float(counts.openings.get(cause, 0)) for cause in Cause}
        trials: dict[Labels, float] = {("passed",): counts.trials_passed, ("failed",): counts.trials_failed}
        return [
            counter(
                "kvrouter_frontend_breaker_openings",
                "Times a worker's circuit breaker opened (the worker taken out of selection), by cause",
                ("cause",),
                openings,
            ),
            counter(
                "kvrouter_frontend_breaker_trials",
                "Half-open trials (probes) of workers out of selection, by outcome",
                ("outcome",),
                trials,
            ),
            counter(
                "kvrouter_frontend_dead_worker_retries",
                "Requests booked again on another worker because theirs failed",
                (),
                {(): float(self.retried)},
            ),
            gauge(
                "kvrouter_frontend_workers_out",
                "Worker endpoints out of selection now (breaker open or half-open)",
                (),
                {(): float(len(self.breakers.out()))},
            ),
        ]
