"""An owned scope: the scope actor's ``decide``/``fold``, with every write fenced on the subject's last sequence.

The owner's state is always the fold of its subject up to ``last_seq``: it decides on that state, proposes the
events with ``expected_last_seq = last_seq``, and folds them only once the log accepted them at a new sequence.
A refused append means someone else wrote the subject: the owner's state is stale and must be dropped and
recovered (``recovery.recover``), never patched. One proposal at a time: the next command is decided on the
state the previous one produced.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.state import ScopeState


@attrs.frozen
class Proposal:
    """Events to append to the subject if its last sequence is still ``expected_last_seq``."""

    events: tuple[Event, ...]
    expected_last_seq: int
    decision: Accepted


class OwnedScope:
    __slots__ = ("last_seq", "state")

    def __init__(self, state: ScopeState, last_seq: int) -> None:
        self.state = state
        self.last_seq = last_seq


def propose(owned: OwnedScope, command: Command) -> Rejected | Accepted | Proposal:
    """A rejection or a no-op decision (nothing to append: answer at once), or the events to append."""
    decision = decide(owned.state, command)
    if isinstance(decision, Rejected) or not decision.events:
        return decision
    return Proposal(decision.events, owned.last_seq, decision)


def commit(owned: OwnedScope, proposal: Proposal, seq: int) -> None:
    """The log accepted ``proposal`` at ``seq``: apply its events."""
    if proposal.expected_last_seq != owned.last_seq or seq <= owned.last_seq:
        raise ValueError(f"commit at {seq} of a proposal on {proposal.expected_last_seq}, owner at {owned.last_seq}")
    fold(owned.state, proposal.events)
    owned.last_seq = seq


def overtaken(owned: OwnedScope, subject_last_seq: int, appending: bool) -> bool:
    """Whether the subject moved past the owner without a write of its own in flight: someone else appended, or
    an append the owner gave up on (no answer in time) landed after it recovered. Its state is then stale (for
    reads too, though its next write would be fenced) and must be recovered again. While an append of its own is
    in flight, the newer message may be that append: its answer settles it."""
    return not appending and subject_last_seq > owned.last_seq
