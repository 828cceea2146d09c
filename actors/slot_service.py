"""SlotService: the slot tracker's commands and queries, in plain data, over the actor system.

What ``api/routes/slot_tracker.py`` calls. Every write goes to its scope's actor (journaled, durable before the
method returns); a rejection raises ``Refused``. In the slot tracker worker and request ids belong to
their (model, tenant) scope, as in 1.6.1, so there is no service-wide directory here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvrouter.actors.core.commands import (
    AddRequest,
    Command,
    CompletePrefill,
    FreeRequest,
    RegisterWorker,
    UnregisterWorker,
)
from kvrouter.actors.core.decide import no_tracker
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import PotentialLoad, RankLoad, loads, potential_loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.load_feed import LoadChange, LoadChanges, LoadFeed, read_changes
from kvrouter.actors.metric_families import Family, FamilySource
from kvrouter.actors.service_metrics import system_families
from kvrouter.actors.service_support import EVERY_SCOPE, Refused, ScopeFilter, accepted, encode_failure
from kvrouter.actors.system import ActorSystem


def _write_command(write: Sequence[Any], at: int) -> Command:
    """The command of one ``apply_writes`` item (the same command its own method makes)."""
    method = write[0]
    if method == "add":
        hashes = write[6]
        return AddRequest(
            write[3], write[4], write[5], hashes if type(hashes) is tuple else tuple(hashes), write[7], at
        )
    if method == "free":
        return FreeRequest(write[3], at)
    if method == "prefill_complete":
        return CompletePrefill(write[3], at)
    if method == "register":
        return RegisterWorker(write[3], write[4], write[5], write[6], at=at)
    if method == "unregister":
        return UnregisterWorker(write[3], at=at)
    raise ValueError(f"apply_writes has no write {method!r}")


@attrs.frozen
class RegisteredRange:
    scope: ScopeKey
    worker_id: int
    block_size: int | None
    dp_start: int
    dp_size: int


@attrs.frozen
class ScopeLoads:
    scope: ScopeKey
    loads: list[RankLoad]


class SlotService:
    # The methods whose calls ``apply_writes`` takes, many at a time (a front's dispatcher batches them).
    BATCHED_WRITES = frozenset(("register", "unregister", "add", "prefill_complete", "free"))

    def __init__(self, system: ActorSystem) -> None:
        self.system = system
        self._now = system.clock.now_ns
        # Which scopes' loads changed, for GET /ws/loads (one O(1) bump per applied change).
        self.load_feed = LoadFeed()
        system.observers.append(self.load_feed.observe)
        # More figures for GET /metrics: each is called at scrape time and returns plain Family values.
        self.metric_sources: list[FamilySource] = []

    # -- commands: each returns whether it created something ------------------------------------------

    async def register(self, scope: ScopeKey, worker_id: int, block_size: int, dp_start: int, dp_size: int) -> bool:
        command = RegisterWorker(worker_id, block_size, dp_start, dp_size, at=self._now())
        return accepted(await self.system.ask(scope, command)).created

    async def unregister(self, scope: ScopeKey, worker_id: int) -> bool:
        return accepted(await self.system.ask(scope, UnregisterWorker(worker_id, at=self._now()))).created

    async def add(
        self,
        scope: ScopeKey,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: tuple[int, ...],
        isl_tokens: int,
    ) -> bool:
        command = AddRequest(request_id, worker_id, dp_rank, sequence_hashes, isl_tokens, at=self._now())
        return accepted(await self.system.ask(scope, command)).created

    async def prefill_complete(self, scope: ScopeKey, request_id: str) -> bool:
        return accepted(await self.system.ask(scope, CompletePrefill(request_id, at=self._now()))).created

    async def free(self, scope: ScopeKey, request_id: str) -> bool:
        return accepted(await self.system.ask(scope, FreeRequest(request_id, at=self._now()))).created

    async def apply_writes(self, writes: list[Any]) -> list[Any]:
        """Many writes at once, each ``[method, model_name, tenant_id, *arguments]`` naming one of the methods
        above and its arguments after the scope, as plain data (so a front forwards a whole batch in one
        call). Applied as if each were called in list order once the one before it was submitted (the
        writes of one scope are decided in list order); answered once all are durable, each with what its
        method returns (``True``/``False``: created) or, in its place, its failure as data
        (``encode_failure``: refused, overloaded, past the reply deadline, journal unavailable).
        A write naming no method above is a bug of the caller: ``ValueError`` for the lot, nothing applied."""
        at = self._now()
        scopes: dict[tuple[str, str], ScopeKey] = {}  # one ScopeKey per scope of the call, not one per write
        commands = []
        for write in writes:
            named = (write[1], write[2])
            scope = scopes.get(named)
            if scope is None:
                scope = scopes[named] = ScopeKey(write[1], write[2])
            commands.append((scope, _write_command(write, at)))
        outcomes: list[Any] = []
        for outcome in await self.system.ask_many(commands):
            if isinstance(outcome, Accepted):
                outcomes.append(outcome.created)
            elif isinstance(outcome, Rejected):
                outcomes.append(encode_failure(Refused.because(outcome)))
            else:
                outcomes.append(encode_failure(outcome))
        return outcomes

    # -- queries --------------------------------------------------------------------------------------

    async def workers(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[RegisteredRange]:
        """Registered DP ranges, sorted by (model, tenant, worker)."""
        rows = [
            RegisteredRange(state.scope, worker_id, state.slots.block_size, start, size)
            for state in self.system.states()
            if wanted(state.scope)
            for worker_id, (start, size) in sorted(state.slots.workers.items())
        ]
        await self.system.read_barrier()
        return rows

    async def loads(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[ScopeLoads]:
        """Every registered rank's load, idle ones at 0, sorted."""
        rows = [ScopeLoads(state.scope, loads(state)) for state in self.system.states() if wanted(state.scope)]
        await self.system.read_barrier()
        return rows

    async def potential_loads(
        self, scope: ScopeKey, sequence_hashes: Sequence[int], isl_tokens: int
    ) -> list[PotentialLoad]:
        """What each rank of ``scope`` would carry with this prompt; 404 without a tracker."""
        state = self.system.state(scope)
        if state is None:
            await self.system.read_barrier()  # the tracker's absence may come from a write not yet durable
            raise Refused.because(no_tracker(ScopeState(scope)))
        rows = potential_loads(state, sequence_hashes, isl_tokens)
        await self.system.read_barrier(scope)
        return rows

    async def load_changes(self, epoch: str, cursor: int, wait_seconds: float) -> LoadChanges:
        """Loads of the scopes changed after ``cursor`` of feed ``epoch``, waiting up to ``wait_seconds`` seconds
        (at most 2) for one; every scope if the cursor is of another epoch or too old (``GET /ws/loads``)."""

        def measure(scope: ScopeKey, version: int) -> LoadChange:
            state = self.system.state(scope)
            return LoadChange(scope, version, loads(state) if state is not None else None)

        return await read_changes(self.load_feed, self.system, epoch, cursor, wait_seconds, measure)

    async def cluster(self) -> dict[str, Any]:
        """``GET /cluster`` of a service that is no cluster replica (no ``--cluster``): nothing to show."""
        return {"cluster": None, "member": None, "lease": None, "members": [], "scopes": [], "followers": []}

    async def metrics(self) -> list[Family]:
        """The actor side's figures for ``GET /metrics`` (see ``actors/service_metrics.py``)."""
        families = system_families(self.system)
        for source in self.metric_sources:
            families.extend(source())
        return families
