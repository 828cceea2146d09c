"""Where a replica sends a command for a scope: serve it, forward it to the owner, or refuse it with 503.

A replica serves only a scope it owns, has recovered, and whose lease it still holds on its own clock. It
forwards to the owner its view names when that owner is a live member; a command that was already forwarded is
never forwarded again (ownership moved under it: one hop, no loops). Otherwise there is no owner it can reach,
and the client is told so, plainly, with 503: the command was not applied and may be retried anywhere.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

UNAVAILABLE_STATUS = 503
# The header a replica adds to a command it forwards to the scope's owner (lower-case, as HTTP/1 servers hand
# header names over): its receiver never forwards it again. Its value is the sender's advertise URL; a receiver
# honours it only from a member of its view (``api/routes/forwarded.py``), else answers 400 with
# ``FORWARD_REFUSED_HEADER``, which tells the sender that nothing was applied.
FORWARDED_HEADER = "kvrouter-forwarded"
FORWARD_REFUSED_HEADER = "kvrouter-forward-refused"


def forwarded_sender_problem(sender: str, me: str, members: Collection[str]) -> str | None:
    """Why a command marked forwarded by ``sender`` is not to be honoured by ``me``, or None: the marker answers
    for the sender alone, so it must name another member of this replica's view."""
    if sender == me:
        return f"the {FORWARDED_HEADER} header names this replica ({me}), which never forwards to itself"
    if sender not in members:
        shown = sender if len(sender) <= 80 else sender[:80] + "..."
        return (
            f"the {FORWARDED_HEADER} header is for the replicas of a cluster, and names {shown!r}, not a member; "
            "a client leaves it out"
        )
    return None


@attrs.frozen
class Serve:
    pass


@attrs.frozen
class Forward:
    owner: str


@attrs.frozen
class Unavailable:
    message: str

    @property
    def status(self) -> int:
        return UNAVAILABLE_STATUS

    def body(self) -> dict[str, str]:
        return {"error": self.message}


Route = Serve | Forward | Unavailable


def route(
    scope: str, me: str, owner: str | None, live: Collection[str], serving: bool, forwarded: bool = False
) -> Route:
    """``owner``: who this replica's view says holds ``scope``; ``live``: the members with live leases;
    ``serving``: this replica owns the scope, has recovered it and holds its lease."""
    if owner == me:
        if serving:
            return Serve()
        return Unavailable(f"scope {scope} is not ready on its owner {me} (recovering, or its lease lapsed)")
    if forwarded:
        return Unavailable(f"scope {scope} moved while the command was forwarded to {me}")
    if owner is None:
        return Unavailable(f"no replica owns scope {scope} yet")
    if owner not in live:
        return Unavailable(f"the owner of scope {scope}, {owner}, holds no live lease")
    return Forward(owner)
