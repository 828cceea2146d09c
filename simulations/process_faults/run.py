"""One run on real processes: etcd, a 3-node NATS cluster (the stream R=3) and 3 slot-tracker replicas with
``--cluster``; clients and the nemesis for ``fault_seconds``; then healing, the replicas' agreement, the truth read
from JetStream, and the ownership simulation's checker over the history.

By default each of the seven processes runs in a network namespace of its own (``network.py``), the clients in
this one reaching them through a bridge, and the nemesis also partitions them and kills and pauses etcd. With
``network=False`` every process listens on 127.0.0.1 and the nemesis kills and pauses replicas and NATS nodes
only. Every process is started and stopped here by its PID; the namespaces are deleted after, whatever happened."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from kvrouter.simulations.ownership.checker import check
from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.process_faults.clients import Client, Clock
from kvrouter.simulations.process_faults.leader import stream_led
from kvrouter.simulations.process_faults.nemesis import (
    Nemesis,
    etcd_target,
    nats_target,
    replica_target,
    wait_all_healthy,
)
from kvrouter.simulations.process_faults.network import Network
from kvrouter.simulations.process_faults.replicas import TOKEN, Replica, cluster_argv
from kvrouter.simulations.process_faults.servers import LOOPBACK, NatsNode, Place, binary, etcd_server, nats_cluster
from kvrouter.simulations.process_faults.truth import (
    agreed_loads,
    answer_rows,
    digest,
    scope_truth,
    subject_messages,
    truth_rows,
)

CLUSTER = "FAULTS"
AGREE_SECONDS = 10.0  # every replica answers /loads alike within this long of the stream's leader answering
TRUTH_GRACE_SECONDS = 2.0  # the replicas may still be catching up on the truth when it has been read
LEADER_SECONDS = 30.0  # the stream has a leader again within this long of the last fault's end
NATS_NODES = ("n1", "n2", "n3")
REPLICAS = ("a", "b", "c")
HOSTS = ["etcd", *NATS_NODES, *REPLICAS]  # one network namespace each


@attrs.frozen
class RunOptions:
    seed: int = 1
    fault_seconds: float = 20.0
    clients: int = 4
    scopes: int = 3
    ttl_seconds: int = 2
    network: bool = True  # False: every process on 127.0.0.1, no partitions, etcd left alone


@attrs.frozen
class Result:
    operations: dict[str, int]  # ok, fail, info: attempts' outcomes
    faults: dict[str, int]
    led_after: float | None  # seconds from the last fault's end until the stream answered (had a leader)
    agreed_after: float | None  # seconds from the last fault's end until every replica answered /loads alike
    violations: list[str]
    history: Path


def servers_missing() -> str | None:
    """Why a run cannot start here, or None."""
    for name, fallback in (("etcd", "/usr/bin/etcd"), ("nats-server", "/usr/sbin/nats-server")):
        if binary(name, fallback) is None:
            return f"{name} is not installed"
    return None


async def run_faults(directory: Path, options: RunOptions) -> Result:
    nats = binary("nats-server", "/usr/sbin/nats-server")
    etcd = binary("etcd", "/usr/bin/etcd")
    assert nats is not None and etcd is not None, servers_missing()
    with contextlib.ExitStack() as stack:  # left in reverse: the processes stopped, then the namespaces deleted
        network = stack.enter_context(Network(HOSTS)) if options.network else None
        places = {name: _place(network, name) for name in HOSTS}
        etcd_server_ = stack.enter_context(etcd_server(etcd, directory / "etcd", places["etcd"]))
        nodes = stack.enter_context(nats_cluster(nats, directory / "nats", 3, [places[n] for n in NATS_NODES]))
        argv = cluster_argv(CLUSTER, etcd_server_.url, [n.url for n in nodes], 3, options.ttl_seconds)
        replicas = [Replica(directory, name, argv, places[name]) for name in REPLICAS]
        for replica in replicas:
            stack.callback(replica.stop)
        targets = [replica_target(r) for r in replicas] + [nats_target(n, nats) for n in nodes]
        targets += [etcd_target(etcd_server_)] if network is not None else []
        nemesis = Nemesis(History(), Clock(), options.seed, targets, network)
        return await _exercise(directory, options, nemesis, nodes, replicas)
    raise AssertionError("unreachable")


def _place(network: Network | None, name: str) -> Place:
    if network is None:
        return LOOPBACK
    host = network.hosts[name]
    return Place(host.address, tuple(host.wrap([])))


async def _exercise(
    directory: Path, options: RunOptions, nemesis: Nemesis, nodes: list[NatsNode], replicas: list[Replica]
) -> Result:
    history, clock = nemesis.history, nemesis.clock
    urls = [r.url for r in replicas]
    scopes = [f"model-{i}" for i in range(options.scopes)]
    headers = {"authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(trust_env=False, limits=limits, headers=headers) as http:
        for replica in replicas:
            replica.launch()
        await wait_all_healthy(http, replicas)
        until = trio.current_time() + options.fault_seconds
        clients = [Client(f"c{i}", history, clock, options.seed, urls, scopes) for i in range(options.clients)]
        async with trio.open_nursery() as supervision:
            for replica in replicas:
                supervision.start_soon(replica.supervise)
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(client.run, http, until)
                nursery.start_soon(nemesis.run, until)
            await wait_all_healthy(http, replicas)
            supervision.cancel_scope.cancel()
        servers = tuple(n.url for n in nodes)
        settled = await _settle(http, urls, servers, max(nemesis.last_fault_ended, until))
        violations = settled.violations + await _check(history, servers, scopes, http, urls, settled)
        if violations:
            await _keep_evidence(http, urls, directory / "replicas-after.json")
            await _keep_subjects(servers, scopes, directory / "subjects.json")
    path = directory / "history.jsonl"
    path.write_bytes(history.to_bytes())
    kinds = Counter(r["type"] for r in history.records if r["process"].startswith("c"))
    operations = {kind: kinds[kind] for kind in ("ok", "fail", "info")}
    faults = dict(nemesis.counts) | {"replica relaunched after exiting": sum(r.relaunches for r in replicas)}
    return Result(operations, faults, settled.led_after, settled.agreed_after, violations, path)


@attrs.frozen
class Settled:
    led_after: float | None
    agreed: list[Any] | None  # every replica's /loads, once alike
    agreed_after: float | None
    violations: list[str]
    deadline: float = 0.0  # trio time by which every replica answers /loads as the truth


async def _settle(http: httpx.AsyncClient, urls: list[str], servers: tuple[str, ...], healed_at: float) -> Settled:
    """The stream led again (within ``LEADER_SECONDS``), then every replica answering ``/loads`` alike within
    ``AGREE_SECONDS`` of that (or of the last fault, if later)."""
    led = await stream_led(servers, CLUSTER, max(0.0, healed_at + LEADER_SECONDS - trio.current_time()))
    led_after = trio.current_time() - healed_at if led else None
    if not led:
        return Settled(None, None, None, [f"the stream {CLUSTER} had no leader within {LEADER_SECONDS:g} s"])
    start = max(healed_at, trio.current_time())
    agreed = await agreed_loads(http, urls, max(0.0, start + AGREE_SECONDS - trio.current_time()))
    if agreed is None:
        why = f"the replicas did not answer /loads alike within {AGREE_SECONDS:g} s of the stream's answer"
        return Settled(led_after, None, None, [why])
    return Settled(led_after, agreed, trio.current_time() - healed_at, [], start + AGREE_SECONDS)


async def _keep_evidence(http: httpx.AsyncClient, urls: list[str], path: Path) -> None:
    """After a violation, once the replicas had 3 s more: each one's ``/cluster`` and ``/loads``, beside the
    history (whether they came to match the truth late, and who served what)."""
    await trio.sleep(3.0)
    evidence: dict[str, Any] = {}
    for url in urls:
        for route in ("/cluster", "/loads"):
            try:
                answer = await http.get(url + route, timeout=5)
                evidence[url + route] = answer.json() if answer.status_code == 200 else answer.text
            except (httpx.TransportError, ValueError) as exc:
                evidence[url + route] = repr(exc)
    await trio.Path(path).write_text(json.dumps(evidence, indent=1, sort_keys=True))


async def _keep_subjects(servers: tuple[str, ...], scopes: list[str], path: Path) -> None:
    """After a violation: every message of each scope's subject (``subject_messages``)."""
    evidence: dict[str, Any] = {}
    for model in scopes:
        try:
            evidence[model] = await trio.to_thread.run_sync(subject_messages, servers, CLUSTER, model)
        except Exception as exc:  # evidence only: say why it is missing
            evidence[model] = repr(exc)
    await trio.Path(path).write_text(json.dumps(evidence, indent=1, sort_keys=True))


