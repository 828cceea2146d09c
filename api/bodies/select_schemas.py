"""Wire DTOs of the selection service (seed ``selection-service.md``; 1.6.1 where it is silent).

As in ``api/bodies/schemas.py``: strict JSON types, serde-like 422 messages, unknown fields ignored,
``tenant_id`` with ``routing_group`` as an alias, ``reservation_id`` with ``selection_id``.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, NewType, cast

import attrs

from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord, record_problem
from kvrouter.actors.core.commands import Prompt, SelectionOptions
from kvrouter.actors.core.constraints import ENFORCEMENTS
from kvrouter.actors.core.endpoints import parse_decimal
from kvrouter.actors.core.hashing import u32_token_ids
from kvrouter.actors.core.ids import U32_MAX, ScopeKey
from kvrouter.actors.core.limits import (
    MAX_PROMPT_TOKENS,
    MAX_RANKS_PER_WORKER,
    MAX_TAINTS,
    MAX_TOPOLOGY_DOMAINS,
    text_too_long,
)
from kvrouter.actors.core.router_config import ROUTER_MODES, RouterConfigOverride, parse_router_mode
from kvrouter.api.bodies import select_body_reader as body_reader
from kvrouter.api.bodies.schemas import (
    API_CONVERTER,
    DEFAULT_TENANT,
    HashListError,
    SequenceHashes,
    _deserialize_failed,
    parse,
)
from kvrouter.api.bodies.wire import U32, U64, USize, WireSizeError, WireTypeError, json_kind
from kvrouter.api.http import UNPARSED, HttpError, Request

TokenIds = NewType("TokenIds", tuple)


def _structure_tokens(value: Any, _: Any = None) -> tuple[int, ...]:
    if type(value) is not list:
        raise WireTypeError(f"invalid type: {json_kind(value)}, expected a sequence")
    if len(value) > MAX_PROMPT_TOKENS:
        raise WireSizeError(f"{len(value)} tokens exceed the maximum of {MAX_PROMPT_TOKENS} per prompt")
    # Prompts run to thousands of tokens: walk element by element only to name the first bad one.
    if not u32_token_ids(value):
        for index, token in enumerate(value):
            if type(token) is not int:
                raise HashListError(index, f"invalid type: {json_kind(token)}, expected u32")
            if not 0 <= token <= U32_MAX:
                raise HashListError(index, f"invalid value: {json_kind(token)}, expected u32")
    return tuple(value)


API_CONVERTER.register_structure_hook(TokenIds, _structure_tokens)


def _scope(model_name: str, tenant_id: str | None, routing_group: str | None) -> ScopeKey:
    tenant = tenant_id if tenant_id is not None else routing_group
    return ScopeKey(model_name, DEFAULT_TENANT if tenant is None else tenant)


@attrs.frozen
class WorkerBody:
    """A worker's catalog record. ``endpoint`` (where requests for it are sent) is an http:// or https:// base URL
    with no user information, query or fragment; routes are joined to its path. A service started with
    --worker-endpoint-allow refuses hosts outside that list (400)."""

    worker_id: U64
    model_name: str = "default"
    tenant_id: str = attrs.field(default=None)  # absent = default; null is a 422
    routing_group: str = attrs.field(default=None)
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[str, str] | None = None
    replay_endpoint: str | None = None
    block_size: U32 | None = None
    data_parallel_start_rank: U32 | None = None
    data_parallel_size: U32 | None = None
    max_num_batched_tokens: U64 | None = None
    total_kv_blocks: U64 | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: list[str] | None = None
    topology_domains: dict[str, str] | None = None
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None
    worker_role: str | None = None  # prefill / decode / both (kvrouter's; disaggregated serving)

    def to_record(self) -> WorkerRecord:
        """The catalog record, fully checked (422 types, 413 sizes, 400 what could never work), so that
        nothing journaled can fail later, at each restart."""
        for field, size, limit in (
            ("kv_events_endpoints", len(self.kv_events_endpoints or ()), MAX_RANKS_PER_WORKER),
            ("taints", len(self.taints or ()), MAX_TAINTS),
            ("topology_domains", len(self.topology_domains or ()), MAX_TOPOLOGY_DOMAINS),
        ):
            if size > limit:
                raise HttpError(413, f"{field}: {size} entries exceed the maximum of {limit}")
        if self.kv_transfer_enforcement is not None and self.kv_transfer_enforcement not in ENFORCEMENTS:
            variant = self.kv_transfer_enforcement
            expected = " or ".join(f"`{e}`" for e in ENFORCEMENTS)
            raise HttpError(
                422, _deserialize_failed(f"kv_transfer_enforcement: unknown variant `{variant}`, expected {expected}")
            )
        scope = _scope(self.model_name, self.tenant_id, self.routing_group)
        record = WorkerRecord(
            worker_id=self.worker_id,
            model_name=scope.model_name,
            tenant_id=scope.tenant_id,
            endpoint=self.endpoint,
            kv_events_endpoint=self.kv_events_endpoint,
            kv_events_endpoints=self._endpoints_by_rank(),
            replay_endpoint=self.replay_endpoint,
            block_size=self.block_size,
            data_parallel_start_rank=self.data_parallel_start_rank,
            data_parallel_size=self.data_parallel_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            total_kv_blocks=self.total_kv_blocks,
            stable_routing_id=self.stable_routing_id,
            is_eagle=self.is_eagle,
            taints=tuple(sorted(set(self.taints or ()))),  # a set, as in 1.6.1 (which lists it in hash order)
            topology_domains=tuple(sorted((self.topology_domains or {}).items())),
            kv_transfer_domain=self.kv_transfer_domain,
            kv_transfer_enforcement=self.kv_transfer_enforcement,
            kv_transfer_preferred_weight=self.kv_transfer_preferred_weight,
            worker_role=self.worker_role,
        )
        problem = record_problem(record)
        if problem is not None:
            raise HttpError(400, problem)
        return record

    def _endpoints_by_rank(self) -> tuple[tuple[int, str], ...] | None:
        if self.kv_events_endpoints is None:
            return None
        ranks: dict[int, str] = {}
        for key, endpoint in self.kv_events_endpoints.items():
            rank = parse_decimal(key, U32_MAX)
            if rank is None:
                problem = f"kv_events_endpoints: invalid dp_rank key {key!r}, expected a u32 in ASCII digits"
                raise HttpError(422, _deserialize_failed(problem))
            if rank in ranks:
                problem = f"kv_events_endpoints: dp_rank {rank} is given twice ({key!r})"
                raise HttpError(422, _deserialize_failed(problem))
            ranks[rank] = endpoint
        return tuple(sorted(ranks.items()))


def worker_patch(changes: dict[str, Any]) -> WorkerPatch:
    """PATCH: the supplied fields (nulls and ``worker_id`` already dropped), checked as a POST checks them
    (before the worker is looked up, as 1.6.1 deserialises first), in the record's types. ``routing_group``
    is ``tenant_id``'s alias (``tenant_id`` wins when both are given); unknown fields are ignored."""
    checked = parse(WorkerBody, {**changes, "worker_id": 0}).to_record()
    known = {field.name for field in attrs.fields(WorkerPatch)}
    given = {name for name in changes if name in known}
    if "routing_group" in changes:
        given.add("tenant_id")
    return WorkerPatch(**{name: getattr(checked, name) for name in given})


