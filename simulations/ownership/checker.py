"""The checker: what must hold over a history and the cluster it ran against, once every fault is healed.

* Every acknowledged write is there: a booking acknowledged (and never possibly freed) is live on the rank it
  was booked on; an acknowledged completion left it without prefill load; an acknowledged registration left
  its worker registered.
* A booking freed with an acknowledgement, after every attempt to book it had its answer, is gone.
* No booking id was acknowledged twice (a retry must be told "already exists").
* Each worker's load is the sum of its live bookings (the slot tracker's own invariants, on the truth: the fold
  of each scope's subject from its first message).
* Every replica answers every scope (its /loads and its /dump) exactly as that truth, and every scope has an
  owner serving it again.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.state import ScopeState


@attrs.define
class Attempt:
    f: str
    scope: str
    value: Any
    invoked: int
    extra: dict[str, Any]
    outcome: str = "info"  # until an answer says otherwise
    answered: int | None = None


def attempts(history: list[dict[str, Any]]) -> list[Attempt]:
    by_call: dict[tuple[str, int], Attempt] = {}
    found = []
    for record in history:
        if record["process"] in ("nemesis", "checker"):
            continue
        key = (record["process"], record["call"])
        if record["type"] == "invoke":
            extra: dict[str, Any] = {k: record[k] for k in ("worker", "dp_rank") if k in record}
            attempt = Attempt(record["f"], record["scope"], record["value"], record["t"], extra)
            by_call[key] = attempt
            found.append(attempt)
        elif key in by_call:
            by_call[key].outcome = record["type"]
            by_call[key].answered = record["t"]
    return found


def check(
    history: list[dict[str, Any]],
    truth: dict[str, ScopeState | str],
    answers: dict[str, dict[str, str]],
    truth_digests: dict[str, str],
    unserved: list[str],
) -> list[str]:
    problems = [f"{subject}: {state}" for subject, state in truth.items() if isinstance(state, str)]
    states = {subject: state for subject, state in truth.items() if isinstance(state, ScopeState)}
    for subject, state in sorted(states.items()):
        problems.extend(f"{subject}: load accounting: {p}" for p in state.slots.check())
    by_key: dict[tuple[str, Any], list[Attempt]] = {}
    for attempt in attempts(history):
        by_key.setdefault((attempt.scope, attempt.value), []).append(attempt)
    for (subject, value), tried in by_key.items():
        if subject in states:
            problems.extend(_booking_problems(subject, value, tried, states[subject]))
    for replica, digests in sorted(answers.items()):
        for subject, digest in sorted(digests.items()):
            if digest != truth_digests.get(subject):
                problems.append(f"{replica} answers {subject} differently from its subject's fold")
    problems.extend(f"{subject}: no replica serves it after healing" for subject in unserved)
    return problems


def _booking_problems(subject: str, value: Any, tried: list[Attempt], state: ScopeState) -> list[str]:
    registers = [a for a in tried if a.f == "register" and a.outcome == "ok"]
    if registers and int(value) not in state.slots.workers:
        return [f"{subject}: worker {value} was registered (acknowledged) and is gone"]
    books = [a for a in tried if a.f == "book"]
    if not books:
        return []
    problems = []
    acked = [a for a in books if a.outcome == "ok"]
    if len(acked) > 1:
        problems.append(f"{subject}: booking {value} acknowledged {len(acked)} times")
    frees = [a for a in tried if a.f == "free"]
    maybe_freed = any(a.outcome != "fail" for a in frees)
    live = state.slots.requests.get(value)
    if acked and not maybe_freed:
        rank = WorkerRank(acked[0].extra["worker"], acked[0].extra["dp_rank"])
        if live is None:
            problems.append(f"{subject}: booking {value} was acknowledged and is lost")
        elif live.rank != rank:
            problems.append(f"{subject}: booking {value} is on {live.rank}, acknowledged on {rank}")
        elif any(a.f == "complete" and a.outcome == "ok" for a in tried) and value in state.slots.ranks[rank].prefill:
            problems.append(f"{subject}: booking {value}'s prefill completion was acknowledged and is lost")
    freed = [a.invoked for a in frees if a.outcome == "ok"]
    if freed and live is not None:
        settled = all(a.outcome != "info" and a.answered is not None and a.answered < freed[0] for a in books)
        if settled:
            problems.append(f"{subject}: booking {value} was freed (acknowledged) and is live")
    return problems
