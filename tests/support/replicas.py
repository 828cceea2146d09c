"""kvrouter replicas with ``--cluster`` as real processes, on free loopback ports, stopped by PID: slot trackers
(``Replica``) or selection services (``SelectReplica``), and the fixtures that start two or three of them on the
``servers`` fixture's etcd and nats-server (``tests/support/fleet_servers``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from tests.support.processes import KvrouterProcess, free_port

CLUSTER = "FAILOVER_TEST"  # the cluster's name, and its JetStream stream's
TTL_SECONDS = 2
TOKEN = "cluster-test-token"  # the replicas share it: a forwarded command presents it to the owner
AUTH = {"authorization": f"Bearer {TOKEN}"}

R = TypeVar("R", bound="Replica")


class Replica(KvrouterProcess):
    """One replica named ``name``: its data in ``directory / name``, its log in ``directory / NAME.log``, the shared
    token in ``directory / "token"``."""

    KIND = "slot-tracker"

    def __init__(self, directory: Path, name: str, etcd: str, nats: str) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.data_dir = directory / name
        token_file = directory / "token"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        argv = [
            sys.executable, "-m", "kvrouter.api.cli.main", self.KIND, "--port", str(port),
            "--data-dir", str(self.data_dir), "--log-level", "info", "--cluster", CLUSTER, "--etcd-endpoints", etcd,
            "--nats-server", nats, "--advertise-url", url, "--cluster-lease-ttl", str(TTL_SECONDS),
            "--auth-token-file", str(token_file),
        ]  # fmt: skip
        super().__init__(directory, name, argv, port)


class SelectReplica(Replica):
    KIND = "select-service"


@contextlib.asynccontextmanager
async def running(replicas: Sequence[R]) -> AsyncIterator[list[R]]:
    """``replicas`` started together; each killed with kill -9 at the end."""
    started = list(replicas)
    try:
        async with trio.open_nursery() as nursery:
            for replica in started:
                nursery.start_soon(replica.start)
        yield started
    finally:
        for replica in started:
            await replica.kill9()


# -- fixtures: a test module imports the ones it uses, and ``servers`` and ``etcd_and_nats`` from fleet_servers --


@pytest.fixture
async def replicas(tmp_path: Path, servers: tuple[str, str]) -> AsyncIterator[list[Replica]]:
    """Three slot-tracker replicas, a, b and c."""
    async with running([Replica(tmp_path, name, *servers) for name in ("a", "b", "c")]) as started:
        yield started


@pytest.fixture
async def pair(tmp_path: Path, servers: tuple[str, str]) -> AsyncIterator[list[Replica]]:
    """Two slot-tracker replicas, a and b."""
    async with running([Replica(tmp_path, name, *servers) for name in ("a", "b")]) as started:
        yield started


@pytest.fixture
async def select_replicas(tmp_path: Path, servers: tuple[str, str]) -> AsyncIterator[list[SelectReplica]]:
    """Three selection-service replicas, a, b and c."""
    async with running([SelectReplica(tmp_path, name, *servers) for name in ("a", "b", "c")]) as started:
        yield started
