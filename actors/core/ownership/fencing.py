"""A stream of per-subject logs with JetStream's fence: an append names the subject's last sequence it expects.

This states the rule of ``Nats-Expected-Last-Subject-Sequence``: sequences are the stream's (one counter for
every subject), a subject's last sequence is that of its newest message (0 before the first), and an append
whose expectation differs is refused and changes nothing. An owner that lost its scope without knowing it
(paused, partitioned) still expects the sequence it last wrote, which a new owner has moved past, so its
append fails instead of forking the scope's history. ``expected_last=None`` is an unfenced publish.
"""

from __future__ import annotations

import base64
from typing import Generic, TypeVar

import attrs

from kvrouter.actors.core.ids import ScopeKey

P = TypeVar("P")

MAX_READ = 1_024  # messages one read returns: a recovering owner pages through a long tail


@attrs.frozen
class Appended:
    seq: int


@attrs.frozen
class WrongLastSequence:
    expected: int
    actual: int


AppendResult = Appended | WrongLastSequence


def scope_token(scope: ScopeKey) -> str:
    """The scope as one subject token: an unpadded URL-safe base64 of it (names may hold dots, spaces or
    wildcards, none of which a subject token may)."""
    raw = f"{len(scope.model_name)}:{scope.model_name}{scope.tenant_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def scope_subject(prefix: str, scope: ScopeKey) -> str:
    """``<prefix>.<token>`` (``scope_token``)."""
    return f"{prefix}.{scope_token(scope)}"


class SubjectLog(Generic[P]):
    __slots__ = ("_subjects", "last_seq")

    def __init__(self) -> None:
        self.last_seq = 0  # the stream's
        self._subjects: dict[str, list[tuple[int, P]]] = {}

    def last_subject_seq(self, subject: str) -> int:
        messages = self._subjects.get(subject)
        return messages[-1][0] if messages else 0

    def append(self, subject: str, payload: P, expected_last: int | None) -> AppendResult:
        actual = self.last_subject_seq(subject)
        if expected_last is not None and expected_last != actual:
            return WrongLastSequence(expected_last, actual)
        self.last_seq += 1
        self._subjects.setdefault(subject, []).append((self.last_seq, payload))
        return Appended(self.last_seq)

    def read(self, subject: str, after: int, limit: int = MAX_READ) -> tuple[tuple[int, P], ...]:
        """Up to ``limit`` messages of ``subject`` with a sequence above ``after``, oldest first."""
        messages = self._subjects.get(subject, [])
        lo, hi = 0, len(messages)
        while lo < hi:  # the first message past ``after`` (sequences grow along a subject)
            mid = (lo + hi) // 2
            if messages[mid][0] <= after:
                lo = mid + 1
            else:
                hi = mid
        return tuple(messages[lo : lo + limit])

    def subjects(self) -> tuple[str, ...]:
        return tuple(sorted(self._subjects))
