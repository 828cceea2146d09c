"""A simulated inference worker (one dp rank): a scheduler of forward passes over a ``KvCache``.

Pure and synchronous (no trio, no clock): the cluster driver calls ``step`` at a pass boundary and
gets back how long the pass lasts and what it did; it owns time. A pass works like vLLM's scheduler
with chunked prefill, as the reference's mocker does:

1. Running requests, in admission order, each take what they still need from the pass's token budget
   (``max_batched_tokens``): the rest of their prompt (a chunk of it if the budget is short), or one
   token when decoding. A request that needs a new block when the cache is full preempts the last
   running request (its blocks are released; it waits again at the head of the queue and recomputes).
2. Waiting requests are admitted in arrival order while fewer than ``max_running`` run, budget is left
   and the cache can hold their first chunk. At admission the longest cached prefix of the prompt is
   found (prefix caching; at most ``(len - 1) // block_size`` blocks, since the last token is always
   computed) and only the rest is computed.
3. Every running request whose whole sequence is computed emits one token at the end of the pass; a
   request that has emitted ``output_length`` tokens ends and releases its blocks.

The pass lasts ``prefill(T) + decode(p)`` (``timing.EngineParams``), ``decode(p)`` only when a request
past its prompt computes its next token in it: the pass that ends a prompt samples that request's first
token from the prefill itself, as the reference's mocker times it (a lone prompt's time to first token is
``prefill(T)``). ``p`` sums the tokens of the decoding sequences, over the capacity in tokens; ``T`` is
the reference's rounding of the chunks' mean end and start (``EngineParams.timed_prefill_tokens``).
KV events of the pass (blocks stored as they fill, evictions, a clear) are returned with it, in order.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.hashing import block_hashes, next_sequence_hash
from kvrouter.actors.core.kv_wire import KvEvent
from kvrouter.simulations.kv_cache import KvCache
from kvrouter.simulations.timing import EngineParams

OUTPUT_TOKEN_BASE = 1 << 31  # generated tokens never collide with trace tokens (hash ids < 2**31)


class EngineRequest:
    """One request inside a worker: its sequence, how much of it is computed, the blocks it holds.

    The sequence is the prompt, then one generated token per emission but the last (the last one ends
    the request and never enters the cache). Generated tokens are a function of the request and their
    position (``token_at``), so they are made only when a block of them fills."""

    __slots__ = (
        "computed",
        "generated",
        "held",
        "index",
        "length",
        "output_length",
        "private",
        "prompt_hashes",
        "prompt_length",
        "request_id",
        "tokens",
    )

    def __init__(
        self, request_id: str, index: int, tokens: list[int], prompt_hashes: list[int], output_length: int
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.tokens = tokens  # the prompt
        self.prompt_length = len(tokens)
        self.length = len(tokens)  # of the sequence so far: prompt_length + generated
        self.prompt_hashes = prompt_hashes  # sequence hashes of the prompt's full blocks
        self.output_length = output_length
        self.computed = 0  # tokens whose KV is computed
        self.generated = 0
        self.held: list[int] = []  # sequence hashes of the full cached blocks held, in order
        self.private = 0  # blocks held that are not cached (partial)

    def token_at(self, position: int) -> int:
        """The sequence's token at ``position`` (a prompt token, or the one generated there)."""
        if position < self.prompt_length:
            return self.tokens[position]
        return (OUTPUT_TOKEN_BASE + self.index * 7919 + position - self.prompt_length + 1) & 0xFFFFFFFF

    def token_slice(self, start: int, end: int) -> list[int]:
        if end <= self.prompt_length:
            return self.tokens[start:end]
        return [self.token_at(position) for position in range(start, end)]


@attrs.define
class PassResult:
    duration_ms: float
    prefill_tokens: int  # uncached prompt tokens computed (T)
    kv_share: float  # p: share of the KV capacity, in tokens, that the sequences decoding in the pass fill
    admitted: list[tuple[EngineRequest, int]]  # (request, prompt tokens found cached)
    emitted: list[EngineRequest]  # requests that produced a token at the end of the pass
    finished: list[EngineRequest]  # requests whose last token that was
    preempted: list[EngineRequest]
    events: list[KvEvent]


