"""Block hashes of a trace request's prompt at the engine's block size, as the router computes them.

The simulated client sends these with the prompt (``block_hashes`` + ``sequence_hashes`` +
``isl_tokens``, the API's precomputed form) and the simulated worker caches its blocks under the same
sequence hashes, so "the router predicted a hit" and "the worker had the block" are comparable.
Values are bit for bit what ``kvrouter.actors.core.hashing`` gives for the synthesised token ids
(``TraceRequest.token_ids``); a test holds the fast path to that.

Fast path: when an engine block lies inside one trace block, all its tokens equal that block's hash
id, so its local hash depends on the hash id alone and is memoised per id.
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
        if self._aligned:
            per = self.trace_block_size // ebs
            memo = self._local
            local = []
            for j in range(count):
                hash_id = request.hash_ids[j // per] & TOKEN_MASK
                value = memo.get(hash_id)
                if value is None:
                    value = memo[hash_id] = block_hashes([hash_id] * ebs, ebs)[0]
                local.append(value)
        else:
            local = block_hashes(request.token_ids(self.trace_block_size), ebs)
        sequence = []
        prev = None
        for value in local:
            prev = value if prev is None else next_sequence_hash(prev, value)
            sequence.append(prev)
        return PromptBlocks(tuple(local), tuple(sequence))
