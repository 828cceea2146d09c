"""The frontend's calls to a selection service over HTTP (``kvrouter frontend --selection-url URL[,URL...]``):
a single ``kvrouter select-service`` or any replicas of a ``select-service --cluster``, which forward each call to
its scope's owner. The frontend then keeps no routing state: any number of frontends share the service's.

The same calls as ``Routing`` (the in-process core): book, plan, complete a prefill, free. The catalog's reads
(models, workers, endpoints) come from the service's ``GET /workers``, fetched every ``REFRESH_SECONDS``; when a
fetch fails (the service unreachable, a scope moving between replicas: 503) the last catalog is kept.

A call goes to the URL that answered last; one whose connection cannot be made (nothing sent) goes to the next URL,
each URL once. Any other failure is the call's answer: a refusal with the service's status and ``{"error"}`` text,
or 504 when the outcome is unknown (no answer in time). Bounds: one catalog fetch at a time; the connections are
the frontend's ``--max-in-flight``; a call waits ``CALL_SECONDS`` for its answer.

``families`` gives what ``GET /metrics`` shows of it: the calls per URL and outcome, the catalog's age and size.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Collection, Sequence
from typing import Any, Final
from urllib.parse import quote

import httpx
import trio

from kvrouter.actors.core.worker_endpoints import EndpointAllowList
from kvrouter.actors.metric_families import Family, counter, gauge
from kvrouter.api.embedded import RouterError
from kvrouter.api.frontend.routing import PREFILL, TENANT, Plan, Target
from kvrouter.api.http.auth import BearerToken

log = logging.getLogger("kvrouter.frontend")
REFRESH_SECONDS = 0.5
STARTUP_REACH_SECONDS = 5.0  # a frontend started with its service finds it within this; else exit 2
CONNECT_SECONDS = 1.0
CALL_SECONDS = 15.0
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# A call's outcome at one URL, as ``GET /metrics`` counts it.
ANSWERED: Final = "answered"  # any HTTP answer (a refusal too)
NOT_SENT_OUTCOME: Final = "not_sent"  # no connection: the next URL was tried
NO_ANSWER: Final = "no_answer"  # sent, no answer in time: the caller was told 504 (outcome unknown)


def selection_client(max_connections: int) -> httpx.AsyncClient:
    """The client to the selection service: bounded connections, no proxy from the environment."""
    timeout = httpx.Timeout(CALL_SECONDS, connect=CONNECT_SECONDS, pool=CONNECT_SECONDS)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(64, max_connections))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, follow_redirects=False)


def _part(view: dict[str, Any], block_size: int) -> Target:
    """A booked rank from a selection's answer (``/select_and_reserve``, or a part of ``/select_disaggregated``)."""
    overlap_tokens = int(view.get("overlap", {}).get("dp", {}).get(str(view["dp_rank"]), 0))
    return Target(
        view["reservation_id"], view["worker_id"], view["dp_rank"], view["endpoint"], overlap_tokens // block_size
    )


class NotReached(RouterError):
    """No URL of the list could be connected to: nothing was sent (503)."""


class SelectionUnreachable(Exception):
    """At startup, no URL of ``--selection-url`` could be connected to: one line, exit 2."""


