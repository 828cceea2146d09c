"""Events: the facts the journal stores. ``evolve`` folds them into state; nothing else does.

Tags are explicit and stable (see ``EVENT_TAGS``): renaming a class must never orphan a journal.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class WorkerRegistered:
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int


@attrs.frozen
class WorkerUnregistered:
    worker_id: int


@attrs.frozen
class RequestAdded:
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: tuple[int, ...]
    prefill_tokens: int
    at: int


@attrs.frozen
class PrefillCompleted:
    request_id: str


@attrs.frozen
class RequestFreed:
    request_id: str


@attrs.frozen
class RequestsExpired:
    request_ids: tuple[str, ...]
    at: int


Event = (
    WorkerRegistered | WorkerUnregistered | RequestAdded | PrefillCompleted | RequestFreed | RequestsExpired
)

EVENT_TAGS: dict[type, str] = {
    WorkerRegistered: "worker_registered",
    WorkerUnregistered: "worker_unregistered",
    RequestAdded: "request_added",
    PrefillCompleted: "prefill_completed",
    RequestFreed: "request_freed",
    RequestsExpired: "requests_expired",
}
