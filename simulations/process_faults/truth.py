"""After healing: what every replica answers, and the truth it must match (each scope's JetStream subject, read
from its snapshot and tail and folded with ``evolve``, the way an owner recovers it), for the checker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import httpx
import nats
import nats.errors
import trio
from nats.js import api as js_api

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.queries import loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record
from kvrouter.actors.persistence.recovery import recover
from kvrouter.journal import jetstream_batch
from kvrouter.journal.jetstream import JetStreamJournal
from kvrouter.journal.jetstream_link import subject_of
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


def subject_messages(servers: tuple[str, ...], stream: str, model: str) -> list[dict[str, Any]]:
    """Every message on the scope's subject as stored (sequence, headers, each record's events in short): the
    evidence kept after a violation, to tell a forked log (two messages fenced on one sequence) from a lost write.
    Blocking (its own asyncio loop): run it in a thread."""
    return asyncio.run(_subject_messages(servers, stream, scope_token(ScopeKey(model, "default"))))


async def _subject_messages(servers: tuple[str, ...], stream: str, token: str) -> list[dict[str, Any]]:
    connection = await nats.connect(list(servers), connect_timeout=2, max_reconnect_attempts=2)
    try:
        js = connection.jetstream(timeout=5)
        config = js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL, ack_policy=js_api.AckPolicy.NONE)
        subscription = await js.pull_subscribe(subject_of(stream, token), stream=stream, config=config)
        found: list[dict[str, Any]] = []
        while True:
            try:
                messages = await subscription.fetch(256, timeout=1)
            except nats.errors.TimeoutError:
                return found
            for message in messages:
                seq = message.metadata.sequence.stream
                records: list[Any] = []
                for payload in jetstream_batch.unframe(message.data, seq):
                    try:
                        record = decode_record(payload)
                    except RecordFormatError as exc:
                        records.append(f"undecodable: {exc}")
                        continue
                    records.append([_short(event) for event in record.events])
                found.append({"seq": seq, "headers": dict(message.headers or {}), "records": records})
    finally:
        await connection.close()


def _short(event: Any) -> str:
    named = {k: v for k, v in attrs.asdict(event).items() if k in ("request_id", "worker_id", "dp_rank")}
    return f"{type(event).__name__} {named}"
