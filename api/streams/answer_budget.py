"""Answer budgets: what the service holds of its answers is bounded in bytes, per answer path.

A read command costs its client ~60 bytes and can cost the service an answer of megabytes (``GET /loads`` of a
model with a 4,096-rank worker is ~600 KB), so without bounds a 52 KB ``POST /batch`` of 1,000 such reads built a
600 MB answer, and a command-stream client that sent such reads and never read its socket made the service hold
every answer until the write timeout. Two bounds, with their policies:

* **POST /batch** (``BatchAnswer``): the answer holds the commands' results in order until it reaches
  ``batch_answer_bytes``. A read whose result would take it past that is answered 413 instead (it changed
  nothing), and from then on no command of the batch is run: each is answered 413 ``{"error": ...}``. So every
  command is either run and answered in full, or not run: a write is never applied with its answer dropped (a
  write that takes the answer past the cap keeps its answer, and the batch stops after it; writes already under
  way when the cap is reached complete and are answered).
* **The command stream** (``StreamOutput``): each connection counts its unsent result bytes (rendered, not yet
  written to its socket). While they are over ``stream_unsent_bytes`` the connection stops reading messages and
  starts no read (a command the operation table marks as not writing) until its client has taken enough
  (backpressure: results are still delivered, in full). Beside it a service-wide budget, ``unsent_bytes``,
  over every stream of the process: while the total is over it, only connections with nothing unsent read or
  start commands (one read at a time), so clients that read their answers keep going while those that do not
  wait. A read about to start reserves room for its answer: the largest answer its route has given in this
  process (at least 1/1,024 of the connection's budget), so the reads running on one connection stop at the
  budget; a route that has not answered yet in this process runs alone, on a connection with nothing unsent,
  until it has. Writes are not held: their answers are small and their count is bounded by the connection's
  window of commands in flight.

Figures for both are in ``GET /metrics`` (``AnswerMetrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio
from prometheus_client import Counter, Gauge

from kvrouter.api.http import Response, error_response

MIB = 1 << 20
DEFAULT_BATCH_ANSWER_BYTES = 16 * MIB  # 27 reads of a 4,096-rank /loads (1,000 writes answer ~40 KB)
DEFAULT_STREAM_UNSENT_BYTES = 4 * MIB  # four results messages (each at most 1 MiB) per connection
DEFAULT_UNSENT_BYTES = 64 * MIB  # every command stream of a process together
# A read reserves at least this share of its connection's budget: at most 1,024 reads run at once on one connection.
MIN_GUESS_SHARE = 1024
RESULT_OVERHEAD = 32  # bytes a result adds around its body (id, status, punctuation)


@attrs.frozen
class AnswerBudgets:
    """The bounds above (``--max-batch-answer-bytes``, ``--max-stream-unsent-bytes``, ``--max-unsent-bytes``)."""

    batch_answer_bytes: int = DEFAULT_BATCH_ANSWER_BYTES
    stream_unsent_bytes: int = DEFAULT_STREAM_UNSENT_BYTES
    unsent_bytes: int = DEFAULT_UNSENT_BYTES


DEFAULT_BUDGETS = AnswerBudgets()


class AnswerMetrics:
    """The budgets' figures in ``GET /metrics``; updated on rare events only (a pause, a new peak, a cap)."""

    def __init__(self, registry: Any | None) -> None:
        self.paused: Counter | None = None
        self.peak: Gauge | None = None
        self.capped: Counter | None = None
        if registry is None:
            return
        self.paused = Counter(
            "kvrouter_command_stream_paused",
            "Times a command stream stopped reading and starting reads for its unsent answers (backpressure)",
            registry=registry,
        )
        self.peak = Gauge(
            "kvrouter_command_stream_unsent_peak_bytes",
            "The most unsent answer bytes one command-stream connection has held (bound: --max-stream-unsent-bytes "
            "plus one answer)",
            registry=registry,
            multiprocess_mode="max",
        )
        self.capped = Counter(
            "kvrouter_batch_commands_not_run",
            "Commands of POST /batch answered 413 because the batch's answer reached --max-batch-answer-bytes",
            registry=registry,
        )


class BatchAnswer:
    """One ``POST /batch`` answer's bytes against its cap (the module doc's rule)."""

    __slots__ = ("cap", "closed", "metrics", "ordered", "used")

    def __init__(self, cap: int, metrics: AnswerMetrics, ordered: bool = True) -> None:
        self.cap = cap
        self.used = 0
        self.closed = False  # the cap was reached: later commands are not run
        self.metrics = metrics
        self.ordered = ordered  # False: every command started at once, so a read past the cap ran (not kept)

    def refusal(self) -> Response:
        if self.metrics.capped is not None:
            self.metrics.capped.inc()
        if not self.ordered:
            return error_response(
                413,
                f"not answered: this batch's answer reached its cap of {self.cap} bytes (--max-batch-answer-bytes) "
                "before this read's answer; it changed nothing: send it again in another batch",
            )
        return error_response(
            413,
            f"not run: this batch's answer reached its cap of {self.cap} bytes (--max-batch-answer-bytes); "
            "send this command and the ones after it in another batch",
        )

    def admit(self, result: bytes, writes: bool) -> bytes | None:
        """Count ``result`` in; None: it is past the cap and the command wrote nothing (answer 413 instead)."""
        size = len(result)
        if self.used + size > self.cap:
            self.closed = True
            if not writes:
                return None
        self.used += size
        return result


