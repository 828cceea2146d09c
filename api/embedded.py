"""The router in-process: the selection service's actors and service object, called as Python methods.

For runtimes that embed the router instead of calling it over HTTP (the seed's "Using KvPushRouter Python
API"). ``Router`` runs the same composition as ``kvrouter select-service`` (``actors/runtime.py``: journal,
actor system, ``SelectService``, KV listeners) without hypercorn, and every method goes through the
HTTP route's own steps: the same body parsing (so the same validation and messages), the same service
call, the same rendering. A refusal raises ``RouterError`` carrying the status and the ``error`` text the
HTTP API would answer.

``Router`` is trio-native (``async with Router.open(...) as router``); ``api/embedded_thread.py`` hosts
one on a thread of its own for asyncio code and plain threads.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from kvrouter.actors.core.catalog import record_view
from kvrouter.actors.core.commands import IngestKvBatch
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_wire import KvBatch, KvEvent, WireError, decode_batch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.mailbox import JournalUnavailable, OutcomeUnknown, Overloaded
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.runtime import running_actors, start_select_service
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.service_support import Refused, ScopeFilter, accepted
from kvrouter.actors.snapshotter import SnapshotMethod
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import SelectBody, WorkerBody
from kvrouter.api.http import HttpError
from kvrouter.api.process import data_dir as data_dirs
from kvrouter.api.process.main import REPLY_DEADLINE_SECONDS, lock_data_dir
from kvrouter.api.routes.selection import disaggregated_answer, potential_load_view, selection_request, worker_view
from kvrouter.api.routes.support import REASON_STATUS, RETRY_AFTER
from kvrouter.journal.file import FileJournal
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.store import Durability, Journal

# Fields the router fills in itself: its scope, and (in selections) the prompt and the booking's id.
SCOPE_FIELDS = frozenset({"model_name", "tenant_id", "routing_group"})
SELECTION_ARGUMENTS = SCOPE_FIELDS | {"token_ids", "block_hashes", "sequence_hashes", "isl_tokens"}
SELECTION_ARGUMENTS |= {"router_config_override", "reservation_id", "selection_id"}
RETRY_AFTER_SECONDS = 1.0  # what the HTTP API's Retry-After says


class RouterError(Exception):
    """The router refused a call or could not complete it. ``status`` is the HTTP status the selection
    service answers for the same call, ``message`` its ``{"error": ...}`` text (also ``str(error)``),
    ``retry_after`` the seconds of its ``Retry-After`` header when it sends one (overloaded: try again)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class RouterClosed(RouterError):
    """The router is closed (or stopped on a failure): nothing more can be asked of it."""

    def __init__(self, message: str = "the router is closed") -> None:
        super().__init__(503, message)


@contextmanager
def as_router_errors() -> Iterator[None]:
    """The service's and the body parser's failures as ``RouterError``, with the HTTP API's status and text."""
    try:
        yield
    except Refused as refused:
        retry_after = RETRY_AFTER_SECONDS if refused.reason in RETRY_AFTER else None
        raise RouterError(REASON_STATUS[refused.reason], refused.message, retry_after) from None
    except HttpError as bad:
        raise RouterError(bad.status, bad.message) from None
    except Overloaded as full:  # a scope's mailbox stayed full (the app's 503 with Retry-After)
        raise RouterError(503, str(full), RETRY_AFTER_SECONDS) from None
    except JournalUnavailable as gone:
        raise RouterError(504 if gone.maybe_written else 503, str(gone)) from None
    except OutcomeUnknown as late:
        raise RouterError(504, str(late)) from None


