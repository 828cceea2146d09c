"""Routing policies of the simulated clients: who picks the worker, and how the router hears of it.

* ``kv``: the router picks (``POST /select_and_reserve``): KV-aware selection with its cost function.
* ``round_robin``: the client cycles through the ranks in (worker, dp rank) order.
* ``random``: the client draws a rank uniformly (seeded).
* ``least_loaded``: the client reads ``GET /loads`` and takes the rank with the fewest active requests,
  then the fewest prefill tokens, then the fewest decode blocks; ties are drawn (seeded).
* ``kv_ttft``: the router picks with the ``kv_ttft`` mode (predicted time to first token, ``docs/routing.md``);
  ``kv_ttft_no_queue``, ``kv_ttft_no_fit`` and ``kv_ttft_no_drift`` leave one of its terms out (the ablation):
  the queued prefill ahead, the online throughput fit (the prior's rates stay), the drift discount.
* ``router:<mode>``: the router picks with the service's routing mode ``<mode>`` (``router_mode`` in the
  ``/select_and_reserve`` body): ``round_robin``, ``random``, ``least_loaded`` (the service's own, on its
  eligible non-busy ranks and its seeded source), ``kv`` (as ``kv``), or ``direct`` (the client pins the rank
  round robin in ``pinned_worker`` and the router checks and books it).

Whoever picks, the request is booked on the router (the client-chosen ones through ``POST
/reservations`` with an explicit rank), so the router's load accounting sees every request and the
lifecycle calls are the same for every policy.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Protocol

import attrs
import trio
import trio.testing

from kvrouter.actors.core.commands import Prompt, SelectionOptions
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import ROUTER_MODES
from kvrouter.actors.core.routing_modes import MODE_KV_TTFT
from kvrouter.actors.ttft_tracker import FULL, Ablation
from kvrouter.simulations.prompts import PromptBlocks
from kvrouter.simulations.router import RouterReplica

ROUTER_MODE_PREFIX = "router:"
# kv_ttft and its ablations: the router's kv_ttft mode with a term left out of the prediction.
TTFT_POLICIES: dict[str, Ablation] = {
    MODE_KV_TTFT: FULL,
    "kv_ttft_no_queue": Ablation(queue_term=False),
    "kv_ttft_no_fit": Ablation(fit=False),
    "kv_ttft_no_drift": Ablation(drift=False),
    "kv_ttft_no_load": Ablation(load_term=False),
}
POLICIES = (
    "kv",
    *TTFT_POLICIES,
    "round_robin",
    "random",
    "least_loaded",
    *(f"{ROUTER_MODE_PREFIX}{mode}" for mode in ROUTER_MODES),
)


@attrs.frozen
class Placement:
    rank: WorkerRank
    predicted_cached_tokens: int | None  # the router's overlap on the chosen rank (kv only)


class Policy(Protocol):
    name: str

    async def place(
        self, router: RouterReplica, request_id: str, blocks: PromptBlocks, isl_tokens: int
    ) -> Placement: ...


class KvPolicy:
    """The router picks (``POST /select_and_reserve``), with the service's mode or the one named."""

    name = "kv"

    def __init__(self, router_mode: str | None = None, pins: ClientPolicy | None = None) -> None:
        self.router_mode = router_mode  # None: the service's (kv unless configured otherwise)
        self.pins = pins  # direct mode: who chooses the pinned rank
        if router_mode is not None:
            self.name = f"{ROUTER_MODE_PREFIX}{router_mode}"

    async def place(self, router: RouterReplica, request_id: str, blocks: PromptBlocks, isl_tokens: int) -> Placement:
        prompt = Prompt(block_hashes=blocks.local_hashes, sequence_hashes=blocks.sequence_hashes, isl_tokens=isl_tokens)
        options = SelectionOptions()
        if self.pins is not None:
            pin = await self.pins.choose(router)
            options = SelectionOptions(pinned_worker=(pin.worker_id, pin.dp_rank))
        selection = await router.select_and_reserve(prompt, request_id, options, self.router_mode)
        per_rank: dict[str, int] = selection.overlap["dp"]  # device-tier tokens per rank of the chosen worker
        return Placement(WorkerRank(selection.worker_id, selection.dp_rank), per_rank[str(selection.dp_rank)])


class ClientPolicy(ABC):
    """A policy that picks the rank itself, then books it explicitly."""

    name = "client"

    def __init__(self, ranks: list[WorkerRank], rng: random.Random) -> None:
        self.ranks = sorted(ranks)
        self.rng = rng

    @abstractmethod
    async def choose(self, router: RouterReplica) -> WorkerRank:
        """The rank this policy sends the next request to."""

    async def place(self, router: RouterReplica, request_id: str, blocks: PromptBlocks, isl_tokens: int) -> Placement:
        rank = await self.choose(router)
        await router.reserve(request_id, rank.worker_id, rank.dp_rank, blocks.sequence_hashes, isl_tokens)
        return Placement(rank, None)


class RoundRobinPolicy(ClientPolicy):
    name = "round_robin"

    def __init__(self, ranks: list[WorkerRank], rng: random.Random) -> None:
        super().__init__(ranks, rng)
        self._next = 0

    async def choose(self, router: RouterReplica) -> WorkerRank:
        rank = self.ranks[self._next % len(self.ranks)]
        self._next += 1
        return rank


class RandomPolicy(ClientPolicy):
    name = "random"

    async def choose(self, router: RouterReplica) -> WorkerRank:
        return self.ranks[self.rng.randrange(len(self.ranks))]


class LeastLoadedPolicy(ClientPolicy):
    name = "least_loaded"

    async def choose(self, router: RouterReplica) -> WorkerRank:
        # KV batches and peers' sync messages are handed over without waiting: read the loads once the
        # router has applied everything it was sent, so what is read does not depend on scheduling.
        await trio.testing.wait_all_tasks_blocked()
        rows = {row.rank: row for row in await router.loads()}
        keyed = []
        for rank in self.ranks:
            row = rows.get(rank)
            key = (row.active_requests, row.active_prefill_tokens, row.active_decode_blocks) if row else (0, 0, 0)
            keyed.append((key, rank))
        best = min(key for key, _ in keyed)
        tied = [rank for key, rank in keyed if key == best]
        return tied[self.rng.randrange(len(tied))] if len(tied) > 1 else tied[0]


def ttft_ablation(name: str) -> Ablation:
    """The router's kv_ttft terms for policy ``name`` (all of them unless it is an ablation)."""
    return TTFT_POLICIES.get(name, FULL)


def make_policy(name: str, ranks: list[WorkerRank], rng: random.Random) -> KvPolicy | ClientPolicy:
    if name == "kv":
        return KvPolicy()
    if name in TTFT_POLICIES:
        policy = KvPolicy(MODE_KV_TTFT)
        policy.name = name
        return policy
    mode = name.removeprefix(ROUTER_MODE_PREFIX)
    if name.startswith(ROUTER_MODE_PREFIX) and mode in ROUTER_MODES:
        return KvPolicy(mode, RoundRobinPolicy(ranks, rng) if mode == "direct" else None)
    if name == "round_robin":
        return RoundRobinPolicy(ranks, rng)
    if name == "random":
        return RandomPolicy(ranks, rng)
    if name == "least_loaded":
        return LeastLoadedPolicy(ranks, rng)
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
