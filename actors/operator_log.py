"""Info-level lines an operator reads: workers arriving and leaving, and what expired.

An observer of applied decisions (called by the actor right after fold, live traffic only: recovery folds
without observers, so a restart does not re-log history). One line per event, a bounded summary for the
big ones (an expiry sweep can carry thousands of ids).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import (
    ApproxBlocksExpired,
    Event,
    RequestsExpired,
    SessionsExpired,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.core.state import ScopeState

log = logging.getLogger("kvrouter.catalog")

SHOWN_IDS = 5  # ids named in one expiry line; the rest are counted


def _some(ids: tuple[str, ...]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def _registered(event: WorkerRegistered, scope: str) -> None:
    last = event.dp_start + event.dp_size - 1
    log.info(
        "worker %d registered (%s, block_size %d, dp ranks %d..%d)",
        event.worker_id,
        scope,
        event.block_size,
        event.dp_start,
        last,
    )


def _upserted(event: WorkerUpserted, scope: str) -> None:
    record = event.record
    log.info("worker %d registered or updated (%s, %d dp ranks)", record.worker_id, scope, record.dp_size)


def _removed(event: WorkerUnregistered | WorkerRemoved, scope: str) -> None:
    log.info("worker %d removed (%s)", event.worker_id, scope)


def _requests_expired(event: RequestsExpired, scope: str) -> None:
    log.info("%d requests expired (%s): %s", len(event.request_ids), scope, _some(event.request_ids))


def _sessions_expired(event: SessionsExpired, scope: str) -> None:
    log.info("%d session bindings expired (%s): %s", len(event.session_ids), scope, _some(event.session_ids))


def _predictions_expired(event: ApproxBlocksExpired, scope: str) -> None:
    count = len(event.block_hashes)
    log.info("worker %d dp_rank %d: %d predicted blocks expired (%s)", event.worker_id, event.dp_rank, count, scope)


# By exact type: one dict lookup per event keeps the observer off the add/free hot path's profile.
_LINES: dict[type, Callable[[Any, str], None]] = {
    WorkerRegistered: _registered,
    WorkerUpserted: _upserted,
    WorkerUnregistered: _removed,
    WorkerRemoved: _removed,
    RequestsExpired: _requests_expired,
    SessionsExpired: _sessions_expired,
    ApproxBlocksExpired: _predictions_expired,
}


def log_operator_events(state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
    """Log the events of one applied decision that change who serves, or that expired something."""
    for event in events:
        line = _LINES.get(type(event))
        if line is not None and log.isEnabledFor(logging.INFO):
            line(event, state.scope.describe())
