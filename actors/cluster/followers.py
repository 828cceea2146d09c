"""Follower copies: read-only copies of scopes this replica does not own, so that it answers their reads itself.

A read of ``GET /loads`` or ``GET /workers`` reaching a replica covers scopes that other members own. Without a
copy, the replica gathers their rows from the owners. With one, it answers from the copy, when the copy is new
enough (``ready``):

* **current**: the last round that read the scope's subject found nothing past what the copy folded, at most
  ``CURRENT_WITHIN_SECONDS`` ago. So a copy reflects every write acknowledged before that round asked: a read
  without a token sees the scope as it stood at most that long ago (usually one round, ``REFRESH_SECONDS``, and a
  request's time);
* **past the caller's writes**: a read may name, per scope, the subject sequence of its own last acknowledged write
  there (the ``kvrouter-written`` answer header of that write); the copy must have folded that message. A copy
  behind it is read again at once, and waited for at most ``CATCH_UP_SECONDS``; then the read goes to the owners.

A copy begins when a read first needs it (that read is gathered from the owners) and is built as an owner
recovers: the scope's snapshot and its subject's tail, read through a journal opened for reading only (nothing is
appended). From then on, every ``REFRESH_SECONDS``, one round asks JetStream for each followed subject's messages
past the copy's sequence (``follow_link``) and folds their records with recovery's fold (``replay``: the pure
``evolve`` of ``actors/core``), record by record, in lsn order. A message whose first lsn is past the next one
expected (the owner took a snapshot and purged messages the copy had not read) has the copy built again from the
snapshot.

Bounded: at most ``MAX_FOLLOWED`` copies; a new one evicts the least recently read (policy: evict LRU). A copy of
a scope this replica comes to serve is dropped (its owner's state answers). One NATS connection for every round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Final

import nats.errors
import trio

from kvrouter.actors.cluster.follow_link import FollowLink, Read
from kvrouter.actors.cluster.scopes import ScopeJournals
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.recovery import PoisonRecord, recover, replay
from kvrouter.journal import jetstream_batch as batch
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.jetstream_link import subject_of

log = logging.getLogger("kvrouter.cluster")

MAX_FOLLOWED: Final = 64  # copies kept; a new one evicts the least recently read
REFRESH_SECONDS: Final = 0.5
CURRENT_WITHIN_SECONDS: Final = 2.0
CATCH_UP_SECONDS: Final = 0.5


class FollowedCopy:
    """One scope's copy: its state folded up to the subject's message ``seq`` (record ``lsn``)."""

    def __init__(self, scope: ScopeKey, stream: str) -> None:
        self.scope = scope
        self.token = scope_token(scope)
        self.subject = subject_of(stream, self.token)
        self.states: dict[ScopeKey, ScopeState] | None = None  # None until built
        self.lsn = 0
        self.seq = 0
        self.chain = batch.Chain()  # which messages are the log (``jetstream_batch``): those folded
        self.current_at = -math.inf  # trio time of the last round that found nothing past ``seq``
        self.last_read = trio.current_time()
        self.moved = trio.Event()  # set (and replaced) whenever the copy advances or is found current
        self.building = False

    def state(self) -> ScopeState | None:
        return self.states.get(self.scope) if self.states is not None else None

    def ready(self, after_seq: int | None, now: float) -> bool:
        return (
            self.states is not None
            and now - self.current_at <= CURRENT_WITHIN_SECONDS
            and (after_seq is None or self.seq >= after_seq)
        )

    def fold(self, read: Read, at: float) -> bool:
        """Fold the messages of ``read``; False (nothing folded past the gap) when one starts past the next lsn."""
        assert self.states is not None
        for message in read.messages:
            if message.prev > self.seq:
                return False  # it follows a message this copy never read (purged): a gap
            if not self.chain.take(message.seq, message.prev):
                self.seq = message.seq  # off the log: passed over, as recovery does
                continue
            if message.first_lsn > self.lsn + 1:
                return False
            records = [(message.first_lsn + i, payload) for i, payload in enumerate(message.payloads)]
            replay(self.states, [(lsn, payload) for lsn, payload in records if lsn > self.lsn])
            self.lsn = max(self.lsn, message.first_lsn + len(message.payloads) - 1)
            self.seq = message.seq
        if read.complete:
            self.current_at = at
        self._moved()
        return True

    def _moved(self) -> None:
        self.moved.set()
        self.moved = trio.Event()


class Followers:
    """The copies, their builds and their refresh rounds (``run``); ``copy_for`` is what a read asks."""

    def __init__(self, journals: ScopeJournals, served: Callable[[ScopeKey], bool]) -> None:
        self.journals = journals
        self._served = served
        self._copies: dict[str, FollowedCopy] = {}
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self.reads = 0  # reads answered from copies
        self.built = 0
        self.evicted = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._refresh)
            task_status.started()
            await trio.sleep_forever()

    def copies(self) -> list[FollowedCopy]:
        return sorted(self._copies.values(), key=lambda copy: copy.scope)

    async def copy_for(self, scope: ScopeKey, after_seq: int | None) -> FollowedCopy | None:
        """``scope``'s copy once it is ready for a read that must see ``after_seq`` (None: any write), waiting
        at most ``CATCH_UP_SECONDS``; None if it is not by then (the read goes to the owners)."""
        copy = self._follow(scope)
        deadline = trio.current_time() + CATCH_UP_SECONDS
        while not copy.ready(after_seq, trio.current_time()):
            if trio.current_time() >= deadline or self._copies.get(copy.token) is not copy:
                return None
            self._wake.set()  # a round now rather than at the next interval
            with trio.move_on_at(deadline):
                await copy.moved.wait()
        copy.last_read = trio.current_time()
        return copy

    def _follow(self, scope: ScopeKey) -> FollowedCopy:
        token = scope_token(scope)
        copy = self._copies.get(token)
        if copy is not None:
            return copy
        if len(self._copies) >= MAX_FOLLOWED:  # overflow policy: evict the least recently read copy
            oldest = min(self._copies.values(), key=lambda copy: copy.last_read)
            del self._copies[oldest.token]
            self.evicted += 1
        copy = self._copies[token] = FollowedCopy(scope, self.journals.stream)
        self._build(copy)
        return copy

    def _build(self, copy: FollowedCopy) -> None:
        assert self._nursery is not None, "Followers.run has not started"
        if not copy.building:
            copy.building = True
            self._nursery.start_soon(self._build_copy, copy)

    async def _build_copy(self, copy: FollowedCopy) -> None:
        """The copy as an owner recovers the scope: its snapshot and its subject's tail (nothing appended)."""
        journals = self.journals
        opened = partial(JetStreamJournal.open, journals.servers, journals.stream, journals.durability, log=copy.token)
        try:
            asked = trio.current_time()
            journal = await trio.to_thread.run_sync(opened, abandon_on_cancel=False)
            try:
                recovered = await trio.to_thread.run_sync(recover, journal)
                seq, chain = journal.statistics().last_stream_sequence, journal.statistics().chain_sequence
            finally:
                with trio.CancelScope(shield=True):
                    await journal.aclose()
        except Exception as exc:  # a copy that cannot be built never stops the replica: its reads go to the owner
            log.warning("cluster: cannot follow scope %s (%s); its reads go to its owner", copy.scope.describe(), exc)
            if self._copies.get(copy.token) is copy:
                del self._copies[copy.token]
            copy._moved()
            return
        finally:
            copy.building = False
        copy.states, copy.lsn, copy.seq, copy.current_at = recovered.states, recovered.last_lsn, seq, asked
        copy.chain = batch.Chain(chain or None)
        self.built += 1
        copy._moved()

    async def _refresh(self) -> None:
        """Every ``REFRESH_SECONDS`` (or at once when a read waits), read every built copy's subject past it."""
        link: FollowLink | None = None
        try:
            while True:
                with trio.move_on_after(REFRESH_SECONDS):
                    await self._wake.wait()
                self._wake = trio.Event()
                if link is None:
                    try:
                        link = await FollowLink.open(self.journals.servers, self.journals.stream)
                    except (OSError, TimeoutError, nats.errors.Error) as exc:
                        log.warning("cluster: cannot follow the scopes' subjects (%s); trying again", exc)
                        await trio.sleep(REFRESH_SECONDS)
                        continue
                await self._round(link)
        finally:
            if link is not None:
                with trio.CancelScope(shield=True):
                    await link.aclose()

    async def _round(self, link: FollowLink) -> None:
        for copy in list(self._copies.values()):
            if self._served(copy.scope):  # served here: its owner's state answers
                del self._copies[copy.token]
        asked = {copy.subject: copy for copy in self._copies.values() if copy.states is not None}
        at = trio.current_time()
        reads = await link.read({subject: copy.seq for subject, copy in asked.items()})
        for subject, read in reads.items():
            copy = asked[subject]
            if self._copies.get(copy.token) is not copy:
                continue  # evicted meanwhile
            try:
                folded = copy.fold(read, at)
            except PoisonRecord as exc:
                log.warning("cluster: the copy of scope %s cannot fold its subject (%s)", copy.scope.describe(), exc)
                folded = False
            if not folded:  # records purged under a snapshot (or unreadable): build it again
                copy.states = None
                self._build(copy)


def states_of(copies: Iterable[FollowedCopy]) -> list[ScopeState]:
    """The scope states of ``copies`` (a scope without workers has none)."""
    return [state for state in (copy.state() for copy in copies) if state is not None]
