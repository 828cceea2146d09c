"""The selection service's routes (seed ``selection-service.md``): each handler parses its body, calls
``SelectService``, renders the result. Service-wide identity, claims and read barriers live in the
service object (``actors/select_service.py``); failures are answered by ``api/route_support.bound``.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.catalog import WorkerPatch, record_view
from kvrouter.actors.core.disaggregation import DisaggregatedSelection
from kvrouter.actors.core.endpoints import parse_decimal
from kvrouter.actors.core.explanation import Explanation, TtftBreakdown
from kvrouter.actors.core.ids import U64_MASK, to_i64
from kvrouter.actors.core.queries import PotentialLoad
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.select_service import Booking, PartitionLoads, SelectionRequest, SelectService, WorkerStatus
from kvrouter.api.bodies.schemas import _deserialize_failed, parse
from kvrouter.api.bodies.select_schemas import (
    OutputBlockBody,
    ReservationBody,
    SelectBody,
    WorkerBody,
    cached_tokens_of,
    request_select_body,
    worker_patch,
)
from kvrouter.api.bodies.wire import json_kind
from kvrouter.api.http import UNPARSED, HttpError, Request, Response, Route, json_response
from kvrouter.api.routes.operations import route
from kvrouter.api.routes.support import bound, scope_fields, scope_filter

SELECTION_BODY_LIMIT = 8 * 1024 * 1024  # REQUEST_BODY_LIMIT_BYTES of the reference selection service
OK_STATUS = {"status": "ok"}


# -- rendering --------------------------------------------------------------------------------------------


def worker_view(status: WorkerStatus) -> dict[str, Any]:
    shown = record_view(status.record, "incomplete" if status.reasons else "schedulable", list(status.reasons))
    if status.listeners:
        shown["kv_listeners"] = status.listeners
    if status.kv_modes:
        shown["kv_modes"] = status.kv_modes
    if status.out_of_selection:  # only while a rank is out (actors/core/kv_liveness.py)
        shown["out_of_selection"] = status.out_of_selection
    if status.tokenizer:  # a discovered card's tokenizer checksum against --model-path's
        shown["tokenizer"] = status.tokenizer
    if status.index_evicted_blocks or status.index_refused_blocks:  # only once the scope's index met its cap
        shown["kv_index"] = {
            "evicted_blocks": status.index_evicted_blocks,
            "refused_blocks": status.index_refused_blocks,
        }
    return shown


def selection_view(selection: Selection, body: SelectBody, reserved: bool) -> dict[str, Any]:
    """The reference's field order, ``reservation_id`` (seed) after ``selection_id`` (1.6.1). Each id is
    echoed as given; a booking under a generated id shows it as both (1.6.1 names it ``selection_id``)."""
    view: dict[str, Any] = {}
    selection_id = body.selection_id
    if reserved and selection_id is None and body.reservation_id is None:
        selection_id = selection.reservation_id
    if selection_id is not None:
        view["selection_id"] = selection_id
    if reserved:
        view["reservation_id"] = selection.reservation_id
        view["sequence_hashes"] = [to_i64(h) for h in selection.sequence_hashes]
        view["isl_tokens"] = selection.isl_tokens
        view["track_prefill_tokens"] = selection.track_prefill_tokens
    view.update(scope_fields(body.scope()))
    view.update(
        worker_id=selection.worker_id,
        dp_rank=selection.dp_rank,
        endpoint=selection.endpoint,
        block_size=selection.block_size,
        overlap=selection.overlap,
        effective_prefill_tokens=selection.effective_prefill_tokens,
        potential_decode_blocks=selection.potential_decode_blocks,
    )
    if body.explain and selection.explanation is not None:
        view["explain"] = explanation_view(selection.explanation)
    return view


def explanation_view(explanation: Explanation) -> dict[str, Any]:
    """What ``"explain": true`` adds to a reply (and a ``/ws/decisions`` message holds): the reason, the rule,
    the mode and temperature, and every candidate's terms."""
    return {
        "reason": explanation.reason,
        "rule": explanation.rule,
        "router_mode": explanation.router_mode,
        "temperature": explanation.temperature,
        "isl_tokens": explanation.isl_tokens,
        "block_size": explanation.block_size,
        "candidates": [
            {
                "worker_id": c.worker_id,
                "dp_rank": c.dp_rank,
                "overlap_blocks": {
                    "device": c.device_blocks,
                    "host": c.host_blocks,
                    "disk": c.disk_blocks,
                    "external": c.external_blocks,
                },
                "cached_tokens": c.cached_tokens,
                "new_prefill_tokens": c.new_prefill_tokens,
                "active_prefill_tokens": c.active_prefill_tokens,
                "active_decode_blocks": c.active_decode_blocks,
                "active_requests": c.active_requests,
                "potential_decode_blocks": c.potential_decode_blocks,
                "cost": c.cost,
                "excluded": c.excluded,
                **({"ttft_ms": ttft_view(c.ttft)} if c.ttft is not None else {}),
            }
            for c in explanation.candidates
        ],
    }


