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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import attrs
import orjson
import trio

from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.fleet.etcd import EtcdUnavailable
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.runtime import running_actors
from kvrouter.actors.slot_service import SlotService
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.store import Durability, JournalUnreachable

log = logging.getLogger("kvrouter.cluster")

RECOVERY_WAIT_SECONDS: Final = 10.0  # how long a command waits for its scope's claim and recovery
# Scopes one replica owns at most (each has its own journal: a NATS connection and an asyncio thread). Policy:
# reject; a scope placed on a full replica is refused with 503 until one of its scopes goes.
MAX_OWNED_SCOPES: Final = 256


@attrs.frozen
class ScopeJournals:
    """Where the scopes' journals live: the cluster's stream on these NATS servers."""

    servers: tuple[str, ...]
    stream: str
    durability: Durability = Durability.ALWAYS


class OwnedScope:
    """One scope this replica claimed (or is claiming): its service once recovered."""

    def __init__(self, scope: ScopeKey, lease_id: int) -> None:
        self.scope = scope
        self.token = scope_token(scope)
        self.lease_id = lease_id
        self.service: SlotService | None = None
        self.settled = trio.Event()  # claimed and recovered, or given up
        self.cancel = trio.CancelScope()
        self.recovered_at = math.nan  # trio.current_time() when it began serving


class OwnedScopes:
    def __init__(
        self,
        membership: Membership,
        journals: ScopeJournals,
        system_options: dict[str, Any],
        on_service: Callable[[SlotService], None] = lambda service: None,
    ) -> None:
        self.membership = membership
        self.journals = journals
        self.system_options = system_options
        self.on_service = on_service  # told of each scope's service as it starts (the load feed hooks in)
        self._owned: dict[str, OwnedScope] = {}
        self._nursery: trio.Nursery | None = None
        self.recoveries = 0
        self.drops = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- what the routes ask ---------------------------------------------------------------------------

    def serving(self, scope: ScopeKey) -> SlotService | None:
        """The scope's service if this replica may serve it now: claimed under the lease it still holds,
        recovered, and not dropped."""
        owned = self._owned.get(scope_token(scope))
        membership = self.membership
        if owned is None or owned.service is None or owned.lease_id != membership.lease_id or not membership.live():
            return None
        return owned.service

    def services(self) -> list[SlotService]:
        """The services of every scope served now (reads of many scopes), in scope order."""
        found = [self.serving(owned.scope) for owned in sorted(self._owned.values(), key=lambda o: o.scope)]
        return [service for service in found if service is not None]

    def owned(self) -> list[OwnedScope]:
        return sorted(self._owned.values(), key=lambda owned: owned.scope)

    async def ensure(self, scope: ScopeKey) -> SlotService | None:
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

    def start(self, scope: ScopeKey) -> OwnedScope | None:
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
        owned = self._owned[token] = OwnedScope(scope, membership.lease_id)
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

    # -- owning one scope ----------------------------------------------------------------------------

    async def _own(self, owned: OwnedScope) -> None:
        try:
            with owned.cancel:
                if await self._claim(owned):
                    await self._serve(owned)
        except (EtcdUnavailable, JournalUnreachable, OSError) as exc:
            log.warning("cluster: scope %s dropped: %s", owned.scope.describe(), exc)
        finally:
            served = not math.isnan(owned.recovered_at)
            owned.service = None
            owned.settled.set()
            if self._owned.get(owned.token) is owned:
                del self._owned[owned.token]
            self.drops += served

    async def _claim(self, owned: OwnedScope) -> bool:
        membership = self.membership
        value = orjson.dumps({"member": membership.me, "lease": str(owned.lease_id)})
        created, held, _ = await membership.etcd.create_if_absent(
            membership.key("owners", owned.token), value, owned.lease_id
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
            service = SlotService(runtime.system)
            self.on_service(service)
            owned.service = service
            owned.recovered_at = trio.current_time()
            self.recoveries += 1
            log.info(
                "cluster: serving scope %s (recovered %d records after the snapshot at lsn %d)",
                owned.scope.describe(),
                recovered.replayed_records,
                recovered.snapshot_lsn,
            )
            owned.settled.set()
            await runtime.stopping.wait()  # the journal failed (fenced, or a publish failed)
            owned.service = None
            runtime.nursery.cancel_scope.cancel()
