"""ClusterService: what a cluster replica does for every service kind; ClusterSlotService: the slot tracker's
methods on a replica (what its routes call with ``--cluster``; the selection service's are ``select_service.py``).

For each command the replica first asks where its scope is served (``where``): the pure rule
``forwarding.route`` decides from this replica's view (the scope's owner key, the live members) and whether it
serves the scope now (claimed under its live lease and recovered, ``OwnedScopes.serving``). A scope nobody owns
yet is claimed by the member placement prefers (``placement.preferred_owner`` over the live members): by this
replica at once if that is itself, else the command goes to that member, which claims it on receipt. A scope
this replica owns but does not serve (its journal failed) is recovered again first. A scope served here that
placement now gives another live member (one that joined) is handed over (``keep_placed``); a command for it
waits for the hand-over, then goes to the new owner.

Served here, a method runs on the scope's own service (a ``SlotService``, a ``SelectService``: its actor system
and journal, built by ``OwnedScopes.build_service``); a scope not served here when the method runs (ownership
moved in between) is refused with 503, not applied. Reads of many scopes (``workers``, ``loads``) answer for the
scopes served here; the routes gather the other members' answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Generic

import orjson
import trio

from kvrouter.actors.cluster.booked_scopes import OVERFLOW_POLICY as BOOKED_OVERFLOW
from kvrouter.actors.cluster.booked_scopes import BookedScopes
from kvrouter.actors.cluster.follower_reads import FollowerReads, WrittenSequences, copies_read
from kvrouter.actors.cluster.forward_batches import ForwardBatches, Outcome, command
from kvrouter.actors.cluster.forwarder import Forwarder, OwnerUnreachable, Relayed
from kvrouter.actors.cluster.marks import FORWARDED_BATCH
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.cluster.scopes import MAX_OWNED_SCOPES, OwnedScopes, S
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey, to_i64
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.forwarding import Forward, Route, Serve, Unavailable, route
from kvrouter.actors.core.ownership.placement import preferred_owner
from kvrouter.actors.core.queries import PotentialLoad
from kvrouter.actors.core.queries import loads as rank_loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.load_feed import LoadChange, LoadChanges, LoadFeed, read_changes
from kvrouter.actors.mailbox import JournalUnavailable, OutcomeUnknown
from kvrouter.actors.metric_families import Family, FamilySource, counter, gauge
from kvrouter.actors.service_support import EVERY_SCOPE, Refused, ScopeFilter, encode_failure
from kvrouter.actors.slot_service import RegisteredRange, ScopeLoads, SlotService
from kvrouter.client.table import BY_NAME

# What a relayed answer's status means for a write of a batch (its failure as data).
_STATUS_REASON = {400: Reason.INVALID, 404: Reason.NOT_FOUND, 409: Reason.CONFLICT, 429: Reason.OVERLOADED}


def not_applied(message: str) -> Refused:
    return Refused(Reason.UNAVAILABLE, f"{message}; the command was not applied and is safe to retry")


class ClusterService(Generic[S]):
    """What every service kind's replica does alike: route a scope's command (serve, forward, refuse), keep the
    scopes placed, and answer ``GET /cluster`` and the cluster's figures. ``S``: the per-scope service."""

    # Whether the commands forwarded in one batch must run in order on the owner (``ForwardBatches``).
    FORWARDED_IN_ORDER = True

    def __init__(self, membership: Membership, owned: OwnedScopes[S], forwarder: Forwarder) -> None:
        self.membership = membership
        self.owned = owned
        self.forwarder = forwarder
        # its ``run`` is started by the composition root
        self.batches = ForwardBatches(self.relay, ordered=self.FORWARDED_IN_ORDER)
        self.metric_sources: list[FamilySource] = [self.batches.families]
        self.written = WrittenSequences(owned)  # the tokens of the writes answered here (``follower_reads``)
        self.booked = BookedScopes()  # the scopes of reservations booked through here (``booked_scopes``)
        self.follower_reads: FollowerReads | None = None  # reads answered from copies (set at composition)

    # -- where a scope is served ------------------------------------------------------------------------

    def live_members(self) -> set[str]:
        members = set(self.membership.view.members)
        if self.membership.live():
            members.add(self.membership.me)
        return members

    async def where(self, scope: ScopeKey, forwarded: bool = False) -> Route:
        held_through = await self.owned.wait_handed_over(scope)  # held, then routed to the member that takes it
        membership, me = self.membership, self.membership.me
        if not membership.live():  # its view of owners and members may be stale: neither serve nor forward
            return Unavailable(
                f"this replica ({me}) cannot route {scope.describe()} now: {membership.not_live_reason()}"
            )
        token = scope_token(scope)
        held = membership.view.owners.get(token)
        owner = held.member if held is not None else None
        if owner is None:
            owner = preferred_owner(token, membership.placement(self.live_members()))
        if owner == me and self.owned.serving(scope) is None:
            if self.owned.full() and held is None:
                return Unavailable(
                    f"scope {scope.describe()} is placed on {me}, which owns {MAX_OWNED_SCOPES} scopes, its limit"
                )
            if held is None or held.lease_id == membership.lease_id:
                await self.owned.ensure(scope)  # claim it, or recover it again after its journal failed
            if self.owned.serving(scope) is None:
                again = membership.view.owners.get(token)
                owner = again.member if again is not None and again.member != me else owner
                failure = self.owned.failure(scope)
                if owner == me and failure is not None:
                    return Unavailable(f"scope {scope.describe()} cannot be recovered on its owner {me}: {failure}")
        serving = self.owned.serving(scope) is not None
        # A replica that handed the scope over (or is stopping: it hands every scope over) forwards once more what
        # was forwarded to it, to the owner that claimed the scope after the release: each extra hop follows a move.
        follows_move = held_through or membership.leaving
        return route(scope.describe(), me, owner, self.live_members(), serving, forwarded and not follows_move)

    async def keep_placed(self) -> None:
        """Claim the known scopes that have no owner and that placement gives this replica (a dead owner's, once
        its lease ended, or one another member handed over), hand over those served here that placement now
        gives another live member (one that joined, or any other once this replica is stopping: placement then
        leaves it out), and drop those the view shows under another owner; on every change of the view, and at
        least twice per lease TTL."""
        membership, owned = self.membership, self.owned
        while True:
            owned.drop_moved()
            if membership.live():
                live = membership.placement(self.live_members())
                view = membership.view
                for token, scope in list(view.scopes.items()):
                    preferred = preferred_owner(token, live)
                    if token not in view.owners and preferred == membership.me:
                        owned.start(scope)
                    elif preferred != membership.me and owned.serving(scope) is not None:
                        owned.hand_over(scope)
            with trio.move_on_after(membership.ttl_seconds / 2):
                await membership.wait_changed()

    async def relay(self, owner: str, method: str, path: str, query: bytes, body: bytes) -> Relayed:
        """``Forwarder.relay``, given up on (outcome unknown) as soon as ``owner`` leaves the live members: a
        paused or cut-off owner holds a forwarded command for about a lease, not for the whole answer timeout."""
        answer: list[Relayed | OwnerUnreachable] = []
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                try:
                    answer.append(await self.forwarder.relay(owner, method, path, query, body))
                except OwnerUnreachable as exc:  # raised below, not out of the nursery (as an exception group)
                    answer.append(exc)
                nursery.cancel_scope.cancel()

            nursery.start_soon(ask)
            while owner in self.live_members():
                await self.membership.wait_changed()
            nursery.cancel_scope.cancel()
        if not answer:
            self.forwarder.failed += 1
            raise OwnerUnreachable(f"{owner} left the cluster while the command was with it", unknown=True)
        if isinstance(answer[0], OwnerUnreachable):
            raise answer[0]
        return answer[0]

    @contextlib.contextmanager
    def _local(self, scope: ScopeKey) -> Iterator[S]:
        """The scope's service here, counted in flight while the block runs (a hand-over waits for it to end)."""
        with self._journal_of(scope):
            service, owned = self.owned.serving(scope), self.owned.held(scope)
            if service is None or owned is None:
                raise not_applied(f"this replica ({self.membership.me}) does not serve {scope.describe()} now")
            owned.enter()
            try:
                yield service
            finally:
                owned.leave()

    @contextlib.contextmanager
    def _journal_of(self, scope: ScopeKey) -> Iterator[None]:
        """A scope's journal failing stops that scope on this replica, not the replica: say so."""
        try:
            yield
        except JournalUnavailable as exc:
            where = (
                f"the JetStream journal of {scope.describe()} (NATS at {', '.join(self.owned.journals.servers)}) "
                f"failed on {self.membership.me} ({exc.__cause__ or exc})"
            )
            recovered = "the scope is recovered from the stream on the next command"
            if exc.maybe_written:  # appended, not acknowledged: JetStream may still store it (504)
                raise OutcomeUnknown(
                    f"{where}; this write was not acknowledged and may or may not have landed, now or later "
                    f"(check its effect before retrying); {recovered}"
                ) from exc
            refusal = f"{where}; this write was not applied, safe to retry; {recovered}"
            raise Refused(Reason.UNAVAILABLE, refusal) from exc

    def unowned(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[ScopeKey]:
        """The known scopes ``wanted`` selects whose owner is no live member in this replica's view: a read of
        many scopes cannot answer for them now (their owner died and nobody has claimed them yet)."""
        view, live = self.membership.view, self.live_members()
        return sorted(
            scope
            for token, scope in view.scopes.items()
            if wanted(scope) and (token not in view.owners or view.owners[token].member not in live)
        )

    async def cluster(self) -> dict[str, Any]:
        """``GET /cluster``: this replica, its lease, the members and each scope's owner, as this replica sees them."""
        membership = self.membership
        view = membership.view
        serving = {scope_token(owned.scope) for owned in self.owned.owned() if self.owned.serving(owned.scope)}
        scopes = []
        for token in sorted(set(view.scopes) | set(view.owners)):
            held = view.owners.get(token)
            scope = view.scopes.get(token)
            scopes.append(
                {
                    "model_name": scope.model_name if scope is not None else None,
                    "tenant_id": scope.tenant_id if scope is not None else None,
                    "token": token,
                    "owner": held.member if held is not None else None,
                    "owner_lease": format(held.lease_id, "x") if held is not None else None,
                    "served_here": token in serving,
                }
            )
        return {
            "cluster": membership.cluster,
            "member": membership.me,
            "lease": {
                "id": format(membership.lease_id, "x"),
                "live": membership.live(),
                "remaining_seconds": round(membership.lease_remaining(), 3),
                "ttl_seconds": membership.ttl_seconds,
            },
            "members": sorted(self.live_members()),
            "scopes": scopes,
            "revision": view.revision,
            "followers": self.follower_reads.describe() if self.follower_reads is not None else [],
        }

    async def metrics(self) -> list[Family]:
        """The replica's cluster figures (the scopes' own actor systems are not broken out per scope yet)."""
        owned = self.owned
        families = [
            gauge(
                "kvrouter_cluster_scopes_served",
                "Scopes this replica serves now",
                (),
                {(): float(len(owned.services()))},
            ),
            gauge(
                "kvrouter_cluster_members",
                "Live members in this replica's view",
                (),
                {(): float(len(self.live_members()))},
            ),
            gauge(
                "kvrouter_cluster_lease_remaining_seconds",
                "Time left on this replica's lease, on its own clock",
                (),
                {(): self.membership.lease_remaining()},
            ),
            counter(
                "kvrouter_cluster_leases_taken",
                "Leases this replica took",
                (),
                {(): float(self.membership.leases_taken)},
            ),
            counter(
                "kvrouter_cluster_recoveries", "Scopes claimed and recovered here", (), {(): float(owned.recoveries)}
            ),
            counter(
                "kvrouter_cluster_scope_drops",
                "Scopes dropped here (lease, move, journal)",
                (),
                {(): float(owned.drops)},
            ),
            counter(
                "kvrouter_cluster_overtaken",
                "Scopes recovered again because their subject moved past what this replica held",
                (),
                {(): float(owned.overtaken)},
            ),
            counter(
                "kvrouter_cluster_handed_over",
                "Scopes this replica handed over to the member placement prefers",
                (),
                {(): float(owned.handed_over)},
            ),
            counter(
                "kvrouter_cluster_forwarded",
                "Requests forwarded to an owner (a batch of forwarded writes counts once)",
                (),
                {(): float(self.forwarder.forwarded)},
            ),
            counter(
                "kvrouter_cluster_forward_failures", "Forwards with no answer", (), {(): float(self.forwarder.failed)}
            ),
            gauge(
                "kvrouter_cluster_booked_reservations",
                "Reservations booked through this replica whose scope it remembers (their commands go to its owner)",
                (),
                {(): float(len(self.booked))},
            ),
            counter(
                "kvrouter_cluster_booked_reservations_forgotten",
                f"Reservations forgotten past the memory's bound ({BOOKED_OVERFLOW})",
                (),
                {(): float(self.booked.forgotten)},
            ),
        ]
        for source in self.metric_sources:
            families.extend(source())
        return families


class ClusterSlotService(ClusterService[SlotService]):
    """The slot tracker's methods on a cluster replica."""

    BATCHED_WRITES = SlotService.BATCHED_WRITES

    def __init__(self, membership: Membership, owned: OwnedScopes[SlotService], forwarder: Forwarder) -> None:
        super().__init__(membership, owned, forwarder)
        self.load_feed = LoadFeed()
        owned.on_service = self._hook

    def _hook(self, service: SlotService) -> None:
        service.system.observers.append(self.load_feed.observe)

    # -- commands ---------------------------------------------------------------------------------------

    async def register(self, scope: ScopeKey, worker_id: int, block_size: int, dp_start: int, dp_size: int) -> bool:
        with self._local(scope) as service:
            return await service.register(scope, worker_id, block_size, dp_start, dp_size)

    async def unregister(self, scope: ScopeKey, worker_id: int) -> bool:
        with self._local(scope) as service:
            return await service.unregister(scope, worker_id)

    async def add(
        self,
        scope: ScopeKey,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: tuple[int, ...],
        isl_tokens: int,
    ) -> bool:
        with self._local(scope) as service:
            return await service.add(scope, request_id, worker_id, dp_rank, sequence_hashes, isl_tokens)

    async def prefill_complete(self, scope: ScopeKey, request_id: str) -> bool:
        with self._local(scope) as service:
            return await service.prefill_complete(scope, request_id)

    async def free(self, scope: ScopeKey, request_id: str) -> bool:
        with self._local(scope) as service:
            return await service.free(scope, request_id)

    async def apply_writes(self, writes: list[Any]) -> list[Any]:
        """``SlotService.apply_writes`` across the cluster: the writes of a scope served here go to its service
        together; those of a scope owned elsewhere go to its owner together, in order (``forward_writes``). In a
        batch another replica forwarded here (``FORWARDED_BATCH``), a scope not served here is refused (503)."""
        outcomes: list[Any] = [None] * len(writes)
        by_scope: dict[ScopeKey, list[int]] = {}
        for index, write in enumerate(writes):
            by_scope.setdefault(ScopeKey(write[1], write[2]), []).append(index)
        for scope, indices in by_scope.items():
            where = await self.where(scope, FORWARDED_BATCH.get())
            if isinstance(where, Serve):
                try:
                    with self._local(scope) as service:
                        found = await service.apply_writes([writes[i] for i in indices])
                except Refused as exc:
                    found = [encode_failure(exc)] * len(indices)
            elif isinstance(where, Forward):
                found = [
                    write_outcome(one) for one in await self.forward_writes(where.owner, [writes[i] for i in indices])
                ]
            else:
                found = [encode_failure(not_applied(where.message))] * len(indices)
            for i, outcome in zip(indices, found, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def forward_writes(self, owner: str, writes: Sequence[Sequence[Any]]) -> list[Outcome]:
        """Write items (``[method, model, tenant, *arguments]``) sent to ``owner`` as one group of a batch
        (``ForwardBatches``): each one's answer from its own route there (its token noted), or why it has none."""
        commands = [command(BY_NAME[write[0]].method, BY_NAME[write[0]].path, write_body(write)) for write in writes]
        outcomes = await self.batches.send(owner, commands)
        for outcome in outcomes:
            if isinstance(outcome, Relayed):
                self.written.note(outcome.written)
        return outcomes

    # -- queries: the scopes served here --------------------------------------------------------------

    async def workers(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[RegisteredRange]:
        await self.owned.settled()
        rows = []
        for service in self.owned.services():
            rows.extend(await service.workers(wanted))
        for state in copies_read(wanted):  # a read answered from follower copies (``follower_reads.reading``)
            for worker_id, (start, size) in state.slots.workers.items():
                rows.append(RegisteredRange(state.scope, worker_id, state.slots.block_size, start, size))
        return sorted(rows, key=lambda row: (row.scope, row.worker_id))

    async def loads(self, wanted: ScopeFilter = EVERY_SCOPE) -> list[ScopeLoads]:
        await self.owned.settled()
        rows = []
        for service in self.owned.services():
            rows.extend(await service.loads(wanted))
        rows.extend(ScopeLoads(state.scope, rank_loads(state)) for state in copies_read(wanted))
        return sorted(rows, key=lambda row: row.scope)

    async def potential_loads(
        self, scope: ScopeKey, sequence_hashes: Sequence[int], isl_tokens: int
    ) -> list[PotentialLoad]:
        with self._local(scope) as service:
            return await service.potential_loads(scope, sequence_hashes, isl_tokens)

    async def load_changes(self, epoch: str, cursor: int, wait_seconds: float) -> LoadChanges:
        """As ``SlotService.load_changes``, over the scopes served here."""

        def measure(scope: ScopeKey, version: int) -> LoadChange:
            service = self.owned.serving(scope)
            state = service.system.state(scope) if service is not None else None
            return LoadChange(scope, version, rank_loads(state) if state is not None else None)

        return await read_changes(self.load_feed, ServedStates(self.owned), epoch, cursor, wait_seconds, measure)


def write_outcome(outcome: Outcome) -> Any:
    """A forwarded write's answer as ``apply_writes`` gives it: created, done, or its failure as data."""
    if isinstance(outcome, OwnerUnreachable):
        if outcome.unknown:
            return encode_failure(OutcomeUnknown(f"{outcome}; the outcome is unknown"))
        return encode_failure(not_applied(str(outcome)))
    if outcome.status in (200, 201):
        return outcome.status == 201
    if outcome.status in (500, 504):  # the owner's outcome unknown (504), or its failure mid-command (500)
        return encode_failure(OutcomeUnknown(error_message(outcome.body)))
    return encode_failure(Refused(_STATUS_REASON.get(outcome.status, Reason.UNAVAILABLE), error_message(outcome.body)))


def error_message(body: bytes) -> str:
    """The message of an owner's ``{"error": ...}`` answer (so the write is answered with it as the owner did),
    or the whole body if it is not one."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    if type(value) is dict and type(value.get("error")) is str:
        return str(value["error"])
    return body.decode("utf-8", errors="replace")


class ServedStates:
    """The scopes served here, as ``read_changes`` reads an actor system (their states, a read barrier)."""

    def __init__(self, owned: OwnedScopes[Any]) -> None:
        self._owned = owned

    def states(self) -> list[ScopeState]:
        return [state for service in self._owned.services() for state in service.system.states()]

    async def read_barrier(self) -> None:
        for service in self._owned.services():
            await service.system.read_barrier()
        await trio.lowlevel.checkpoint()


def write_body(write: Sequence[Any]) -> bytes:
    """The JSON body of a write item (``[method, model, tenant, *arguments]``) on its own route."""
    method = write[0]
    body: dict[str, Any] = {"model_name": write[1], "tenant_id": write[2]}
    if method == "register":
        body.update(worker_id=write[3], block_size=write[4], dp_start=write[5], dp_size=write[6])
    elif method == "unregister":
        body.update(worker_id=write[3])
    elif method == "add":
        body.update(
            request_id=write[3],
            worker_id=write[4],
            dp_rank=write[5],
            sequence_hashes=[to_i64(h) for h in write[6]],  # read as unsigned; the route takes them signed
            new_isl_tokens=write[7],
        )
    elif method in ("prefill_complete", "free"):
        body.update(request_id=write[3])
    else:
        raise ValueError(f"apply_writes has no write {method!r}")
    return orjson.dumps(body)