class Unsent:
    """Unsent result bytes of every command stream of a process, and the room reserved for reads running."""

    def __init__(self, limit: int, metrics: AnswerMetrics | None = None) -> None:
        self.limit = limit
        self.used = 0  # rendered results not yet written, plus room reserved for reads running
        self.peak = 0  # the most one connection has held unsent
        self.metrics = metrics if metrics is not None else AnswerMetrics(None)
        self.largest: dict[tuple[str, str], int] = {}  # the largest answer of each route (method, path) so far
        self._waiting: set[StreamOutput] = set()

    def freed(self) -> None:
        """Room was given back: connections waiting for the service-wide budget look again."""
        if self._waiting and self.used < self.limit:
            for output in self._waiting:
                output.wake()

    def note_peak(self, used: int) -> None:
        self.peak = used
        if self.metrics.peak is not None:
            self.metrics.peak.set(used)


class StreamOutput:
    """One command-stream connection's unsent result bytes against its budget (the module doc's rule).

    ``unsent`` is updated by the stream itself (results rendered in; ``sent`` when their message is written), so
    the hot path pays two additions per group of results; ``wait_for_room`` and ``run_read`` hold what must
    wait."""

    __slots__ = ("_freed", "_turn", "everywhere", "limit", "reserved", "stalled", "unsent")

    def __init__(self, limit: int, everywhere: Unsent) -> None:
        self.limit = limit
        self.everywhere = everywhere
        self.unsent = 0
        self.reserved = 0  # room held for the answers of reads running
        self.stalled = 0  # reads waiting for room
        self._turn = trio.Lock()  # held by the read that waits for room; the others wait their turn behind it
        self._freed = trio.Event()

    def add(self, size: int) -> None:
        self.unsent += size
        everywhere = self.everywhere
        everywhere.used += size
        if self.unsent > everywhere.peak:
            everywhere.note_peak(self.unsent)

    def sent(self, size: int) -> None:
        self.unsent -= size
        self.everywhere.used -= size
        self._freed.set()
        self.everywhere.freed()

    def wake(self) -> None:
        self._freed.set()

    def close(self) -> None:
        """The connection is over: its unsent results are gone with it."""
        self.sent(self.unsent)

    def has_room(self, wanted: int) -> bool:
        """Room for ``wanted`` more bytes: a connection holding nothing always has room for one thing."""
        held = self.unsent + self.reserved
        if held == 0:
            return True
        everywhere = self.everywhere
        return held + wanted <= self.limit and everywhere.used + wanted <= everywhere.limit

    async def wait_for_room(self) -> None:
        """Before reading a message: until the connection is under its budget and no read of it waits for room
        (the client takes results, or other connections do)."""
        if not self.stalled and self.has_room(1):
            return
        if self.everywhere.metrics.paused is not None:
            self.everywhere.metrics.paused.inc()
        await self._wait(lambda: not self.stalled and self.has_room(1))

    async def _wait(self, ready: Callable[[], bool]) -> None:
        waiting = self.everywhere._waiting
        waiting.add(self)
        try:
            while not ready():
                if self._freed.is_set():  # (a fresh event shared by every task of the connection that waits)
                    self._freed = trio.Event()
                await self._freed.wait()
        finally:
            waiting.discard(self)

    async def run_read(self, key: tuple[str, str], answer: Any) -> Response:
        """``await answer()`` once there is room for its answer (reserved while it runs). Reads that must wait
        take turns (a fair lock): only the first waits for room, so freed bytes wake one task, not every read
        of a message of a thousand."""
        largest = self.everywhere.largest
        known = largest.get(key)
        guess = self.limit if known is None else max(known, self.limit // MIN_GUESS_SHARE)
        reserved = False
        try:
            if self.stalled or not self.has_room(guess):
                self.stalled += 1  # the connection reads no message meanwhile
                try:
                    async with self._turn:
                        await self._wait(lambda: self.has_room(guess))
                        reserved = self._reserve(guess)
                finally:
                    self.stalled -= 1
                    self._freed.set()
            else:
                reserved = self._reserve(guess)
            response: Response = await answer()
        finally:
            if reserved:
                self.reserved -= guess
                self.everywhere.used -= guess
                self._freed.set()
                self.everywhere.freed()
        if len(response.body) > largest.get(key, -1):  # (keys: route templates, a bounded set)
            largest[key] = len(response.body)
        return response

    def _reserve(self, size: int) -> bool:
        self.reserved += size
        self.everywhere.used += size
        return True
