"""Checks run by simulations after steps: invariants, and replay(journal) == live state."""

from __future__ import annotations

import hashlib

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import digest
from kvrouter.actors.persistence.recovery import recover
from kvrouter.journal.store import Journal


def invariant_failures(states: list[ScopeState]) -> list[str]:
    return [f"{s.scope.describe()}: {problem}" for s in states for problem in check(s)]


def load_failures(states: list[ScopeState]) -> list[str]:
    """The cheap part of the invariants: load accounting (no negative load, sums that match)."""
    return [f"{s.scope.describe()}: {problem}" for s in states for problem in s.slots.check()]


def states_digest(states: list[ScopeState]) -> str:
    return digest([s.to_snapshot() for s in sorted(states, key=lambda s: s.scope)])


def replay_mismatch(journal: Journal, live: list[ScopeState]) -> str | None:
    """Recover from the journal alone and compare with the live actors' states."""
    recovered = recover(journal).states
    live_by_scope: dict[ScopeKey, ScopeState] = {s.scope: s for s in live}
    if set(recovered) != set(live_by_scope):
        return f"scopes differ: replayed {sorted(recovered)} vs live {sorted(live_by_scope)}"
    if states_digest(list(recovered.values())) != states_digest(live):
        return "replayed state differs from the live state"
    return None


def journal_digest(journal: Journal) -> str:
    sha = hashlib.sha256()
    for lsn, payload in journal.read(0):
        sha.update(lsn.to_bytes(8, "big"))
        sha.update(payload)
    return sha.hexdigest()


def idle_load_problems(states: list[ScopeState]) -> list[str]:
    """Once every request has ended, no rank may carry any load and no request may be left."""
    problems = []
    for state in states:
        if state.slots.requests:
            left = sorted(state.slots.requests)
            problems.append(f"{state.scope.describe()}: {len(left)} request(s) still booked, e.g. {left[:3]}")
        for rank, load in sorted(state.slots.ranks.items()):
            if load.prefill_tokens or load.active_decode_blocks or load.requests:
                problems.append(
                    f"{state.scope.describe()}: worker {rank.worker_id} dp_rank {rank.dp_rank} still has load "
                    f"(prefill {load.prefill_tokens}, decode blocks {load.active_decode_blocks}, "
                    f"requests {len(load.requests)})"
                )
    return problems


def replicas_disagree(replicas: dict[str, list[ScopeState]]) -> list[str]:
    """Replicas fed the same KV events and kept in step by replica sync must end with the same view:
    the same live requests, the same load per rank, the same blocks per rank and the same watermarks."""
    if len(replicas) < 2:
        return []
    views = {name: _view(states) for name, states in replicas.items()}
    (first_name, first), *others = sorted(views.items())
    problems = []
    for name, view in others:
        for part, value in view.items():
            if value != first[part]:
                problems.append(f"{name} and {first_name} disagree on {part}")
    return problems


def _view(states: list[ScopeState]) -> dict[str, object]:
    requests = sorted(r for s in states for r in s.slots.requests)
    loads = sorted(
        (s.scope, rank, load.prefill_tokens, load.active_decode_blocks, len(load.requests))
        for s in states
        for rank, load in s.slots.ranks.items()
    )
    blocks = sorted((s.scope, rank, s.selection.index.block_count(rank)) for s in states for rank in s.slots.ranks)
    marks = sorted((s.scope, rank, seq) for s in states for rank, seq in s.selection.kv_watermarks.items())
    return {"live requests": requests, "loads": loads, "KV blocks per rank": blocks, "KV watermarks": marks}
