"""After healing: what every replica answers, and the truth it must match (each scope's JetStream subject, read
from its snapshot and tail and folded with ``evolve``, the way an owner recovers it), for the checker."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import trio

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.queries import loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.recovery import recover
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.store import CorruptJournal, JournalUnreachable

Rows = tuple[tuple[int, int, int, int], ...]  # (worker, dp rank, prefill tokens, decode blocks), sorted


def answer_rows(rows: list[dict[str, Any]], model: str) -> Rows:
    return tuple(
        sorted(
            (r["worker_id"], r["dp_rank"], r["active_prefill_tokens"], r["active_decode_blocks"])
            for r in rows
            if r["model_name"] == model
        )
    )


def truth_rows(state: ScopeState) -> Rows:
    return tuple(
        (load.rank.worker_id, load.rank.dp_rank, load.active_prefill_tokens, load.active_decode_blocks)
        for load in loads(state)
    )


def digest(rows: Rows) -> str:
    return json.dumps(rows)


async def loads_of(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]] | None:
    """A replica's whole ``GET /loads``, or None if it did not answer 200."""
    try:
        answer = await http.get(f"{url}/loads", timeout=2)
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code == 200 else None


async def agreed_loads(http: httpx.AsyncClient, urls: list[str], seconds: float) -> list[list[dict[str, Any]]] | None:
    """Every replica's ``/loads`` once all answer alike (within ``seconds``); None if they never did."""
    with trio.move_on_after(seconds):
        while True:
            answers = [await loads_of(http, url) for url in urls]
            known = [a for a in answers if a is not None]
            if len(known) == len(urls) and all(sorted_rows(a) == sorted_rows(known[0]) for a in known):
                return known
            await trio.sleep(0.1)
    return None


def sorted_rows(rows: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True) for row in rows)


async def scope_truth(servers: tuple[str, ...], stream: str, model: str, seconds: float = 30.0) -> ScopeState | str:
    """The scope's state folded from its subject (snapshot and tail), or what stopped the fold. A read that JetStream
    did not serve (no answer in time: the stream may be electing a leader, or busy) is tried again for ``seconds``."""
    scope = ScopeKey(model, "default")
    opened = partial(JetStreamJournal.open, servers, stream, log=scope_token(scope))
    deadline = trio.current_time() + seconds
    while True:
        try:
            return await _fold(opened, scope)
        except JournalUnreachable as exc:
            if trio.current_time() >= deadline:
                return f"its subject cannot be read: {exc}"
        await trio.sleep(0.5)


async def _fold(opened: Callable[[], JetStreamJournal], scope: ScopeKey) -> ScopeState | str:
    journal = await trio.to_thread.run_sync(opened)
    try:
        recovered = await trio.to_thread.run_sync(recover, journal)
    except CorruptJournal as exc:
        return f"its subject does not fold: {exc}"
    finally:
        await journal.aclose()
    return recovered.states.get(scope) or ScopeState(scope)