def ttft_view(terms: TtftBreakdown) -> dict[str, Any]:
    """A ``kv_ttft`` candidate's predicted time to first token, term by term, and its cost (milliseconds)."""
    return {
        "queue": terms.queue_ms,
        "prefill": terms.prefill_ms,
        "decode": terms.decode_ms,
        "ttft": terms.ttft_ms,
        "load": terms.load_ms,
        "cost": terms.cost_ms,
        "cached_tokens": terms.cached_tokens,
        "queued_tokens": terms.queued_tokens,
        "prefill_tokens_per_s": terms.tokens_per_s,
        "fit_samples": terms.fit_samples,
        "overlap_factor": terms.overlap_factor,
    }


def potential_load_view(row: PotentialLoad) -> dict[str, Any]:
    return {
        "worker_id": row.rank.worker_id,
        "dp_rank": row.rank.dp_rank,
        "potential_prefill_tokens": row.potential_prefill_tokens,
        "potential_decode_blocks": row.potential_decode_blocks,
        "active_requests": row.active_requests,
    }


def booking_view(booking: Booking) -> dict[str, Any]:
    return {
        "selection_id": booking.reservation_id,
        "reservation_id": booking.reservation_id,
        **scope_fields(booking.scope),
        "worker_id": booking.worker_id,
        "dp_rank": booking.dp_rank,
        "endpoint": booking.endpoint,
    }


def selection_request(body: SelectBody) -> SelectionRequest:
    return SelectionRequest(
        body.scope(),
        body.prompt(),
        body.options(),
        body.override(),
        body.selection_id,
        body.reservation_id,
        router_mode=body.mode(),
        explain=body.explain,
    )


def part_view(part: Selection) -> dict[str, Any]:
    return {
        "reservation_id": part.reservation_id,
        "worker_id": part.worker_id,
        "dp_rank": part.dp_rank,
        "endpoint": part.endpoint,
        "overlap": part.overlap,
        # a decode part computes no prefill (its KV cache arrives by transfer) unless it prefills itself
        "effective_prefill_tokens": part.effective_prefill_tokens if part.track_prefill_tokens else 0,
        "potential_decode_blocks": part.potential_decode_blocks,
    }


def disaggregated_view(chosen: DisaggregatedSelection, body: SelectBody) -> dict[str, Any]:
    """Both parts with their own reservation ids (each has the usual lifecycle routes), and the decode
    stage's constraints as merged from the request's and the prefill worker's KV-transfer policy."""
    decode = chosen.decode
    view: dict[str, Any] = {"reservation_id": chosen.reservation_id, **scope_fields(body.scope())}
    view.update(
        mode="disaggregated" if chosen.prefill is not None else "decode_only",
        block_size=decode.block_size,
        isl_tokens=decode.isl_tokens,
        sequence_hashes=[to_i64(h) for h in decode.sequence_hashes],
        prefill=part_view(chosen.prefill) if chosen.prefill is not None else None,
        decode=part_view(decode),
        decode_constraints={
            "required_taints": sorted(chosen.decode_constraints.required),
            "preferred_taints": dict(chosen.decode_constraints.preferred),
        },
    )
    if chosen.fallback_reason is not None:
        view["fallback_reason"] = chosen.fallback_reason
    return view


