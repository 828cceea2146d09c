"""What ``decide`` returns: the events to journal, or a rejection with its reason."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from kvrouter.actors.core.events import Event


class Reason(enum.Enum):
    """Why a command was refused; the API maps each to one HTTP status."""

    INVALID = "invalid"  # 400
    NOT_FOUND = "not_found"  # 404
    CONFLICT = "conflict"  # 409
    UNAVAILABLE = "unavailable"  # 503: nothing schedulable
    OVERLOADED = "overloaded"  # 429: every eligible rank is busy (the shell may queue the request instead)


@attrs.frozen
class Accepted:
    events: tuple[Event, ...] = ()
    created: bool = False  # the command created something (HTTP 201)
    reply: Any = None  # what the client is told beyond ok/created (e.g. a selection)


@attrs.frozen
class Rejected:
    reason: Reason
    message: str


Decision = Accepted | Rejected

NOTHING_CHANGED = Accepted()
