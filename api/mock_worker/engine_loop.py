"""The simulator's engine on the real clock: one forward pass after another, each lasting its modelled
duration divided by ``speedup``.

``kvrouter.simulations.engine.WorkerEngine`` is pure (``step`` says what a pass does and how long it takes;
the caller owns time), so it is reused as is: the simulator's cluster driver advances a virtual clock by
each pass's duration, this loop sleeps until the pass's end on trio's clock. A pass starts when the previous
one ended (or when work arrives), its KV events are published and its tokens delivered at its end, as in the
simulator, so a virtual-time and a real-time run of the same arrivals make the same passes. The only
addition is ``abort`` (a client that goes away frees its blocks, as vLLM aborts a disconnected request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from kvrouter.actors.core.hashing import block_hashes, sequence_hashes
from kvrouter.actors.core.kv_wire import KvEvent
from kvrouter.api.openai.tokenizer import OutputText
from kvrouter.simulations.engine import EngineRequest, PassResult, WorkerEngine
from kvrouter.simulations.timing import EngineParams


class Generation(EngineRequest):
    """One request in the engine, and what its HTTP handler waits for: tokens as passes emit them."""

    __slots__ = ("aborted", "cached_tokens", "changed", "done", "output", "output_tokens")

    def __init__(self, request_id: str, index: int, prompt: Sequence[int], max_tokens: int, block_size: int) -> None:
        local = block_hashes(prompt, block_size)
        super().__init__(request_id, index, list(prompt), sequence_hashes(local), max_tokens)
        self.output = OutputText(prompt)
        self.output_tokens: list[int] = []  # delivered to the handler (at the end of the pass that made them)
        self.cached_tokens: int | None = None  # prompt tokens found cached at (first) admission
        self.done = False  # every token delivered, or aborted
        self.aborted = False
        self.changed = trio.Event()  # set when tokens arrive or the request ends; replaced by the reader

    def token_at(self, position: int) -> int:
        """The prompt's token, or the one generated there: the built-in tokenizer's id of that output word, so
        a later prompt that quotes the answer finds its blocks cached."""
        if position < self.prompt_length:
            return self.tokens[position]
        return self.output.token(position - self.prompt_length)

    def text(self, start: int, end: int) -> str:
        return "".join(self.output.piece(i) for i in range(start, end))

    def wake(self) -> None:
        self.changed.set()


class MockEngine(WorkerEngine):
    def abort(self, request: EngineRequest) -> None:
        """Take ``request`` out (waiting or running) and release its blocks; a no-op once it has finished."""
        if any(r is request for r in self.waiting):
            self.waiting = [r for r in self.waiting if r is not request]
        elif any(r is request for r in self.running):
            self.running = [r for r in self.running if r is not request]
            self.cache.release(request.held, request.private)
            request.held, request.private = [], 0


PublishEvents = Callable[[list[KvEvent]], object]  # its return value is ignored


class EngineLoop:
    """Runs passes while there is work; ``submit`` hands it a request (the loop task is the only one
    stepping the engine; handlers only submit and abort, between passes, on the same trio thread)."""

    def __init__(self, params: EngineParams, publish: PublishEvents, *, speedup: float = 1.0) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        self.engine = MockEngine(params)
        self.params = params
        self.speedup = speedup
        self._publish = publish
        self._work = trio.Event()
        self._next_index = 0
        self.passes = 0
        self.finished = 0

    def new_generation(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Generation:
        index = self._next_index
        self._next_index += 1
        return Generation(request_id, index, prompt, max_tokens, self.params.block_size)

    @property
    def load(self) -> int:
        """Requests inside the engine (running and waiting)."""
        return len(self.engine.running) + len(self.engine.waiting)

    def submit(self, generation: Generation) -> None:
        self.engine.submit(generation)
        self._work.set()

    def abort(self, generation: Generation) -> None:
        if not generation.done:
            self.engine.abort(generation)
            generation.done = generation.aborted = True
            generation.wake()

    async def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work:
                self._work = trio.Event()
                await self._work.wait()
            started = trio.current_time()
            result = engine.step()
            self.passes += 1
            for request, cached in result.admitted:
                if isinstance(request, Generation) and request.cached_tokens is None:
                    request.cached_tokens = cached
            if result.duration_ms > 0:
                await trio.sleep_until(started + result.duration_ms / 1000.0 / self.speedup)
            else:
                await trio.lowlevel.checkpoint()  # everything running was preempted: try again at once
            self._end_pass(result)

    def _end_pass(self, result: PassResult) -> None:
        if result.events:
            self._publish(result.events)
        for request in result.emitted:
            if isinstance(request, Generation) and not request.done:
                request.output_tokens.append(request.output.token(len(request.output_tokens)))
                request.wake()
        for request in result.finished:
            if isinstance(request, Generation) and not request.done:
                request.done = True
                self.finished += 1
                request.wake()