@attrs.frozen
class PinnedWorker:
    worker_id: U64
    dp_rank: U32


@attrs.frozen
class AffinityTarget:
    """1.6.1's ``affinity_target``: a worker (and optionally one of its ranks) the request should go to."""

    worker_id: U64
    dp_rank: U32 | None = None


@attrs.frozen
class SessionContext:
    """1.6.1's ``session_context``; its ``session_id`` wins over the body's ``session_id``."""

    session_id: str
    parent_session_id: str | None = None
    session_final: bool | None = None
    input_trigger: str | None = None


@attrs.frozen
class RoutingConstraints:
    required_taints: list[str] | None = None
    preferred_taints: dict[str, float] | None = None


@attrs.frozen
class Override:
    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    overlap_score_weight: float | None = None
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: float | None = None
    track_active_blocks: bool | None = None  # kvrouter's
    track_output_blocks: bool | None = None  # kvrouter's


@attrs.frozen
class PromptBody:
    model_name: str = "default"
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)
    token_ids: TokenIds | None = None  # a tuple, or read_select_body's array("I") (hashing takes either)
    lora_name: str | None = None
    block_hashes: SequenceHashes | None = None
    sequence_hashes: SequenceHashes | None = None
    isl_tokens: USize | None = None

    def scope(self) -> ScopeKey:
        return _scope(self.model_name, self.tenant_id, self.routing_group)

    def prompt(self) -> Prompt:
        return Prompt(self.token_ids, self.lora_name, self.block_hashes, self.sequence_hashes, self.isl_tokens)


