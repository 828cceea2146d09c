"""Members and their leases, with etcd's rules: a lease lives until ``expires_at`` unless renewed before then.

Time is a number the caller passes in (nanoseconds on whatever clock the lease holder shares); nothing here
reads a clock. A renewal after expiry fails, as etcd's keep-alive of a revoked lease does, so a member that was
paused past its TTL must take a new lease (and with it lose every key held under the old one).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Lease:
    lease_id: int
    member: str
    ttl_ns: int
    expires_at: int

    def live(self, now: int) -> bool:
        return now < self.expires_at


class LeaseTable:
    """The leases a coordinator (etcd) holds; ids are handed out in order, never reused."""

    __slots__ = ("_leases", "_next_id")

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._next_id = 1

    def grant(self, member: str, ttl_ns: int, now: int) -> Lease:
        if ttl_ns <= 0:
            raise ValueError(f"a lease needs a positive TTL, got {ttl_ns}")
        lease = Lease(self._next_id, member, ttl_ns, now + ttl_ns)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        return lease

    def renew(self, lease_id: int, now: int) -> Lease | None:
        """The renewed lease, or None when it is unknown or already expired (the holder must re-grant)."""
        lease = self._leases.get(lease_id)
        if lease is None or not lease.live(now):
            return None
        renewed = attrs.evolve(lease, expires_at=now + lease.ttl_ns)
        self._leases[lease_id] = renewed
        return renewed

    def revoke(self, lease_id: int) -> Lease | None:
        """A clean leave: the lease (and, for the caller to drop, its keys) ends now."""
        return self._leases.pop(lease_id, None)

    def expire(self, now: int) -> tuple[Lease, ...]:
        """Remove and return every lease whose time ran out by ``now``, oldest id first."""
        gone = tuple(lease for lease in self._leases.values() if not lease.live(now))
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def live_members(self, now: int) -> tuple[str, ...]:
        """Members holding at least one live lease, sorted (placement must not depend on grant order)."""
        return tuple(sorted({lease.member for lease in self._leases.values() if lease.live(now)}))


def holder_deadline(request_sent_at: int, ttl_ns: int) -> int:
    """Until when the holder may act as owner, on its own clock: counted from when it *sent* the grant or
    renewal that succeeded. The coordinator counts from when it received it, which is later, so the holder's
    view ends first, whatever the network delay; only clock drift (excluded here) could invert that."""
    return request_sent_at + ttl_ns