class Router:
    """The selection service of one (model, tenant) scope, as async methods on trio.

    Open it with ``async with Router.open(model_name, ...) as router``; it stops (actors cancelled,
    journal flushed and closed) when the block ends. Methods may be called from any task of that trio
    run, concurrently.
    """

    def __init__(self, service: SelectService, scope: ScopeKey) -> None:
        self.service = service  # the object the HTTP routes call (serve it too with select_service_routes)
        self.scope = scope

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model_name: str = "default",
        *,
        tenant_id: str = "default",
        data_dir: str | Path | None = None,
        durability: Durability | str = Durability.ALWAYS,
        fresh: bool = False,
        config: RouterConfig | None = None,
        seed: int | None = None,
        listener_slots: ListenerSlots | None = None,
        reply_deadline: float = REPLY_DEADLINE_SECONDS,
    ) -> AsyncIterator[Router]:
        """Start a router for ``model_name`` (and ``tenant_id``).

        ``data_dir`` keeps a journal there (one process at a time; a restart recovers every worker, indexed
        block and booking); ``None`` keeps it in memory (nothing survives ``close``). ``durability`` and
        ``fresh`` are the service's ``--durability`` and ``--fresh``; ``config`` the router knobs (default:
        the reference's defaults; ``RouterConfig.from_env(os.environ)`` reads the ``DYN_*`` variables);
        ``seed`` roots the random tie-breaks (fresh per process by default).
        """
        scope = ScopeKey(model_name, tenant_id)
        durability = Durability(durability)
        async with _opened_journal(data_dir, durability, fresh) as (journal, states):
            body_error: list[BaseException] = []
            try:
                async with running_actors(
                    journal,
                    states,
                    seed=secrets.randbits(64) if seed is None else seed,
                    reply_deadline=reply_deadline,
                    # A fork in a process with other threads (asyncio, Ray, gRPC) may deadlock the child.
                    snapshot_method=SnapshotMethod.THREAD,
                ) as runtime:
                    service = await start_select_service(
                        runtime.system, config or RouterConfig(), runtime.nursery, listener_slots
                    )
                    try:
                        yield cls(service, scope)
                    except BaseException as exc:
                        body_error.append(exc)
                        raise
                    finally:
                        runtime.nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                alone = _alone(group, body_error)
                if alone is None:
                    raise
                raise alone from None

    # -- the catalog ----------------------------------------------------------------------------------

    async def register_worker(self, worker_id: int, **fields: Any) -> dict[str, Any]:
        """Create or replace worker ``worker_id`` in this router's scope: the fields of ``POST /workers``
        (``endpoint``, ``block_size``, ``kv_events_endpoint`` for ZMQ KV events, ``data_parallel_size``, ...).
        Returns the record as ``POST /workers`` answers it (with ``lifecycle``)."""
        misplaced = SCOPE_FIELDS & fields.keys()
        if misplaced:
            raise TypeError(
                f"register_worker: {', '.join(sorted(misplaced))} is set by the router ({self.scope.describe()})"
            )
        body = {
            **fields,
            "worker_id": worker_id,
            "model_name": self.scope.model_name,
            "tenant_id": self.scope.tenant_id,
        }
        with as_router_errors():
            record = parse(WorkerBody, body).to_record()
            return worker_view(await self.service.put_worker(record))

    async def unregister_worker(self, worker_id: int) -> dict[str, Any]:
        """Remove the worker (its KV listeners stop, its blocks leave the index); returns its last record."""
        with as_router_errors():
            record = await self.service.remove_worker(worker_id)
        return record_view(record, "unschedulable", [])

    async def workers(self) -> list[dict[str, Any]]:
        """This scope's workers as ``GET /workers`` shows them (lifecycle, KV listener states)."""
        with as_router_errors():
            statuses = await self.service.workers(ScopeFilter(self.scope.model_name, self.scope.tenant_id))
        return [worker_view(status) for status in statuses]

    # -- KV events ------------------------------------------------------------------------------------

    async def apply_kv_events(
        self,
        worker_id: int,
        batch: bytes | KvBatch | Sequence[KvEvent],
        *,
        dp_rank: int = 0,
        seq: int | None = None,
    ) -> None:
        """Index one KV-event batch of a registered worker rank, as its ZMQ listener would.

        ``batch`` is the engine's msgpack payload (the third frame of a KV-event message, vLLM/SGLang
        wire format), a decoded ``KvBatch``, or a list of ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``. ``seq`` is the stream's sequence number, if it has one (it becomes the
        rank's watermark). Returns once the batch is applied; like the listener's batches it is journaled
        without waiting for fsync (a crash may lose it; the engine's replay brings it back).
        """
        if isinstance(batch, bytes | bytearray | memoryview):
            try:
                batch = decode_batch(bytes(batch))
            except WireError as exc:
                raise RouterError(400, f"not a KV-event batch: {exc}") from None
        elif not isinstance(batch, KvBatch):
            batch = KvBatch(0.0, tuple(batch))
        state = self.service.system.state(self.scope)
        record = state.selection.catalog.get(worker_id) if state is not None else None
        if record is None:
            raise RouterError(404, f"worker {worker_id} not found")
        if all(rank.dp_rank != dp_rank for rank in record.ranks):
            raise RouterError(404, f"worker {worker_id} dp_rank {dp_rank} not found for {self.scope.describe()}")
        system = self.service.system
        command = IngestKvBatch(
            worker_id, dp_rank, seq, batch, at=system.clock.now_ns(), max_index_blocks=system.max_index_blocks_per_scope
        )
        with as_router_errors():
            decision, _ = await self.service.system.apply(self.scope, command)
            accepted(decision)

    # -- selection and the request lifecycle ----------------------------------------------------------

    async def best_worker(
        self,
        token_ids: Sequence[int],
        router_config_override: dict[str, Any] | None = None,
        request_id: str | None = None,
        **selection: Any,
    ) -> tuple[int, int, int]:
        """The rank ``POST /select`` would pick for ``token_ids``: ``(worker_id, dp_rank, overlap_blocks)``,
        ``overlap_blocks`` being the prompt blocks already cached on that rank's device tier.

        Without ``request_id`` nothing is booked. With it the request is booked on that rank, as
        ``POST /select_and_reserve`` with ``reservation_id``: call ``mark_prefill_complete`` after its
        first token and ``free`` when it ends (requests left booked expire after 300 s). ``selection``
        takes the other fields of a ``/select`` body (``routing_constraints``, ``session_id``,
        ``router_mode``, ``pinned_worker``, ``allowed_worker_ids``, ``expected_output_tokens``, ...).
        """
        misplaced = SELECTION_ARGUMENTS & selection.keys()
        if misplaced:
            named = ", ".join(sorted(misplaced))
            raise TypeError(f"best_worker: {named} is an argument of its own or set by the router")
        body = {**selection, **self._prompt_body(token_ids, router_config_override)}
        if request_id is not None:
            body["reservation_id"] = request_id
        with as_router_errors():
            request = selection_request(parse(SelectBody, body))
            if request_id is None:
                chosen = await self.service.select(request)
            else:
                chosen = await self.service.select_and_reserve(request)
        overlap_tokens: int = chosen.overlap["dp"][str(chosen.dp_rank)]
        return chosen.worker_id, chosen.dp_rank, overlap_tokens // chosen.block_size

    async def select_disaggregated(
        self,
        token_ids: Sequence[int],
        request_id: str,
        router_config_override: dict[str, Any] | None = None,
        **selection: Any,
    ) -> dict[str, Any]:
        """A prefill rank and a decode rank for ``token_ids``, booked as ``<request_id>:prefill`` and
        ``<request_id>:decode`` (or only the decode part when no prefill rank is available): what ``POST
        /select_disaggregated`` answers. Each part takes ``mark_prefill_complete`` and ``free`` by its own id.
        ``selection`` takes the other fields of the body, as ``best_worker``'s."""
        misplaced = SELECTION_ARGUMENTS & selection.keys()
        if misplaced:
            named = ", ".join(sorted(misplaced))
            raise TypeError(f"select_disaggregated: {named} is an argument of its own or set by the router")
        body = {**selection, **self._prompt_body(token_ids, router_config_override), "reservation_id": request_id}
        with as_router_errors():
            return await disaggregated_answer(self.service, parse(SelectBody, body))

    async def get_potential_loads(
        self, token_ids: Sequence[int], router_config_override: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """What each schedulable rank would carry with ``token_ids``, as ``POST /potential_loads`` answers:
        ``worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks, active_requests``."""
        with as_router_errors():
            body = parse(SelectBody, self._prompt_body(token_ids, router_config_override))
            rows = await self.service.potential_loads(body.scope(), body.prompt(), body.override())
        return [potential_load_view(row) for row in rows]

    async def mark_prefill_complete(self, request_id: str) -> None:
        """The booked request has produced its first token: its prefill tokens no longer count."""
        with as_router_errors():
            await self.service.complete_prefill(request_id)

    async def add_output_block(self, request_id: str, decay_fraction: float | None = None) -> None:
        """One more output block for the booked request (``POST /reservations/{id}/output_block``)."""
        with as_router_errors():
            await self.service.add_output_block(request_id, decay_fraction)

    async def free(self, request_id: str) -> None:
        """The booked request has ended: release what it held."""
        with as_router_errors():
            await self.service.release(request_id)

    async def dump_events(self) -> str:
        """The KV index as JSON text, in ``GET /dump``'s format (the standalone indexer's recovery format)."""
        with as_router_errors():
            return orjson.dumps(await self.service.dump()).decode()

    def _prompt_body(self, token_ids: Sequence[int], override: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model_name": self.scope.model_name,
            "tenant_id": self.scope.tenant_id,
            "token_ids": list(token_ids) if isinstance(token_ids, tuple | range) else token_ids,
        }
        if override is not None:
            body["router_config_override"] = override
        return body


@asynccontextmanager
async def _opened_journal(
    data_dir: str | Path | None, durability: Durability, fresh: bool
) -> AsyncIterator[tuple[Journal, dict[ScopeKey, Any]]]:
    """The journal and what it recovers: files under ``data_dir`` (locked for this router), or memory."""
    if data_dir is None:
        yield MemoryJournal(), {}
        return
    path = Path(data_dir)
    with lock_data_dir(path):
        # The selection service's journal: either may open the other's directory, a slot tracker's is refused.
        data_dirs.check_owner(path, data_dirs.SELECTION_SERVICE)
        journal = await trio.to_thread.run_sync(partial(FileJournal.open, path, durability, fresh=fresh))
        recovered = await trio.to_thread.run_sync(recover, journal)
        data_dirs.claim(path, data_dirs.SELECTION_SERVICE, recovered.states.values())
        yield journal, recovered.states


def _alone(group: BaseExceptionGroup[BaseException], body_error: list[BaseException]) -> BaseException | None:
    """The nurseries wrap whatever leaves them in exception groups: the caller's own exception from the
    ``async with`` block, if it is all the group holds, to be raised as itself (else None: keep the group)."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    if len(leaves) == 1 and body_error and leaves[0] is body_error[0]:
        return leaves[0]
    return None