class WorkerEngine:
    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.cache = KvCache(params.num_blocks)
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.preemptions = 0

    # -- requests ---------------------------------------------------------------------------------

    def fits(self, prompt_length: int, output_length: int) -> bool:
        """Whether a request can ever run here (its whole sequence fits the cache)."""
        bs = self.params.block_size
        return -(-(prompt_length + output_length) // bs) <= self.params.num_blocks

    def submit(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def peek_cached_tokens(self, request: EngineRequest) -> int:
        """Prompt tokens this worker would find cached if the request were admitted now (no side effects)."""
        if not self.params.prefix_caching:
            return 0
        limit = (request.prompt_length - 1) // self.params.block_size
        return self.cache.prefix_hits(request.prompt_hashes, limit) * self.params.block_size

    def drop_all(self) -> list[EngineRequest]:
        """A crash: every request is lost and the cache is cleared (one ``AllBlocksCleared``)."""
        lost = self.running + self.waiting
        self.running, self.waiting = [], []
        self.cache.clear()
        for request in lost:
            request.held, request.private, request.computed = [], 0, 0
        return lost

    # -- a forward pass ---------------------------------------------------------------------------

    def step(self) -> PassResult:
        params = self.params
        budget = params.max_batched_tokens
        prefill = 0
        admitted: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []
        running = self.running
        bs = params.block_size
        emitted: list[EngineRequest] = []  # requests whose whole sequence is computed after this pass
        caching = params.prefix_caching
        decoding = 0  # tokens in the sequences of the requests past their prompt that decode in this pass
        chunks = ends = starts = 0  # prefill chunks in the pass, the sums of where they end and start
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.computed
            need = request.length - computed
            if need == 1 and computed % bs and computed >= request.prompt_length:
                # Decoding inside a partly filled block (the common case): no allocation, nothing fills.
                computed += 1
                request.computed = computed
                if caching and computed % bs == 0:
                    self._fill_last(request)
                budget -= 1
                i += 1
                emitted.append(request)
                decoding += request.length
                continue
            count = need if need < budget else budget
            if not self._grow(request, count):
                victim = running.pop()  # the most recently admitted; it may be this request itself
                self._preempt(victim)
                preempted.append(victim)
                continue
            if need > 1 or computed < request.prompt_length:
                prefill += count
                chunks += 1
                ends += computed + count
                starts += computed
            else:
                decoding += request.length
            budget -= count
            i += 1
            if request.computed == request.length:
                emitted.append(request)
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < params.max_running and not preempted:
            request = waiting[0]
            cached = self._admit(request, budget)
            if cached is None:
                break
            del waiting[0]
            running.append(request)
            admitted.append((request, cached))
            computed_now = request.computed - cached
            prefill += computed_now
            chunks += 1
            ends += request.computed
            starts += cached
            budget -= computed_now
            if request.computed == request.length:
                emitted.append(request)
        duration = params.prefill_time(params.timed_prefill_tokens(chunks, ends, starts))
        share = 0.0
        if decoding:
            share = decoding / (params.num_blocks * bs)
            duration += params.decode_time(share)
        finished = self._emit(emitted) if emitted else []
        return PassResult(duration, prefill, share, admitted, emitted, finished, preempted, self.cache.take_events())

    # -- internals --------------------------------------------------------------------------------

    def _emit(self, emitted: list[EngineRequest]) -> list[EngineRequest]:
        """Each request in ``emitted`` produced a token this pass; the ones now done release their blocks and
        leave ``running``. Returns those."""
        finished: list[EngineRequest] = []
        for request in emitted:
            request.generated += 1
            if request.generated >= request.output_length:
                finished.append(request)
            else:
                request.length += 1
        if finished:
            for request in finished:
                self.cache.release(request.held, request.private)
                request.held, request.private = [], 0
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return finished

    def _admit(self, request: EngineRequest, budget: int) -> int | None:
        """Take the cached prefix and the first chunk's blocks; None (nothing changed) if they do not fit."""
        params = self.params
        bs = params.block_size
        cache = self.cache
        hits = 0
        if params.prefix_caching:
            limit = (request.length - 1) // bs
            hits = cache.prefix_hits(self._sequence_hashes(request, limit), limit)
        cached = hits * bs
        count = min(request.length - cached, budget)
        new_blocks = -(-(cached + count) // bs) - hits
        hit_keys = request.prompt_hashes[:hits]
        inactive_hits = sum(1 for k in hit_keys if cache.refs[k] == 0)
        if cache.available() - inactive_hits < new_blocks:
            return None
        for key in hit_keys:
            cache.acquire(key)
        request.held = list(hit_keys)
        request.computed = cached
        self._grow(request, count)
        return cached

    def _grow(self, request: EngineRequest, count: int) -> bool:
        """Compute ``count`` more tokens of ``request``: allocate their blocks, cache and publish the ones filled."""
        bs = self.params.block_size
        cache = self.cache
        after = request.computed + count
        have = len(request.held) + request.private
        need = -(-after // bs) - have
        if need > 0:
            if not cache.allocate(need):
                return False
            request.private += need
        request.computed = after
        if not self.params.prefix_caching:
            return True  # nothing is cached or published: every block stays private to its request
        full_before = len(request.held)
        full_after = after // bs
        if full_after > full_before:
            keys = self._keys(request, full_after)[full_before:full_after]
            parent = request.held[-1] if request.held else None
            for key in keys:
                cache.fill(key)
            request.private -= len(keys)
            request.held.extend(keys)
            cache.publish_stored(keys, parent, request.token_slice(full_before * bs, full_after * bs), bs)
        return True

    def _fill_last(self, request: EngineRequest) -> None:
        """The request's last allocated block just filled (decoding): cache and publish it."""
        bs = self.params.block_size
        full = request.computed // bs
        key = self._keys(request, full)[full - 1]
        parent = request.held[-1] if request.held else None
        self.cache.fill(key)
        request.private -= 1
        request.held.append(key)
        self.cache.publish_stored([key], parent, request.token_slice((full - 1) * bs, full * bs), bs)

    def _preempt(self, request: EngineRequest) -> None:
        self.cache.release(request.held, request.private)
        request.held, request.private, request.computed = [], 0, 0
        self.preemptions += 1
        self.waiting.insert(0, request)

    def _keys(self, request: EngineRequest, count: int) -> list[int]:
        """Sequence hashes of the first ``count`` full blocks of the request's sequence (prompt, then output)."""
        keys = request.prompt_hashes
        if count <= len(keys):
            return keys
        return self._sequence_hashes(request, count)

    def _sequence_hashes(self, request: EngineRequest, count: int) -> list[int]:
        keys = request.prompt_hashes
        if count <= len(keys):
            return keys
        bs = self.params.block_size
        start = len(keys)
        prev = keys[-1] if keys else None
        extended = list(keys)
        for j in range(start, count):
            local = block_hashes(request.token_slice(j * bs, (j + 1) * bs), bs)[0]
            prev = local if prev is None else next_sequence_hash(prev, local)
            extended.append(prev)
        request.prompt_hashes = extended  # generated blocks are fixed once computed: keep them
        return extended