def worker_id_param(request: Request) -> int:
    raw = request.path_params["worker_id"]
    worker_id = parse_decimal(raw, U64_MASK)
    if worker_id is None:
        raise HttpError(400, f"Invalid URL: Cannot parse `{raw}` to a `u64`")
    return worker_id


def patch_changes(value: Any) -> WorkerPatch:
    """A PATCH body: a JSON object whose fields have the record's types (checked before the worker is
    looked up, as 1.6.1 deserialises first). A null leaves the field as it is, as in 1.6.1."""
    if type(value) is not dict:
        raise HttpError(422, _deserialize_failed(f"invalid type: {json_kind(value)}, expected a JSON object"))
    return worker_patch({name: field for name, field in value.items() if field is not None and name != "worker_id"})


# -- the catalog ------------------------------------------------------------------------------------------


async def post_worker(service: SelectService, request: Request) -> Response:
    record = parse(WorkerBody, request.json()).to_record()
    return json_response(201, worker_view(await service.put_worker(record)))


async def patch_worker(service: SelectService, request: Request) -> Response:
    worker_id = worker_id_param(request)
    patch = patch_changes(request.json())
    return json_response(200, worker_view(await service.patch_worker(worker_id, patch)))


async def delete_worker(service: SelectService, request: Request) -> Response:
    record = await service.remove_worker(worker_id_param(request))
    return json_response(200, record_view(record, "unschedulable", []))


async def list_workers(service: SelectService, request: Request) -> Response:
    return json_response(200, [worker_view(status) for status in await service.workers(scope_filter(request))])


async def ready(service: SelectService, request: Request) -> Response:
    statuses = await service.workers()
    count = sum(status.schedulable for status in statuses)
    rows = [worker_view(status) for status in statuses]
    body = {"ready": count > 0, "schedulable_workers": count, "workers": rows, **await service.readiness()}
    return json_response(200 if count else 503, body)


async def health(service: SelectService, request: Request) -> Response:
    return json_response(200, OK_STATUS)


# -- selection and reservations ---------------------------------------------------------------------------


async def select(service: SelectService, request: Request) -> Response:
    body = request_select_body(request)
    return json_response(200, selection_view(await service.select(selection_request(body)), body, False))


async def select_and_reserve(service: SelectService, request: Request) -> Response:
    body = request_select_body(request)
    return json_response(200, selection_view(await service.select_and_reserve(selection_request(body)), body, True))


async def select_disaggregated(service: SelectService, request: Request) -> Response:
    body = request_select_body(request)
    return json_response(200, await disaggregated_answer(service, body))


async def disaggregated_answer(service: SelectService, body: SelectBody) -> dict[str, Any]:
    """Book a disaggregated selection and render it (the route's and the in-process router's)."""
    if body.pinned_worker is not None:
        raise HttpError(400, "pinned_worker is not available for a disaggregated selection (it picks two workers)")
    return disaggregated_view(await service.select_disaggregated(selection_request(body)), body)


async def post_reservation(service: SelectService, request: Request) -> Response:
    body = parse(ReservationBody, request.json())
    booking_id = body.booking_id()
    if body.worker_id is None:
        return json_response(201, booking_view(await service.reserve_selection(body.scope(), booking_id)))
    if body.sequence_hashes is None or body.isl_tokens is None:
        missing = "sequence_hashes" if body.sequence_hashes is None else "isl_tokens"
        raise HttpError(422, _deserialize_failed(f"missing field `{missing}`"))
    booking = await service.reserve(
        body.scope(),
        booking_id,
        body.worker_id,
        body.dp_rank,
        body.sequence_hashes,
        body.isl_tokens,
        body.effective_prefill_tokens,
        body.track_prefill_tokens,
        body.expected_output_tokens,
    )
    return json_response(201, booking_view(booking))