@attrs.frozen
class SelectBody(PromptBody):
    selection_id: str | None = None
    reservation_id: str | None = None
    router_config_override: Override | None = None
    expected_output_tokens: U32 | None = None
    pinned_worker: PinnedWorker | None = None
    allowed_worker_ids: list[U64] | None = None
    routing_constraints: RoutingConstraints | None = None
    session_id: str | None = None
    session_context: SessionContext | None = None
    affinity_target: AffinityTarget | None = None
    priority_jump: float | None = None
    router_mode: str | None = None  # kvrouter's: kv, round_robin, random, direct, least_loaded, kv_ttft
    explain: bool = False  # kvrouter's: the reply says why (candidates, costs, reason); without it, unchanged

    def mode(self) -> str | None:
        """The request's router mode (canonical name), None for the service's; 422 for an unknown one."""
        if self.router_mode is None:
            return None
        mode = parse_router_mode(self.router_mode)
        if mode is None:
            modes = ", ".join(f"`{m}`" for m in ROUTER_MODES)
            raise HttpError(
                422, _deserialize_failed(f"router_mode: unknown variant `{self.router_mode}`, expected one of {modes}")
            )
        return mode

    def override(self) -> RouterConfigOverride | None:
        if self.router_config_override is None:
            return None
        override = RouterConfigOverride(**attrs.asdict(self.router_config_override))
        problem = override.validate()
        if problem:
            raise HttpError(422, _deserialize_failed(f"router_config_override: {problem}"))
        return override

    def options(self) -> SelectionOptions:
        if (
            self.allowed_worker_ids is None
            and self.routing_constraints is None
            and self.pinned_worker is None
            and self.expected_output_tokens is None
            and self.session_id is None
            and self.session_context is None
            and self.affinity_target is None
            and self.priority_jump is None
        ):
            return NO_OPTIONS  # the common body: what the code below builds from nothing, built once
        constraints = self.routing_constraints or RoutingConstraints()
        return SelectionOptions(
            allowed_worker_ids=None if self.allowed_worker_ids is None else frozenset(self.allowed_worker_ids),
            required_taints=frozenset(constraints.required_taints or ()),
            preferred_taints=tuple(sorted((constraints.preferred_taints or {}).items())),
            pinned_worker=None
            if self.pinned_worker is None
            else (self.pinned_worker.worker_id, self.pinned_worker.dp_rank),
            expected_output_tokens=self.expected_output_tokens,
            session_id=self.session_context.session_id if self.session_context is not None else self.session_id,
            affinity_target=None
            if self.affinity_target is None
            else (self.affinity_target.worker_id, self.affinity_target.dp_rank),
            priority_jump=self._priority_jump(),
        )

    def _priority_jump(self) -> float:
        jump = self.priority_jump
        if jump is None:
            return 0.0
        if not math.isfinite(jump):
            raise HttpError(422, _deserialize_failed("priority_jump must be a finite number"))
        return jump


NO_OPTIONS = SelectionOptions()  # a body without any option field (SelectBody.options)


# The fields of a /select body that ``fast_select_body`` reads itself: plain strings (null allowed or not) and
# scalars. A body naming any other SelectBody field goes to the converter.
_STRICT_TEXT = ("model_name", "tenant_id", "routing_group")
_OPTIONAL_TEXT = ("lora_name", "selection_id", "reservation_id", "session_id", "router_mode")
_FAST_FIELDS = frozenset((*_STRICT_TEXT, *_OPTIONAL_TEXT, "token_ids", "expected_output_tokens", "explain"))
_OTHER_FIELDS = frozenset(field.name for field in attrs.fields(SelectBody)) - _FAST_FIELDS


