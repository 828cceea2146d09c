"""The envelope that carries a command into a scope actor and its decision back out.

The reply slot is part of the envelope (a ``trio.Event`` plus two fields) rather than a channel
per request: it is the cheapest ask/reply primitive trio has, and the actor never blocks on it.
"""

from __future__ import annotations

import trio

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.decisions import Decision

# Mailbox size per scope. Large enough that 4-64 concurrent clients never wait in normal
# operation, small enough that a stuck actor turns into 503s within a second instead of memory
# growth. Overflow policy: the sender waits up to ENQUEUE_TIMEOUT, then the API answers 503.
MAILBOX_SIZE = 1024
ENQUEUE_TIMEOUT = 1.0


class Envelope:
    __slots__ = ("command", "decision", "done", "lsn")

    def __init__(self, command: Command) -> None:
        self.command = command
        self.decision: Decision | None = None
        self.lsn = 0  # journal position of the decision's events; 0 when nothing was written
        self.done = trio.Event()

    def settle(self, decision: Decision, lsn: int) -> None:
        """Record the decision; ``done`` is set by whoever knows it is durable (the actor)."""
        self.decision = decision
        self.lsn = lsn


class Overloaded(Exception):
    """The scope's mailbox stayed full for ENQUEUE_TIMEOUT: the command was not applied."""
