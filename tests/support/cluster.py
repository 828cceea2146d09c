"""What the cluster tests ask of a running cluster (``tests/support/replicas``): a client with the replicas' token,
the members and a scope's row of ``GET /cluster`` once settled, the model a given replica owns, and a record written
to a scope's subject behind its owner's back."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import trio

from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.placement import preferred_owner
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.journal.jetstream import JetStreamJournal
from tests.support.replicas import AUTH, CLUSTER, Replica


def client(replica: Replica) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=replica.url, timeout=15, trust_env=False, headers=AUTH)


async def wait_for_members(http: httpx.AsyncClient, count: int) -> dict[str, Any]:
    with trio.fail_after(10):
        while True:
            view: dict[str, Any] = (await http.get("/cluster")).json()
            if len(view["members"]) == count:
                return view
            await trio.sleep(0.05)


async def scope_row(
    http: httpx.AsyncClient, model: str, settled: Callable[[dict[str, Any]], bool] = lambda row: bool(row["owner"])
) -> dict[str, Any]:
    """The scope's row of ``GET /cluster`` once ``settled`` (its owner known, by default): views follow etcd's
    watch, a few milliseconds behind."""
    with trio.fail_after(10):
        while True:
            rows = [row for row in (await http.get("/cluster")).json()["scopes"] if row["model_name"] == model]
            if rows and settled(rows[0]):
                return rows[0]
            await trio.sleep(0.05)


def model_owned_by(owner: str, members: list[str]) -> str:
    """A model name whose scope (default tenant) placement gives to ``owner`` among ``members``."""
    for n in range(1000):
        model = f"model-{n}"
        if preferred_owner(scope_token(ScopeKey(model, "default")), sorted(members)) == owner:
            return model
    raise AssertionError("no model placed on the owner")


async def append_behind_the_owners_back(nats: str, scope: ScopeKey, event: RequestAdded) -> None:
    """``event`` appended to the scope's subject by a writer of its own, as another replica might."""
    opened = partial(JetStreamJournal.open, (nats,), CLUSTER, log=scope_token(scope))
    journal = await trio.to_thread.run_sync(opened)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        lsn = journal.append(encode_record(scope, (event,)))
        with trio.fail_after(10):
            await journal.wait_durable(lsn)
        await journal.aclose()


async def figures(http: httpx.AsyncClient) -> dict[str, float]:
    """The replica's ``GET /metrics`` samples by name (labels included)."""
    text = (await http.get("/metrics")).text
    return {
        name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    }
