"""Real etcd and nats-server processes for the fleet, cluster and JetStream tests, and the fixtures that start
them: on free loopback ports, data in the test's directory, stopped by their PID. ``.ci/run`` installs both from
Debian (``etcd-server``, ``nats-server``); a test that needs one that is absent skips, saying how to install it."""

from __future__ import annotations

import base64
import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from tests.support.processes import free_port, start_process

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
NATS_SERVER = shutil.which("nats-server") or next(
    (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if Path(p).exists()), None
)
ETCD_MISSING = "etcd is not installed (apt-get install etcd-server; .ci/run installs it)"
NATS_MISSING = "nats-server is not installed (apt-get install nats-server; .ci/run installs it)"


def require_etcd() -> str:
    if ETCD is None:
        pytest.skip(ETCD_MISSING)
    return ETCD


def require_nats() -> str:
    if NATS_SERVER is None:
        pytest.skip(NATS_MISSING)
    return NATS_SERVER


class EtcdServer:
    """One etcd member; ``restart`` keeps its data (revisions, leases) as a real restart does."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: trio.Process | None = None

    async def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            require_etcd(),
            "--name=n1",
            f"--data-dir={self.directory / 'etcd'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=n1={peer}",
            "--log-level=error",
        ]
        self.process = await start_process(argv, self.port, self.directory / "etcd.log")
        async with httpx.AsyncClient(trust_env=False) as client:
            with trio.fail_after(30):
                while True:  # the port opens before the member serves
                    try:
                        if (await client.get(self.url + "/health", timeout=1)).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.05)

    async def stop(self) -> None:
        await _stop(self.process)
        self.process = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    # -- the v3 JSON gateway, as a test writes Dynamo's keys --

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(self.url + path, content=orjson.dumps(body), timeout=5)
            response.raise_for_status()
            data: dict[str, Any] = response.json()
            return data

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        return int((await self.call("/v3/kv/put", body))["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key.encode())})

    async def grant(self, ttl: int) -> int:
        return int((await self.call("/v3/lease/grant", {"TTL": str(ttl)}))["ID"])

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})


class NatsServer:
    def __init__(self, directory: Path, *, jetstream: bool = True) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.jetstream = jetstream
        self.process: trio.Process | None = None

    async def start(self) -> None:
        argv = [require_nats(), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.jetstream:
            argv += ["-js", "-sd", str(self.directory / "jetstream")]
        self.process = await start_process(argv, self.port, self.directory / "nats.log")

    async def stop(self) -> None:
        await _stop(self.process)
        self.process = None


@contextlib.contextmanager
def nats_process(directory: Path) -> Iterator[str]:
    """A nats-server with JetStream (store in ``directory``) for synchronous fixtures and tests: its URL, once it
    accepts connections; stopped by its PID on exit. Skips when nats-server is absent."""
    port = free_port()
    argv = [require_nats(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(directory / "jetstream")]
    with (directory / "nats.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start (see {directory / 'nats.log'})") from None
                time.sleep(0.02)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _stop(process: trio.Process | None) -> None:
    """SIGCONT (a test may have paused it), SIGTERM, then SIGKILL after 10 s; by its PID."""
    if process is not None and process.returncode is None:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- fixtures: a test module imports the ones it uses (and those they depend on) --


@pytest.fixture
async def etcd_and_nats(tmp_path: Path) -> AsyncIterator[tuple[EtcdServer, NatsServer]]:
    """etcd and a nats-server with JetStream, for a cluster; the objects, for tests that stop or pause them."""
    etcd, nats = EtcdServer(tmp_path), NatsServer(tmp_path)
    await etcd.start()
    try:
        await nats.start()
        try:
            yield etcd, nats
        finally:
            await nats.stop()
    finally:
        await etcd.stop()


@pytest.fixture
def servers(etcd_and_nats: tuple[EtcdServer, NatsServer]) -> tuple[str, str]:
    """``etcd_and_nats``' URLs: what a replica's ``--etcd-endpoints`` and ``--nats-server`` take."""
    etcd, nats = etcd_and_nats
    return etcd.url, nats.url


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A nats-server with JetStream, its store in the test's directory."""
    server = NatsServer(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One nats-server with JetStream for the test module (each test uses streams of its own): its URL."""
    with nats_process(tmp_path_factory.mktemp("nats")) as url:
        yield url


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
