"""What both service objects share: rejections as exceptions, and the scope filter of list queries.

A service method either returns its result or raises: ``Refused`` (the core, or a service rule, said
no: ``reason`` picks the answer), ``Overloaded`` / ``ReplyTimeout`` / ``JournalUnavailable``
(``actors/mailbox.py``). Nothing here knows HTTP: the routes map reasons to statuses.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.decisions import Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.ids import ScopeKey


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