def _digests(urls: list[str], scopes: list[str], agreed: list[Any] | None) -> dict[str, dict[str, str]]:
    return {
        url: {model: digest(answer_rows(rows, model)) for model in scopes}
        for url, rows in zip(urls, agreed or [], strict=False)
    }


async def _check(
    history: History,
    servers: tuple[str, ...],
    scopes: list[str],
    http: httpx.AsyncClient,
    urls: list[str],
    settled: Settled,
) -> list[str]:
    """The checker over the history and the truth; the replicas' answers are those agreed on, or, while they
    differ from the truth, agreed on again until the deadline (at least ``TRUTH_GRACE_SECONDS`` after the truth
    was read): an owner overtaken on its subject just before the truth was read catches up within about a second."""
    truth = {model: await scope_truth(servers, CLUSTER, model) for model in scopes}
    truth_digests = {m: digest(truth_rows(s)) for m, s in truth.items() if not isinstance(s, str)}
    answers = _digests(urls, scopes, settled.agreed)
    deadline = max(settled.deadline, trio.current_time() + TRUTH_GRACE_SECONDS)
    while settled.agreed and trio.current_time() < deadline and any(a != truth_digests for a in answers.values()):
        await trio.sleep(0.2)
        answers = _digests(urls, scopes, await agreed_loads(http, urls, 1.0)) or answers
    violations = check(history.records, dict(truth), answers, truth_digests, [])
    history.add(  # the verdict, with what it compared: each scope's rows as folded and as each replica answered
        {"process": "checker", "type": "info", "t": 0, "truth": truth_digests, "answers": answers,
         "violations": violations}
    )  # fmt: skip
    return violations
