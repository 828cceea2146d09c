"""Real server processes on free 127.0.0.1 ports, each stopped by its PID: a NATS cluster with JetStream (one node
or several, routed to each other, each with its own store directory) and etcd. Synchronous (``subprocess``)."""

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
    port: int
    route_port: int
    monitor_port: int
    routes: tuple[int, ...]  # every node's route port (its own included: nats-server skips it)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def argv(self, nats: str) -> list[str]:
        argv = [nats, "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port)]
        argv += ["-js", "-sd", str(self.directory / "store"), "-n", self.name]
        if len(self.routes) > 1:
            argv += ["--cluster_name", "kvr", "-cluster", f"nats://127.0.0.1:{self.route_port}"]
            argv += ["-routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes if p != self.route_port)]
        return argv

    def start(self, nats: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "nats.log").open("ab") as log:
            self.process = subprocess.Popen(self.argv(nats), stdout=subprocess.DEVNULL, stderr=log)

    def wait_healthy(self) -> None:
        assert self.process is not None
        _wait_http(f"http://127.0.0.1:{self.monitor_port}/healthz", self.process, f"nats-server {self.name}")


def _meta_leader(node: NatsNode) -> tuple[str, bool]:
    """The JetStream meta leader ``node`` sees ('' for none), and whether it lists every peer as current."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/jsz", timeout=1) as answer:
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


def nats_nodes(directory: Path, count: int) -> list[NatsNode]:
    route_ports = tuple(free_port() for _ in range(count))
    return [
        NatsNode(f"n{i + 1}", directory / f"n{i + 1}", free_port(), route_ports[i], free_port(), route_ports)
        for i in range(count)
    ]


@contextlib.contextmanager
def nats_cluster(nats: str, directory: Path, count: int) -> Iterator[list[NatsNode]]:
    """``count`` nats-servers with JetStream, routed to each other when more than one; healthy (a JetStream meta
    leader elected) before this yields; all stopped by PID after."""
    nodes = nats_nodes(directory, count)
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


@contextlib.contextmanager
def etcd_server(etcd: str, directory: Path) -> Iterator[str]:
    """One etcd on free ports, its data in ``directory``: its client URL once healthy; stopped by PID after."""
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = [etcd, "--data-dir", str(directory / "etcd"), "--listen-client-urls", url, "--advertise-client-urls", url]
    argv += ["--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls"]
    argv += [
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"default=http://127.0.0.1:{peer}",
        "--log-level",
        "error",
    ]
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "etcd.log").open("ab") as log:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_http(f"{url}/health", process, "etcd")
        yield url
    finally:
        stop(process)
