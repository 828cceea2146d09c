"""LoadFeed: which scopes' loads changed, and when, for the live load streams (``GET /ws/loads``).

The actors do O(1) per applied change: an observer bumps the scope's version and wakes one trio Event,
with no work per subscriber and nothing that can block. Readers (one hub per process, ``api/streams/loads.py``)
hold a cursor, the feed's change count when they last read, and ask for the scopes changed since it
(``changed_since``): the scopes are kept in order of their last change, so that walk touches only the
changed ones. Many changes of one scope between two reads are one entry: conflated, by design.

Bounds: one entry per scope ever seen, at most ``max_entries``; beyond it the entries of the scopes changed
longest ago are forgotten (policy: drop oldest) and a reader whose cursor predates them is told to resync
from a full listing (``floor``). ``epoch`` changes with each process, so a reader never mixes two feeds.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from kvrouter.actors.core.commands import BindSession, Command, IngestKvBatch, RecoverKv, ResetKvStream
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import RankLoad
from kvrouter.actors.core.state import ScopeState

# Commands that never change a rank's load: KV-event ingest (the busiest path by far) and session bindings.
QUIET_COMMANDS = (IngestKvBatch, RecoverKv, ResetKvStream, BindSession)
MAX_ENTRIES = 20_000  # twice the service's scope limit: dissolved scopes are remembered a while
# The longest a ``load_changes`` call waits for a change: well under a front's reply deadline, so an idle
# long poll is answered, never timed out.
MAX_WAIT_SECONDS = 2.0


@attrs.frozen
class LoadChange:
    """One scope's loads at ``version``; ``loads`` None: the scope is gone (or, in the selection service,
    not listed by ``GET /loads`` yet)."""

    scope: ScopeKey
    version: int
    loads: list[RankLoad] | None
    pending_count: int = 0
    pending_isl_tokens: int = 0


@attrs.frozen
class LoadChanges:
    """What changed after a reader's cursor (``reset``: a full listing that replaces what it knew)."""

    epoch: str
    cursor: int
    reset: bool
    changes: list[LoadChange]


class LoadFeed:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.epoch = secrets.token_hex(8)
        self.total = 0  # changes seen, all scopes together: the readers' cursor
        self.floor = 0  # a cursor below this has lost entries: its reader resyncs
        self.max_entries = max_entries
        # scope -> (version, total at its last change), in order of last change (oldest first)
        self._scopes: dict[ScopeKey, tuple[int, int]] = {}
        self._changed = trio.Event()

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        """An actor observer: called right after a decision's events are applied."""
        if not isinstance(command, QUIET_COMMANDS):
            self.bump(state.scope)

    def bump(self, scope: ScopeKey) -> None:
        """The scope's loads may have changed: O(1)."""
        version = self._scopes.pop(scope, (0, 0))[0] + 1
        self.total += 1
        self._scopes[scope] = (version, self.total)
        if len(self._scopes) > self.max_entries:
            oldest = next(iter(self._scopes))
            self.floor = self._scopes.pop(oldest)[1]
        self._changed.set()

    def version(self, scope: ScopeKey) -> int:
        entry = self._scopes.get(scope)
        return entry[0] if entry is not None else 0

    def current(self, epoch: str, cursor: int) -> bool:
        """Whether a reader at ``(epoch, cursor)`` can follow by changes (else it needs a full listing)."""
        return epoch == self.epoch and self.floor <= cursor <= self.total

    def changed_since(self, cursor: int) -> list[tuple[ScopeKey, int]]:
        """``(scope, version)`` of every scope changed after ``cursor``, oldest change first."""
        changed = []
        for scope in reversed(self._scopes):
            version, at = self._scopes[scope]
            if at <= cursor:
                break
            changed.append((scope, version))
        changed.reverse()
        return changed

    def known(self) -> Sequence[ScopeKey]:
        return list(self._scopes)

    async def wait(self, cursor: int, seconds: float) -> None:
        """Until a change after ``cursor``, or ``seconds``."""
        with trio.move_on_after(seconds):
            while self.total <= cursor:
                if self._changed.is_set():
                    self._changed = trio.Event()
                await self._changed.wait()


class ScopeStates(Protocol):
    """What ``read_changes`` reads of the scopes (an ``ActorSystem``, or a cluster replica's served scopes)."""

    def states(self) -> list[ScopeState]: ...

    async def read_barrier(self) -> None: ...


async def read_changes(
    feed: LoadFeed,
    system: ScopeStates,
    epoch: str,
    cursor: int,
    wait_seconds: float,
    measure: Callable[[ScopeKey, int], LoadChange],
) -> LoadChanges:
    """The service objects' ``load_changes``: waits up to ``wait_seconds`` (at most MAX_WAIT_SECONDS) for a change
    after ``cursor``, then measures each changed scope once (``measure(scope, version)``); a reader of another
    epoch, or too far behind, gets every scope (``reset``). Answered after a read barrier, as ``GET /loads``."""
    if feed.current(epoch, cursor):
        await feed.wait(cursor, min(max(wait_seconds, 0.0), MAX_WAIT_SECONDS))
        at = feed.total
        changes = [measure(scope, version) for scope, version in feed.changed_since(cursor)]
        reset = False
    else:
        at = feed.total
        changes = [measure(state.scope, feed.version(state.scope)) for state in system.states()]
        reset = True
    await system.read_barrier()
    return LoadChanges(feed.epoch, at, reset, changes)
