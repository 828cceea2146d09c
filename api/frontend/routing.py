"""The frontend's calls into the selection service's core (in-process, journaled): choose and book a worker
rank for a prompt, mark its prefill complete, free it. Refusals become ``RouterError`` with the status and
text the selection service's HTTP API would answer for the same call."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import attrs

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.core.worker_endpoints import EndpointAllowList
from kvrouter.actors.select_service import SelectService
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import SelectBody
from kvrouter.api.embedded import RouterError, as_router_errors
from kvrouter.api.routes.selection import selection_request

TENANT = "default"
# Every booking the frontend's proxy makes has an id starting with this (``fe-<process>-<n>``, with ``:retry``,
# ``:prefill`` or ``:decode`` after it): at a restart, the ones still booked died with the process and are freed.
BOOKING_PREFIX = "fe-"
PREFILL = "prefill"


@attrs.frozen
class Target:
    """A booked worker rank: where to send the request and what to tell the client about it."""

    reservation_id: str
    worker_id: int
    dp_rank: int
    endpoint: str | None
    overlap_blocks: int


@attrs.frozen
class Plan:
    """Where a request goes: ``decode`` always, after ``prefill`` when the pool is disaggregated."""

    decode: Target
    prefill: Target | None = None


def _target(chosen: Selection, reservation_id: str) -> Target:
    overlap_tokens = int(chosen.overlap.get("dp", {}).get(str(chosen.dp_rank), 0))
    block_size = max(1, chosen.block_size)
    return Target(reservation_id, chosen.worker_id, chosen.dp_rank, chosen.endpoint, overlap_tokens // block_size)


class Routing:
    """One selection service core shared by every request of the frontend."""

    def __init__(self, service: SelectService) -> None:
        self.service = service

    registration_hint = "POST /workers, --workers or mock-worker --register"

    @property
    def worker_endpoint_allow(self) -> EndpointAllowList | None:
        """The allow-list a worker's endpoint must pass to be forwarded to (``--worker-endpoint-allow``)."""
        return self.service.config.worker_endpoint_allow

    def models(self) -> list[str]:
        """The models some registered worker serves, sorted."""
        return sorted({state.scope.model_name for state in self.service.system.states() if state.selection.catalog})

    def worker_ids(self, model: str, excluded_endpoints: Collection[str] = ()) -> list[int]:
        """The workers of ``model``, less those whose endpoint is in ``excluded_endpoints`` (out of selection)."""
        return [worker_id for worker_id, endpoint in self.workers(model) if endpoint not in excluded_endpoints]

    def workers(self, model: str) -> list[tuple[int, str | None]]:
        """The (worker id, endpoint) of each worker of ``model``, by id."""
        state = self.service.system.state(ScopeKey(model, TENANT))
        if state is None:
            return []
        return [(worker_id, record.endpoint) for worker_id, record in sorted(state.selection.catalog.items())]

    def catalog_workers(self) -> list[tuple[str, int, str | None]]:
        """The (model, worker id, endpoint) of every worker the frontend routes to."""
        return [(model, worker_id, endpoint) for model in self.models() for worker_id, endpoint in self.workers(model)]

    def endpoints(self) -> set[str]:
        """Every worker endpoint in the catalog (a breaker of any other is dropped)."""
        return {endpoint for _, _, endpoint in self.catalog_workers() if endpoint is not None}

    def disaggregated(self, model: str) -> bool:
        """Whether prefill workers are registered for ``model`` (the seed's automatic prefill router)."""
        state = self.service.system.state(ScopeKey(model, TENANT))
        if state is None:
            return False
        return any(record.worker_role == PREFILL for record in state.selection.catalog.values())

    async def book(
        self, model: str, tokens: Sequence[int], reservation_id: str, allowed: Sequence[int] | None = None
    ) -> Target:
        """Choose a rank by the service's router mode and book ``reservation_id`` on it."""
        body: dict[str, Any] = {"model_name": model, "tenant_id": TENANT, "token_ids": tokens}
        body["reservation_id"] = reservation_id
        if allowed is not None:
            body["allowed_worker_ids"] = list(allowed)
        with as_router_errors():
            chosen = await self.service.select_and_reserve(selection_request(parse(SelectBody, body)))
        return _target(chosen, reservation_id)

    async def plan(
        self, model: str, tokens: Sequence[int], request_id: str, allowed: Sequence[int] | None = None
    ) -> Plan:
        """A prefill and a decode booking when prefill workers exist (``<id>:prefill``, ``<id>:decode``; decode
        only when none is available), else one booking ``request_id``; only on ``allowed`` workers if given."""
        if not self.disaggregated(model):
            return Plan(await self.book(model, tokens, request_id, allowed))
        body: dict[str, Any] = {"model_name": model, "tenant_id": TENANT, "token_ids": tokens}
        body["reservation_id"] = request_id
        if allowed is not None:
            body["allowed_worker_ids"] = list(allowed)
        with as_router_errors():
            chosen = await self.service.select_disaggregated(selection_request(parse(SelectBody, body)))
        decode = _target(chosen.decode, chosen.decode.reservation_id or f"{request_id}:decode")
        prefill = None
        if chosen.prefill is not None:
            prefill = _target(chosen.prefill, chosen.prefill.reservation_id or f"{request_id}:prefill")
        return Plan(decode, prefill)

    async def prefill_complete(self, target: Target, cached_tokens: int | None = None) -> None:
        """``cached_tokens``: what the worker reported cached, when known then (the service compares it with
        its prediction)."""
        with as_router_errors():
            await self.service.complete_prefill(target.reservation_id, cached_tokens)

    async def free(self, target: Target) -> None:
        """Release the booking; one already gone (expired, freed) is not an error here."""
        try:
            with as_router_errors():
                await self.service.release(target.reservation_id)
        except RouterError as exc:
            if exc.status != 404:
                raise

    async def free_orphans(self) -> int:
        """Free every booking a previous run of this frontend left (its requests died with it), through the
        journaled release: a crash in the middle leaves the rest for the next start. The count freed."""
        orphans = [
            request_id
            for state in self.service.system.states()
            for request_id in state.slots.requests
            if request_id.startswith(BOOKING_PREFIX)
        ]
        for request_id in orphans:
            with as_router_errors():
                try:
                    await self.service.release(request_id)
                except RouterError as exc:
                    if exc.status != 404:
                        raise
        return len(orphans)
