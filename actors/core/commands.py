"""Commands: what a client (or the clock) asks a scope actor to do.

Every command carries ``at`` (wall-clock nanoseconds stamped by the shell) so that the core never
reads a clock and a journal replays to the same state whenever it is replayed. The scope a command
belongs to travels beside it in the mailbox envelope, not inside it.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RegisterWorker:
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int
    at: int = 0


@attrs.frozen
class UnregisterWorker:
    worker_id: int
    at: int = 0


@attrs.frozen
class AddRequest:
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]  # unsigned 64-bit chained hashes, one per prompt block
    isl_tokens: int  # new prompt tokens to account as prefill load; 0 = no prefill tracking
    at: int = 0


@attrs.frozen
class CompletePrefill:
    request_id: str
    at: int = 0


@attrs.frozen
class FreeRequest:
    request_id: str
    at: int = 0


@attrs.frozen
class ExpireStale:
    """A clock tick: drop requests admitted more than ``max_age_ns`` before ``at``."""

    max_age_ns: int
    at: int = 0


Command = RegisterWorker | UnregisterWorker | AddRequest | CompletePrefill | FreeRequest | ExpireStale

# Commands that may bring a scope into existence; every other command to a missing scope is
# answered by the core from an empty state (a "not found" rejection or a no-op).
SCOPE_CREATING = (RegisterWorker,)
