"""Routing constraints and worker topology: taints, the preferred-taint factor, catalog rules. Pure.

behaviour.md#constraints-and-disaggregation and the seed ``topology-aware-kv-transfer.md``:

* A request's ``routing_constraints`` has ``required_taints`` (a rank is eligible only if its worker carries
  every one, exact strings) and ``preferred_taints`` (taint -> weight; every rank stays eligible and its cost is
  multiplied by ``exp(-tanh(sum of the weights of the taints it carries))``, so negative weights repel).
* A worker's ``topology_domains`` entry ``domain: value`` is also the taint ``dynamo.topology/<domain>=<value>``.
  The prefix is reserved: a worker cannot claim such a taint in ``taints`` (it would fake a topology).
* ``kv_transfer_domain`` names the topology domain a prefill worker's KV cache can be transferred within;
  ``kv_transfer_enforcement`` says whether a decode worker must share its value (``required``, the default
  when a domain is set) or is only preferred when it does (``preferred``, weighted by
  ``kv_transfer_preferred_weight`` in [0, 1]). :func:`decode_constraint` derives that constraint; the
  disaggregated selection merges it into the decode stage's constraints.

Differences from Dynamo 1.6.1 (probed): 1.6.1 stores ``topology_domains`` but derives no taint from them in
its selection service (a ``required_taints`` of ``dynamo.topology/zone=z1`` matches no worker there), and it
accepts any weight, empty domain names and reserved-prefix taints; kvrouter refuses those with a 400.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

from kvrouter.actors.core.catalog import TOPOLOGY_TAINT_PREFIX, WorkerRecord, routing_taints, topology_taint

__all__ = ["TOPOLOGY_TAINT_PREFIX", "routing_taints", "topology_taint"]  # canonical taints live with the catalog

ENFORCEMENT_REQUIRED = "required"
ENFORCEMENT_PREFERRED = "preferred"
ENFORCEMENTS = (ENFORCEMENT_REQUIRED, ENFORCEMENT_PREFERRED)

# A worker's role in disaggregated serving: it prefills only, decodes only (and prefills for itself when no
# prefill worker is available), or both. A record without a role is "both".
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)


def role_of(record: WorkerRecord) -> str:
    return record.worker_role or ROLE_BOTH


def can_prefill(record: WorkerRecord) -> bool:
    """A prefill stage may use prefill and both-role workers."""
    return role_of(record) != ROLE_DECODE


def can_decode(record: WorkerRecord) -> bool:
    """Aggregated selections and decode stages may use decode and both-role workers (not prefill-only ones)."""
    return role_of(record) != ROLE_PREFILL


def preference_factor(taints: frozenset[str], preferred: Mapping[str, float]) -> float:
    """``exp(-tanh(w))`` for ``w`` the sum of the weights of the preferred taints the worker carries.

    1.0 when it carries none; within [1/e, e] always. fsum is exact, so the order of the map does not matter.
    """
    weight = math.fsum(w for taint, w in preferred.items() if taint in taints)
    return math.exp(-math.tanh(weight)) if weight else 1.0


@attrs.frozen
class RoutingConstraints:
    """A request's constraints, as sets and a sorted map so that equal constraints compare equal."""

    required: frozenset[str] = frozenset()
    preferred: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, required: Iterable[str] = (), preferred: Mapping[str, float] | None = None) -> RoutingConstraints:
        return cls(frozenset(required), tuple(sorted((preferred or {}).items())))

    def merged(self, other: RoutingConstraints) -> RoutingConstraints:
        """Both sets of required taints; preferred weights of ``other`` replace ours for the same taint."""
        preferred = dict(self.preferred)
        preferred.update(other.preferred)
        return RoutingConstraints(self.required | other.required, tuple(sorted(preferred.items())))

    def describe_required(self) -> str:
        return "[" + ", ".join(sorted(self.required)) + "]"


NO_CONSTRAINTS = RoutingConstraints()


def decode_constraint(prefill: WorkerRecord) -> RoutingConstraints | str:
    """The constraint a decode worker must meet after ``prefill`` was chosen, or why it cannot be derived.

    No ``kv_transfer_domain`` and no enforcement: no constraint. ``required`` (also the default once a domain
    is set, and what an unknown stored enforcement means: fail closed): the prefill worker's value for the
    domain becomes a required taint, and a missing domain or value is a refusal (a string), so the caller fails
    the request before anything is booked. ``preferred``: the value becomes a preferred taint with the worker's
    weight; without a domain, value or weight nothing is preferred (a preference never refuses a request).
    """
    domain = prefill.kv_transfer_domain
    enforcement = prefill.kv_transfer_enforcement
    if enforcement == ENFORCEMENT_PREFERRED:
        value = dict(prefill.topology_domains).get(domain) if domain else None
        weight = prefill.kv_transfer_preferred_weight
        if value is None or weight is None:
            return NO_CONSTRAINTS
        return RoutingConstraints(preferred=((topology_taint(domain or "", value), weight),))
    if domain is None:
        if enforcement is None:
            return NO_CONSTRAINTS
        return (
            f"prefill worker {prefill.worker_id} requires KV transfer within a domain "
            "but has no kv_transfer_domain: cannot derive the decode constraint"
        )
    value = dict(prefill.topology_domains).get(domain)
    if not value:
        return (
            f"prefill worker {prefill.worker_id} has kv_transfer_domain {domain!r} (required) but no "
            f"topology_domains value for it: cannot derive the decode constraint"
        )
    return RoutingConstraints(required=frozenset({topology_taint(domain, value)}))


def catalog_problem(record: WorkerRecord) -> str | None:
    """Why a catalog record cannot be stored (a 400), checked before anything is journaled; None when fine.

    Records already journaled are never re-checked (evolve accepts whatever history holds).
    """
    if record.worker_role is not None and record.worker_role not in ROLES:
        return f"worker_role must be one of {', '.join(ROLES)}, got {record.worker_role!r}"
    for taint in record.taints:
        if taint.startswith(TOPOLOGY_TAINT_PREFIX):
            return (
                f"taint {taint!r} uses the reserved prefix {TOPOLOGY_TAINT_PREFIX!r}: "
                "set topology_domains instead (each entry becomes such a taint)"
            )
    for domain, value in record.topology_domains:
        if not domain or "=" in domain:
            return f"topology domain {domain!r} must be non-empty and must not contain '='"
        if not value:
            return f"topology domain {domain!r} must have a non-empty value"
    if record.kv_transfer_domain is not None and not record.kv_transfer_domain:
        return "kv_transfer_domain must not be empty"
    if record.kv_transfer_enforcement is not None and record.kv_transfer_enforcement not in ENFORCEMENTS:
        return f"kv_transfer_enforcement must be required or preferred, got {record.kv_transfer_enforcement!r}"
    weight = record.kv_transfer_preferred_weight
    if weight is not None and not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
        return f"kv_transfer_preferred_weight must be between 0 and 1, got {weight!r}"
    if (
        record.kv_transfer_enforcement == ENFORCEMENT_PREFERRED
        and record.kv_transfer_domain is not None
        and weight is None
    ):
        return "kv_transfer_enforcement preferred needs kv_transfer_preferred_weight (between 0 and 1)"
    return None
