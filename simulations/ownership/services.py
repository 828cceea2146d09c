"""The two services the cluster leans on, as the contracts it relies on: etcd and a JetStream stream.

``Coordinator`` is one linearizable node (etcd's guarantee), built from the core's ``LeaseTable`` and
``ClaimTable``; it expires leases, and with them their keys, on every request. ``Stream`` is the replicated
stream at the level of its contract: per-subject sequences with the expected-last-sequence fence
(``SubjectLog``), snapshots kept by sequence, and R=3 availability: it answers only while a majority of its
three nodes is up (a request meanwhile goes unanswered and times out, as a publish without quorum does).
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ownership.claims import Claimed, ClaimTable, Taken
from kvrouter.actors.core.ownership.fencing import Appended, SubjectLog
from kvrouter.actors.core.ownership.leases import LeaseTable
from kvrouter.actors.core.ownership.recovery import ScopeSnapshot, newer
from kvrouter.simulations.ownership.kernel import Kernel
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
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.log: SubjectLog[tuple[Event, ...]] = SubjectLog()
        self.snapshots: dict[str, ScopeSnapshot] = {}
        self.nodes_down: set[int] = set()
        self.fenced = 0  # appends the fence refused

    @property
    def available(self) -> bool:
        return STREAM_NODES - len(self.nodes_down) > STREAM_NODES // 2

    def handle(self, src: str, message: Any) -> None:
        if not self.available:
            return
        if isinstance(message, Append):
            result = self.log.append(message.subject, message.events, message.expected_last)
            if isinstance(result, Appended):
                answer = AppendAnswer(message.req, result.seq, result.seq)
            else:
                self.fenced += 1
                answer = AppendAnswer(message.req, None, result.actual)
            self.kernel.send(STREAM, src, answer)
        elif isinstance(message, Read):
            snapshot = self.snapshots.get(message.subject) if message.with_snapshot else None
            after = max(message.after, snapshot.seq if snapshot is not None else 0)
            messages = self.log.read(message.subject, after)
            self.kernel.send(STREAM, src, ReadAnswer(message.req, message.subject, snapshot, messages))
        elif isinstance(message, PutSnapshot) and newer(self.snapshots.get(message.subject), message.snapshot):
            self.snapshots[message.subject] = message.snapshot