class RemoteRouting:
    """The selection service at ``urls``, called over HTTP by every request of the frontend."""

    def __init__(
        self,
        urls: Sequence[str],
        client: httpx.AsyncClient,
        auth: BearerToken | None,
        worker_endpoint_allow: EndpointAllowList | None,
    ) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.client = client
        self.headers = {"authorization": auth.authorization()} if auth is not None else {}
        self.worker_endpoint_allow = worker_endpoint_allow
        self._current = 0
        self._rows: list[dict[str, Any]] = []
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (url, outcome); bounded by urls
        self.catalog_failures = 0
        self.catalog_read_at = math.nan  # trio.current_time() of the last catalog read that succeeded

    @property
    def registration_hint(self) -> str:
        return f"POST /workers to the selection service ({', '.join(self.urls)}), or mock-worker --register"

    # -- the catalog, as last fetched ---------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({row["model_name"] for row in self._rows})

    def worker_ids(self, model: str, excluded_endpoints: Collection[str] = ()) -> list[int]:
        return [worker_id for worker_id, endpoint in self.workers(model) if endpoint not in excluded_endpoints]

    def workers(self, model: str) -> list[tuple[int, str | None]]:
        rows = self._scope_rows(model)
        return sorted((row["worker_id"], row.get("endpoint")) for row in rows)

    def catalog_workers(self) -> list[tuple[str, int, str | None]]:
        return [(model, worker_id, endpoint) for model in self.models() for worker_id, endpoint in self.workers(model)]

    def endpoints(self) -> set[str]:
        return {endpoint for _, _, endpoint in self.catalog_workers() if endpoint is not None}

    def disaggregated(self, model: str) -> bool:
        return any(row.get("worker_role") == PREFILL for row in self._scope_rows(model))

    def _scope_rows(self, model: str) -> list[dict[str, Any]]:
        return [row for row in self._rows if row["model_name"] == model and row.get("tenant_id") == TENANT]

    async def follow_catalog(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fetch ``GET /workers`` now, then every ``REFRESH_SECONDS``; started once the first fetch ended.
        ``SelectionUnreachable`` if no URL could be connected to for ``STARTUP_REACH_SECONDS``: nothing listens
        where the flag says (a service that answers, even with a refusal, is kept and read again)."""
        deadline = trio.current_time() + STARTUP_REACH_SECONDS
        while True:
            try:
                failing = await self._refresh(False, starting=True)
                break
            except NotReached as exc:
                if trio.current_time() >= deadline:
                    raise SelectionUnreachable(
                        f"--selection-url: nothing answered for {STARTUP_REACH_SECONDS:g} s ({exc.message}); start "
                        "the selection service first, or fix --selection-url"
                    ) from None
                await trio.sleep(REFRESH_SECONDS)
        task_status.started()
        while True:
            await trio.sleep(REFRESH_SECONDS)
            failing = await self._refresh(failing)

    async def _refresh(self, failing: bool, *, starting: bool = False) -> bool:
        """One fetch of the catalog; logs the first failure of a run of them and the recovery. Whether it failed.
        ``starting``: ``NotReached`` is raised, not logged."""
        try:
            rows = await self._call("GET", "/workers")
        except RouterError as exc:
            self.catalog_failures += 1
            if starting and isinstance(exc, NotReached):
                raise
            if not failing:
                log.warning("the selection service's catalog could not be read (the last one is kept): %s", exc)
            return True
        if failing:
            log.info("the selection service's catalog is read again (%d workers)", len(rows))
        self._rows = [row for row in rows if isinstance(row, dict) and row.get("lifecycle") != "unschedulable"]
        self.catalog_read_at = trio.current_time()
        return False

    # -- the calls ------------------------------------------------------------------------------------------

    async def book(
        self, model: str, tokens: Sequence[int], reservation_id: str, allowed: Sequence[int] | None = None
    ) -> Target:
        view = await self._call("POST", "/select_and_reserve", _select_body(model, tokens, reservation_id, allowed))
        return _part(view, max(1, int(view["block_size"])))

    async def plan(
        self, model: str, tokens: Sequence[int], request_id: str, allowed: Sequence[int] | None = None
    ) -> Plan:
        if not self.disaggregated(model):
            return Plan(await self.book(model, tokens, request_id, allowed))
        view = await self._call("POST", "/select_disaggregated", _select_body(model, tokens, request_id, allowed))
        block_size = max(1, int(view["block_size"]))
        prefill = _part(view["prefill"], block_size) if view.get("prefill") is not None else None
        return Plan(_part(view["decode"], block_size), prefill)

    async def prefill_complete(self, target: Target, cached_tokens: int | None = None) -> None:
        body = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
        await self._call("POST", f"/reservations/{quote(target.reservation_id, safe='')}/prefill_complete", body)

    async def free(self, target: Target) -> None:
        """Release the booking; one already gone (expired, freed) is not an error here."""
        try:
            await self._call("DELETE", f"/reservations/{quote(target.reservation_id, safe='')}")
        except RouterError as exc:
            if exc.status != 404:
                raise

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The service's answer to ``method path``; ``RouterError`` with its status and text when refused."""
        unreachable = []
        for step in range(len(self.urls)):
            index = (self._current + step) % len(self.urls)
            try:
                answer = await self.client.request(method, self.urls[index] + path, json=body, headers=self.headers)
            except NOT_SENT as exc:
                self.calls[self.urls[index], NOT_SENT_OUTCOME] += 1
                unreachable.append(f"{self.urls[index]} ({exc or type(exc).__name__})")
                continue
            except httpx.HTTPError as exc:
                self.calls[self.urls[index], NO_ANSWER] += 1
                text = f"the selection service at {self.urls[index]} gave no answer ({exc or type(exc).__name__})"
                raise RouterError(504, f"{text}: the outcome of {method} {path} is unknown") from exc
            self.calls[self.urls[index], ANSWERED] += 1
            self._current = index
            return _answer(answer)
        raise NotReached(503, "the selection service cannot be reached: " + ", ".join(unreachable))

    async def metrics(self) -> list[Family]:
        """For ``GET /metrics`` (a ``MetricsEndpoint`` source)."""
        age = trio.current_time() - self.catalog_read_at if not math.isnan(self.catalog_read_at) else math.nan
        return [
            counter(
                "kvrouter_frontend_selection_calls",
                "Calls to the selection service, by URL and outcome (answered, not_sent: tried the next URL, "
                "no_answer: answered 504, outcome unknown)",
                ("url", "outcome"),
                {key: float(count) for key, count in sorted(self.calls.items())},
            ),
            counter(
                "kvrouter_frontend_selection_catalog_failures",
                "Reads of the selection service's catalog (GET /workers) that failed (the last one is kept)",
                (),
                {(): float(self.catalog_failures)},
            ),
            gauge(
                "kvrouter_frontend_selection_catalog_age_seconds",
                "Seconds since the catalog was last read (NaN before the first read)",
                (),
                {(): age},
            ),
            gauge(
                "kvrouter_frontend_selection_catalog_workers",
                "Workers in the catalog as last read",
                (),
                {(): float(len(self.catalog_workers()))},
            ),
        ]


def _answer(answer: httpx.Response) -> Any:
    """The JSON of a 2xx answer; ``RouterError`` with the answer's status and ``{"error"}`` text otherwise."""
    try:
        value = answer.json()
    except ValueError:
        value = None
    if answer.is_success and value is not None:
        return value
    message = value.get("error") if isinstance(value, dict) else None
    status = answer.status_code if not answer.is_success else 502
    retry_after = answer.headers.get("retry-after")
    text = str(message or f"the selection service answered {answer.status_code}")
    raise RouterError(status, text, 1.0 if retry_after is not None else None)


def _select_body(
    model: str, tokens: Sequence[int], reservation_id: str, allowed: Sequence[int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": model, "tenant_id": TENANT, "token_ids": list(tokens)}
    body["reservation_id"] = reservation_id
    if allowed is not None:
        body["allowed_worker_ids"] = list(allowed)
    return body
