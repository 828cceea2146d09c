"""Overload and queueing rules (behaviour.md#eligibility-busy-ranks-and-queueing): which ranks are busy, and in which
order waiting requests go.

Pure. A rank is *busy* when it exceeds any configured load threshold; busy ranks are left out of a selection,
and when every eligible rank is busy the selection is refused as overloaded. The shell then either answers
429 or, with queueing on (``router_queue_threshold``), parks the request in its scope's bounded queue and asks
again whenever loads fall; the order it asks in is :func:`queue_key`. With queueing on, a rank also counts as
busy while its active prefill tokens exceed ``router_queue_threshold * max_num_batched_tokens`` (1.6.1's
queue condition).

Each capacity is per rank: ``total_kv_blocks`` and ``max_num_batched_tokens`` describe one engine, and each dp
rank is one. A rank whose record lacks the capacity a rule needs is never busy by that rule (with queueing on,
such a worker is not schedulable at all: see ``catalog.not_schedulable_reasons``). Every comparison is strict:
a rank exactly at its threshold still takes requests, as 1.6.1's queue does.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.decisions import Reason, Rejected
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection import RankCandidate

NS_PER_SECOND = 1_000_000_000


class Busy(enum.Enum):
    """Which rule found a rank busy (shown to operators, and how tests name the rules)."""

    DECODE_BLOCKS = "active_decode_blocks_threshold"
    PREFILL_TOKENS = "active_prefill_tokens_threshold"
    PREFILL_FRACTION = "active_prefill_tokens_threshold_frac"
    QUEUE = "router_queue_threshold"


@attrs.frozen
class RankLoad:
    """What the rules read about one rank: its live load and its worker's capacities."""

    active_prefill_tokens: int
    active_decode_blocks: int
    total_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None


def busy_because(load: RankLoad, config: RouterConfig) -> Busy | None:
    """The first rule the rank breaks, or None when it may take a request."""
    decode = config.active_decode_blocks_threshold
    if decode is not None and load.total_kv_blocks and load.active_decode_blocks > decode * load.total_kv_blocks:
        return Busy.DECODE_BLOCKS
    tokens = config.active_prefill_tokens_threshold
    if tokens is not None and load.active_prefill_tokens > tokens:
        return Busy.PREFILL_TOKENS
    batch = load.max_num_batched_tokens
    fraction = config.active_prefill_tokens_threshold_frac
    if fraction is not None and batch and load.active_prefill_tokens > fraction * batch:
        return Busy.PREFILL_FRACTION
    queue = config.router_queue_threshold
    if queue is not None and batch and load.active_prefill_tokens > queue * batch:
        return Busy.QUEUE
    return None


def overloaded_message(count: int) -> str:
    return f"all {count} eligible workers are overloaded"


@attrs.frozen
class Waiting:
    """What a queue policy weighs about one waiting request."""

    arrival_ns: int  # when it first asked
    sequence: int  # arrival order within the queue (breaks every tie)
    isl_tokens: int
    priority_jump: float = 0.0  # seconds (fcfs, lcfs); a weight bonus (wspt)


def queue_key(policy: str, waiting: Waiting) -> tuple[float, int]:
    """Sort key of a waiting request under ``policy``: the smallest key is admitted first.

    * ``fcfs``: earliest arrival first; ``priority_jump`` seconds move a request that much earlier (1.6.1: a
      request 0.3 s later with a jump of 5 s goes first, with 0.1 s it does not).
    * ``lcfs``: latest arrival first; a jump counts as arriving that much later.
    * ``wspt`` (weighted shortest processing time): highest ``(1 + priority_jump) / isl_tokens`` first, so short
      prompts go first (1.6.1 admitted 12-, 16- then 20-token prompts in that order) and a jump weighs a prompt
      up. The prompt length stands for its processing time.
    Ties go to the earlier arrival.
    """
    jump_ns = round(waiting.priority_jump * NS_PER_SECOND)
    if policy == "fcfs":
        return (float(waiting.arrival_ns - jump_ns), waiting.sequence)
    if policy == "lcfs":
        return (float(-(waiting.arrival_ns + jump_ns)), -waiting.sequence)
    if policy == "wspt":
        return (-(1.0 + max(waiting.priority_jump, 0.0)) / max(waiting.isl_tokens, 1), waiting.sequence)
    raise ValueError(f"unknown queue policy {policy!r}")


def not_busy(
    kept: Sequence[RankCandidate], catalog: Mapping[int, WorkerRecord], config: RouterConfig
) -> list[RankCandidate] | Rejected:
    """The eligible ranks that may take a request now, or an overloaded refusal when every one is busy."""
    if not _any_threshold(config):
        return list(kept)
    free = []
    for candidate in kept:
        record = catalog[candidate.rank.worker_id]
        load = RankLoad(
            candidate.active_prefill_tokens,
            candidate.active_decode_blocks,
            record.total_kv_blocks,
            record.max_num_batched_tokens,
        )
        if busy_because(load, config) is None:
            free.append(candidate)
    if not free:
        return Rejected(Reason.OVERLOADED, overloaded_message(len(kept)))
    return free


def _any_threshold(config: RouterConfig) -> bool:
    return (
        config.active_decode_blocks_threshold is not None
        or config.active_prefill_tokens_threshold is not None
        or config.active_prefill_tokens_threshold_frac is not None
        or config.router_queue_threshold is not None
    )
