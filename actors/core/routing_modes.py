"""Routing modes: how a rank is chosen among the eligible ones. Pure.

The seed ``kv-cache-routing.md`` names ``kv`` (the cost function, the default), ``random`` and ``round-robin``
(the baselines to compare KV routing against) and direct routing (a caller-chosen worker); ``least_loaded``
takes the rank with the least current work. Every mode sees only eligible ranks (constraints, allowed ids,
pins and roles are applied before), and every mode books the same way, so load accounting and the lifecycle
routes do not depend on the mode.

* ``kv``: minimum cost (``actors/core/selection.py``), the caller's job here.
* ``kv_ttft``: minimum predicted time to first token (``actors/core/ttft_cost.py``), the caller's job too.
* ``round_robin``: ranks in (worker_id, dp_rank) order, the ``turn``-th modulo their number; the shell counts
  turns per scope (only round-robin selections advance it), so the cycle is deterministic.
* ``random``: uniform over the ranks, from the shell's seeded ``draw``.
* ``direct``: the pinned rank (``pinned_worker``), which the eligibility filter already reduced them to.
* ``least_loaded``: fewest active requests, then fewest active prefill tokens, then fewest active decode
  blocks (the simulator's ``least_loaded`` policy); exact ties drawn uniformly.

Names may be written with dashes (``round-robin``, ``least-loaded``, ``kv-ttft``), as Dynamo's ``--router-mode``
spells them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import ROUTER_MODES, parse_router_mode

if TYPE_CHECKING:
    from kvrouter.actors.core.selection import RankCandidate

MODE_KV = "kv"
MODE_ROUND_ROBIN = "round_robin"
MODE_RANDOM = "random"
MODE_DIRECT = "direct"
MODE_LEAST_LOADED = "least_loaded"
MODE_KV_TTFT = "kv_ttft"
COST_MODES = (MODE_KV, MODE_KV_TTFT)  # the modes that weigh cached blocks (and are explained term by term)
MODES = ROUTER_MODES  # the same names, in this order (the config parses them)
parse_mode = parse_router_mode


def unknown_mode(text: str) -> str:
    return f"router_mode must be one of {', '.join(MODES)}, got {text!r}"


DIRECT_NEEDS_PIN = "router_mode direct needs pinned_worker {worker_id, dp_rank}"


def choose_without_cost(mode: str, eligible: Sequence[RankCandidate], *, draw: float, turn: int) -> WorkerRank:
    """The rank a non-``kv`` mode picks from ``eligible`` (non-empty); ``draw`` in [0, 1), ``turn`` >= 0."""
    if not eligible:
        raise ValueError("choose_without_cost needs at least one eligible rank")
    ordered = sorted(eligible, key=lambda c: c.rank)
    if mode == MODE_ROUND_ROBIN:
        return ordered[turn % len(ordered)].rank
    if mode == MODE_RANDOM:
        return ordered[_slice(draw, len(ordered))].rank
    if mode == MODE_DIRECT:
        return ordered[0].rank  # eligibility kept only the pinned rank
    if mode == MODE_LEAST_LOADED:
        keyed = [((c.active_requests, c.active_prefill_tokens, c.active_decode_blocks), c.rank) for c in ordered]
        least = min(key for key, _ in keyed)
        tied = [rank for key, rank in keyed if key == least]
        return tied[_slice(draw, len(tied))]
    raise ValueError(f"mode {mode!r} is not chosen without a cost")


def _slice(draw: float, count: int) -> int:
    return min(int(draw * count), count - 1)
