"""One seed of the ownership simulation, start to verdict, and many seeds in parallel processes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs

from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_subject
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import digest
from kvrouter.journal.jetstream_batch import Chain
from kvrouter.simulations.ownership.checker import check
from kvrouter.simulations.ownership.clients import Client, ClientOptions
from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.ownership.kernel import SECOND, Kernel, NetOptions
from kvrouter.simulations.ownership.nemesis import NEMESIS, Nemesis, NemesisOptions
from kvrouter.simulations.ownership.replica import Replica, ReplicaOptions
from kvrouter.simulations.ownership.services import COORDINATOR, STREAM, Coordinator, Stream, StreamOptions

SUBJECT_PREFIX = "kvrouter.journal.SIM"


@attrs.frozen
class OwnershipOptions:
    replicas: int = 3
    clients: int = 4
    models: int = 2
    tenants: int = 2
    seconds: int = 30  # clients work and the nemesis strikes this long (virtual time); then everything heals
    settle_seconds: int = 10  # quiet time after healing, before the final reads
    net: NetOptions = attrs.Factory(NetOptions)
    stream: StreamOptions = attrs.Factory(StreamOptions)
    replica: ReplicaOptions = attrs.Factory(ReplicaOptions)
    client: ClientOptions = attrs.Factory(ClientOptions)
    nemesis: NemesisOptions = attrs.Factory(NemesisOptions)


@attrs.frozen
class SeedResult:
    seed: int
    digest: str  # SHA-256 of the history's bytes
    violations: tuple[str, ...]
    ops: dict[str, int]  # ok / fail / info attempts
    faults: dict[str, int]
    counters: dict[str, int]  # fenced appends, lease expiries, claims, recoveries, hand-overs, forwards, messages


def scopes_of(options: OwnershipOptions) -> dict[str, ScopeKey]:
    keys = [ScopeKey(f"model-{m}", f"tenant-{t}") for m in range(options.models) for t in range(options.tenants)]
    return {scope_subject(SUBJECT_PREFIX, key): key for key in keys}


def simulate(seed: int, options: OwnershipOptions) -> tuple[SeedResult, History]:
    kernel = Kernel(seed, options.net)
    history = History()
    scopes = scopes_of(options)
    names = tuple(f"replica-{i}" for i in range(options.replicas))
    coordinator = Coordinator(kernel)
    stream = Stream(kernel, options.stream)
    kernel.add(COORDINATOR, coordinator)
    kernel.add(STREAM, stream)
    replicas: dict[str, Replica] = {}
    retired: list[Replica] = []

    def start(name: str) -> None:
        if name in replicas:
            retired.append(replicas[name])
        kernel.add(name, _placeholder)
        replicas[name] = Replica(name, kernel, scopes, options.replica)
        kernel.nodes[name] = replicas[name]

    for name in names:
        start(name)
    end = options.seconds * SECOND
    for i in range(options.clients):
        client = f"client-{i}"
        kernel.add(client, _placeholder)
        kernel.nodes[client] = Client(client, kernel, history, seed, names, scopes, options.client, end)
    kernel.add(NEMESIS, _placeholder)
    nemesis = Nemesis(kernel, history, seed, names, stream, start, options.nemesis, end)
    kernel.nodes[NEMESIS] = nemesis
    kernel.run_until(end + options.settle_seconds * SECOND)
    chained = options.replica.chained
    violations = verdict(history, stream, replicas, scopes, chained)
    # The verdict closes the history, so the file of a failing seed says what failed, and what each subject held.
    held = {_label(key): _truth_digest(stream, subject, key, chained) for subject, key in scopes.items()}
    history.add({"t": kernel.now, "process": "checker", "type": "verdict", "subjects": held, "violations": violations})
    everyone = [*retired, *replicas.values()]
    counters = {
        "fenced appends": stream.fenced,
        "lease expiries": coordinator.expired,
        "claims": sum(r.stats.claims for r in everyone),
        "recoveries": sum(r.stats.recoveries for r in everyone),
        "from a snapshot": sum(r.stats.from_snapshot for r in everyone),
        "snapshots": sum(r.stats.snapshots for r in everyone),
        "hand-overs": sum(r.stats.handovers for r in everyone),
        "forwarded": sum(r.stats.forwarded for r in everyone),
        "messages": kernel.stats.sent,
        "lost": kernel.stats.lost,
        "cut": kernel.stats.cut,
        "slowed": kernel.stats.slowed,
        "subject messages": stream.log.last_seq,
    }
    if options.stream.racy_fence:  # (only then: the figures of a run on the stream's contract stay as they were)
        counters["raced fences"] = stream.raced
        counters["off the chain"] = stream.off_chain
    ops = {"ok": 0, "fail": 0, "info": 0}
    for record in history.records:
        if record["process"] != NEMESIS and record["type"] in ops:
            ops[record["type"]] += 1
    result = SeedResult(seed, history.digest(), tuple(violations), ops, dict(nemesis.counts), counters)
    return result, history


class _Placeholder:
    """Stands for a node while its object is built (the kernel must know the name to schedule its timers)."""

    def handle(self, src: str, message: Any) -> None:
        raise AssertionError("a node received a message before it existed")


_placeholder = _Placeholder()


def truth_of(stream: Stream, subject: str, scope: ScopeKey, chained: bool = True) -> ScopeState | str:
    """The scope as its subject says, folded from the first message (snapshots not used: they are checked by
    being recovered from): the chain of its messages, or every message for a variant without the chain."""
    state = ScopeState(scope)
    chain = Chain()
    try:
        for seq, (prev, events) in stream.log.read(subject, 0, limit=1 << 30):
            if chain.take(seq, prev) or not chained:
                fold(state, events)
    except Exception as exc:  # a forked subject can hold events that contradict each other
        return f"its subject does not fold ({type(exc).__name__}: {exc})"
    return state


def verdict(
    history: History, stream: Stream, replicas: dict[str, Replica], scopes: dict[str, ScopeKey], chained: bool = True
) -> list[str]:
    truth = {subject: truth_of(stream, subject, scope, chained) for subject, scope in scopes.items()}
    truth_digests = {s: digest(state.to_snapshot()) for s, state in truth.items() if isinstance(state, ScopeState)}
    answers = {
        name: {subject: digest(replica.answer_for(subject).to_snapshot()) for subject in scopes}
        for name, replica in replicas.items()
    }
    unserved = [s for s in scopes if not any(r.serving(s) for r in replicas.values())]
    problems = [f"{subject}: {why}" for r in replicas.values() for subject, why in sorted(r.broken.items())]
    problems += check(history.records, truth, answers, truth_digests, unserved)
    for subject, key in scopes.items():  # name scopes as people do
        problems = [p.replace(subject, f"scope {_label(key)}") for p in problems]
    return problems


def _label(key: ScopeKey) -> str:
    return f"{key.model_name}/{key.tenant_id}"


def _truth_digest(stream: Stream, subject: str, key: ScopeKey, chained: bool) -> str:
    state = truth_of(stream, subject, key, chained)
    return state if isinstance(state, str) else digest(state.to_snapshot())


def _run_one(args: tuple[int, OwnershipOptions]) -> SeedResult:
    return simulate(*args)[0]


def run_seeds(
    seeds: Iterable[int], options: OwnershipOptions, jobs: int | None, on_result: Callable[[SeedResult], None]
) -> list[SeedResult]:
    """Every seed, in seed order whatever the number of processes (each seed's run is independent)."""
    work = [(seed, options) for seed in seeds]
    jobs = jobs or os.cpu_count() or 1
    results = []
    if jobs == 1:
        for item in work:
            results.append(_run_one(item))
            on_result(results[-1])
        return results
    with ProcessPoolExecutor(jobs) as pool:
        for result in pool.map(_run_one, work, chunksize=8):
            results.append(result)
            on_result(result)
    return results
