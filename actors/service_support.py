"""What both service objects share: rejections as exceptions, and the scope filter of list queries.

A service method either returns its result or raises: ``Refused`` (the core, or a service rule, said
no: ``reason`` picks the answer), ``Overloaded`` / ``OutcomeUnknown`` (``ReplyTimeout``) / ``JournalUnavailable``
(``actors/mailbox.py``). Nothing here knows HTTP: the routes map reasons to statuses.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvrouter.actors.core.decisions import Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.mailbox import JournalUnavailable, OutcomeUnknown, Overloaded, ReplyTimeout


class Refused(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    @classmethod
    def because(cls, rejection: Rejected) -> Refused:
        return cls(rejection.reason, rejection.message)


def accepted(decision: Decision) -> Accepted:
    """The decision if it was accepted; a rejection raises Refused."""
    if isinstance(decision, Rejected):
        raise Refused.because(decision)
    return decision


@attrs.frozen
class ScopeFilter:
    """``model_name`` and ``tenant_id`` filters of list queries, combined with AND; None matches all."""

    model_name: str | None = None
    tenant_id: str | None = None

    def __call__(self, scope: ScopeKey) -> bool:
        return (self.model_name is None or scope.model_name == self.model_name) and (
            self.tenant_id is None or scope.tenant_id == self.tenant_id
        )


EVERY_SCOPE = ScopeFilter()


# -- failures as data (between processes, and in a batch's answers) ---------------------------------------

REFUSED, OVERLOADED, REPLY_TIMEOUT, JOURNAL_UNAVAILABLE, INTERNAL = "refused", "overloaded", "timeout", "journal", "bug"
UNKNOWN = "unknown"
INTERNAL_ERROR = "the actor process failed on this request (a bug: its log has the traceback)"


def encode_failure(exc: Exception) -> list[Any]:
    """A service failure as data; anything else is a bug in the actor process (the front answers 500)."""
    if isinstance(exc, Refused):
        return [REFUSED, exc.reason.value, exc.message]
    if isinstance(exc, Overloaded):
        return [OVERLOADED, str(exc)]
    if isinstance(exc, ReplyTimeout):
        return [REPLY_TIMEOUT, str(exc), exc.request_id]
    if isinstance(exc, OutcomeUnknown):
        return [UNKNOWN, str(exc)]
    if isinstance(exc, JournalUnavailable):
        return [JOURNAL_UNAVAILABLE, str(exc), exc.maybe_written]
    return [INTERNAL, INTERNAL_ERROR]


class ActorProcessBug(Exception):
    """The actor process raised something that is not a service failure (the app answers 500)."""


def decode_failure(data: list[Any]) -> Exception:
    kind = data[0]
    if kind == REFUSED:
        return Refused(Reason(data[1]), data[2])
    if kind == OVERLOADED:
        return Overloaded(data[1])
    if kind == REPLY_TIMEOUT:
        late = ReplyTimeout.__new__(ReplyTimeout)
        Exception.__init__(late, data[1])
        late.request_id = data[2]
        return late
    if kind == JOURNAL_UNAVAILABLE:
        gone = JournalUnavailable.__new__(JournalUnavailable)
        Exception.__init__(gone, data[1])
        gone.maybe_written = bool(data[2]) if len(data) > 2 else False
        return gone
    if kind == UNKNOWN:
        return OutcomeUnknown(data[1])
    return ActorProcessBug(data[1])
