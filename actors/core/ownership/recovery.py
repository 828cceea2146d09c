"""A new owner (or a follower) rebuilds a scope from its latest snapshot and the subject's tail.

A snapshot is the scope's state as of a subject sequence. Any snapshot an owner wrote is a correct fold of
the subject up to its sequence (the fence makes every owner's state a prefix of the log), so the newest one
wins whoever wrote it; the tail is every message past it, folded in order with ``evolve`` only (``decide`` is
never re-run, so a change of rules cannot rewrite history).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvrouter.actors.core.events import Event
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.owner import OwnedScope
from kvrouter.actors.core.state import ScopeState


@attrs.frozen(eq=False)
class ScopeSnapshot:
    seq: int  # the subject sequence the state covers (0: none)
    data: dict[str, Any]  # ScopeState.to_snapshot(): never mutated once taken


def take_snapshot(owned: OwnedScope) -> ScopeSnapshot:
    return ScopeSnapshot(owned.last_seq, owned.state.to_snapshot())


def newer(current: ScopeSnapshot | None, offered: ScopeSnapshot) -> bool:
    """Whether the snapshot store should keep ``offered`` over ``current``."""
    return current is None or offered.seq > current.seq


def recover(
    scope: ScopeKey, snapshot: ScopeSnapshot | None, tail: Iterable[tuple[int, tuple[Event, ...]]]
) -> OwnedScope:
    """The scope as of the last message of ``tail`` (messages at or below the snapshot's sequence are skipped)."""
    if snapshot is None:
        owned = OwnedScope(ScopeState(scope), 0)
    else:
        owned = OwnedScope(ScopeState.from_snapshot(snapshot.data), snapshot.seq)
    catch_up(owned, tail)
    return owned


def catch_up(owned: OwnedScope, tail: Iterable[tuple[int, tuple[Event, ...]]]) -> None:
    """Fold the messages past ``owned.last_seq`` (a follower's tailing, and the end of a recovery)."""
    for seq, events in tail:
        if seq <= owned.last_seq:
            continue
        fold(owned.state, events)
        owned.last_seq = seq
