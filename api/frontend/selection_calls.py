"""What the frontend asks of its selection service, whichever runs it: ``Routing`` (the core in this process) or
``RemoteRouting`` (a selection service, or a cluster of them, over HTTP)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from kvrouter.actors.core.worker_endpoints import EndpointAllowList
from kvrouter.api.frontend.routing import Plan, Target


class SelectionCalls(Protocol):
    @property
    def registration_hint(self) -> str:
        """How a worker is added (a client's 503 says it while no worker is registered)."""

    @property
    def worker_endpoint_allow(self) -> EndpointAllowList | None: ...

    def models(self) -> list[str]: ...

    def worker_ids(self, model: str, excluded_endpoints: Collection[str] = ()) -> list[int]: ...

    def workers(self, model: str) -> list[tuple[int, str | None]]: ...

    def catalog_workers(self) -> list[tuple[str, int, str | None]]: ...

    def endpoints(self) -> set[str]: ...

    def disaggregated(self, model: str) -> bool: ...

    async def book(
        self, model: str, tokens: Sequence[int], reservation_id: str, allowed: Sequence[int] | None = None
    ) -> Target: ...

    async def plan(
        self, model: str, tokens: Sequence[int], request_id: str, allowed: Sequence[int] | None = None
    ) -> Plan: ...

    async def prefill_complete(self, target: Target, cached_tokens: int | None = None) -> None: ...

    async def free(self, target: Target) -> None: ...
