"""The scopes this replica owns: each claimed under its lease and run over a journal of its own.

Owning a scope is, in order:

1. the claim: etcd's ``If(CreateRevision(owners/<token>) == 0) Then(Put(owners/<token>, me, lease))``; a key
   already there under this replica's current lease is its own claim; anyone else's means the scope is not
   ours (the caller forwards to them);
2. the journal: the scope's own log in the cluster's JetStream stream (subject ``kvrouter.journal.NAME.<token>``,
   snapshot object ``<token>``), opened, which reads where the subject ends (the fence of the first append);
3. recovery: the scope's latest snapshot and the subject's tail, folded (the same ``recover`` as a restart's);
4. the actors: an ``ActorSystem`` over that journal (``running_actors``): the one door through which the scope's
   actor is started, fed and retired, exactly as a single-node service runs all of its scopes.

The scope is served only once all of that is done, and only while the claim was made under the lease this
replica still holds on its own clock (``service.py`` asks ``serving``). It is dropped (its actor system stopped,
its journal closed) when the lease ends, when the view shows another owner, or when its journal fails: a fenced
append (someone else wrote the subject) or a publish that failed. The next command, or the next change of the
view, claims and recovers it again from the stream.

Two ways end serving a scope cleanly (``end_serving``: no new commands, those in flight answered, then the actors
stop and the journal closes): its subject moved past what it holds with nothing of its own in flight (the
overtaken rule, checked by ``_check_subjects``), after which it is recovered again under the same claim; and
placement preferring another live member (``hand_over``), after which the claim is released (deleted only if it is
still this one's) for that member to take.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, Generic, TypeVar

import attrs
import nats.errors
import orjson
import trio

from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.subject_check import CHECK_INTERVAL_SECONDS, SubjectCheck
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.owner import OwnedScope as CoreOwnedScope
from kvrouter.actors.core.ownership.owner import overtaken
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.fleet.etcd import EtcdUnavailable
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.runtime import running_actors
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.jetstream_link import subject_of
from kvrouter.journal.store import Durability, JournalUnreachable

log = logging.getLogger("kvrouter.cluster")

RECOVERY_WAIT_SECONDS: Final = 10.0  # how long a command waits for its scope's claim and recovery
# Scopes one replica owns at most (each has its own journal: a NATS connection and an asyncio thread). Policy:
# reject; a scope placed on a full replica is refused with 503 until one of its scopes goes.
MAX_OWNED_SCOPES: Final = 256
# Ending a scope here (a hand-over, a recovery after its subject moved): how long the commands it took may take
# to be answered before its actors stop (each is bounded by the reply deadline anyway).
DRAIN_SECONDS: Final = 5.0


# The service object one scope's owner runs over the scope's actor system (a ``SlotService``, a ``SelectService``):
# built once the scope is recovered, with the nursery its tasks may run in (cancelled when the scope stops).
S = TypeVar("S")
ServiceBuilder = Callable[[ActorSystem, trio.Nursery], Awaitable[S]]


async def slot_service_of(system: ActorSystem, nursery: trio.Nursery) -> SlotService:
    return SlotService(system)


@attrs.frozen
class ScopeJournals:
    """Where the scopes' journals live: the cluster's stream on these NATS servers."""

    servers: tuple[str, ...]
    stream: str
    durability: Durability = Durability.ALWAYS


class OwnedScope(Generic[S]):
    """One scope this replica claimed (or is claiming): its service once recovered."""

    def __init__(self, scope: ScopeKey, lease_id: int) -> None:
        self.scope = scope
        self.token = scope_token(scope)
        self.lease_id = lease_id
        self.service: S | None = None
        self.journal: JetStreamJournal | None = None  # while serving
        self.settled = trio.Event()  # claimed and recovered, or given up
        self.cancel = trio.CancelScope()
        self.recovered_at = math.nan  # trio.current_time() when it began serving
        self.stop: trio.Event | None = None  # the serving runtime's ``stopping``: set to end it cleanly
        self.overtaken = False  # its subject moved past it: recover again
        self.handing_over = False  # placement prefers another member: drain, release the claim
        self.in_flight = 0  # commands running on its service (``ClusterSlotService._local``)
        self.drained = trio.Event()  # set whenever ``in_flight`` falls to 0
        self.drained.set()
        self.released = trio.Event()  # set once this replica no longer holds it (dropped or handed over)

    def end_serving(self) -> None:
        """Stop taking commands here and end the serving runtime once those in flight are answered."""
        self.service = None
        if self.stop is not None:
            self.stop.set()

    def enter(self) -> None:
        self.in_flight += 1
        if self.in_flight == 1:
            self.drained = trio.Event()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.drained.set()


class OwnedScopes(Generic[S]):
    def __init__(
        self,
        membership: Membership,
        journals: ScopeJournals,
        system_options: dict[str, Any],
        build_service: ServiceBuilder[S],
        on_service: Callable[[S], None] = lambda service: None,
    ) -> None:
        self.membership = membership
        self.journals = journals
        self.system_options = system_options
        self.build_service = build_service  # what runs over a recovered scope's actor system (the service kind's)
        self.on_service = on_service  # told of each scope's service as it starts (the load feed hooks in)
        self._owned: dict[str, OwnedScope[S]] = {}
        self._nursery: trio.Nursery | None = None
        self.recoveries = 0
        self.drops = 0
        self.overtaken = 0  # recoveries because the subject moved past what the owner held
        self.handed_over = 0
        # Why a scope's last claim or recovery failed (etcd or NATS not answering), by scope token, until one
        # succeeds: a command refused meanwhile says it. Bounded: at most ``MAX_OWNED_SCOPES`` (oldest dropped).
        self.failures: dict[str, str] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._check_subjects)
            task_status.started()
            await trio.sleep_forever()

    # -- what the routes ask ---------------------------------------------------------------------------

    def serving(self, scope: ScopeKey) -> S | None:
        """The scope's service if this replica may serve it now: claimed under the lease it still holds,
        recovered, and not dropped."""
        owned = self._owned.get(scope_token(scope))
        membership = self.membership
        if owned is None or owned.service is None or owned.lease_id != membership.lease_id or not membership.live():
            return None
        return owned.service

    def failure(self, scope: ScopeKey) -> str | None:
        """Why the scope's last claim or recovery here failed, unless one has succeeded since."""
        return self.failures.get(scope_token(scope))

    def _failed(self, token: str, reason: str) -> None:
        self.failures.pop(token, None)
        if len(self.failures) >= MAX_OWNED_SCOPES:  # overflow: forget the oldest reason
            del self.failures[next(iter(self.failures))]
        self.failures[token] = reason

    def held(self, scope: ScopeKey) -> OwnedScope[S] | None:
        return self._owned.get(scope_token(scope))

    def services(self) -> list[S]:
        """The services of every scope served now (reads of many scopes), in scope order."""
        found = [self.serving(owned.scope) for owned in sorted(self._owned.values(), key=lambda o: o.scope)]
        return [service for service in found if service is not None]

    def owned(self) -> list[OwnedScope[S]]:
        return sorted(self._owned.values(), key=lambda owned: owned.scope)

    async def ensure(self, scope: ScopeKey) -> S | None:
        """Claim and recover ``scope`` unless that is done or under way; its service once it serves, None if
        another replica holds it, the claim or recovery failed, or it took past ``RECOVERY_WAIT_SECONDS``."""
        owned = self.start(scope)
        if owned is not None:
            with trio.move_on_after(RECOVERY_WAIT_SECONDS):
                await owned.settled.wait()
        return self.serving(scope)

    async def settled(self) -> None:
        """Wait (at most ``RECOVERY_WAIT_SECONDS``) until no claim or recovery is under way: a read of many scopes
        then includes every scope this replica has claimed."""
        with trio.move_on_after(RECOVERY_WAIT_SECONDS):
            for owned in list(self._owned.values()):
                await owned.settled.wait()

    def full(self) -> bool:
        return len(self._owned) >= MAX_OWNED_SCOPES

    def start(self, scope: ScopeKey) -> OwnedScope[S] | None:
        """Begin claiming ``scope`` in the background (no-op if under way); None without a live lease, or when
        this replica owns ``MAX_OWNED_SCOPES`` already."""
        membership = self.membership
        if not membership.live():
            return None
        token = scope_token(scope)
        owned = self._owned.get(token)
        if owned is not None and owned.lease_id == membership.lease_id:
            return owned
        if owned is None and self.full():
            return None
        if owned is not None:
            owned.cancel.cancel()  # claimed under a lease that ended: its task drops it
        owned = self._owned[token] = OwnedScope[S](scope, membership.lease_id)
        assert self._nursery is not None, "OwnedScopes.run has not started"
        self._nursery.start_soon(self._own, owned)
        return owned

    def drop_all(self) -> None:
        """The lease ended: nothing held under it is served any more."""
        for owned in list(self._owned.values()):
            owned.cancel.cancel()

    def drop_moved(self) -> None:
        """Drop the scopes the view shows under another owner, or under another lease of this replica."""
        membership = self.membership
        for token, owned in list(self._owned.items()):
            held = membership.view.owners.get(token)
            if held is not None and (held.member != membership.me or held.lease_id != owned.lease_id):
                log.warning(
                    "cluster: scope %s is now held by %s; dropping it here", owned.scope.describe(), held.member
                )
                owned.cancel.cancel()

    def hand_over(self, scope: ScopeKey) -> None:
        """Placement prefers another live member for ``scope``: stop taking its commands, let those in flight be
        answered, close its journal, then release its claim (``_release``). No-op unless it is served here."""
        owned = self._owned.get(scope_token(scope))
        if owned is not None and owned.service is not None and not owned.handing_over:
            log.info("cluster: handing scope %s over", scope.describe())
            owned.handing_over = True
            owned.end_serving()

    async def wait_handed_over(self, scope: ScopeKey) -> bool:
        """If ``scope`` is being handed over from here, wait (at most ``RECOVERY_WAIT_SECONDS``) until it is gone and
        this replica's view names its new owner: a command then forwarded there finds that member's view past the
        release too (the claim follows the release it saw), rather than naming this replica still. Whether it
        waited (the command was held through a hand-over)."""
        membership, token = self.membership, scope_token(scope)
        owned = self._owned.get(token)
        if owned is None or not owned.handing_over:
            return False
        with trio.move_on_after(RECOVERY_WAIT_SECONDS):
            await owned.released.wait()
            while (held := membership.view.owners.get(token)) is None or held.member == membership.me:
                if not membership.placement(membership.view.members | {membership.me}):
                    break  # the last member stopping: nobody will claim it
                await membership.wait_changed()
        return True

    async def all_released(self) -> None:
        """Return once this replica holds no scope (each handed over, or dropped): a stopping replica's wait, which
        its caller bounds."""
        while self._owned:
            for owned in list(self._owned.values()):
                await owned.released.wait()

    async def _check_subjects(self) -> None:
        """The overtaken rule, every ``CHECK_INTERVAL_SECONDS``: a scope served here whose subject holds a message
        past the sequence it holds, with no append of its own in flight before and after asking, is recovered
        again (``subject_check``)."""
        check: SubjectCheck | None = None
        try:
            while True:
                await trio.sleep(CHECK_INTERVAL_SECONDS)
                if check is None:
                    try:
                        check = await SubjectCheck.open(self.journals.servers, self.journals.stream)
                    except (OSError, TimeoutError, nats.errors.Error) as exc:
                        log.warning("cluster: cannot check the scopes' subjects (%s); trying again", exc)
                        continue
                await self._check_round(check)
        finally:
            if check is not None:
                with trio.CancelScope(shield=True):
                    await check.aclose()

    async def _check_round(self, check: SubjectCheck) -> None:
        stream = self.journals.stream
        asked = {}
        for owned in self._owned.values():
            position = _idle_position(owned)
            if position is not None:
                asked[subject_of(stream, owned.token)] = (owned, position)
        passed = await check.passed({subject: position[0] for subject, (_, position) in asked.items()})
        for subject, seq in passed.items():
            owned, position = asked[subject]
            now = _idle_position(owned)
            held = CoreOwnedScope(ScopeState(owned.scope), position[0])
            if overtaken(held, seq, appending=now != position) and owned.service is not None:
                log.warning(
                    "cluster: the subject of scope %s holds message %d past the %d this replica holds; recovering it",
                    owned.scope.describe(),
                    seq,
                    position[0],
                )
                owned.overtaken = True
                owned.settled = trio.Event()  # commands wait for the recovery, as for a first one
                owned.end_serving()

    # -- owning one scope ----------------------------------------------------------------------------

    async def _own(self, owned: OwnedScope) -> None:
        try:
            with owned.cancel:
                if await self._claim(owned):
                    await self._serve_until_released(owned)
        except (EtcdUnavailable, JournalUnreachable, OSError) as exc:
            log.warning("cluster: scope %s dropped: %s", owned.scope.describe(), exc)
            self._failed(owned.token, str(exc))
        finally:
            served = not math.isnan(owned.recovered_at)
            owned.service = None
            owned.settled.set()
            owned.released.set()
            if self._owned.get(owned.token) is owned:
                del self._owned[owned.token]
            self.drops += served and not owned.handing_over

    async def _serve_until_released(self, owned: OwnedScope) -> None:
        """Serve the scope; recover it again each time its subject moved past it (the overtaken rule); return
        when its journal failed (dropped: the next command recovers it) or once it was handed over."""
        while True:
            await self._serve(owned)
            if owned.handing_over:
                await self._release(owned)
                return
            if not owned.overtaken:
                return
            owned.overtaken = False
            self.overtaken += 1

    async def _release(self, owned: OwnedScope) -> None:
        """The hand-over's end: the scope's journal is closed, every command it took answered; delete the claim
        (only if it is still this one) so the member placement prefers claims it."""
        membership = self.membership
        key = membership.key("owners", owned.token)
        if await membership.etcd.delete_if_value(key, self._claim_value(owned)):
            held = membership.view.owners.get(owned.token)
            if held is not None and held.member == membership.me and held.lease_id == owned.lease_id:
                del membership.view.owners[owned.token]  # (the watch says so too, a moment later)
            self.handed_over += 1
            log.info("cluster: scope %s handed over (claim released)", owned.scope.describe())

    def _claim_value(self, owned: OwnedScope) -> bytes:
        return orjson.dumps({"member": self.membership.me, "lease": str(owned.lease_id)})

    async def _claim(self, owned: OwnedScope) -> bool:
        membership = self.membership
        created, held, _ = await membership.etcd.create_if_absent(
            membership.key("owners", owned.token), self._claim_value(owned), owned.lease_id
        )
        if not created:
            holder: Any = orjson.loads(held) if held else {}
            if holder.get("member") != membership.me or int(holder.get("lease", 0)) != owned.lease_id:
                return False  # another replica's (or, for a moment, this one's under its previous lease)
        known = {"model_name": owned.scope.model_name, "tenant_id": owned.scope.tenant_id}
        if owned.token not in membership.view.scopes:
            await membership.etcd.put(membership.key("scopes", owned.token), orjson.dumps(known))
        return True

    async def _serve(self, owned: OwnedScope) -> None:
        journals = self.journals
        opened = partial(JetStreamJournal.open, journals.servers, journals.stream, journals.durability, log=owned.token)
        journal = await trio.to_thread.run_sync(opened, abandon_on_cancel=False)
        try:
            recovered = await trio.to_thread.run_sync(recover, journal)
        except BaseException:
            with trio.CancelScope(shield=True):
                await journal.aclose()
            raise
        async with running_actors(journal, recovered.states, **self.system_options) as runtime:
            if not await _claim_the_tail(journal, owned.scope, runtime.nursery):
                return  # refused or failed: ``running_actors`` raises why as it ends (the scope is dropped here)
            service = await self.build_service(runtime.system, runtime.nursery)
            self.on_service(service)
            owned.journal, owned.stop, owned.service = journal, runtime.stopping, service
            owned.recovered_at = trio.current_time()
            self.failures.pop(owned.token, None)
            self.recoveries += 1
            log.info(
                "cluster: serving scope %s (recovered %d records after the snapshot at lsn %d)",
                owned.scope.describe(),
                recovered.replayed_records,
                recovered.snapshot_lsn,
            )
            owned.settled.set()
            await runtime.stopping.wait()  # the journal failed (fenced, a publish failed), or ``end_serving``
            owned.service = None
            with trio.move_on_after(DRAIN_SECONDS):  # the commands it took are answered (durable, or refused)
                await owned.drained.wait()
            owned.journal = owned.stop = None
            runtime.nursery.cancel_scope.cancel()


