"""Reads answered from follower copies, and the tokens that keep them behind no client's own writes.

* ``written_token(scope, seq)``: the ``kvrouter-written`` header a write's answer carries, ``<scope token>:<seq>``:
  the subject sequence of the scope's last message once the write was acknowledged (its own message, or a later
  one), so a copy that folded that message holds the write.
* ``parse_read_after``: a read's tokens (the ``read_after`` query parameter: ``<token>:<seq>`` separated by
  commas), as ``{scope token: sequence}``; bad input is a ``ValueError`` naming it (the route answers 400).
* ``FollowerReads.states_for``: the copies' states that answer a read of the scopes ``wanted`` selects, when each
  such scope is served here or has a copy ready for the read (``followers.py``); None: gather from the owners.
  The states are handed to the read through ``reading`` (a context variable), which the cluster service's
  ``loads`` and ``workers`` add to the rows of the scopes it serves.
* ``WrittenSequences``: per scope, the newest subject sequence this replica saw acknowledged (its own scopes'
  journals, and the owners' answers to writes it forwarded), for the tokens of writes it answers. Bounded
  (``MAX_RELAYED``, policy: forget the oldest).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Final

import trio

from kvrouter.actors.cluster.followers import MAX_FOLLOWED, Followers, states_of
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.scopes import OwnedScopes
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.metric_families import Family, counter, gauge
from kvrouter.actors.service_support import ScopeFilter

WRITTEN_HEADER: Final = "kvrouter-written"
READ_AFTER: Final = "read_after"  # the query parameter naming a read's tokens
MAX_READ_AFTER: Final = 64  # tokens one read may name
MAX_RELAYED: Final = 4096  # scopes whose forwarded writes' sequences are remembered

_READING: ContextVar[tuple[ScopeState, ...]] = ContextVar("kvrouter_follower_states", default=())


def written_token(scope: ScopeKey, seq: int) -> str:
    return f"{scope_token(scope)}:{seq}"


def parse_read_after(value: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for item in value.split(","):
        token, _, seq = item.strip().rpartition(":")
        if not token or not seq.isdigit() or len(seq) > 19:
            raise ValueError(
                f"{READ_AFTER}: {item.strip()!r} is not <scope token>:<sequence> (a write's {WRITTEN_HEADER})"
            )
        found[token] = max(found.get(token, 0), int(seq))
    if len(found) > MAX_READ_AFTER:
        raise ValueError(f"{READ_AFTER}: {len(found)} tokens; a read names at most {MAX_READ_AFTER}")
    return found


@contextlib.contextmanager
def reading(states: list[ScopeState]) -> Iterator[None]:
    """Within the block, the cluster service's reads of many scopes include ``states`` (copies)."""
    reset = _READING.set(tuple(states))
    try:
        yield
    finally:
        _READING.reset(reset)


def copies_read(wanted: ScopeFilter) -> list[ScopeState]:
    """The copies' states handed to the read running now (``reading``) that ``wanted`` selects."""
    return [state for state in _READING.get() if wanted(state.scope)]


class WrittenSequences:
    def __init__(self, owned: OwnedScopes[Any]) -> None:
        self._owned = owned
        self._relayed: dict[str, int] = {}

    def note(self, token: str | None) -> None:
        """A forwarded write's answer carried ``token`` (its ``kvrouter-written``, None if none)."""
        if token is None:
            return
        scope, _, seq = token.rpartition(":")
        if not scope or not seq.isdigit():
            return
        known = self._relayed.pop(scope, 0)
        if len(self._relayed) >= MAX_RELAYED:  # overflow: forget the oldest scope
            del self._relayed[next(iter(self._relayed))]
        self._relayed[scope] = max(known, int(seq))

    def relayed(self, token: str) -> int | None:
        """The newest sequence an owner answered a write of the scope (its token) forwarded from here with."""
        return self._relayed.get(token)

    def of(self, scope: ScopeKey) -> str | None:
        """The token for a write of ``scope`` acknowledged just now: the sequence its journal here holds, or the
        newest an owner answered with; None when neither is known."""
        token = scope_token(scope)
        owned = self._owned.held(scope)
        journal = owned.journal if owned is not None else None
        seqs = [self._relayed.get(token, 0), journal.statistics().last_stream_sequence if journal is not None else 0]
        return f"{token}:{max(seqs)}" if max(seqs) > 0 else None


class FollowerReads:
    def __init__(
        self, followers: Followers, membership: Membership, owned: OwnedScopes[Any], written: WrittenSequences
    ) -> None:
        self.followers = followers
        self._written = written
        self._membership = membership
        self._owned = owned

    async def states_for(self, wanted: ScopeFilter, after: dict[str, int]) -> list[ScopeState] | None:
        """The copies answering a read of ``wanted`` (each known scope it selects is served here, or has a copy
        ready for it, waited for briefly); None when one is not: the read is gathered from the owners. A copy must
        hold the read's tokens (``after``) and every write this replica forwarded: a client reading through the
        replica it wrote through sees its writes without a token."""
        if not self._membership.live():
            return None
        scopes = [scope for scope in self._membership.view.scopes.values() if wanted(scope)]
        others = [scope for scope in scopes if self._owned.serving(scope) is None]
        if not scopes or len(others) > MAX_FOLLOWED // 2:  # a read of that many scopes would churn the copies
            return None
        copies = []
        for scope in others:
            token = scope_token(scope)
            need = max(after.get(token, 0), self._written.relayed(token) or 0)
            copy = await self.followers.copy_for(scope, need or None)
            if copy is None:
                return None
            copies.append(copy)
        self.followers.reads += bool(copies)
        return states_of(copies)

    def describe(self) -> list[dict[str, Any]]:
        """``GET /cluster``'s ``followers``: each copy, the sequence it folded, and its lag."""
        now = trio.current_time()
        return [
            {
                "model_name": copy.scope.model_name,
                "tenant_id": copy.scope.tenant_id,
                "sequence": copy.seq,
                "lsn": copy.lsn,
                "lag_seconds": _lag(copy.current_at, now),
            }
            for copy in self.followers.copies()
        ]

    def metrics(self) -> list[Family]:
        now = trio.current_time()
        copies = self.followers.copies()
        lags: dict[tuple[str, ...], float] = {
            (copy.scope.model_name, copy.scope.tenant_id): lag
            for copy in copies
            if (lag := _lag(copy.current_at, now)) is not None
        }
        return [
            gauge("kvrouter_cluster_followed_scopes", "Follower copies kept here", (), {(): float(len(copies))}),
            gauge(
                "kvrouter_cluster_follower_lag_seconds",
                "Seconds since each follower copy was last found current on its subject",
                ("model_name", "tenant_id"),
                lags,
            ),
            counter(
                "kvrouter_cluster_follower_reads", "Reads answered from follower copies", (), _one(self.followers.reads)
            ),
            counter(
                "kvrouter_cluster_follower_evictions",
                "Follower copies evicted for a new one (the cap reached)",
                (),
                _one(self.followers.evicted),
            ),
        ]


def _lag(current_at: float, now: float) -> float | None:
    return None if math.isinf(current_at) else round(now - current_at, 3)


def _one(value: int) -> dict[tuple[str, ...], float]:
    return {(): float(value)}


def served_predicate(owned: OwnedScopes[Any]) -> Callable[[ScopeKey], bool]:
    return lambda scope: owned.serving(scope) is not None
