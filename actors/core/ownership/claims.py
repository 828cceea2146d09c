"""Ownership keys: one per scope, created under the owner's lease in a create-if-absent transaction.

This is the etcd transaction ``If(CreateRevision(key) == 0) Then(Put(key, member, lease))``: the first claimant
wins, a second one learns who holds the scope. A key lives as long as its lease (``drop_leases``), so a dead
owner's scopes become claimable exactly when its lease expires. ``revision`` grows on every change, as etcd's
does, and is what a watcher orders ownership moves by.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.ownership.leases import Lease, LeaseTable


@attrs.frozen
class Claim:
    owner: str
    lease_id: int
    revision: int  # the key's create revision: a later owner of the same scope always has a larger one


@attrs.frozen
class Claimed:
    claim: Claim


@attrs.frozen
class Taken:
    """The scope is held by someone (possibly the claimant itself, under this or an older lease)."""

    claim: Claim


@attrs.frozen
class NoLease:
    """The claimant's lease is unknown or expired: it must take a new lease before claiming anything."""


ClaimResult = Claimed | Taken | NoLease


class ClaimTable:
    __slots__ = ("_claims", "revision")

    def __init__(self) -> None:
        self._claims: dict[str, Claim] = {}
        self.revision = 0

    def claim(self, scope: str, member: str, lease_id: int, leases: LeaseTable, now: int) -> ClaimResult:
        lease = leases.get(lease_id)
        if lease is None or not lease.live(now) or lease.member != member:
            return NoLease()
        held = self._claims.get(scope)
        if held is not None:
            return Taken(held)
        self.revision += 1
        claim = Claim(member, lease_id, self.revision)
        self._claims[scope] = claim
        return Claimed(claim)

    def release(self, scope: str, member: str, lease_id: int) -> bool:
        """Delete the key if ``member`` holds it under ``lease_id`` (a clean hand-over); False otherwise."""
        held = self._claims.get(scope)
        if held is None or held.owner != member or held.lease_id != lease_id:
            return False
        del self._claims[scope]
        self.revision += 1
        return True

    def drop_leases(self, gone: tuple[Lease, ...]) -> tuple[str, ...]:
        """Delete the keys held under leases that ended; the scopes freed, in key order."""
        ended = {lease.lease_id for lease in gone}
        freed = tuple(sorted(scope for scope, claim in self._claims.items() if claim.lease_id in ended))
        for scope in freed:
            del self._claims[scope]
        if freed:
            self.revision += 1
        return freed

    def owner_of(self, scope: str) -> Claim | None:
        return self._claims.get(scope)

    def snapshot(self) -> tuple[tuple[str, Claim], ...]:
        """Every key, sorted: what a replica's watch (or a range read) sees."""
        return tuple(sorted(self._claims.items()))
