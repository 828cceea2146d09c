"""The selection service's worker catalog: records as clients send them, and their lifecycle.

A record is accepted with whatever metadata it has; what is missing is reported, not refused
(``lifecycle: "incomplete"`` with ``not_schedulable_reasons``), as the reference does. Lifecycle is
derived from the record, the partition's block size and whether KV events are in use, so it is
never stored and can never go stale.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvrouter.actors.core.endpoints import MAX_PORT, InvalidEndpoint, parse_zmq_endpoint
from kvrouter.actors.core.ids import U32_MAX, ScopeKey, WorkerRank
from kvrouter.actors.core.limits import MAX_RANKS_PER_WORKER
from kvrouter.actors.core.worker_endpoints import (
    EndpointAllowList,
    allow_list_problem,
    http_endpoint_problem,
    zmq_allow_list_problem,
)

# Topology domains are routing taints too (behaviour.md#constraints-and-disaggregation); the prefix is reserved for
# them.
TOPOLOGY_TAINT_PREFIX = "dynamo.topology/"


def topology_taint(domain: str, value: str) -> str:
    """The canonical taint of one topology entry: ``zone=us-east-1a`` is ``dynamo.topology/zone=us-east-1a``."""
    return f"{TOPOLOGY_TAINT_PREFIX}{domain}={value}"


def routing_taints(taints: Iterable[str], topology_domains: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Every taint a worker carries for routing: its own and one per topology domain."""
    return frozenset(taints) | {topology_taint(domain, value) for domain, value in topology_domains}


@attrs.frozen
class WorkerRecord:
    worker_id: int
    model_name: str = "default"
    tenant_id: str = "default"
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: tuple[tuple[int, str], ...] | None = None  # (dp_rank, endpoint), sorted
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: tuple[str, ...] = ()
    topology_domains: tuple[tuple[str, str], ...] = ()
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None
    worker_role: str | None = None  # prefill / decode / both (None: both); see actors/core/constraints.py
    # The discovery backend that owns this record ("etcd", "file"), or None for a worker registered over HTTP.
    # Only its owner may change or remove it (``ownership_conflict``): a discovered worker follows its source.
    discovered_by: str | None = None

    def to_plain(self) -> dict[str, Any]:
        """JSON-ready form for snapshots (tuples become lists)."""
        return attrs.asdict(self, recurse=True)

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> WorkerRecord:
        fields = dict(data)
        if fields.get("kv_events_endpoints") is not None:
            fields["kv_events_endpoints"] = tuple((r, e) for r, e in fields["kv_events_endpoints"])
        fields["taints"] = tuple(fields["taints"])
        fields["topology_domains"] = tuple((k, v) for k, v in fields["topology_domains"])
        return cls(**fields)

    @property
    def scope(self) -> ScopeKey:
        return ScopeKey(self.model_name, self.tenant_id)

    @property
    def dp_start(self) -> int:
        return self.data_parallel_start_rank or 0

    @property
    def dp_size(self) -> int:
        return 1 if self.data_parallel_size is None else self.data_parallel_size

    @functools.cached_property
    def taint_set(self) -> frozenset[str]:
        """The taints routing matches: the worker's own and one per topology domain."""
        return routing_taints(self.taints, self.topology_domains)

    @functools.cached_property
    def ranks(self) -> tuple[WorkerRank, ...]:
        return tuple(WorkerRank(self.worker_id, r) for r in range(self.dp_start, self.dp_start + self.dp_size))

    def kv_events_endpoint_for(self, dp_rank: int) -> str | None:
        """The ZMQ endpoint publishing ``dp_rank``'s KV events (``kv_events_endpoint`` only for DP 1)."""
        if self.kv_events_endpoints is not None:
            for rank, endpoint in self.kv_events_endpoints:
                if rank == dp_rank and endpoint:
                    return endpoint
        if self.kv_events_endpoint and self.dp_size == 1:
            return self.kv_events_endpoint
        return None

    def replay_endpoint_for(self, dp_rank: int) -> str | None:
        """vLLM serves rank r's replay on the replay port + (r - start); the reference refuses DP > 1."""
        if not self.replay_endpoint:
            return None
        offset = dp_rank - self.dp_start
        if offset == 0:
            return self.replay_endpoint
        try:
            return parse_zmq_endpoint(self.replay_endpoint).with_port_offset(offset)
        except InvalidEndpoint:
            return None  # only a record journaled before endpoints were checked can get here


@attrs.frozen
class WorkerPatch:
    """A PATCH of a worker's record as plain data: each field that is not None replaces the record's (maps
    and lists wholesale); None leaves it as it is (a JSON null does too, as in 1.6.1). Plain data, so the
    change can cross a process boundary; the catalog writer applies it to the record as it is then."""

    model_name: str | None = None
    tenant_id: str | None = None
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: tuple[tuple[int, str], ...] | None = None
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: tuple[str, ...] | None = None
    topology_domains: tuple[tuple[str, str], ...] | None = None
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None
    worker_role: str | None = None

    def apply(self, current: WorkerRecord) -> WorkerRecord | str:
        """The patched record, or why the catalog must refuse it (``record_problem``: a 400)."""
        changes = {name: value for name, value in attrs.asdict(self, recurse=False).items() if value is not None}
        patched = attrs.evolve(current, **changes)
        problem = record_problem(patched)
        return patched if problem is None else problem


