"""The shared composition of a running router: journal writer, actor system, selection service.

Both owners build on it: the HTTP services (``api/process/main.py``, which adds hypercorn and replication) and the
in-process router (``api/embedded.py``, which adds nothing). Keeping the order in one place keeps them alike:
the journal starts first and closes last, the actors run between, and a journal that can no longer be
written halts the actor system (every later command fails with ``JournalUnavailable``) and tells the owner to
stop (``ActorRuntime.stopping``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.fleet.worker_file import FileParser
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.ports import WallClock
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.journal.store import Journal


@attrs.frozen
class ActorRuntime:
    system: ActorSystem
    nursery: trio.Nursery  # the actors' nursery: components start here; cancel it to stop them
    stopping: trio.Event  # set when the journal fails for good; an owner may set it too


@asynccontextmanager
async def running_actors(
    journal: Journal, states: dict[ScopeKey, ScopeState], **system_options: Any
) -> AsyncIterator[ActorRuntime]:
    """Run ``journal``'s writer and an ``ActorSystem`` over the recovered ``states`` (options as
    ``ActorSystem`` takes them; the clock is the wall clock).

    The block's nursery (``ActorRuntime.nursery``) runs until its tasks end or the owner cancels it; then
    the journal flushes and closes. A failed journal write is raised when the block ends, after the
    requests in flight have been answered (``JournalUnavailable``: not acknowledged).
    """
    stopping = trio.Event()
    system = ActorSystem(journal, WallClock(), states, **system_options)
    journal_failure: list[OSError] = []

    async def run_journal(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await journal.run(task_status=task_status)
        except OSError as exc:
            journal_failure.append(exc)
            system.halt(exc)
            stopping.set()

    async with trio.open_nursery() as outer:
        await outer.start(run_journal)
        async with trio.open_nursery() as inner:
            await inner.start(system.run)
            yield ActorRuntime(system, inner, stopping)
        await journal.aclose()
        outer.cancel_scope.cancel()
    if journal_failure:
        raise journal_failure[0]


async def start_select_service(
    system: ActorSystem,
    config: RouterConfig,
    nursery: trio.Nursery,
    listener_slots: ListenerSlots | None = None,
    *,
    before_listeners: Callable[[SelectService], Awaitable[object]] | None = None,
    writer_id: int = 0,
    fleet: FleetOptions | None = None,
    parse_worker_file: FileParser | None = None,
) -> SelectService:
    """The selection service over ``system``: its service object, then the KV listeners of the catalog, then the
    fleet side (``fleet``: a discovery source and Dynamo's event plane, ``actors/fleet``), whose first list is in
    the catalog when this returns.

    ``before_listeners`` runs in between (the HTTP service seeds the index from ``--indexer-peers`` there).
    ``listener_slots`` defaults to what this process affords (it raises the open-files limit once).
    ``writer_id`` versions the session bindings this service makes (its replica sync router id).
    ``parse_worker_file`` reads a ``--discovery-file``'s entries as ``POST /workers`` bodies.
    """
    ingest = KvIngest(system, listener_slots or ListenerSlots.for_this_process())
    service: SelectService = await nursery.start(SelectService(system, config, ingest, writer_id=writer_id).run)
    if before_listeners is not None:
        await before_listeners(service)
    await nursery.start(ingest.run)
    if fleet is not None and fleet.enabled:
        from kvrouter.actors.fleet.fleet import Fleet  # the NATS and etcd clients load only when a fleet is asked for

        await nursery.start(Fleet(service, fleet, parse_worker_file).run)
    return service