def fast_select_body(value: Any) -> SelectBody | None:
    """The common ``/select`` body read without the converter, or None for anything it does not accept
    exactly as ``parse(SelectBody, value)`` would: then the caller parses it with the converter, which gives
    the same result or the same error (``tests/api/test_select_bodies.py`` checks both ways agree)."""
    if type(value) is not dict or not _OTHER_FIELDS.isdisjoint(value):
        return None
    get = value.get
    for name in _STRICT_TEXT:
        text = get(name, "")
        if type(text) is not str or text_too_long(text):
            return None
    for name in _OPTIONAL_TEXT:
        text = get(name)
        if text is not None and (type(text) is not str or text_too_long(text)):
            return None
    tokens = get("token_ids")
    if tokens is not None:
        if type(tokens) is array:  # ``read_select_body``'s: u32s already, kept packed for hashing
            if len(tokens) > MAX_PROMPT_TOKENS:
                return None
            tokens = cast(TokenIds, tokens)
        elif type(tokens) is not list or len(tokens) > MAX_PROMPT_TOKENS or not u32_token_ids(tokens):
            return None
        else:
            tokens = TokenIds(tuple(tokens))
    expected = get("expected_output_tokens")
    if expected is not None and (type(expected) is not int or not 0 <= expected <= U32_MAX):
        return None
    explain = get("explain", False)
    if type(explain) is not bool:
        return None
    return SelectBody(
        model_name=get("model_name", "default"),
        tenant_id=cast(str, get("tenant_id")),  # absent: None, as the converter leaves it
        routing_group=cast(str, get("routing_group")),
        token_ids=tokens,
        lora_name=get("lora_name"),
        selection_id=get("selection_id"),
        reservation_id=get("reservation_id"),
        expected_output_tokens=None if expected is None else U32(expected),
        session_id=get("session_id"),
        router_mode=get("router_mode"),
        explain=explain,
    )


def select_body(value: Any) -> SelectBody:
    """A ``/select`` (``/select_and_reserve``, ...) body: the fast reader's, else the converter's (or its 4xx)."""
    body = fast_select_body(value)
    return body if body is not None else parse(SelectBody, value)


def request_select_body(request: Request) -> SelectBody:
    """A route's ``/select`` body, read from its bytes by ``read_select_body`` when compiled (token ids straight
    into an ``array("I")``: no Python int per token), else, or for any other shape, as ``select_body`` of its
    JSON. Either way the same body, or the same 4xx (``tests/api/test_select_body_reader.py``)."""
    if body_reader.COMPILED and request.parsed is UNPARSED:
        fields = body_reader.read_select_body(request.body)
        if fields is not None:
            body = fast_select_body(fields)
            if body is not None:
                return body
    return select_body(request.json())


@attrs.frozen
class ReservationBody:
    model_name: str = "default"
    tenant_id: str = attrs.field(default=None)
    routing_group: str = attrs.field(default=None)
    reservation_id: str | None = None
    selection_id: str | None = None
    worker_id: U64 | None = None
    dp_rank: U32 = 0  # type: ignore[assignment]
    sequence_hashes: SequenceHashes | None = None
    isl_tokens: USize | None = None
    effective_prefill_tokens: USize | None = None
    track_prefill_tokens: bool | None = None
    expected_output_tokens: U32 | None = None

    def scope(self) -> ScopeKey:
        return _scope(self.model_name, self.tenant_id, self.routing_group)

    def booking_id(self) -> str:
        booking = self.reservation_id if self.reservation_id is not None else self.selection_id
        if booking is None:
            raise HttpError(422, _deserialize_failed("missing field `reservation_id`"))
        return booking


@attrs.frozen
class OutputBlockBody:
    decay_fraction: float | None = None


@attrs.frozen
class PrefillCompleteBody:
    """Optional (a kvrouter extension): what the engine found cached for the reservation's prompt, in tokens
    (vLLM's ``usage.prompt_tokens_details.cached_tokens``), compared with what the router predicted."""

    cached_tokens: int | None = None


MAX_CACHED_TOKENS = 2**32


def cached_tokens_of(value: Any) -> int | None:
    """``cached_tokens`` of a prefill_complete body (None: none given); raises a 400 for anything else."""
    if value is None:
        return None
    if type(value) is not dict:
        raise HttpError(400, f"the prefill_complete body must be a JSON object, got {json_kind(value)}")
    cached = value.get("cached_tokens")
    if cached is None:
        return None
    if type(cached) is not int or not 0 <= cached <= MAX_CACHED_TOKENS:
        given = cached if type(cached) is int else json_kind(cached)
        raise HttpError(400, f"cached_tokens must be an integer from 0 to {MAX_CACHED_TOKENS}, got {given}")
    return cached