async def prefill_complete(service: SelectService, request: Request) -> Response:
    # An optional JSON body reports the engine's cached tokens; none (or one of another type) is ignored, as 1.6.1.
    given = request.parsed is not UNPARSED or request.body.strip()
    cached_tokens = cached_tokens_of(request.json()) if given else None
    await service.complete_prefill(request.path_params["reservation_id"], cached_tokens)
    return json_response(200, OK_STATUS)


async def output_block(service: SelectService, request: Request) -> Response:
    body = parse(OutputBlockBody, request.json())
    await service.add_output_block(request.path_params["reservation_id"], body.decay_fraction)
    return json_response(200, OK_STATUS)


async def delete_reservation(service: SelectService, request: Request) -> Response:
    await service.release(request.path_params["reservation_id"])
    return json_response(200, OK_STATUS)


# -- inspection -------------------------------------------------------------------------------------------


def partition_view(partition: PartitionLoads) -> dict[str, Any]:
    """One ``GET /loads`` partition (also what ``GET /ws/loads`` sends, with its ``seq``)."""
    return {
        **scope_fields(partition.scope),
        "loads": [
            {
                "worker_id": row.rank.worker_id,
                "dp_rank": row.rank.dp_rank,
                "potential_prefill_tokens": row.active_prefill_tokens,
                "potential_decode_blocks": row.active_decode_blocks,
                "active_requests": row.active_requests,
            }
            for row in partition.loads
        ],
        "pending_count": partition.pending_count,
        "pending_isl_tokens": min(partition.pending_isl_tokens, U64_MASK),  # u64 on the wire: saturate
    }


async def loads(service: SelectService, request: Request) -> Response:
    partitions = [partition_view(partition) for partition in await service.loads(scope_filter(request))]
    return json_response(200, partitions)


async def potential_loads(service: SelectService, request: Request) -> Response:
    body = request_select_body(request)
    rows = await service.potential_loads(body.scope(), body.prompt(), body.override())
    return json_response(200, [potential_load_view(row) for row in rows])


async def overlap_scores(service: SelectService, request: Request) -> Response:
    body = request_select_body(request)
    body.override()  # validated as /select validates it
    scores = await service.overlap_scores(body.scope(), body.prompt())
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
        for row in scores.workers
    ]
    return json_response(
        200,
        {
            "block_size": scores.block_size,
            "num_blocks": scores.num_blocks,
            "workers": rows,
            "shared_cache": {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None},
        },
    )


async def dump(service: SelectService, request: Request) -> Response:
    return json_response(200, await service.dump())


async def cluster(service: SelectService, request: Request) -> Response:
    return json_response(200, await service.cluster())


def select_service_routes(service: SelectService) -> list[Route]:
    handlers = {
        "put_worker": post_worker,
        "workers": list_workers,
        "patch_worker": patch_worker,
        "remove_worker": delete_worker,
        "ready": ready,
        "health": health,
        "select": select,
        "select_and_reserve": select_and_reserve,
        "select_disaggregated": select_disaggregated,
        "reserve": post_reservation,
        "reservation_prefill_complete": prefill_complete,
        "output_block": output_block,
        "release": delete_reservation,
        "loads": loads,
        "potential_loads": potential_loads,
        "overlap_scores": overlap_scores,
        "dump": dump,
        "cluster": cluster,
    }
    # Bodies the table names no single class for: the class each is read as here.
    body_types: dict[str, type] = {"patch_worker": WorkerBody, "potential_loads": SelectBody}
    return [route(name, bound(service, handler), body_type=body_types.get(name)) for name, handler in handlers.items()]
