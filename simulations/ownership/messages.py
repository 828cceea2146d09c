"""What the simulated parts send each other. ``req`` ties a reply to its request; replies to a request the
sender no longer waits for (it timed out, or it is a new incarnation) are ignored."""

from __future__ import annotations

from typing import Any

import attrs

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ownership.claims import Claim
from kvrouter.actors.core.ownership.recovery import ScopeSnapshot

# -- replica -> coordinator (etcd) and back ---------------------------------------------------------------


@attrs.frozen
class Grant:
    req: int
    member: str
    ttl_ns: int


@attrs.frozen
class Granted:
    req: int
    lease_id: int


@attrs.frozen
class KeepAlive:
    req: int
    lease_id: int


@attrs.frozen
class KeptAlive:
    req: int
    ok: bool


@attrs.frozen
class Revoke:
    lease_id: int


@attrs.frozen
class ClaimScope:
    req: int
    subject: str
    member: str
    lease_id: int


@attrs.frozen
class ClaimAnswer:
    req: int
    subject: str
    owner: str | None


@attrs.frozen
class ReleaseScope:
    subject: str
    member: str
    lease_id: int


@attrs.frozen
class Watch:
    req: int


@attrs.frozen
class View:
    req: int
    members: tuple[str, ...]
    claims: tuple[tuple[str, Claim], ...]


# -- replica -> stream (JetStream) and back ---------------------------------------------------------------


@attrs.frozen
class Append:
    req: int
    subject: str
    events: tuple[Event, ...]
    expected_last: int | None  # the fence (None: unfenced)
    prev: int  # the message this one follows on the chain (``Kvr-Prev``): the writer's last one of the chain


@attrs.frozen
class AppendAnswer:
    req: int
    seq: int | None  # None: refused by the fence
    actual_last: int
    on_chain: bool = True  # False: stored, but another message took its place on the chain (a raced fence)


@attrs.frozen
class Read:
    req: int
    subject: str
    after: int
    with_snapshot: bool


@attrs.frozen
class ReadAnswer:
    req: int
    subject: str
    snapshot: ScopeSnapshot | None
    messages: tuple[tuple[int, tuple[int, tuple[Event, ...]]], ...]  # (seq, (prev on the chain, events))


@attrs.frozen
class PutSnapshot:
    subject: str
    snapshot: ScopeSnapshot


# -- client <-> replica ------------------------------------------------------------------------------------


@attrs.frozen
class Call:
    call: int
    client: str
    subject: str
    command: Command
    via: str | None = None  # the replica that forwarded it (one hop at most)


@attrs.frozen
class Answer:
    call: int
    client: str
    outcome: str  # "ok", "fail" (refused by the rules: not applied), "unavailable" (503), "unknown" (504)
    detail: str = ""


@attrs.frozen
class Tick:
    """A node's own timer; ``what`` says which."""

    what: str
    data: Any = None
