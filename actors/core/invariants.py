"""Invariant checks shared by tests, simulations and debug assertions. Pure; returns messages."""

from __future__ import annotations

from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.trie import PrefixTrie


def check(state: ScopeState) -> list[str]:
    problems: list[str] = []
    if state.workers and state.block_size is None:
        problems.append("scope has workers but no block size")
    expected_ranks = {(w, r) for w, (start, size) in state.workers.items() for r in range(start, start + size)}
    if set(state.ranks) != expected_ranks:
        problems.append("ranks do not match the registered DP ranges")
    seen = 0
    for rank_key, rank in state.ranks.items():
        if rank.prefill_tokens < 0:
            problems.append(f"{rank_key}: negative prefill tokens {rank.prefill_tokens}")
        if rank.prefill_tokens != sum(rank.prefill.values()):
            problems.append(f"{rank_key}: prefill sum {rank.prefill_tokens} != entries")
        if not set(rank.prefill) <= set(rank.requests):
            problems.append(f"{rank_key}: prefill entry without an active request")
        rebuilt = PrefixTrie()
        for request in rank.requests.values():
            rebuilt.insert(request.sequence_hashes)
            if state.requests.get(request.request_id) is not request:
                problems.append(f"{rank_key}: request {request.request_id!r} missing from the scope index")
        if rebuilt.size != rank.trie.size:
            problems.append(f"{rank_key}: {rank.trie.size} decode blocks, requests imply {rebuilt.size}")
        seen += len(rank.requests)
    if seen != len(state.requests):
        problems.append(f"scope index holds {len(state.requests)} requests, ranks hold {seen}")
    return problems
