"""Engine parameters and the forward-pass timing model of the simulated workers.

``dynamo-mocker`` is the reference simulator's default engine (``dynamo._core.run_mocker_trace_replay``
in ai-dynamo-runtime 1.6.1): per worker 16,384 KV blocks of 64 tokens, LRU eviction, prefix caching,
chunked prefill under an 8,192-token budget, at most 256 running sequences, and a pass lasting
``prefill(T) + decode(p)`` ms where

* ``prefill(T) = 4.209989e-7·T² + 0.01518344·T + 16.50142`` when the pass computes ``T > 0`` uncached
  prompt tokens, else 0 (T as the reference counts it: ``timed_prefill_tokens``);
* ``decode(p) = max(1, -25.74·p² + 54.01·p + 5.74)`` when a request past its prompt decodes a token in
  the pass (the token that ends a prompt comes with the prefill), else 0, with ``p`` the tokens of the
  sequences decoding in the pass (prompt and generated so far) over the worker's capacity in tokens
  (blocks times block size). Both measured against the reference request by request
  (``tests/simulations/test_sim_reference_timing.py``).

Every field can be changed from the command line (``--kv-blocks``, ``--engine-block-size``, ...).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class EngineParams:
    block_size: int = 64  # tokens per KV block
    num_blocks: int = 16_384  # KV capacity per worker (dp rank), in blocks
    max_batched_tokens: int = 8_192  # tokens computed per forward pass (chunked-prefill budget)
    max_running: int = 256  # sequences in the running batch
    prefix_caching: bool = True
    # prefill(T) = p2·T² + p1·T + p0 ms for T > 0 uncached prompt tokens in the pass
    prefill_ms: tuple[float, float, float] = (4.209989e-7, 0.01518344, 16.50142)
    # decode(p) = max(floor, d2·p² + d1·p + d0) ms, p = decoding sequences' tokens / capacity in tokens
    decode_ms: tuple[float, float, float] = (-25.74, 54.01, 5.74)
    decode_floor_ms: float = 1.0

    def __attrs_post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_batched_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine {name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def prefill_time(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        a, b, c = self.prefill_ms
        return a * tokens * tokens + b * tokens + c

    @staticmethod
    def timed_prefill_tokens(chunks: int, ends: int, starts: int) -> int:
        """The T the reference's mocker times a pass's prefill with: the chunks' count times the difference
        of their mean end and mean start positions in their prompts, each mean rounded down. It is the
        uncached prompt tokens computed, give or take a token per chunk when the means are not whole."""
        if chunks <= 0:
            return 0
        return chunks * (ends // chunks - starts // chunks)

    def decode_time(self, kv_share: float) -> float:
        a, b, c = self.decode_ms
        return max(self.decode_floor_ms, a * kv_share * kv_share + b * kv_share + c)


ENGINE_PRESETS: dict[str, EngineParams] = {
    "dynamo-mocker": EngineParams(),
}
