"""``GET /dump``: the KV index as the reference's recovery format, and its parsing.

Format (behaviour.md#loads-dump-and-session-affinity, the standalone indexer's): ``{"<model>:<tenant>": {"block_size":
N, "events":
[RouterEvent]}}`` where each RouterEvent is ``{worker_id, storage_tier, residency_domain, event:
{event_id, data: {"stored": {parent_hash, start_position, blocks: [{block_hash, tokens_hash,
mm_extra_info}]}}, dp_rank}}``; hashes are unsigned 64-bit here (unlike the rest of the API,
as 1.6.1 writes them; signed ones are accepted too). A kvrouter replica recovers from a reference
selector or indexer and vice versa.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvrouter.actors.core.commands import RecoveredRun
from kvrouter.actors.core.ids import ScopeKey, to_u64
from kvrouter.actors.core.kv_index import Tier
from kvrouter.actors.core.state import ScopeState

TIERS_BY_LABEL = {tier.label: tier for tier in Tier}


class DumpError(ValueError):
    """A peer's /dump that is not in the recovery format."""


def dump_document(states: Iterable[ScopeState], *, include_predicted: bool = False) -> dict[str, Any]:
    """The whole ``/dump``: every partition whose block size is fixed (it stays after its last worker
    left, as in 1.6.1), and any partition whose index holds blocks (recovered from a peer before its
    workers registered). A partition whose workers never were schedulable is not listed.

    ``include_predicted`` (approximate mode) adds the predicted (booked) blocks after the index's, as 1.6.1's
    approximate indexer dumps them: block hash = the chained sequence hash, tokens hash = the local hash."""
    return {
        f"{s.scope.model_name}:{s.scope.tenant_id}": dump_scope(s, include_predicted=include_predicted)
        for s in states
        if s.selection.listed
        or not s.selection.index.is_empty()
        or (include_predicted and not s.selection.predicted.is_empty())
    }


def dump_scope(state: ScopeState, *, include_predicted: bool = False) -> dict[str, Any]:
    events = []
    runs = state.selection.index.dump_events()
    if include_predicted:
        runs += state.selection.predicted.dump_events()
    for event_id, run in enumerate(runs):
        blocks = [{"block_hash": ext, "tokens_hash": local, "mm_extra_info": None} for ext, local in run.blocks]
        events.append(
            {
                "worker_id": run.rank.worker_id,
                "storage_tier": run.tier.label,
                "residency_domain": "worker",
                "event": {
                    "event_id": event_id,
                    "data": {"stored": {"parent_hash": run.parent_hash, "start_position": None, "blocks": blocks}},
                    "dp_rank": run.rank.dp_rank,
                },
            }
        )
    return {"block_size": state.selection.partition_block_size, "events": events}


def scope_key(name: str) -> ScopeKey:
    model, sep, tenant = name.rpartition(":")
    if not sep:
        raise DumpError(f"dump key {name!r} is not <model>:<tenant>")
    return ScopeKey(model, tenant)


def parse_dump(document: Any) -> dict[ScopeKey, tuple[int | None, list[RecoveredRun]]]:
    """Stored runs per scope (with the peer's block size); removals and clears in a dump are
    history the peer already applied, so only stores matter for a fresh index."""
    if not isinstance(document, dict):
        raise DumpError("a dump is a JSON object keyed by <model>:<tenant>")
    scopes = {}
    for name, section in document.items():
        if not isinstance(section, dict) or not isinstance(section.get("events"), list):
            raise DumpError(f"dump section {name!r} has no events list")
        runs = []
        for router_event in section["events"]:
            try:
                event = router_event["event"]
                stored = event["data"]["stored"] if isinstance(event["data"], dict) else None
                if stored is None:
                    continue
                tier = TIERS_BY_LABEL.get(router_event.get("storage_tier", "device"), Tier.DEVICE)
                parent = stored.get("parent_hash")
                blocks = tuple((to_u64(b["block_hash"]), to_u64(b["tokens_hash"])) for b in stored["blocks"])
                runs.append(
                    RecoveredRun(
                        int(router_event["worker_id"]),
                        int(event.get("dp_rank") or 0),
                        int(tier),
                        None if parent is None else to_u64(parent),
                        blocks,
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise DumpError(f"malformed event in {name!r}: {exc!r}") from None
        scopes[scope_key(name)] = (section.get("block_size"), runs)
    return scopes
