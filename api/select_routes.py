"""THE route table of the selection service (seed ``selection-service.md``).

Catalog, selection and reservation writes are commands to the scope actor (journaled, durable
before the reply); inspection routes read actor state between awaits and pass a read barrier.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons, record_view
from kvrouter.actors.core.commands import (
    AddOutputBlock,
    CompleteReservationPrefill,
    ReleaseReservation,
    RemoveWorker,
    Reserve,
    ReserveSelection,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import Accepted, Decision, Rejected
from kvrouter.actors.core.dump import dump_document
from kvrouter.actors.core.ids import ScopeKey, to_i64
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import NO_SCHEDULABLE_WORKERS_ANYWHERE, RankCandidate
from kvrouter.actors.core.selection_queries import (
    SelectionInput,
    candidates,
    overlap_scores,
    partition_loads,
    potential_loads,
    schedulable,
    selection_input,
)
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.system import ActorSystem
from kvrouter.api.http import HttpError, Request, Response, Route, json_response
from kvrouter.api.routes import REASON_STATUS, scope_filter
from kvrouter.api.schemas import parse
from kvrouter.api.select_schemas import OutputBlockBody, ReservationBody, SelectBody, WorkerBody, patched_record

SELECTION_BODY_LIMIT = 8 * 1024 * 1024  # REQUEST_BODY_LIMIT_BYTES of the reference selection service
OK_STATUS = {"status": "ok"}


def refuse(decision: Rejected) -> HttpError:
    return HttpError(REASON_STATUS[decision.reason], decision.message)


def accepted(decision: Decision) -> Accepted:
    if isinstance(decision, Rejected):
        raise refuse(decision)
    return decision


def selection_view(selection: Selection, scope: ScopeKey, selection_id: str | None, reserved: bool) -> dict[str, Any]:
    """The reference's field order; ``reservation_id`` (seed) beside ``selection_id`` (1.6.1)."""
    view: dict[str, Any] = {}
    booking = selection.reservation_id if reserved else selection_id
    if booking is not None:
        view["selection_id"] = booking
        if reserved:
            view["reservation_id"] = booking
    if reserved:
        view["sequence_hashes"] = [to_i64(h) for h in selection.sequence_hashes]
        view["isl_tokens"] = selection.isl_tokens
        view["track_prefill_tokens"] = selection.track_prefill_tokens
    view.update(
        model_name=scope.model_name,
        tenant_id=scope.tenant_id,
        routing_group=scope.tenant_id,
        worker_id=selection.worker_id,
        dp_rank=selection.dp_rank,
        endpoint=selection.endpoint,
        block_size=selection.block_size,
        overlap=selection.overlap,
        effective_prefill_tokens=selection.effective_prefill_tokens,
        potential_decode_blocks=selection.potential_decode_blocks,
    )
    return view


