"""The two services the cluster leans on, as the contracts it relies on: etcd and a JetStream stream.

``Coordinator`` is one linearizable node (etcd's guarantee), built from the core's ``LeaseTable`` and
``ClaimTable``; it expires leases, and with them their keys, on every request. ``Stream`` is the replicated
stream at the level of its contract: per-subject sequences with the expected-last-sequence fence
(``SubjectLog``), snapshots kept by sequence, and R=3 availability: it answers only while a majority of its
three nodes is up (a request meanwhile goes unanswered and times out, as a publish without quorum does).

With ``StreamOptions.racy_fence`` the stream is the real nats-server before 2.9.21 instead of its contract: a
clustered stream checks the fence before replicating, so an append fenced on a sequence that another append,
fenced on the same one, took less than ``race_window_ms`` ago is stored all the same. Each message names the one
it follows on the chain (``Kvr-Prev``), and the append's answer says whether it is on the chain: what the real
writer's check after each publish finds (``journal/jetstream_link``), computed with the same ``Chain`` rule over the
messages stored between its fence and itself.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ownership.claims import Claimed, ClaimTable, Taken
from kvrouter.actors.core.ownership.fencing import Appended, SubjectLog, WrongLastSequence
from kvrouter.actors.core.ownership.leases import LeaseTable
from kvrouter.actors.core.ownership.recovery import ScopeSnapshot, newer
from kvrouter.journal.jetstream_batch import Chain
from kvrouter.simulations.ownership.kernel import MS, Kernel
from kvrouter.simulations.ownership.messages import (
    Append,
    AppendAnswer,
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
    View,
    Watch,
)

COORDINATOR = "etcd"
STREAM = "stream"
STREAM_NODES = 3

Entry = tuple[int, tuple[Event, ...]]  # a subject message: the sequence it follows on the chain, its events


@attrs.frozen
class StreamOptions:
    racy_fence: bool = False  # True: nats-server 2.9.10's clustered fence, checked before replication
    race_window_ms: int = 50  # how long an append's fence stays open to another append on the same sequence


class Coordinator:
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.leases = LeaseTable()
        self.claims = ClaimTable()
        self.expired = 0  # leases that ran out (failovers start here)

    def handle(self, src: str, message: Any) -> None:
        now = self.kernel.now
        gone = self.leases.expire(now)
        if gone:
            self.expired += len(gone)
            self.claims.drop_leases(gone)
        send = self.kernel.send
        if isinstance(message, KeepAlive):
            send(COORDINATOR, src, KeptAlive(message.req, self.leases.renew(message.lease_id, now) is not None))
        elif isinstance(message, Watch):
            send(COORDINATOR, src, View(message.req, self.leases.live_members(now), self.claims.snapshot()))
        elif isinstance(message, ClaimScope):
            result = self.claims.claim(message.subject, message.member, message.lease_id, self.leases, now)
            owner = result.claim.owner if isinstance(result, Claimed | Taken) else None
            send(COORDINATOR, src, ClaimAnswer(message.req, message.subject, owner))
        elif isinstance(message, ReleaseScope):
            self.claims.release(message.subject, message.member, message.lease_id)
        elif isinstance(message, Revoke):
            revoked = self.leases.revoke(message.lease_id)
            if revoked is not None:
                self.claims.drop_leases((revoked,))
        elif isinstance(message, Grant):
            send(
                COORDINATOR, src, Granted(message.req, self.leases.grant(message.member, message.ttl_ns, now).lease_id)
            )


class Stream:
    def __init__(self, kernel: Kernel, options: StreamOptions | None = None) -> None:
        self.kernel = kernel
        self.options = options or StreamOptions()
        self.log: SubjectLog[Entry] = SubjectLog()
        self.snapshots: dict[str, ScopeSnapshot] = {}
        self.nodes_down: set[int] = set()
        self.fenced = 0  # appends the fence refused
        self.raced = 0  # appends stored past a stale fence (racy_fence only)
        self.off_chain = 0  # appends stored that another message had taken the place of on the chain
        self._stored_on: dict[tuple[str, int], int] = {}  # (subject, fence) -> when an append on it was stored

    @property
    def available(self) -> bool:
        return STREAM_NODES - len(self.nodes_down) > STREAM_NODES // 2

    def handle(self, src: str, message: Any) -> None:
        if not self.available:
            return
        if isinstance(message, Append):
            self.kernel.send(STREAM, src, self.append(message))
        elif isinstance(message, Read):
            snapshot = self.snapshots.get(message.subject) if message.with_snapshot else None
            after = max(message.after, snapshot.seq if snapshot is not None else 0)
            messages = self.log.read(message.subject, after)
            self.kernel.send(STREAM, src, ReadAnswer(message.req, message.subject, snapshot, messages))
        elif isinstance(message, PutSnapshot) and newer(self.snapshots.get(message.subject), message.snapshot):
            self.snapshots[message.subject] = message.snapshot

    def append(self, message: Append) -> AppendAnswer:
        subject, expected = message.subject, message.expected_last
        result = self.log.append(subject, (message.prev, message.events), expected)
        if isinstance(result, WrongLastSequence) and self._racing(subject, result.expected):
            self.raced += 1
            result = self.log.append(subject, (message.prev, message.events), None)
        if not isinstance(result, Appended):
            self.fenced += 1
            return AppendAnswer(message.req, None, result.actual)
        if expected is not None:
            self._stored_on[(subject, expected)] = self.kernel.now
        on_chain = self._on_chain(subject, result.seq, message.prev if expected is None else expected, message.prev)
        self.off_chain += not on_chain
        return AppendAnswer(message.req, result.seq, result.seq, on_chain)

    def _racing(self, subject: str, expected: int) -> bool:
        """Whether nats-server 2.9.10 would store this stale append: another on the same fence is being replicated."""
        if not self.options.racy_fence:
            return False
        stored_at = self._stored_on.get((subject, expected))
        return stored_at is not None and self.kernel.now - stored_at < self.options.race_window_ms * MS

    def _on_chain(self, subject: str, seq: int, fence: int, prev: int) -> bool:
        """The real writer's check: no message stored between the fence and ``seq`` took ``prev``'s successor place."""
        chain = Chain(prev)
        for at, (named, _) in self.log.read(subject, fence, limit=1 << 30):
            if at >= seq:
                break
            chain.take(at, named)
        return chain.take(seq, prev)
