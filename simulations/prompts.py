"""Block hashes of a trace request's prompt at the engine's block size, as the router computes them.

The simulated client sends these with the prompt (``block_hashes`` + ``sequence_hashes`` +
``isl_tokens``, the API's precomputed form) and the simulated worker caches its blocks under the same
sequence hashes, so "the router predicted a hit" and "the worker had the block" are comparable.
Values are bit for bit what ``kvrouter.actors.core.hashing`` gives for the synthesised token ids
(``TraceRequest.token_ids``); a test holds the fast path to that.

Fast path: when an engine block lies inside one trace block, all its tokens equal that block's hash
id, so its local hash depends on the hash id alone and is memoised per id. And the engine blocks under
one full trace block chain from the sequence hash before it, so their sequence hashes are memoised per
(that hash, hash id): a prefix many requests share is chained once. Both memos grow with the distinct
trace blocks of the one trace a hasher serves, and no further.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvrouter.actors.core.hashing import block_hashes, next_sequence_hash
from kvrouter.simulations.trace import TOKEN_MASK, TraceRequest


@attrs.frozen
class PromptBlocks:
    local_hashes: tuple[int, ...]
    sequence_hashes: tuple[int, ...]


class PromptHasher:
    """Hashes prompts for one (trace block size, engine block size) pair; memoises per hash id."""

    def __init__(self, trace_block_size: int, engine_block_size: int) -> None:
        self.trace_block_size = trace_block_size
        self.engine_block_size = engine_block_size
        self._aligned = trace_block_size % engine_block_size == 0
        self._local: dict[int, int] = {}  # hash id -> local hash of an engine block of that token
        # (sequence hash before a full trace block, or None at the start; its hash id) -> its engine blocks'
        # sequence hashes
        self._chains: dict[tuple[int | None, int], tuple[int, ...]] = {}
        self._done: dict[int, PromptBlocks] = {}  # request index -> its blocks, once ``warm`` computed them

    def warm(self, requests: Iterable[TraceRequest]) -> None:
        """Hash every request now, once for every policy run in this process."""
        for request in requests:
            self._done[request.index] = self._compute(request)

    def blocks(self, request: TraceRequest) -> PromptBlocks:
        done = self._done.get(request.index)
        return done if done is not None else self._compute(request)

    def _compute(self, request: TraceRequest) -> PromptBlocks:
        ebs = self.engine_block_size
        count = request.input_length // ebs
        if not self._aligned:
            local = block_hashes(request.token_ids(self.trace_block_size), ebs)
            return PromptBlocks(tuple(local), tuple(_chain(None, local)))
        per = self.trace_block_size // ebs
        memo, chains = self._local, self._chains
        local_hashes: list[int] = []
        sequence: list[int] = []
        prev: int | None = None
        for t in range(-(-count // per)):
            hash_id = request.hash_ids[t] & TOKEN_MASK
            value = memo.get(hash_id)
            if value is None:
                value = memo[hash_id] = block_hashes([hash_id] * ebs, ebs)[0]
            n = min(per, count - t * per)  # engine blocks of this trace block inside the prompt
            if n == per:
                key = (prev, hash_id)
                chain = chains.get(key)
                if chain is None:
                    chain = chains[key] = tuple(_chain(prev, [value] * per))
            else:
                chain = tuple(_chain(prev, [value] * n))
            local_hashes.extend([value] * n)
            sequence.extend(chain)
            prev = chain[-1]
        return PromptBlocks(tuple(local_hashes), tuple(sequence))


def _chain(prev: int | None, local: list[int]) -> list[int]:
    """Sequence hashes of blocks with these local hashes following a block whose sequence hash is ``prev``."""
    sequence = []
    for value in local:
        prev = value if prev is None else next_sequence_hash(prev, value)
        sequence.append(prev)
    return sequence