def select_service_routes(system: ActorSystem, ingest: KvIngest, config: RouterConfig) -> list[Route]:
    now = system.clock.now_ns
    use_kv_events = config.use_kv_events

    def view(record: WorkerRecord, state: ScopeState | None) -> dict[str, Any]:
        reasons = not_schedulable_reasons(
            record,
            use_kv_events=use_kv_events,
            partition_block_size=state.selection.partition_block_size if state else None,
        )
        shown = record_view(record, "incomplete" if reasons else "schedulable", reasons)
        listeners = ingest.status(record.worker_id)
        if listeners:
            shown["kv_listeners"] = listeners
        return shown

    def find_worker(worker_id: int) -> ScopeState | None:
        for state in system.states():
            if worker_id in state.selection.catalog:
                return state
        return None

    def find_reservation(reservation_id: str) -> ScopeKey:
        for state in system.states():
            if reservation_id in state.slots.requests:
                return state.scope
        raise HttpError(404, f"reservation {reservation_id} not found")

    def worker_id_param(request: Request) -> int:
        raw = request.path_params["worker_id"]
        if not raw.isdigit() or int(raw) >= 1 << 64:
            raise HttpError(400, f"Invalid URL: Cannot parse `{raw}` to a `u64`")
        return int(raw)

    async def store(record: WorkerRecord) -> dict[str, Any]:
        home = find_worker(record.worker_id)
        if home is not None and home.scope != record.scope:
            # worker_id is service-wide: a record naming another partition moves the worker.
            accepted(await system.ask(home.scope, RemoveWorker(record.worker_id, at=now())))
        accepted(await system.ask(record.scope, UpsertWorker(record, use_kv_events, at=now())))
        ingest.reconcile()
        return view(record, system.state(record.scope))

    async def post_worker(request: Request) -> Response:
        record = parse(WorkerBody, request.json()).to_record()
        return json_response(201, await store(record))

    async def patch_worker(request: Request) -> Response:
        worker_id = worker_id_param(request)
        home = find_worker(worker_id)
        if home is None:
            raise HttpError(404, f"worker {worker_id} not found")
        record = patched_record(home.selection.catalog[worker_id], request.json())
        return json_response(200, await store(record))

    async def delete_worker(request: Request) -> Response:
        worker_id = worker_id_param(request)
        home = find_worker(worker_id)
        if home is None:
            raise HttpError(404, f"worker {worker_id} not found")
        record = home.selection.catalog[worker_id]
        accepted(await system.ask(home.scope, RemoveWorker(worker_id, at=now())))
        ingest.reconcile()
        return json_response(200, record_view(record, "unschedulable", []))

    async def list_workers(request: Request) -> Response:
        wanted = scope_filter(request)
        rows = [
            view(record, state)
            for state in system.states()
            if wanted(state)
            for _, record in sorted(state.selection.catalog.items())
        ]
        await system.read_barrier()
        return json_response(200, rows)

    async def ready(request: Request) -> Response:
        rows, count = [], 0
        for state in system.states():
            for _, record in sorted(state.selection.catalog.items()):
                shown = view(record, state)
                count += shown["lifecycle"] == "schedulable"
                rows.append(shown)
        await system.read_barrier()
        return json_response(200 if count else 503, {"ready": count > 0, "schedulable_workers": count, "workers": rows})

    async def health(request: Request) -> Response:
        return json_response(200, OK_STATUS)

    def require_any_schedulable() -> None:
        """1.6.1 answers differently when the whole service has no schedulable worker."""
        if not any(schedulable(state, use_kv_events) for state in system.states()):
            raise HttpError(503, NO_SCHEDULABLE_WORKERS_ANYWHERE)

    def effective_config(body: SelectBody) -> RouterConfig:
        override = body.override()
        return override.apply(config) if override is not None else config

    async def select(request: Request, reserve: bool) -> Response:
        body = parse(SelectBody, request.json())
        scope = body.scope()
        config_for_request = effective_config(body)
        require_any_schedulable()
        command = SelectWorker(
            body.prompt(),
            config_for_request,
            body.options(),
            reserve=reserve,
            reservation_id=body.reservation_id if reserve else None,
            selection_id=body.selection_id,
            at=now(),
        )
        if reserve:
            decision = accepted(await system.ask(scope, command))
        else:
            decision = accepted(system.query(scope, command))
            await system.read_barrier()
        return json_response(200, selection_view(decision.reply, scope, body.selection_id, reserve))

    async def post_select(request: Request) -> Response:
        return await select(request, False)

    async def post_select_and_reserve(request: Request) -> Response:
        return await select(request, True)

    async def post_reservation(request: Request) -> Response:
        body = parse(ReservationBody, request.json())
        scope = body.scope()
        booking = body.booking_id()
        if body.worker_id is None:
            accepted(await system.ask(scope, ReserveSelection(booking, at=now())))
        else:
            if body.sequence_hashes is None or body.isl_tokens is None:
                missing = "sequence_hashes" if body.sequence_hashes is None else "isl_tokens"
                raise HttpError(
                    422, f"Failed to deserialize the JSON body into the target type: missing field `{missing}`"
                )
            command = Reserve(
                booking,
                body.worker_id,
                body.dp_rank,
                body.sequence_hashes,
                body.isl_tokens,
                body.effective_prefill_tokens,
                body.track_prefill_tokens,
                config_tracks_prefill=config.router_track_prefill_tokens,
                at=now(),
            )
            accepted(await system.ask(scope, command))
        state = system.state(scope)
        request_row = state.slots.requests.get(booking) if state else None
        worker_id = request_row.rank.worker_id if request_row else body.worker_id
        dp_rank = request_row.rank.dp_rank if request_row else body.dp_rank
        record = state.selection.catalog.get(worker_id) if state and worker_id is not None else None
        return json_response(
            201,
            {
                "selection_id": booking,
                "reservation_id": booking,
                "model_name": scope.model_name,
                "tenant_id": scope.tenant_id,
                "routing_group": scope.tenant_id,
                "worker_id": worker_id,
                "dp_rank": dp_rank,
                "endpoint": record.endpoint if record else None,
            },
        )

    async def reservation_prefill_complete(request: Request) -> Response:
        reservation_id = request.path_params["reservation_id"]
        scope = find_reservation(reservation_id)
        accepted(await system.ask(scope, CompleteReservationPrefill(reservation_id, at=now())))
        return json_response(200, OK_STATUS)

    async def reservation_output_block(request: Request) -> Response:
        reservation_id = request.path_params["reservation_id"]
        body = parse(OutputBlockBody, request.json() if request.body.strip() else {})
        if body.decay_fraction is not None and not 0.0 <= body.decay_fraction <= 1.0:
            raise HttpError(400, "decay_fraction must be between 0.0 and 1.0")
        scope = find_reservation(reservation_id)
        accepted(await system.ask(scope, AddOutputBlock(reservation_id, body.decay_fraction, at=now())))
        return json_response(200, OK_STATUS)

    async def delete_reservation(request: Request) -> Response:
        reservation_id = request.path_params["reservation_id"]
        scope = find_reservation(reservation_id)
        accepted(await system.ask(scope, ReleaseReservation(reservation_id, at=now())))
        return json_response(200, OK_STATUS)

    async def loads(request: Request) -> Response:
        wanted = scope_filter(request)
        partitions = []
        for state in system.states():
            rows = partition_loads(state, use_kv_events) if wanted(state) else None
            if rows is None:
                continue
            partitions.append(
                {
                    "model_name": state.scope.model_name,
                    "tenant_id": state.scope.tenant_id,
                    "routing_group": state.scope.tenant_id,
                    "loads": [
                        {
                            "worker_id": row.rank.worker_id,
                            "dp_rank": row.rank.dp_rank,
                            "potential_prefill_tokens": row.active_prefill_tokens,
                            "potential_decode_blocks": row.active_decode_blocks,
                            "active_requests": row.active_requests,
                        }
                        for row in rows
                    ],
                    "pending_count": 0,
                    "pending_isl_tokens": 0,
                }
            )
        await system.read_barrier()
        return json_response(200, partitions)

    def prompt_read(request: Request) -> tuple[SelectionInput, list[RankCandidate], RouterConfig]:
        """The candidates of a prompt read (no booking), as ``/select`` would weigh them."""
        body = parse(SelectBody, request.json())
        effective = effective_config(body)
        require_any_schedulable()
        scope = body.scope()
        state = system.state(scope) or ScopeState(scope)
        prepared = selection_input(state, body.prompt(), use_kv_events)
        if isinstance(prepared, Rejected):
            raise refuse(prepared)
        return prepared, candidates(state, prepared), effective

    async def post_potential_loads(request: Request) -> Response:
        prepared, found, effective = prompt_read(request)
        rows = [
            {
                "worker_id": row.rank.worker_id,
                "dp_rank": row.rank.dp_rank,
                "potential_prefill_tokens": row.potential_prefill_tokens,
                "potential_decode_blocks": row.potential_decode_blocks,
                "active_requests": row.active_requests,
            }
            for row in potential_loads(found, prepared, effective)
        ]
        await system.read_barrier()
        return json_response(200, rows)

    async def post_overlap_scores(request: Request) -> Response:
        prepared, found, _ = prompt_read(request)
        rows = [
            {
                "worker_id": row.rank.worker_id,
                "dp_rank": row.rank.dp_rank,
                "device_blocks": row.device_blocks,
                "host_pinned_blocks": row.host_pinned_blocks,
                "disk_blocks": row.disk_blocks,
                "host_pinned_extension_blocks": row.host_pinned_extension_blocks,
                "disk_extension_blocks": row.disk_extension_blocks,
                "shared_beyond_device_blocks": None,
            }
            for row in overlap_scores(found)
        ]
        await system.read_barrier()
        return json_response(
            200,
            {
                "block_size": prepared.block_size,
                "num_blocks": len(prepared.prompt.local_hashes),
                "workers": rows,
                "shared_cache": {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None},
            },
        )

    async def dump(request: Request) -> Response:
        document = dump_document(system.states())
        await system.read_barrier()
        return json_response(200, document)

    return [
        Route("POST", "/workers", post_worker, json_body=True),
        Route("GET", "/workers", list_workers),
        Route("PATCH", "/workers/{worker_id}", patch_worker, json_body=True),
        Route("DELETE", "/workers/{worker_id}", delete_worker, optional_body=True),
        Route("GET", "/ready", ready),
        Route("GET", "/health", health),
        Route("POST", "/select", post_select, json_body=True),
        Route("POST", "/select_and_reserve", post_select_and_reserve, json_body=True),
        Route("POST", "/reservations", post_reservation, json_body=True),
        Route(
            "POST", "/reservations/{reservation_id}/prefill_complete", reservation_prefill_complete, optional_body=True
        ),
        Route("POST", "/reservations/{reservation_id}/output_block", reservation_output_block, optional_body=True),
        Route("DELETE", "/reservations/{reservation_id}", delete_reservation, optional_body=True),
        Route("GET", "/loads", loads),
        Route("POST", "/potential_loads", post_potential_loads, json_body=True),
        Route("POST", "/overlap_scores", post_overlap_scores, json_body=True),
        Route("GET", "/dump", dump),
    ]
