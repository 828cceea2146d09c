"""Session affinity rules (see ``actors/core/sessions.py`` for the semantics): which rank a session prefers,
and the events that pin, release, expire and replicate bindings. Pure."""

from __future__ import annotations

from collections.abc import Container, Iterable

from kvrouter.actors.core.commands import BindSession
from kvrouter.actors.core.decisions import NOTHING_CHANGED, Accepted, Decision
from kvrouter.actors.core.events import Event, SessionBound, SessionReleased, SessionsExpired
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.selection_state import SelectionState
from kvrouter.actors.core.sessions import MAX_SESSIONS
from kvrouter.actors.core.state import ScopeState


def preferred_rank(
    selection: SelectionState, session_id: str | None, at: int, live: Container[str]
) -> WorkerRank | None:
    """The rank the session is pinned to, unless it has no binding or the binding expired."""
    if session_id is None:
        return None
    binding = selection.sessions.get(session_id)
    if binding is None or binding.expired(at, live):
        return None
    return WorkerRank(binding.worker_id, binding.dp_rank)


def bind(
    state: ScopeState,
    session_id: str,
    rank: WorkerRank,
    reservation_id: str | None,
    *,
    at: int,
    ttl_ns: int,
    writer_id: int,
) -> tuple[Event, ...]:
    """Pin (or refresh) the session on ``rank``; a new session beyond ``MAX_SESSIONS`` evicts the least
    recently used binding.

    A refresh of our own binding keeps its version (peers take the republished binding as a touch, as 1.6.1's
    do); a new or moved binding, or one a peer wrote, gets the version ``max(at, current + 1)``: like 1.6.1's,
    a sequence from the clock, so the latest binding wins across replicas, and always past the current one."""
    sessions = state.selection.sessions
    current = sessions.get(session_id)
    if current is not None and current.writer_id == writer_id and (current.worker_id, current.dp_rank) == rank:
        sequence = current.sequence
    else:
        sequence = max(at, current.sequence + 1 if current is not None else 1)
    bound = SessionBound(session_id, rank.worker_id, rank.dp_rank, reservation_id, at, ttl_ns, sequence, writer_id)
    if current is None and len(sessions) >= MAX_SESSIONS:
        evicted = tuple(sessions)[: len(sessions) - MAX_SESSIONS + 1]
        return (SessionsExpired(evicted, at), bound)
    return (bound,)


def released(selection: SelectionState, request_ids: Iterable[str], at: int) -> tuple[SessionReleased, ...]:
    """Release events for the bookings that belong to a session (their session's idle time starts at ``at``)."""
    session_of = selection.session_of
    return tuple(
        SessionReleased(session_of[request_id], request_id, at)
        for request_id in request_ids
        if request_id in session_of
    )


def expired(state: ScopeState, at: int) -> tuple[SessionsExpired, ...]:
    """The sweep: bindings idle past their TTL with no live booking. (A booking the same sweep expires still
    holds its session here: its release restarts the session's idle time.)"""
    live = state.slots.requests
    gone = tuple(session_id for session_id, b in state.selection.sessions.items() if b.expired(at, live))
    return (SessionsExpired(gone, at),) if gone else ()


def decide_bind_session(command: BindSession, state: ScopeState) -> Decision:
    """A peer's binding: taken when newer than ours (``(sequence, writer_id)``), for a partition we know. The
    same binding again (same version and rank, republished when a booking of it ended) restarts its idle time."""
    if not state.exists:
        return NOTHING_CHANGED
    current = state.selection.sessions.get(command.session_id)
    if current is not None:
        incoming = (command.sequence, command.writer_id)
        same = incoming == current.version and (current.worker_id, current.dp_rank) == (
            command.worker_id,
            command.dp_rank,
        )
        if current.version > incoming or (current.version == incoming and not same):
            return NOTHING_CHANGED
        if same and command.at <= current.last_used:
            return NOTHING_CHANGED
    event = SessionBound(
        command.session_id,
        command.worker_id,
        command.dp_rank,
        None,
        command.at,
        command.ttl_ns,
        command.sequence,
        command.writer_id,
    )
    return Accepted((event,))
