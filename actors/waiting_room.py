"""The per-scope queue of selections waiting for a rank to stop being busy (spec §2.6, ``router_queue_threshold``).

Shell state, owned by the scope actor: a selection the core refused as overloaded while queueing is on waits
here, unanswered, and the actor asks the core again (with fresh loads and overlaps) whenever a turn changed
loads, in the order of the queue policy (``admission.queue_key``). Bounded in count (``MAX_WAITING``) and in
bytes (``MAX_WAITING_BYTES``, an estimate from the prompt's size); overflow policy: refuse the newcomer with 429
and ``Retry-After``. A waiter whose client gave up (its reply deadline passed, or it went away) is dropped
without ever being applied. Never journaled: after a restart the clients retry.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.admission import Waiting, queue_key
from kvrouter.actors.core.commands import SelectWorker
from kvrouter.actors.mailbox import Envelope

MAX_WAITING = 4096
MAX_WAITING_BYTES = 64 * 1024 * 1024
QUEUE_FULL = "the request queue is full ({count} requests, {size} bytes waiting): retry later"


@attrs.define
class Waiter:
    envelope: Envelope
    command: SelectWorker
    waiting: Waiting
    size: int


def estimated_size(command: SelectWorker) -> int:
    """Bytes a waiting selection holds: its prompt's integers dominate."""
    prompt = command.prompt
    ints = sum(len(part) for part in (prompt.token_ids, prompt.block_hashes, prompt.sequence_hashes) if part)
    return 512 + 16 * ints


class WaitingRoom:
    def __init__(self, *, max_waiting: int | None = None, max_bytes: int | None = None) -> None:
        self._max_waiting = MAX_WAITING if max_waiting is None else max_waiting
        self._max_bytes = MAX_WAITING_BYTES if max_bytes is None else max_bytes
        self._waiters: list[Waiter] = []
        self._arrivals = 0
        self.size = 0
        self.isl_tokens = 0
        self.refused = 0  # newcomers turned away because the queue was full

    def __len__(self) -> int:
        return len(self._waiters)

    def park(self, envelope: Envelope, command: SelectWorker, isl_tokens: int) -> str | None:
        """Queue the selection; or, when full, the refusal to answer (the overflow policy)."""
        for gone in [w for w in self._waiters if w.envelope.timed_out or w.envelope.abandoned]:
            self.remove(gone)  # their askers answered already: make room
        size = estimated_size(command)
        if len(self._waiters) >= self._max_waiting or self.size + size > self._max_bytes:
            self.refused += 1
            return QUEUE_FULL.format(count=len(self._waiters), size=self.size)
        self._arrivals += 1
        waiting = Waiting(command.at, self._arrivals, isl_tokens, command.options.priority_jump)
        self._waiters.append(Waiter(envelope, command, waiting, size))
        self.size += size
        self.isl_tokens += isl_tokens
        envelope.queued = True
        return None

    def in_order(self) -> list[Waiter]:
        """The waiters the policy would admit first, first; each waiter's own policy (its command's config)."""
        return sorted(self._waiters, key=lambda w: queue_key(w.command.config.router_queue_policy, w.waiting))

    def remove(self, waiter: Waiter) -> None:
        self._waiters.remove(waiter)
        self.size -= waiter.size
        self.isl_tokens -= waiter.waiting.isl_tokens
        waiter.envelope.queued = False
