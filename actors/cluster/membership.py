"""This replica's membership: its etcd lease, its member key, and its view of the cluster's keys.

Under ``kvrouter/cluster/NAME/`` etcd holds:

* ``members/<advertise URL>``: one per replica, under its lease (gone when the lease ends); its value says
  ``"leaving": true`` once the replica stops (SIGTERM): it stays reachable, but placement no longer counts it, so
  its scopes go to the others while it hands them over;
* ``owners/<scope token>``: the scope's owner and its lease, created under that lease in a create-if-absent
  transaction (``scopes.py``), so it too is gone when the owner's lease ends;
* ``scopes/<scope token>``: the scope's model and tenant, without a lease: the scopes the cluster knows, so a
  scope whose owner died is claimed again even when nobody writes to it.

The lease is counted on this replica's clock from when it *sent* the grant or renewal that succeeded
(``leases.holder_deadline``): its view of the lease ends before etcd's does. It is renewed every third of its
TTL; a renewal that finds it gone (paused or cut off past the TTL) tells the owner (``on_lease_lost``: every
scope held under it is dropped) and takes a new lease. The view is a list of the prefix, then a watch from the
next revision; a watch that fails lists again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Final

import attrs
import orjson
import trio

from kvrouter.actors.cluster import ClusterUnreachable
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.leases import holder_deadline
from kvrouter.actors.fleet.etcd import Change, Compacted, EtcdClient, EtcdUnavailable

log = logging.getLogger("kvrouter.cluster")

DEFAULT_LEASE_TTL_SECONDS: Final = 2
RENEWALS_PER_TTL: Final = 3
RELIST_PAUSE_SECONDS: Final = 0.2  # after a failed watch, before listing again
NS: Final = 1_000_000_000


def cluster_prefix(name: str) -> str:
    return f"kvrouter/cluster/{name}/"


@attrs.frozen
class OwnerKey:
    member: str
    lease_id: int


@attrs.define
class View:
    """The cluster's keys as this replica last saw them."""

    members: set[str] = attrs.Factory(set)
    leaving: set[str] = attrs.Factory(set)  # members that are stopping: reachable, but not placed on
    owners: dict[str, OwnerKey] = attrs.Factory(dict)
    scopes: dict[str, ScopeKey] = attrs.Factory(dict)
    revision: int = 0

    def apply(self, kind: str, name: str, value: bytes | None) -> None:
        """One key's change (``value`` None: deleted); keys this build does not know are ignored."""
        try:
            data: Any = orjson.loads(value) if value else None
            if kind == "members" and value is not None:
                self.members.add(name)
                if isinstance(data, dict) and data.get("leaving") is True:
                    self.leaving.add(name)
                else:
                    self.leaving.discard(name)
            elif kind == "members":
                self.members.discard(name)
                self.leaving.discard(name)
            elif kind == "owners":
                if data is None:
                    self.owners.pop(name, None)
                else:
                    self.owners[name] = OwnerKey(str(data["member"]), int(data["lease"]))
            elif kind == "scopes":
                if data is None:
                    self.scopes.pop(name, None)
                else:
                    self.scopes[name] = ScopeKey(str(data["model_name"]), str(data["tenant_id"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring the cluster key %s/%s: its value is not this build's (%r)", kind, name, value)


class Membership:
    def __init__(self, etcd: EtcdClient, cluster: str, me: str, ttl_seconds: int = DEFAULT_LEASE_TTL_SECONDS) -> None:
        self.etcd = etcd
        self.cluster = cluster
        self.prefix = cluster_prefix(cluster)
        self.me = me
        self.ttl_seconds = ttl_seconds
        self.lease_id = 0
        self._deadline = -math.inf  # trio.current_time() before which this replica may act under its lease
        self.view = View()
        self._changed = trio.Event()
        self.leases_taken = 0
        self.etcd_failure: str | None = None  # why the last renewal or lease grant failed; None once one succeeds
        self.leaving = False  # stopping: placement over the others only, while this replica hands its scopes over

    def key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}/{name}"

    # -- joining ----------------------------------------------------------------------------------

    async def join(self) -> None:
        """Take a lease, put the member key, list the cluster's keys; ``ClusterUnreachable`` if etcd does not answer."""
        try:
            await self._take_lease()
            await self._list()
        except EtcdUnavailable as exc:
            raise ClusterUnreachable(
                f"cannot reach etcd at {self.etcd.endpoint} for cluster {self.cluster} ({exc}); "
                "start etcd or fix --etcd-endpoints"
            ) from None

    async def _take_lease(self) -> None:
        sent = trio.current_time()
        lease_id, ttl = await self.etcd.grant(self.ttl_seconds)
        self.lease_id = lease_id
        self._deadline = holder_deadline(int(sent * NS), ttl * NS) / NS
        self.leases_taken += 1
        await self._put_member()
        log.info("cluster %s: member %s holds lease %x (TTL %d s)", self.cluster, self.me, lease_id, ttl)

    async def _put_member(self) -> None:
        value: dict[str, Any] = {"url": self.me, "leaving": True} if self.leaving else {"url": self.me}
        await self.etcd.put(self.key("members", self.me), orjson.dumps(value), self.lease_id)

    async def leave_placement(self) -> None:
        """The first step of stopping: mark the member key ``leaving`` (the lease is kept), so that every replica's
        placement, this one's included, prefers the others for each scope; this replica stays reachable while it
        hands its scopes over. ``EtcdUnavailable`` if etcd does not answer (this replica's own placement already
        leaves itself out)."""
        self.leaving = True
        self._notify()
        if self.lease_id:
            await self._put_member()

    def placement(self, live: set[str]) -> list[str]:
        """The members placement chooses among: the live ones, less those leaving (this one, once stopping)."""
        leaving = self.view.leaving | ({self.me} if self.leaving else set())
        return sorted(live - leaving)

    async def leave(self) -> None:
        """Revoke the lease (its keys go with it): the others may claim this replica's scopes at once."""
        if self.lease_id:
            self._deadline = -math.inf
            try:
                with trio.move_on_after(2):
                    await self.etcd.revoke(self.lease_id)
            except EtcdUnavailable as exc:
                log.warning(
                    "cluster %s: revoking lease %x failed (it expires by itself): %s", self.cluster, self.lease_id, exc
                )

    # -- what the rules ask -------------------------------------------------------------------------

    def live(self) -> bool:
        """Whether this replica still holds its lease, on its own clock."""
        return trio.current_time() < self._deadline

    def not_live_reason(self) -> str:
        """Why this replica holds no live lease now, naming etcd (for a refusal)."""
        where = f"its lease in etcd at {self.etcd.endpoint} lapsed"
        if self.etcd_failure is not None:
            return f"{where} and etcd does not answer ({self.etcd_failure})"
        if not self.lease_id:
            return f"{where}; it is taking a new one"
        return f"{where} before etcd answered a renewal"

    def lease_remaining(self) -> float:
        return max(0.0, self._deadline - trio.current_time())

    async def sees_member(self, name: str, seconds: float) -> bool:
        """Whether ``name`` is a member in this replica's view, waiting up to ``seconds`` for the view to show it
        (a member that just joined is in etcd a moment before this replica's watch brings it)."""
        with trio.move_on_after(seconds):
            while name not in self.view.members:
                await self.wait_changed()
        return name in self.view.members

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        event, self._changed = self._changed, trio.Event()
        event.set()

    # -- running --------------------------------------------------------------------------------------

    async def run(self, on_lease_lost: Callable[[], None]) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_alive, on_lease_lost)
            nursery.start_soon(self._follow)

    async def _keep_alive(self, on_lease_lost: Callable[[], None]) -> None:
        while True:
            await trio.sleep(self.ttl_seconds / RENEWALS_PER_TTL)
            sent = trio.current_time()
            try:
                remaining = await self.etcd.keep_alive(self.lease_id) if self.lease_id else 0
                if remaining > 0:
                    self._deadline = holder_deadline(int(sent * NS), remaining * NS) / NS
                    self.etcd_failure = None
                    continue
                log.warning(
                    "cluster %s: lease %x ended; dropping its scopes and taking a new one", self.cluster, self.lease_id
                )
                self._deadline = -math.inf
                self.lease_id = 0
                on_lease_lost()
                self._notify()
                await self._take_lease()
                self.etcd_failure = None
                self._notify()
            except EtcdUnavailable as exc:
                self.etcd_failure = str(exc)
                log.warning("cluster %s: renewing the lease failed (%s); retrying", self.cluster, exc)

    async def _follow(self) -> None:
        while True:
            try:
                await self.etcd.watch(self.prefix, self.view.revision + 1, self._on_changes)
            except Compacted as exc:
                log.info("cluster %s: %s; listing again", self.cluster, exc)
            except EtcdUnavailable as exc:
                log.debug("cluster %s: the watch ended (%s); listing again", self.cluster, exc)
            await trio.sleep(RELIST_PAUSE_SECONDS)
            try:
                await self._list()
            except EtcdUnavailable as exc:
                log.warning("cluster %s: listing the cluster's keys failed (%s); retrying", self.cluster, exc)

    async def _list(self) -> None:
        revision, found = await self.etcd.list_prefix(self.prefix)
        view = View(revision=revision)
        for key, value in found:
            kind, _, name = key[len(self.prefix) :].partition("/")
            view.apply(kind, name, value)
        self.view = view
        self._notify()

    async def _on_changes(self, changes: list[Change], revision: int) -> None:
        for change in changes:
            if change.key.startswith(self.prefix):
                kind, _, name = change.key[len(self.prefix) :].partition("/")
                self.view.apply(kind, name, change.value)
        self.view.revision = max(self.view.revision, revision)
        self._notify()
