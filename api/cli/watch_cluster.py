"""``kvrouter watch URL --cluster``: a cluster replica's view of ownership, and each move, as it happens.

It asks the replica's ``GET /cluster`` every ``POLL_SECONDS`` and prints what changed since the last answer: a
member that joined or left, and a scope whose owner changed (scope, old owner -> new owner, when). "When" is the
watcher's clock at the answer that first showed the change, so it is at most ``POLL_SECONDS`` late; a move that
came and went between two answers (an owner, then none, then another within one poll) shows as one line.
The first answer is printed whole (each member, each scope's owner). With ``--json`` each line is one JSON object:
``{"type": "member", "at", "member", "joined"}`` or ``{"type": "owner", "at", "model_name", "tenant_id", "token",
"from", "to"}`` (``null``: no owner), ``at`` in seconds since the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, TextIO

import attrs
import httpx
import orjson
import trio

POLL_SECONDS: Final = 0.25
REQUEST_TIMEOUT_SECONDS: Final = 5.0


class ClusterWatchFailed(Exception):
    """One line for the user (exit 1)."""


@attrs.frozen
class ScopeOwner:
    model_name: str | None
    tenant_id: str | None
    owner: str | None


@attrs.frozen
class ClusterView:
    members: frozenset[str]
    owners: dict[str, ScopeOwner]  # by scope token

    @classmethod
    def of(cls, answer: dict[str, Any]) -> ClusterView:
        owners = {
            row["token"]: ScopeOwner(row.get("model_name"), row.get("tenant_id"), row.get("owner"))
            for row in answer.get("scopes", ())
        }
        return cls(frozenset(answer.get("members", ())), owners)


def changes(before: ClusterView, after: ClusterView, at: float) -> list[dict[str, Any]]:
    """What changed from ``before`` to ``after``, seen at ``at``: members first, then scopes, in order."""
    found: list[dict[str, Any]] = []
    for member in sorted(after.members ^ before.members):
        found.append({"type": "member", "at": at, "member": member, "joined": member in after.members})
    for token in sorted(set(after.owners) | set(before.owners)):
        old, new = before.owners.get(token), after.owners.get(token)
        was, now = (old.owner if old else None), (new.owner if new else None)
        if was != now:
            scope = new or old
            assert scope is not None
            found.append(
                {"type": "owner", "at": at, "model_name": scope.model_name, "tenant_id": scope.tenant_id,
                 "token": token, "from": was, "to": now}
            )  # fmt: skip
    return found


def change_line(change: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(change["at"])) + f".{int(change['at'] * 1000) % 1000:03d}"
    if change["type"] == "member":
        return f"{stamp} member {change['member']} {'joined' if change['joined'] else 'left'}"
    scope = f"{change['model_name']}/{change['tenant_id']}" if change["model_name"] is not None else change["token"]
    return f"{stamp} {scope}: {change['from'] or '(no owner)'} -> {change['to'] or '(no owner)'}"


async def follow_cluster(
    base_url: str, token: str | None, as_json: bool, out: TextIO, model_name: str | None, tenant_id: str | None
) -> None:
    """Print the replica's view, then each change (of the scopes of ``model_name`` and ``tenant_id`` when given),
    until the replica stops answering (``ClusterWatchFailed``)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    write: Callable[[dict[str, Any]], str] = (lambda c: orjson.dumps(c).decode()) if as_json else change_line
    async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False) as http:
        view = ClusterView(frozenset(), {})
        first = True
        while True:
            answer = await _ask(http, base_url)
            if first:
                _print(out, _header(answer, as_json))
                first = False
            after = ClusterView.of(answer)
            for change in changes(view, after, time.time()):
                if _wanted(change, model_name, tenant_id):
                    _print(out, write(change))
            view = after
            await trio.sleep(POLL_SECONDS)


def _wanted(change: dict[str, Any], model_name: str | None, tenant_id: str | None) -> bool:
    if change["type"] != "owner":
        return True
    return model_name in (None, change["model_name"]) and tenant_id in (None, change["tenant_id"])


def _header(answer: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return orjson.dumps(
            {"type": "cluster", "cluster": answer.get("cluster"), "member": answer.get("member")}
        ).decode()
    return f"following cluster {answer.get('cluster')} as {answer.get('member')} sees it (Ctrl-C to stop)"


def _print(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()


async def _ask(http: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    try:
        response = await http.get("/cluster", timeout=REQUEST_TIMEOUT_SECONDS)
    except httpx.TransportError as exc:
        raise ClusterWatchFailed(f"cannot reach {base_url} ({type(exc).__name__}); is the replica running?") from None
    if response.status_code != 200:
        hint = " (pass --token-file)" if response.status_code == 401 else ""
        raise ClusterWatchFailed(f"{base_url}/cluster answered {response.status_code}{hint}")
    answer: dict[str, Any] = response.json()
    if answer.get("cluster") is None:
        raise ClusterWatchFailed(f"{base_url} is not a cluster replica (started without --cluster)")
    return answer