def ownership_conflict(current: WorkerRecord | None, writer: str | None) -> str | None:
    """Why ``writer`` (a discovery backend's name, or None for HTTP) may not change or remove ``current`` (a
    409), or None. A discovered worker is its source's: an HTTP edit would be undone by the next change there,
    and a discovery backend never takes over a worker someone registered."""
    if current is None or current.discovered_by == writer:
        return None
    if current.discovered_by is not None:
        return (
            f"worker {current.worker_id} is discovered from {current.discovered_by}; change it there (it cannot "
            "be registered, patched or removed over HTTP)"
        )
    return f"worker {current.worker_id} is registered over HTTP; discovery ({writer}) does not take it over"


def record_problem(record: WorkerRecord) -> str | None:
    """Why the catalog must refuse ``record`` (a 400), or None.

    Metadata that is merely missing makes a record incomplete, not invalid (``not_schedulable_reasons``);
    what is refused here could never work, and would otherwise fail again at every restart.
    """
    size = record.dp_size
    if size > MAX_RANKS_PER_WORKER:
        return f"data_parallel_size {size} exceeds the maximum of {MAX_RANKS_PER_WORKER} ranks per worker"
    if record.dp_start + size > U32_MAX + 1:
        return f"data parallel range overflows u32: start={record.dp_start} size={record.data_parallel_size}"
    # A discovered record's endpoint is where its discovery says the worker answers (Dynamo's request plane is
    # tcp://...): the operator's own registry, not a client's registration; the frontend forwards only to http(s).
    problem = http_endpoint_problem(record.endpoint) if record.discovered_by is None else None
    if problem is not None:
        return f"endpoint: {problem}"
    for field, endpoint in _zmq_endpoints(record):
        if endpoint:  # an empty string means "none", as in 1.6.1
            try:
                parse_zmq_endpoint(endpoint)
            except InvalidEndpoint as exc:
                return f"{field}: {exc}"
    if record.replay_endpoint and size > 1:
        replay = parse_zmq_endpoint(record.replay_endpoint)
        if replay.port is not None and replay.with_port_offset(size - 1) is None:
            return (
                f"replay_endpoint: port {replay.port} + {size - 1} is beyond {MAX_PORT}; "
                "rank r replays on the given port + (r - data_parallel_start_rank)"
            )
    return None


def _zmq_endpoints(record: WorkerRecord) -> list[tuple[str, str | None]]:
    named = [("kv_events_endpoint", record.kv_events_endpoint), ("replay_endpoint", record.replay_endpoint)]
    named += [(f"kv_events_endpoints[{rank}]", endpoint) for rank, endpoint in record.kv_events_endpoints or ()]
    return named


def allow_list_refusal(record: WorkerRecord, allow: EndpointAllowList | None) -> str | None:
    """Why the operator's allow-list (``--worker-endpoint-allow``; None: every host) refuses ``record``: its HTTP
    endpoint or a tcp:// KV-event or replay endpoint names a host outside it (a 400), or None."""
    if allow is None:
        return None
    problem = allow_list_problem("endpoint", record.endpoint, allow)
    for field, endpoint in _zmq_endpoints(record):
        problem = problem or zmq_allow_list_problem(field, endpoint, allow)
    return problem


def not_schedulable_reasons(
    record: WorkerRecord, *, use_kv_events: bool, partition_block_size: int | None, queueing: bool = False
) -> list[str]:
    reasons = []
    if not record.endpoint:
        reasons.append("endpoint is required")
    if not record.block_size:
        reasons.append("block_size must be greater than 0")
    if record.dp_size <= 0:
        reasons.append("data_parallel_size must be greater than 0")
    if queueing and not record.max_num_batched_tokens:
        reasons.append("max_num_batched_tokens is required while queueing is enabled")  # 1.6.1's rule and text
    if use_kv_events:
        for rank in record.ranks:
            if record.kv_events_endpoint_for(rank.dp_rank) is None:
                reasons.append(f"kv_events endpoint is required for dp_rank {rank.dp_rank}")
    if not reasons and partition_block_size is not None and record.block_size != partition_block_size:
        reasons.append(
            f"reconciliation failed: block_size mismatch for {record.scope.describe()}: "
            f"existing={partition_block_size} requested={record.block_size}"
        )
    return reasons


def record_view(record: WorkerRecord, lifecycle: str, reasons: list[str]) -> dict[str, Any]:
    """The catalog record as the API shows it (the reference's field order; both scope names)."""
    view: dict[str, Any] = {
        "worker_id": record.worker_id,
        "model_name": record.model_name,
        "tenant_id": record.tenant_id,
        "routing_group": record.tenant_id,
        "lifecycle": lifecycle,
        "endpoint": record.endpoint,
        "kv_events_endpoint": record.kv_events_endpoint,
    }
    if record.kv_events_endpoints is not None:
        view["kv_events_endpoints"] = {str(rank): endpoint for rank, endpoint in record.kv_events_endpoints}
    view.update(
        replay_endpoint=record.replay_endpoint,
        block_size=record.block_size,
        data_parallel_start_rank=record.data_parallel_start_rank,
        data_parallel_size=record.data_parallel_size,
        max_num_batched_tokens=record.max_num_batched_tokens,
        total_kv_blocks=record.total_kv_blocks,
        stable_routing_id=record.stable_routing_id,
        is_eagle=record.is_eagle,
        taints=list(record.taints),
        topology_domains=dict(record.topology_domains),
        kv_transfer_domain=record.kv_transfer_domain,
        kv_transfer_enforcement=record.kv_transfer_enforcement,
        kv_transfer_preferred_weight=record.kv_transfer_preferred_weight,
    )
    if record.worker_role is not None:  # shown only when set, like 1.6.1's optional router hints
        view["worker_role"] = record.worker_role
    if record.discovered_by is not None:
        view["discovered_by"] = record.discovered_by
    if reasons:
        view["not_schedulable_reasons"] = reasons
    return view