async def _claim_the_tail(journal: JetStreamJournal, scope: ScopeKey, nursery: trio.Nursery) -> bool:
    """Append an empty record fenced on the tail just read, before answering anything for the scope.

    A write of the previous owner still in flight is fenced on the same tail: without this, it could land behind
    the recovered state, unseen until the overtaken rule catches it, and meanwhile an answer that changes nothing
    (a free of a request this state does not hold, a 404) would be acknowledged on a state missing it. With it,
    whichever lands first wins: the previous owner's write is refused (not applied), or this append is, and the
    scope is recovered again, with that write. False when the append was refused or failed (``nursery`` cancelled;
    the journal's failure is raised as its runtime ends)."""
    try:
        await journal.wait_durable(journal.append(encode_record(scope, ())))
    except trio.BrokenResourceError:
        nursery.cancel_scope.cancel()
        return False
    return True


def _idle_position(owned: OwnedScope) -> tuple[int, int] | None:
    """The subject sequence the served scope's journal holds and how many messages it published, when it has no
    append in flight (every record appended is acknowledged); None otherwise, or when it is not served."""
    journal = owned.journal
    if owned.service is None or journal is None:
        return None
    stats = journal.statistics()
    if stats.durable_lsn != stats.last_lsn or stats.pending_bytes:
        return None
    return stats.last_stream_sequence, stats.messages_published
