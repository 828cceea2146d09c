"""The per-scope queue of selections waiting for a rank to stop being busy (``router_queue_threshold``). Pure.

A selection the core refused as overloaded while queueing is on (``parks``) waits here, unanswered; the scope
asks the core again, with fresh loads and overlaps, whenever a turn changed its state, in the order of the queue
policy (``admission.queue_key``), and stops at the first that still finds every rank busy. Bounded in count
(``MAX_WAITING``) and in bytes (``MAX_WAITING_BYTES``, an estimate from the prompt's size); overflow policy:
refuse the newcomer (the shell answers 429 with ``Retry-After``). Never journaled: after a restart the clients
retry.

The room keeps a ticket for each waiter (the shell's handle on its asker) and never looks inside it but through
the ``gone`` predicate the shell hands it: a waiter whose asker has gone (its reply deadline passed, or it went
away) has been answered already, so it is dropped, never decided again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from kvrouter.actors.core.admission import Waiting, queue_key
from kvrouter.actors.core.commands import SelectWorker
from kvrouter.actors.core.decisions import Decision, Reason, Rejected

MAX_WAITING = 4096
MAX_WAITING_BYTES = 64 * 1024 * 1024
QUEUE_FULL = "the request queue is full ({count} requests, {size} bytes waiting): retry later"

T = TypeVar("T")


@attrs.define
class Waiter(Generic[T]):
    ticket: T
    command: SelectWorker
    waiting: Waiting
    size: int


def estimated_size(command: SelectWorker) -> int:
    """Bytes a waiting selection holds: its prompt's integers dominate."""
    prompt = command.prompt
    ints = sum(len(part) for part in (prompt.token_ids, prompt.block_hashes, prompt.sequence_hashes) if part)
    return 512 + 16 * ints


def prompt_tokens(command: SelectWorker) -> int:
    """The prompt's length in tokens, as the queue policy weighs it (``wspt``) and ``/loads`` sums it."""
    prompt = command.prompt
    return len(prompt.token_ids) if prompt.token_ids is not None else prompt.isl_tokens or 0


def parks(decision: Decision, command: SelectWorker) -> bool:
    """Whether the selection waits for a rank instead of being answered: every eligible rank was busy and
    queueing is on."""
    return type(decision) is Rejected and decision.reason is Reason.OVERLOADED and command.config.queueing


class WaitingRoom(Generic[T]):
    def __init__(
        self, gone: Callable[[T], bool], *, max_waiting: int | None = None, max_bytes: int | None = None
    ) -> None:
        self._gone = gone
        self._max_waiting = MAX_WAITING if max_waiting is None else max_waiting
        self._max_bytes = MAX_WAITING_BYTES if max_bytes is None else max_bytes
        self._waiters: list[Waiter[T]] = []
        self._arrivals = 0
        self.size = 0
        self.isl_tokens = 0
        self.refused = 0  # newcomers turned away because the queue was full

    def __len__(self) -> int:
        return len(self._waiters)

    def park(self, ticket: T, command: SelectWorker) -> str | None:
        """Queue the selection; or, when full, the refusal to answer (the overflow policy)."""
        self._drop_gone()  # their askers answered already: make room
        size = estimated_size(command)
        if len(self._waiters) >= self._max_waiting or self.size + size > self._max_bytes:
            self.refused += 1
            return QUEUE_FULL.format(count=len(self._waiters), size=self.size)
        self._arrivals += 1
        tokens = prompt_tokens(command)
        waiting = Waiting(command.at, self._arrivals, tokens, command.options.priority_jump)
        self._waiters.append(Waiter(ticket, command, waiting, size))
        self.size += size
        self.isl_tokens += tokens
        return None

    def in_order(self) -> list[Waiter[T]]:
        """The waiters still wanted, the one the policy admits first first (each by its own command's policy);
        those whose askers have gone are dropped."""
        self._drop_gone()
        return sorted(self._waiters, key=lambda w: queue_key(w.command.config.router_queue_policy, w.waiting))

    def remove(self, waiter: Waiter[T]) -> None:
        self._waiters.remove(waiter)
        self.size -= waiter.size
        self.isl_tokens -= waiter.waiting.isl_tokens

    def _drop_gone(self) -> None:
        gone = self._gone
        for waiter in [w for w in self._waiters if gone(w.ticket)]:
            self.remove(waiter)
