"""A kvrouter replica in the cluster: lease, view, claims, owned scopes, follower copies and forwarding.

Every rule it follows is in ``actors/core/ownership`` (and each owned scope runs the scope actor's real
``decide``/``fold``); this class is the shell: it keeps the view, sends messages, and times requests out. Each
owned scope handles one command at a time, as the scope actor does; the append of its events leaves a moment
after it was decided (``cpu``), which is where a pause can come between deciding and writing.

The log of a subject is the chain of its messages, each naming the one it follows (``Kvr-Prev``), as the real
JetStream journal reads it (``journal/jetstream_batch.Chain``): recovery and follower copies fold the chain only,
and an append stored off it (a fence raced on nats-server before 2.9.21) is answered as a fenced one. An owner
fences on the subject's last sequence it read, and names the chain's last message as the one it follows; they
differ only after a message off the chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import attrs

from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.claims import Claim
from kvrouter.actors.core.ownership.fencing import MAX_READ
from kvrouter.actors.core.ownership.forwarding import Forward, Serve, route
from kvrouter.actors.core.ownership.leases import holder_deadline
from kvrouter.actors.core.ownership.owner import OwnedScope, Proposal, commit, overtaken, propose
from kvrouter.actors.core.ownership.placement import preferred_owner
from kvrouter.actors.core.ownership.recovery import ScopeSnapshot, catch_up, recover, take_snapshot
from kvrouter.actors.core.state import ScopeState
from kvrouter.journal.jetstream_batch import Chain
from kvrouter.simulations.ownership.kernel import MS, Kernel
from kvrouter.simulations.ownership.messages import (
    Answer,
    Append,
    AppendAnswer,
    Call,
    ClaimAnswer,
    ClaimScope,
    Grant,
    Granted,
    KeepAlive,
    KeptAlive,
    PutSnapshot,
    Read,
    ReadAnswer,
    ReleaseScope,
    Revoke,
    Tick,
    View,
    Watch,
)
from kvrouter.simulations.ownership.services import COORDINATOR, STREAM

MAX_QUEUED = 64  # commands waiting per owned scope; past it the replica answers 503 (overflow policy: reject)


@attrs.frozen
class ReplicaOptions:
    ttl_ns: int = 2_000 * MS
    tick_ns: int = 250 * MS
    request_timeout_ns: int = 1_000 * MS  # a coordinator or stream request unanswered this long is abandoned
    cpu_ns: int = 5 * MS  # from deciding a command to its append leaving (encoding, the group-commit window)
    snapshot_every: int = 8  # subject messages between an owner's snapshots
    fencing: bool = True  # False: the broken variant, appends carry no expected last sequence (and no chain)
    chain: bool = True  # False: the journal before ``Kvr-Prev`` (readers fold every message, writers check nothing)

    @property
    def chained(self) -> bool:
        """Whether the log is the chain (the defence against a raced fence); a variant without the fence has none."""
        return self.chain and self.fencing


@attrs.define
class InFlight:
    call: Call
    proposal: Proposal
    req: int = 0


@attrs.define
class ReplicaStats:
    claims: int = 0
    recoveries: int = 0
    fenced: int = 0
    handovers: int = 0
    forwarded: int = 0
    snapshots: int = 0
    from_snapshot: int = 0  # recoveries that started from a snapshot


class Replica:
    def __init__(self, name: str, kernel: Kernel, scopes: dict[str, ScopeKey], options: ReplicaOptions) -> None:
        self.name = name
        self.kernel = kernel
        self.scopes = scopes  # subject -> scope, for every scope of the run
        self.options = options
        self.stats = ReplicaStats()
        self.lease_id: int | None = None
        self.lease_deadline = 0
        self.members: tuple[str, ...] = ()
        self.claims: dict[str, Claim] = {}
        self.owned: dict[str, OwnedScope] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.queues: dict[str, deque[Call]] = {}
        self.recovering: dict[str, tuple[OwnedScope, int] | None] = {}  # subject -> the fold so far, last seq read
        self.fence: dict[str, int] = {}  # owned subject -> its last sequence as read or written (the next fence)
        self.followers = {subject: OwnedScope(ScopeState(scope), 0) for subject, scope in scopes.items()}
        self.snapshot_seq: dict[str, int] = {}
        self.broken: dict[str, str] = {}  # subject -> why its messages did not fold here
        self._next_req = 0
        self._pending: dict[int, tuple[str, int, Any]] = {}  # req -> (kind, sent at, data)
        kernel.timer(name, 0, Tick("tick"))

    # -- plumbing ---------------------------------------------------------------------------------------

    def _request(self, dst: str, kind: str, make: Any, data: Any = None) -> int:
        self._next_req += 1
        req = self._next_req
        self._pending[req] = (kind, self.kernel.now, data)
        self.kernel.send(self.name, dst, make(req))
        return req

    def _take(self, req: int, kind: str) -> tuple[int, Any] | None:
        pending = self._pending.get(req)
        if pending is None or pending[0] != kind:
            return None
        del self._pending[req]
        return pending[1], pending[2]

    def _pending_kind(self, kind: str, data: Any = None) -> bool:
        return any(k == kind and (data is None or d == data) for k, _, d in self._pending.values())

    def handle(self, src: str, message: Any) -> None:
        if isinstance(message, Call):
            self.on_call(message)
        elif isinstance(message, AppendAnswer):
            self.on_append_answer(message)
        elif isinstance(message, Answer):
            self.kernel.send(self.name, message.client, message)  # a forwarded command's answer, relayed
        elif isinstance(message, ReadAnswer):
            self.on_read(message)
        elif isinstance(message, View):
            if self._take(message.req, "watch") is not None:
                self.on_view(message.members, dict(message.claims))
        elif isinstance(message, ClaimAnswer):
            self.on_claim(message)
        elif isinstance(message, KeptAlive | Granted):
            self.on_lease(message)
        elif isinstance(message, Tick):
            self.on_tick(message)

    # -- lease and view ---------------------------------------------------------------------------------

    def on_tick(self, tick: Tick) -> None:
        if tick.what == "send-append":
            self.send_append(tick.data)
            return
        now = self.kernel.now
        self.kernel.timer(self.name, self.options.tick_ns, Tick("tick"))
        self._expire_requests(now)
        if self.lease_id is not None and now >= self.lease_deadline:
            self.lose_lease()
        if self.lease_id is None:
            if not self._pending_kind("grant"):
                self._request(COORDINATOR, "grant", lambda r: Grant(r, self.name, self.options.ttl_ns))
        else:  # every tick, answered or not (as etcd's keep-alive stream does): one lost renewal costs nothing
            lease_id = self.lease_id
            self._request(COORDINATOR, "keepalive", lambda r: KeepAlive(r, lease_id), lease_id)
        if not self._pending_kind("watch"):
            self._request(COORDINATOR, "watch", Watch)
        for subject, follower in self.followers.items():
            if not self._pending_kind("follow", subject):
                after = follower.last_seq
                self._request(STREAM, "follow", lambda r, s=subject, a=after: Read(r, s, a, False), subject)
        for subject, owned in self.owned.items():
            if owned.last_seq - self.snapshot_seq.get(subject, 0) >= self.options.snapshot_every:
                self.snapshot_seq[subject] = owned.last_seq
                self.stats.snapshots += 1
                self.kernel.send(self.name, STREAM, PutSnapshot(subject, take_snapshot(owned)))

    def _expire_requests(self, now: int) -> None:
        timeout = self.options.request_timeout_ns
        for req, (kind, sent_at, data) in list(self._pending.items()):
            if now - sent_at < timeout:
                continue
            del self._pending[req]
            if kind == "append":
                self.append_unknown(data)
            elif kind == "recover":
                self.recovering.pop(data, None)

    def on_lease(self, message: KeptAlive | Granted) -> None:
        kind = "grant" if isinstance(message, Granted) else "keepalive"
        taken = self._take(message.req, kind)
        if taken is None:
            return
        sent_at, lease_id = taken
        if isinstance(message, Granted):
            if self.lease_id is None:
                self.lease_id = message.lease_id
                self.lease_deadline = holder_deadline(sent_at, self.options.ttl_ns)
        elif lease_id == self.lease_id:
            if message.ok:
                self.lease_deadline = max(self.lease_deadline, holder_deadline(sent_at, self.options.ttl_ns))
            else:
                self.lose_lease()

    def lose_lease(self) -> None:
        """Stop owning anything; revoke the lease (best effort) so that its keys go now, not at its expiry."""
        if self.lease_id is not None:
            self.kernel.send(self.name, COORDINATOR, Revoke(self.lease_id))
        self.lease_id = None
        for subject in list(self.owned):
            self.drop(subject, "its owner lost its lease")
        self.recovering.clear()

    def lease_valid(self) -> bool:
        return self.lease_id is not None and self.kernel.now < self.lease_deadline

    def on_view(self, members: tuple[str, ...], claims: dict[str, Claim]) -> None:
        self.members = members
        self.claims = claims
        for subject in self.scopes:
            claim = claims.get(subject)
            owner = None if claim is None else claim.owner
            mine = claim is not None and owner == self.name and claim.lease_id == self.lease_id
            if not mine and (subject in self.owned or subject in self.recovering):
                self.drop(subject, f"scope moved to {owner}")
                self.recovering.pop(subject, None)
            if not self.lease_valid():
                continue
            preferred = preferred_owner(subject, members)
            if claim is None and preferred == self.name and not self._pending_kind("claim", subject):
                lease_id = self.lease_id
                assert lease_id is not None
                self._request(
                    COORDINATOR,
                    "claim",
                    lambda r, s=subject, lease=lease_id: ClaimScope(r, s, self.name, lease),
                    subject,
                )
            elif mine and subject not in self.owned and subject not in self.recovering:
                self.start_recovery(subject)
            elif mine and preferred not in (None, self.name) and self.idle(subject):
                self.hand_over(subject)

    def on_claim(self, message: ClaimAnswer) -> None:
        if self._take(message.req, "claim") is not None and message.owner == self.name:
            self.stats.claims += 1

    def idle(self, subject: str) -> bool:
        return subject in self.owned and subject not in self.in_flight and not self.queues.get(subject)

    def hand_over(self, subject: str) -> None:
        """The preferred owner is live (it joined, or came back): give the scope up cleanly. Nothing is in
        flight, so the subject holds all this replica wrote; the next owner recovers from it."""
        assert self.lease_id is not None
        self.stats.handovers += 1
        self.drop(subject, "scope handed over")
        self.claims.pop(subject, None)
        self.kernel.send(self.name, COORDINATOR, ReleaseScope(subject, self.name, self.lease_id))

    # -- recovery and follower copies -------------------------------------------------------------------

    def start_recovery(self, subject: str) -> None:
        self.stats.recoveries += 1
        self.recovering[subject] = None
        self._request(STREAM, "recover", lambda r: Read(r, subject, 0, True), subject)

    def on_read(self, answer: ReadAnswer) -> None:
        subject = answer.subject
        if self._take(answer.req, "follow") is not None:
            if subject not in self.broken:
                follower = self.followers[subject]
                tail = self.chain_of(follower.last_seq, answer.messages)[0]
                self._guarded(subject, lambda: catch_up(follower, tail))
            owned = self.owned.get(subject)
            if owned is not None and overtaken(owned, self.followers[subject].last_seq, subject in self.in_flight):
                self.drop(subject, "its subject moved past this owner")  # recovered again at the next view
            return
        if self._take(answer.req, "recover") is None or subject not in self.recovering:
            return
        begun = self.recovering[subject]
        so_far: OwnedScope | None
        if begun is None:
            snapshot = answer.snapshot
            self.stats.from_snapshot += snapshot is not None
            start = 0 if snapshot is None else snapshot.seq
            tail, read_to = self.chain_of(start, answer.messages)
            so_far = self._guarded(subject, lambda: recover(self.scopes[subject], snapshot, tail))
            read_to = max(read_to, start)
        else:
            so_far, read_to = begun
            tail, read_to = self.chain_of(so_far.last_seq, answer.messages, read_to)
            if self._guarded(subject, lambda: catch_up(so_far, tail)) is None:
                so_far = None
        if so_far is None:  # the subject does not fold: this replica stops recovering it (a crash, in a real one)
            del self.recovering[subject]
            return
        if len(answer.messages) == MAX_READ:  # a longer tail: read on from where this page ended
            self.recovering[subject] = (so_far, read_to)
            self._request(STREAM, "recover", lambda r: Read(r, subject, read_to, False), subject)
            return
        del self.recovering[subject]
        self.owned[subject] = so_far
        self.fence[subject] = max(read_to, so_far.last_seq)
        self.snapshot_seq[subject] = answer.snapshot.seq if answer.snapshot is not None else 0
        self._next(subject)

    def chain_of(
        self, tail: int, messages: Iterable[tuple[int, tuple[int, tuple[Event, ...]]]], read_to: int = 0
    ) -> tuple[list[tuple[int, tuple[Event, ...]]], int]:
        """The messages of the log among those read after ``tail`` (the chain's last message folded, 0 when
        reading from the subject's start), and the last sequence read: the journal's reading rule."""
        chain = Chain(tail or None)
        found = []
        for seq, (prev, events) in messages:
            read_to = max(read_to, seq)
            if not self.options.chained or chain.take(seq, prev):
                found.append((seq, events))
        return found, read_to

    def _guarded(self, subject: str, step: Any) -> Any:
        """Run a fold of ``subject``'s messages; a fold that raises means the subject holds contradictory events
        (a forked log): record it for the checker and return None (``True`` stands for success of a step that
        returns nothing)."""
        try:
            result = step()
        except Exception as exc:
            self.broken[subject] = f"{self.name} cannot fold its subject ({type(exc).__name__}: {exc})"
            return None
        return True if result is None else result

    # -- commands ---------------------------------------------------------------------------------------

    def serving(self, subject: str) -> bool:
        return subject in self.owned and self.lease_valid()

    def on_call(self, call: Call) -> None:
        claim = self.claims.get(call.subject)
        owner = None if claim is None else claim.owner
        decision = route(
            call.subject, self.name, owner, self.members, self.serving(call.subject), forwarded=call.via is not None
        )
        if isinstance(decision, Forward):
            self.stats.forwarded += 1
            self.kernel.send(self.name, decision.owner, attrs.evolve(call, via=self.name))
        elif isinstance(decision, Serve):
            queue = self.queues.setdefault(call.subject, deque())
            if len(queue) >= MAX_QUEUED:
                self.answer(call, "unavailable", "too many commands queued for this scope")
                return
            queue.append(call)
            self._next(call.subject)
        else:
            self.answer(call, "unavailable", decision.message)

    def answer(self, call: Call, outcome: str, detail: str = "") -> None:
        self.kernel.send(self.name, call.via or call.client, _answer(call, outcome, detail))

    def _next(self, subject: str) -> None:
        """Decide queued commands until one has events to append (then wait for the stream) or none is left."""
        queue = self.queues.get(subject)
        owned = self.owned.get(subject)
        while queue and owned is not None and subject not in self.in_flight:
            if not self.lease_valid():
                self.drop(subject, "its owner's lease lapsed")
                return
            call = queue.popleft()
            result = propose(owned, call.command)
            if isinstance(result, Rejected):
                self.answer(call, "fail", result.reason.value)
            elif isinstance(result, Accepted):
                self.answer(call, "ok")
            else:
                self.in_flight[subject] = InFlight(call, result)
                self.kernel.timer(self.name, self.options.cpu_ns, Tick("send-append", subject))

    def send_append(self, subject: str) -> None:
        flight = self.in_flight.get(subject)
        if flight is None or flight.req:
            return
        proposal = flight.proposal
        prev = proposal.expected_last_seq  # the owner's state is the chain up to there
        expected = self.fence.get(subject, prev) if self.options.fencing else None
        flight.req = self._request(
            STREAM, "append", lambda r: Append(r, subject, proposal.events, expected, prev), (subject, proposal)
        )

    def on_append_answer(self, answer: AppendAnswer) -> None:
        taken = self._take(answer.req, "append")
        if taken is None:
            return
        subject, proposal = taken[1]
        flight = self.in_flight.get(subject)
        owned = self.owned.get(subject)
        if flight is None or flight.proposal is not proposal or owned is None:
            return
        del self.in_flight[subject]
        if answer.seq is None:
            self.stats.fenced += 1
            self.answer(flight.call, "unavailable", "fenced: another replica wrote this scope")
            self.drop(subject, "fenced: another replica wrote this scope")
            return
        if not answer.on_chain and self.options.chained:  # stored, but no reader folds it: as good as fenced
            why = "fenced: another replica's append took this one's place on the log"
            self.answer(flight.call, "unavailable", why)
            self.drop(subject, why)
            return
        commit(owned, proposal, answer.seq)
        self.fence[subject] = answer.seq
        self.answer(flight.call, "ok")
        self._next(subject)

    def append_unknown(self, data: tuple[str, Proposal]) -> None:
        """No answer from the stream: the events may or may not be in the subject. Tell the client so (504) and
        recover the scope from the stream before serving it again."""
        subject, proposal = data
        flight = self.in_flight.get(subject)
        if flight is None or flight.proposal is not proposal:
            return
        del self.in_flight[subject]
        self.answer(flight.call, "unknown", "the stream did not answer")
        self.drop(subject, "the stream did not answer")

    def drop(self, subject: str, why: str) -> None:
        """Forget the owned state (a later owner, or this one, recovers it from the stream); what waits is
        refused with 503 (not applied), what is in flight is told its outcome is unknown (504)."""
        self.owned.pop(subject, None)
        self.fence.pop(subject, None)
        flight = self.in_flight.pop(subject, None)
        if flight is not None:
            self.answer(flight.call, "unknown", why)
        for call in self.queues.pop(subject, deque()):
            self.answer(call, "unavailable", why)

    # -- what the checker reads -------------------------------------------------------------------------

    def answer_for(self, subject: str) -> ScopeState:
        """What this replica answers for ``subject`` (its /loads, its /dump): the owner's state if it serves
        the scope, else its follower copy."""
        owned = self.owned.get(subject)
        if owned is not None and self.serving(subject):
            return owned.state
        return self.followers[subject].state


def _answer(call: Call, outcome: str, detail: str) -> Answer:
    return Answer(call.call, call.client, outcome, detail)


__all__ = ["Replica", "ReplicaOptions", "ScopeSnapshot"]
