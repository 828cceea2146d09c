"""ScopeActor: one trio task per (model, tenant) scope, the only writer of that scope's state.

For each envelope: decide (pure) -> append events to the journal (sync: assigns the LSN) -> fold
(pure) -> settle the envelope. There is no await between append and fold, so the journal and the
state can never disagree, and cancellation cannot split them. The client's reply is held by the
requesting task until the journal reports the LSN durable (``ActorSystem.ask``), which lets the
actor go on deciding the next commands while the disk works: fsyncs are shared by everything
queued meanwhile (group commit) without ever acknowledging a write the journal could lose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from actors.core.decide import decide
from actors.core.decisions import Accepted
from actors.core.evolve import fold
from actors.core.state import ScopeState
from actors.mailbox import MAILBOX_SIZE, Envelope
from journal.codec import encode_record

if TYPE_CHECKING:
    from actors.system import ActorSystem

# Commands taken from the mailbox per scheduling turn. Bounds how long one busy scope holds the
# loop before others (and the journal writer) get a turn.
MAX_TURN = 256


class ScopeActor:
    __slots__ = ("_inbox", "outbox", "state", "system")

    def __init__(self, system: ActorSystem, state: ScopeState) -> None:
        self.system = system
        self.state = state
        self.outbox, self._inbox = trio.open_memory_channel[Envelope](MAILBOX_SIZE)

    async def run(self) -> None:
        journal = self.system.journal
        inbox = self._inbox
        with inbox:
            while True:
                self._handle(await inbox.receive())
                for _ in range(MAX_TURN - 1):
                    try:
                        envelope = inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._handle(envelope)
                self.system.after_turn()
                if not journal.has_room():
                    await journal.wait_for_room()  # policy: block this scope until the disk catches up
                if not self.state.exists and inbox.statistics().current_buffer_used == 0:
                    # Dissolved (last worker left) and nothing queued: retire atomically, before
                    # any await, so no sender can slip a command into a closed mailbox unseen.
                    self.system.retire(self)
                    return

    def _handle(self, envelope: Envelope) -> None:
        decision = decide(self.state, envelope.command)
        lsn = 0
        if isinstance(decision, Accepted) and decision.events:
            lsn = self.system.journal.append(encode_record(self.state.scope, decision.events))
            fold(self.state, decision.events)
        envelope.settle(decision, lsn)

    def mailbox_statistics(self) -> trio.MemoryChannelStatistics:
        return self._inbox.statistics()
