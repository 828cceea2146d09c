"""The envelope that carries a command into a scope actor and its decision back out, and the ways an
ask can end without a decision (overloaded, past its deadline, journal gone).

The reply slot is part of the envelope (a ``trio.Event`` plus a few fields) rather than a channel
per request: it is the cheapest ask/reply primitive trio has, and the actor never blocks on it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.decisions import Decision

# Mailbox size per scope. Large enough that 4-64 concurrent clients never wait in normal
# operation, small enough that a stuck actor turns into 503s within a second instead of memory
# growth. Overflow policy: the sender waits up to ENQUEUE_TIMEOUT, then the API answers 503.
MAILBOX_SIZE = 1024
ENQUEUE_TIMEOUT = 1.0


class Envelope:
    __slots__ = (
        "abandoned",
        "awaited",
        "command",
        "deadline",
        "decision",
        "done",
        "failure",
        "kv_blocks",
        "lsn",
        "on_settled",
        "queued",
        "timed_out",
    )

    def __init__(
        self,
        command: Command,
        on_settled: Callable[[], None] | None = None,
        kv_blocks: int = 0,
        *,
        awaited: bool = True,
    ) -> None:
        self.command = command
        # False: nobody waits for ``done`` (KV ingest waits for ``on_settled`` only), so the actor sets it once the
        # decision is made and asks the journal for no durability callback: a journal under ``always`` may then
        # hold the record back until someone waits for one (FileJournal.UNAWAITED_HOLD_SECONDS).
        self.awaited = awaited
        # The blocks a KV-ingest command's batches name (its share of the actor's turn), when the sender has
        # counted them already (KV ingest does, to bound its runs); 0: the actor counts them itself.
        self.kv_blocks = kv_blocks
        self.decision: Decision | None = None
        self.lsn = 0  # journal position of the decision's events; 0 when nothing was written
        self.done = trio.Event()  # set once the decision is durable (or the ask has failed)
        # Called by the actor the moment it has decided (before durability): in-flight claims end here.
        self.on_settled = on_settled
        self.failure: BaseException | None = None  # the journal refused the events: nothing was applied
        self.deadline = 0.0  # trio time after which the asker stops waiting (see actors/deadlines.py)
        self.timed_out = False
        self.queued = False  # parked in the scope's queue for a rank to stop being busy (core/waiting_room.py)
        self.abandoned = False  # the asker went away: a queued envelope is dropped, never applied

    def settle(self, decision: Decision, lsn: int) -> None:
        """Record the decision; ``done`` is set by whoever knows it is durable (the actor)."""
        self.decision = decision
        self.lsn = lsn


class Batch:
    """Several commands of one scope in one mailbox slot: the actor applies them in order in one turn and
    sets ``done`` once, when the last one's events are durable (one wake-up, one durability callback and
    one deadline for the lot, where envelopes cost one each). Only commands that are answered by their
    decision alone go in a batch (the slot tracker's writes: nothing parks or draws; see ``BATCHABLE``)."""

    __slots__ = ("commands", "deadline", "decisions", "done", "failure", "lsns", "timed_out")

    def __init__(self, commands: list[Command]) -> None:
        self.commands = commands
        self.decisions: list[Decision] = []  # one per command applied, in order (fewer if the journal failed)
        self.lsns: list[int] = []  # each decision's journal position (0: nothing written)
        self.done = trio.Event()  # set once every decision is durable (or the journal has failed)
        self.failure: BaseException | None = None  # the journal refused a command: it and the rest were not applied
        self.deadline = 0.0
        self.timed_out = False


class Overloaded(Exception):
    """The scope's mailbox stayed full for ENQUEUE_TIMEOUT: the command was not applied."""


class OutcomeUnknown(Exception):
    """The command may or may not be applied, now or later: the API answers 504 (never 503, which always means
    "not applied, safe to send again"). A caller that must know looks at the command's effect before retrying."""


class ReplyTimeout(OutcomeUnknown):
    """No durable decision within the reply deadline. The command may still be applied later, so
    ``request_id`` (also logged) lets the operator find out what became of it."""

    def __init__(self, request_id: str, deadline: float) -> None:
        super().__init__(
            f"no reply within {deadline:g} s; the command may still be applied: check its effect before "
            f"retrying (request_id {request_id})"
        )
        self.request_id = request_id


class JournalUnavailable(Exception):
    """The journal cannot be written any more, and the service (or, in a cluster, the scope here) stops.

    ``maybe_written``: the command's record was appended before the journal failed, so whether it survives is
    unknown (504); otherwise it was refused before reaching the journal, not applied (503)."""

    def __init__(self, cause: BaseException | None, *, maybe_written: bool = False) -> None:
        reason = cause.__cause__ or cause if cause is not None else None
        detail = f" ({reason})" if reason is not None else ""
        self.maybe_written = maybe_written
        if maybe_written:
            super().__init__(
                f"the journal failed{detail} after this write was appended: it was not acknowledged and may or "
                "may not have been written; check its effect before retrying"
            )
        else:
            super().__init__(
                f"the journal cannot be written{detail}; this write was not applied and the service is "
                "stopping: retry once it has been restarted"
            )
