"""Real server processes, each stopped by its PID: a NATS cluster with JetStream (one node or several, routed to
each other, each with its own store directory) and etcd. Each listens on free ports of its place: 127.0.0.1, or
the address of a network namespace it runs in (``network.py``). Synchronous (``subprocess``)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs

START_SECONDS = 30.0


@attrs.frozen
class Place:
    """Where a process runs: the address it listens on, and the command prefix that runs it there (``ip netns
    exec NAME``; none on the loopback interface)."""

    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    def argv(self, argv: list[str]) -> list[str]:
        return [*self.prefix, *argv]


LOOPBACK = Place()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def binary(name: str, fallback: str) -> str | None:
    """The installed server binary, or None."""
    found = shutil.which(name)
    if found is not None:
        return found
    return fallback if Path(fallback).exists() else None


def _wait_http(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy at {url}")
        time.sleep(0.1)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGCONT (in case it was paused), SIGTERM, then SIGKILL after 10 s; by PID."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@attrs.define
class NatsNode:
    """One nats-server of a cluster: its client port, its route port, its monitoring port, its store."""

    name: str
    directory: Path
    place: Place
    port: int
    route_port: int
    monitor_port: int
    routes: tuple[str, ...]  # every node's route URL (its own included: skipped in argv)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.place.address}:{self.port}"

    @property
    def route(self) -> str:
        return f"nats://{self.place.address}:{self.route_port}"

    def argv(self, nats: str) -> list[str]:
        argv = [nats, "-a", self.place.address, "-p", str(self.port), "-m", str(self.monitor_port)]
        argv += ["-js", "-sd", str(self.directory / "store"), "-n", self.name]
        if len(self.routes) > 1:
            argv += ["--cluster_name", "kvr", "-cluster", self.route]
            argv += ["-routes", ",".join(r for r in self.routes if r != self.route)]
        return self.place.argv(argv)

    def start(self, nats: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "nats.log").open("ab") as log:
            self.process = subprocess.Popen(self.argv(nats), stdout=subprocess.DEVNULL, stderr=log)

    def wait_healthy(self) -> None:
        assert self.process is not None
        url = f"http://{self.place.address}:{self.monitor_port}/healthz"
        _wait_http(url, self.process, f"nats-server {self.name}")


def _meta_leader(node: NatsNode) -> tuple[str, bool]:
    """The JetStream meta leader ``node`` sees ('' for none), and whether it lists every peer as current."""
    try:
        with urllib.request.urlopen(f"http://{node.place.address}:{node.monitor_port}/jsz", timeout=1) as answer:
            meta = json.load(answer).get("meta_cluster") or {}
    except (OSError, urllib.error.URLError, ValueError):
        return "", False
    peers = meta.get("replicas") or []
    return str(meta.get("leader") or ""), bool(peers) and all(p.get("current") for p in peers)


def _wait_meta_cluster(nodes: list[NatsNode]) -> None:
    """Until every node names the same meta leader, which sees all its peers current: before that, a replicated
    stream may be refused ("no suitable peers for placement")."""
    deadline = time.monotonic() + START_SECONDS
    while True:
        views = {node.name: _meta_leader(node) for node in nodes}
        leaders = {leader for leader, _ in views.values()}
        if len(leaders) == 1 and "" not in leaders and views[leaders.pop()][1]:
            time.sleep(1.0)  # the leader learns the peers' placement details from their first updates
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the NATS cluster did not form a JetStream meta group: {views}")
        time.sleep(0.1)


def nats_nodes(directory: Path, count: int, places: list[Place] | None = None) -> list[NatsNode]:
    """``count`` nodes named n1, n2, ..., each at its place (default: all on 127.0.0.1)."""
    places = places or [LOOPBACK] * count
    ports = [(free_port(), free_port(), free_port()) for _ in places]
    routes = tuple(f"nats://{place.address}:{route}" for place, (_, route, _) in zip(places, ports, strict=True))
    return [
        NatsNode(f"n{i + 1}", directory / f"n{i + 1}", place, port, route, monitor, routes)
        for i, (place, (port, route, monitor)) in enumerate(zip(places, ports, strict=True))
    ]


@contextlib.contextmanager
def nats_cluster(nats: str, directory: Path, count: int, places: list[Place] | None = None) -> Iterator[list[NatsNode]]:
    """``count`` nats-servers with JetStream (at ``places``, default 127.0.0.1), routed to each other when more
    than one; healthy (a JetStream meta leader elected) before this yields; all stopped by PID after."""
    nodes = nats_nodes(directory, count, places)
    try:
        for node in nodes:
            node.start(nats)
        for node in nodes:
            node.wait_healthy()
        if count > 1:
            _wait_meta_cluster(nodes)
        yield nodes
    finally:
        for node in nodes:
            if node.process is not None:
                stop(node.process)


@attrs.define
class EtcdServer:
    """One etcd on free ports of its place, its data in ``directory``; started again on the same data after a
    kill."""

    etcd: str  # the binary
    directory: Path
    place: Place
    client_port: int = attrs.field(factory=free_port)
    peer_port: int = attrs.field(factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.place.address}:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://{self.place.address}:{self.peer_port}"
        argv = [self.etcd, "--data-dir", str(self.directory / "etcd"), "--listen-client-urls", self.url]
        argv += ["--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls"]
        argv += [peer, "--initial-cluster", f"default={peer}", "--log-level", "error"]
        return self.place.argv(argv)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "etcd.log").open("ab") as log:
            self.process = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=log)


@contextlib.contextmanager
def etcd_server(etcd: str, directory: Path, place: Place = LOOPBACK) -> Iterator[EtcdServer]:
    """One etcd at ``place``, healthy before this yields; stopped by PID after."""
    server = EtcdServer(etcd, directory, place)
    server.start()
    try:
        assert server.process is not None
        _wait_http(f"{server.url}/health", server.process, "etcd")
        yield server
    finally:
        if server.process is not None:
            stop(server.process)
